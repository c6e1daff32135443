"""Payload format 2 end to end (issue 37): a trainer publishes with ``payload_format=2`` and real
rollout daemons (one following, one starting late and catching up) reach every head bitwise; the
``patchswarm publish --payload-format`` option, its one-line refusal, and ``inspect`` naming the format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from patchswarm.daemon.board import Board
from patchswarm.daemon.engine import attach
from tests.support.boards import board_patches
from tests.support.daemonkit import Daemon, make_daemon
from tests.support.swarmkit import RUN, Swarm


async def same_bytes(d: Daemon, sw: Swarm, v: int) -> None:
    st = await d.wait_version(v)
    assert st["root"] == sw.served[v].root().hex()
    view = attach((await d.get("/v1/layout"))["attach"])
    try:
        for i, s in enumerate(sw.served[v].specs):
            assert view.tensor(s.name).view(-1).view(sw.served[v].typed(i).dtype).equal(sw.served[v].typed(i).view(-1))
    finally:
        view.close()


@pytest.mark.asyncio
async def test_format_2_versions_reach_a_following_and_a_late_daemon_bitwise(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)  # the trainer at the default payload format (2)
    sw.publish()
    await sw.start_seed()
    d1 = make_daemon(sw, "d1", tmp_path)
    d2: Daemon | None = None
    d1.start()
    try:
        await same_bytes(d1, sw, 1)
        for _ in range(2):  # small updates: sparse, where base contexts pay (docs/benchmarks.md)
            v = sw.publish(scale=2e-5)
            await same_bytes(d1, sw, v)
        patches = board_patches(sw.board, RUN)
        assert sorted(patches) == [2, 3]
        assert all(fmt == 2 and "SPARSE_CTX" in encs for fmt, encs in patches.values()), patches
        d2 = make_daemon(sw, "d2", tmp_path)  # starts after 3 versions: anchor 1, then the format-2 patches
        d2.start()
        await same_bytes(d2, sw, 3)
        v = sw.publish(scale=2e-5)
        for d in (d1, d2):
            await same_bytes(d, sw, v)
        assert await d1.stop() == 0 and await d2.stop() == 0
    finally:
        d1.cleanup()
        if d2 is not None:
            d2.cleanup()
        await sw.close()


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "patchswarm.daemon.cli", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_publish_writes_format_2_by_default_1_when_asked_and_refuses_a_bad_value_in_one_line(tmp_path: Path) -> None:
    assert cli("keygen", "-o", "key", cwd=tmp_path).returncode == 0
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 128, generator=g) * 0.02
    common = ["--board", "board", "--key", "key", "--run-id", "r"]
    # The default is format 2 (where smaller); 1 is still there for fleets with older hosts, and named.
    for option, label in (
        ([], "(served bf16)"),
        ([], "(served bf16)"),
        (["--payload-format", "1"], "(served bf16, payload format 1)"),
    ):
        (tmp_path / "ck").mkdir(exist_ok=True)
        save_file({"model.layers.0.mlp.up_proj.weight": w.clone()}, str(tmp_path / "ck" / "model.safetensors"))
        r = cli("publish", "ck", *common, *option, cwd=tmp_path)
        assert r.returncode == 0 and label in r.stdout, (r.stdout, r.stderr)
        w += torch.randn(w.shape, generator=g) * 2e-5
    assert board_patches(Board(tmp_path / "board"), "r") == {2: (2, ["SPARSE_CTX"]), 3: (1, ["SPARSE_ULP"])}
    for bad in ("3", "0", "two", "1.5"):
        r = cli("publish", "ck", *common, "--payload-format", bad, cwd=tmp_path)
        err = r.stderr.strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and "expected 1 or 2" in err, err


@pytest.mark.parametrize("fmt", [1, 2])
def test_inspect_names_the_payload_format_and_the_encodings(tmp_path: Path, fmt: int) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 128, generator=g) * 0.02
    for name, t in (("a", w), ("b", w + torch.randn(w.shape, generator=g) * 2e-5)):
        save_file({"w": t.to(torch.bfloat16)}, str(tmp_path / f"{name}.safetensors"))
    assert cli("keygen", "-o", "key", cwd=tmp_path).returncode == 0
    r = cli(
        "diff",
        "a.safetensors",
        "b.safetensors",
        "-o",
        "p.psw",
        "--key",
        "key",
        "--run-id",
        "r",
        "--version",
        "2",
        "--base-version",
        "1",
        "--payload-format",
        str(fmt),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(cli("inspect", "p.psw", "--json", cwd=tmp_path).stdout)
    want = "SPARSE_CTX" if fmt == 2 else "SPARSE_ULP"
    assert info["payload_format"] == fmt and [t["encoding"] for t in info["tensors"]] == [want]
    text = cli("inspect", "p.psw", cwd=tmp_path).stdout
    assert f"payload format {fmt}" in text and want in text
