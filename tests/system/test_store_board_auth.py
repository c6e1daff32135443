"""Credentials for an object-store board, on a moto server that checks them
(``INITIAL_NO_AUTH_ACTION_COUNT``): the right key publishes and pulls; a wrong secret, an unknown
key or no credentials at all give one clear line; ``~/.aws/credentials`` works through boto3.
Credentials only ever come from the environment and config files (no command-line flag takes them)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.safetensors_io import load_safetensors, save_safetensors
from patchswarm.protocol.served import ServedModel
from tests.support.boards import Keys
from tests.support.moto_server import AUTH_SETUP_ACTIONS, Moto, clean_env, moto_server, with_auth

RUN = "run-auth"
CLI = [sys.executable, "-m", "patchswarm.daemon.cli"]
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def authed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    with moto_server(tmp_path_factory.mktemp("moto"), no_auth_actions=AUTH_SETUP_ACTIONS) as m:
        yield with_auth(m)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("work")
    keys = Keys(SigningKey.generate(), SigningKey.generate())
    keys.root.save(d / "root.key")
    keys.trainer.save(d / "trainer.key")
    (d / "cert").write_bytes(keys.certificate(RUN))
    w = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}
    save_safetensors(ServedModel.from_tensors(w), d / "ck.safetensors")
    save_safetensors(ServedModel.from_tensors(ServedFormat("bf16").convert(w)), d / "expected.safetensors")
    (d / "home").mkdir()  # an empty HOME: no ~/.aws
    return d


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = clean_env(env) | {"PYTHONPATH": str(ROOT), "HOME": str(cwd / "home")}
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def publish(board: str) -> list[str]:
    return ["publish", "ck.safetensors", "--board", board, "--key", "trainer.key", "--run-id", RUN, "--cert", "cert"]


def pull(board: str) -> list[str]:
    return ["pull", "--from", f"{board}/runs/{RUN}", "--trust", "root.key.pub", "--to", "out.safetensors"]


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.slow
def test_credentials_come_from_the_environment_and_bad_ones_give_one_line(authed: Moto, work: Path) -> None:
    board = f"s3://{authed.buckets[0]}/b"
    r = run_cli(publish(board), authed.env(), work)
    assert r.returncode == 0, r.stderr
    r = run_cli(pull(board), authed.env(), work)
    assert r.returncode == 0, r.stderr
    assert load_safetensors(work / "out.safetensors").bitwise_equal(load_safetensors(work / "expected.safetensors"))

    wrong_secret = authed.env(AWS_SECRET_ACCESS_KEY="not-the-secret")
    for args in (publish(board), pull(board)):
        line = one_line_error(run_cli(args, wrong_secret, work))
        assert "rejected the credentials (SignatureDoesNotMatch)" in line, line

    unknown_key = authed.env(AWS_ACCESS_KEY_ID="AKIAUNKNOWNKEY000000")
    line = one_line_error(run_cli(pull(board), unknown_key, work))
    assert "rejected the credentials (InvalidAccessKeyId)" in line, line

    none = {k: v for k, v in authed.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    line = one_line_error(run_cli(publish(board), none, work))
    assert "no AWS credentials found" in line, line


@pytest.mark.slow
def test_the_aws_credentials_file_is_read_through_boto3(authed: Moto, work: Path, tmp_path: Path) -> None:
    board = f"s3://{authed.buckets[0]}/file-creds"
    for name in ("root.key.pub", "trainer.key", "cert", "ck.safetensors"):
        (tmp_path / name).write_bytes((work / name).read_bytes())
    (tmp_path / "home" / ".aws").mkdir(parents=True)
    (tmp_path / "home" / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = {authed.key_id}\naws_secret_access_key = {authed.secret}\n"
    )
    env = {k: v for k, v in authed.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    r = run_cli(publish(board), env, tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli(pull(board), env, tmp_path)
    assert r.returncode == 0, r.stderr
    (tmp_path / "home" / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = {authed.key_id}\naws_secret_access_key = wrong\n"
    )
    line = one_line_error(run_cli(pull(board), env, tmp_path))
    assert "SignatureDoesNotMatch" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("name", ["AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_REGION"])
def test_a_setting_pasted_with_its_newline_is_one_line_not_a_panic(authed: Moto, work: Path, name: str) -> None:
    """A header value with a control character made obstore panic (a BaseException no handler catches):
    a Rust backtrace and a Python traceback.  Now one line naming the variable, never its value."""
    value = "FwoGZXIvYXdzEXAMPLETOKEN\r\n" if name == "AWS_SESSION_TOKEN" else authed.env()[name] + "\n"
    board = f"s3://{authed.buckets[0]}/b"
    for args in (publish(board), pull(board)):
        line = one_line_error(run_cli(args, authed.env(**{name: value}), work))
        assert name in line and "control character" in line and value.strip() not in line, line
