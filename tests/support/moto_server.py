"""A real S3-compatible server for the object-store board tests: moto's standalone server, in its own
process on a free loopback port (nothing is mocked inside the test process).

Credentials: moto checks none unless started with ``INITIAL_NO_AUTH_ACTION_COUNT=N``; then the
first N requests are free (they create the bucket, an IAM user, its policy and its access key) and
every later request must be signed with a key it issued (``with_auth``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.boards import free_port

REGION = "us-east-1"


@dataclass
class Moto:
    endpoint: str
    key_id: str = "testing"
    secret: str = "testing"
    log: Path | None = None
    buckets: list[str] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """The standard AWS environment that points obstore and boto3 at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": REGION,
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_EC2_METADATA_DISABLED": "true",
        } | extra

    def client(self, service: str = "s3") -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret,
        )

    def new_bucket(self) -> str:
        name = f"board-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name


def clean_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any AWS setting (then ``env`` on top)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | (env or {})


@contextmanager
def moto_server(workdir: Path, *, no_auth_actions: int | None = None) -> Iterator[Moto]:
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"moto-{port}.log"
    env = clean_env()
    if no_auth_actions is not None:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(no_auth_actions)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 60
        while True:  # a TCP connect only: a request would use up one of the free actions
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield Moto(f"http://127.0.0.1:{port}", log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def with_auth(moto: Moto) -> Moto:
    """On a server started with ``no_auth_actions=AUTH_SETUP_ACTIONS``: a bucket and an IAM user allowed
    everything on S3 (4 requests), then a Moto that signs with that user's key."""
    bucket = moto.new_bucket()
    iam = moto.client("iam")
    iam.create_user(UserName="publisher")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="publisher", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="publisher")["AccessKey"]
    return Moto(moto.endpoint, key["AccessKeyId"], key["SecretAccessKey"], moto.log, [bucket])


AUTH_SETUP_ACTIONS = 4
