"""The CLI, run as a real subprocess on real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from patchswarm.protocol.safetensors_io import load_safetensors, save_safetensors
from tests.support.helpers import adam_like_pair


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    base, target = adam_like_pair(seed=7)
    save_safetensors(base, d / "base.safetensors")
    save_safetensors(target, d / "target.safetensors")
    assert run("keygen", "-o", "key", cwd=d).returncode == 0
    assert run("keygen", "-o", "other", cwd=d).returncode == 0
    r = run("diff", "base.safetensors", "target.safetensors", "-o", "p.psw", "--key", "key", cwd=d)
    assert r.returncode == 0, r.stderr
    return d


def test_apply_reproduces_target_exactly(work: Path) -> None:
    r = run("apply", "base.safetensors", "p.psw", "-o", "out.safetensors", "--trust", "key.pub", cwd=work)
    assert r.returncode == 0, r.stderr
    out = load_safetensors(work / "out.safetensors")
    target = load_safetensors(work / "target.safetensors")
    assert out.bitwise_equal(target) and out.metadata == target.metadata


def test_inspect_json(work: Path) -> None:
    r = run("inspect", "p.psw", "--json", cwd=work)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["version"] == 1 and info["kind"] == "patch" and info["chunk_count"] >= 1
    assert 0 < info["changed"] < info["elements"]
    encodings = {t["encoding"] for t in info["tensors"]}
    assert encodings <= {"SAME", "SPARSE_ULP", "SPARSE_RAW", "XOR", "FULL", "SPARSE_CTX"}
    assert info["payload_format"] == (2 if "SPARSE_CTX" in encodings else 1)  # (diff's default allows 2)


def test_diff_in_payload_format_2_applies_exactly(work: Path) -> None:
    r = run("diff", "base.safetensors", "target.safetensors", "-o", "p2.psw", "--payload-format", "2", cwd=work)
    assert r.returncode == 0, r.stderr
    r = run("inspect", "p2.psw", "--json", cwd=work)
    assert r.returncode == 0, r.stderr
    assert "SPARSE_CTX" in {t["encoding"] for t in json.loads(r.stdout)["tensors"]}
    r = run("apply", "base.safetensors", "p2.psw", "-o", "out2.safetensors", cwd=work)
    assert r.returncode == 0, r.stderr
    assert load_safetensors(work / "out2.safetensors").bitwise_equal(load_safetensors(work / "target.safetensors"))
    assert (work / "p2.psw").stat().st_size < (work / "p.psw").stat().st_size
    r = run("diff", "base.safetensors", "target.safetensors", "-o", "p3.psw", "--payload-format", "3", cwd=work)
    assert r.returncode == 2 and "expected 1 or 2, got '3'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (work / "p3.psw").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["verify", "p.psw", "--trust", "other.pub"], "unknown key"),
        (["apply", "target.safetensors", "p.psw", "-o", "bad.safetensors"], "base of version 1"),
        (["apply", "base.safetensors", "missing.psw", "-o", "bad.safetensors"], "no such file"),
        (["inspect", "base.safetensors"], "bad magic"),
        (["keygen", "-o", "key"], "already exists"),
    ],
)
def test_user_errors_are_one_line(work: Path, args: list[str], message: str) -> None:
    r = run(*args, cwd=work)
    assert r.returncode == 1
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (work / "bad.safetensors").exists()


def test_corrupt_patch_writes_nothing(work: Path) -> None:
    data = bytearray((work / "p.psw").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (work / "corrupt.psw").write_bytes(bytes(data))
    r = run("apply", "base.safetensors", "corrupt.psw", "-o", "bad.safetensors", cwd=work)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert not (work / "bad.safetensors").exists()


def test_keygen_never_writes_half_a_key_pair(tmp_path: Path) -> None:
    (tmp_path / "k.pub").write_text("someone else's public key")
    r = run("keygen", "-o", "k", cwd=tmp_path)
    assert r.returncode == 1 and "k.pub already exists" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.pub"]
    assert (tmp_path / "k.pub").read_text() == "someone else's public key"


def test_a_patch_signed_at_the_edges_of_its_arguments_applies(work: Path) -> None:
    r = run(
        "diff", "base.safetensors", "target.safetensors", "-o", "edge.psw", "--key", "key", "--version", "9",
        "--base-version", "0", "--chunk-size", "1024", "--level", "19", "--run-id", "run:a.b_c-1", cwd=work,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = run("apply", "base.safetensors", "edge.psw", "-o", "edge.safetensors", "--trust", "key.pub", cwd=work)
    assert r.returncode == 0, r.stderr
    assert load_safetensors(work / "edge.safetensors").bitwise_equal(load_safetensors(work / "target.safetensors"))
