"""Azurite (Microsoft's Azure Storage emulator, an npm package) as a real blob server process on a free
loopback port, for the Azure board tests.  `make test` installs it when npm is there
(``npm install -g azurite``); without it those tests are skipped with a message saying so.

Its account is the emulator's well-known development account; a container is created with one
Shared Key signed request (the Blob REST API: https://learn.microsoft.com/rest/api/storageservices/authorize-with-shared-key).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path

from tests.support.boards import free_port

ACCOUNT = "devstoreaccount1"
# The emulator's published development key (the same in every Azurite install; not a secret).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
API_VERSION = "2021-08-06"


@dataclass
class Azurite:
    endpoint: str  # http://127.0.0.1:PORT

    def env(self, **extra: str) -> dict[str, str]:
        """The standard Azure environment that points obstore at this emulator."""
        return {
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": KEY,
            "AZURE_STORAGE_ENDPOINT": f"{self.endpoint}/{ACCOUNT}",
            "AZURE_ALLOW_HTTP": "true",
        } | extra

    def new_container(self) -> str:
        name = f"board-{uuid.uuid4().hex[:12]}"
        date = formatdate(usegmt=True)
        headers = {"x-ms-date": date, "x-ms-version": API_VERSION}
        canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        resource = f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"  # path-style: the account twice
        # VERB, then 11 standard headers (Content-Type is the 5th after the verb), then the x-ms- headers.
        to_sign = "PUT\n\n\n\n\napplication/octet-stream\n\n\n\n\n\n\n" + canonical + resource
        sig = base64.b64encode(hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()).decode()
        req = urllib.request.Request(
            f"{self.endpoint}/{ACCOUNT}/{name}?restype=container",
            method="PUT",
            data=b"",
            headers={
                **headers,
                "Authorization": f"SharedKey {ACCOUNT}:{sig}",
                "Content-Type": "application/octet-stream",
            },
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 201, r.status
        return name


def azurite_binary() -> str | None:
    return shutil.which("azurite-blob")


@contextmanager
def azurite_server(workdir: Path) -> Iterator[Azurite]:
    binary = azurite_binary()
    if binary is None:
        import pytest

        pytest.skip("azurite-blob is not installed (make test installs it with npm when npm is there)")
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "azurite.log"
    args = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(workdir / "data")]
    args += ["--skipApiVersionCheck", "--silent"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"azurite did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield Azurite(f"http://127.0.0.1:{port}")
    finally:
        proc.kill()  # (it takes its time over SIGTERM; its data is the test's temporary directory)
        proc.wait()
