"""Trainer side end to end: a training loop publishes 20 versions; pullers reach the head through
the seed and through a real nginx, bitwise, along the byte-minimal plan; bad boards are refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from patchswarm.daemon.board import Board
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.board_names import HEAD_TAG, chunk_rel, head_rel, manifest_rel
from patchswarm.protocol.catalog import plan
from patchswarm.protocol.errors import (
    ChunkError,
    ExpiredError,
    FormatError,
    LimitExceededError,
    MissingError,
    RollbackError,
    UntrustedKeyError,
)
from patchswarm.protocol.head import Head, HeadTracker
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.safetensors_io import load_safetensors, save_safetensors
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import RootDocument, TrustState
from patchswarm.swarm.board_http import board_app
from patchswarm.swarm.board_sources import HttpSource, source_for
from patchswarm.swarm.puller import Puller
from tests.support.boards import DAY_MS, Keys, board_files, nginx_serving, train_and_publish

RUN = "run-1"
PULL = [sys.executable, "-m", "patchswarm.daemon.cli", "pull"]
STEPS = 20


@pytest.fixture(scope="module")
def keys() -> Keys:
    return Keys(SigningKey.generate(), SigningKey.generate())


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> tuple[Board, dict[int, ServedModel]]:
    root = tmp_path_factory.mktemp("board")
    pub = Publisher(root, keys.trainer, run_id=RUN, anchor_every=8, keep_anchors=2, certificate=keys.certificate(RUN))
    served = train_and_publish(pub, STEPS)
    return pub.board, served


def trust(keys: Keys) -> TrustState:
    return TrustState(keys.root.key_id)


@pytest_asyncio.fixture
async def seed_url(published: tuple[Board, dict[int, ServedModel]]) -> AsyncIterator[str]:
    runner = web.AppRunner(board_app(published[0].root))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def test_board_holds_anchors_patches_and_retention(published: tuple[Board, dict[int, ServedModel]]) -> None:
    board, _ = published
    head = Head.from_bytes(Envelope.from_bytes(board.read(head_rel(RUN)) or b"", HEAD_TAG).body)
    assert head.version == STEPS
    anchors = sorted(e.version for e in head.catalog if e.kind == Kind.ANCHOR)
    assert anchors == [8, 16]  # keep_anchors=2: version 1's anchor and its chain were collected
    assert min(e.version for e in head.catalog) == 8
    names = board_files(board)
    assert sum(n.startswith("manifests/") for n in names) == len(head.catalog)


@pytest.mark.asyncio
@pytest.mark.parametrize("start", [None, 16, 12, 3])
async def test_pull_through_seed_follows_the_byte_minimal_plan(
    published: tuple[Board, dict[int, ServedModel]], keys: Keys, seed_url: str, start: int | None
) -> None:
    served = published[1]
    src = HttpSource(seed_url)
    try:
        puller = Puller(src, trust(keys), RUN)
        head = await puller.fetch_head()
        held = None
        if start is not None:
            model = served[start].clone()
            held = await puller.identify(head, model)
            assert (held is None) == (start < 8)  # versions before the oldest anchor are not retained
        got = await puller.catch_up(held, head)
    finally:
        await src.close()
    assert got.version == STEPS and got.model.bitwise_equal(served[STEPS])
    expected = plan(head.catalog, held.version if held else None, STEPS)
    assert puller.stats.steps == expected
    kinds = [e.kind for e in expected]
    if start in (None, 3):
        assert kinds[0] == Kind.ANCHOR and expected[0].version == 16
    else:
        assert kinds == [Kind.PATCH] * (STEPS - start)


@pytest.mark.slow
def test_pull_cli_through_nginx(published: tuple[Board, dict[int, ServedModel]], keys: Keys, tmp_path: Path) -> None:
    board, served = published
    keys.root.save(tmp_path / "root.key")
    save_safetensors(served[17], tmp_path / "old.safetensors")
    with nginx_serving(board.root, tmp_path / "nginx") as url:
        for have in ([], ["--have", "old.safetensors"]):
            r = subprocess.run(
                [*PULL, "--from", f"{url}/runs/{RUN}", "--trust", "root.key.pub", "--to", "out.safetensors", *have],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 0, r.stderr
            assert load_safetensors(tmp_path / "out.safetensors").bitwise_equal(served[STEPS])
        assert "patch 18, patch 19, patch 20" in r.stdout


# ---------------------------------------------------------------- bad boards


def copy_board(board: Board, tmp: Path) -> Board:
    dst = tmp / "copy"
    shutil.copytree(board.root, dst)
    return Board(dst)


async def pull_dir(board: Board, policy: TrustState, tracker: HeadTracker | None = None) -> Held:
    src = source_for(str(board.root))
    return await Puller(src, policy, RUN, tracker=tracker).catch_up(None)


@pytest.mark.asyncio
async def test_head_signed_by_unknown_or_uncertified_key(published, keys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    b = copy_board(published[0], tmp_path)
    head = Head.from_bytes(Envelope.from_bytes(b.read(head_rel(RUN)) or b"", HEAD_TAG).body)
    rogue = SigningKey.generate()
    b.put_head(RUN, head.sign(rogue).to_bytes())
    with pytest.raises(UntrustedKeyError, match="no certificate"):
        await pull_dir(b, trust(keys))
    # A certificate for the rogue key signed by someone other than the root does not help.
    from patchswarm.protocol.trust import Certificate

    b.put_certificate(rogue.key_id, Certificate(rogue.key_id, RUN, 0, 2**62).sign(rogue).to_bytes())
    with pytest.raises(UntrustedKeyError, match="not a root key"):
        await pull_dir(b, trust(keys))


@pytest.mark.asyncio
async def test_expired_certificate_and_revoked_key(published, keys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    b = copy_board(published[0], tmp_path)
    b.put_certificate(keys.trainer.key_id, keys.certificate(RUN, now_ms=int(time.time() * 1000) - 3 * DAY_MS, days=0.5))
    with pytest.raises(ExpiredError):
        await pull_dir(b, trust(keys))
    b.put_certificate(keys.trainer.key_id, keys.certificate(RUN))
    await pull_dir(b, trust(keys))
    b.put_root(1, RootDocument(1, (keys.root.key_id,), (keys.trainer.key_id,)).sign(keys.root).to_bytes())
    with pytest.raises(UntrustedKeyError, match="revoked"):
        await pull_dir(b, trust(keys))


@pytest.mark.asyncio
async def test_rewound_head_is_refused(published, keys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    b = copy_board(published[0], tmp_path)
    t = trust(keys)
    tracker = HeadTracker(RUN)
    await pull_dir(b, t, tracker)
    env = Envelope.from_bytes(b.read(head_rel(RUN)) or b"", HEAD_TAG)
    head = Head.from_bytes(env.body)
    import dataclasses

    older = dataclasses.replace(
        head,
        version=head.version - 1,
        manifest_id=next(e.manifest_id for e in head.catalog if e.version == head.version - 1),
        catalog=tuple(e for e in head.catalog if e.version < head.version),
        counter=head.counter + 1,
    )
    b.put_head(RUN, older.sign(keys.trainer).to_bytes())
    with pytest.raises(RollbackError):
        await pull_dir(b, t, tracker)


@pytest.mark.asyncio
async def test_manifest_of_another_run_or_layout(published, keys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    b = copy_board(published[0], tmp_path)
    other = tmp_path / "other"
    pub = Publisher(other, keys.trainer, run_id="run-2", certificate=keys.certificate("run-2"))
    train_and_publish(pub, 2, seed=5)
    env = Envelope.from_bytes(b.read(head_rel(RUN)) or b"", HEAD_TAG)
    head = Head.from_bytes(env.body)
    # Point run-1's newest entry at run-2's manifest (same bytes, genuinely signed): refused.
    foreign = next((other / "manifests").iterdir())
    target = b.path(manifest_rel(head.manifest_id))
    target.write_bytes(foreign.read_bytes())
    with pytest.raises(FormatError, match="not the one the head names"):
        await pull_dir(b, trust(keys))


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["missing", "wrong", "truncated", "oversized"])
async def test_damaged_chunks(published, keys, tmp_path, damage) -> None:  # type: ignore[no-untyped-def]
    b = copy_board(published[0], tmp_path)
    env = Envelope.from_bytes(b.read(head_rel(RUN)) or b"", HEAD_TAG)
    head = Head.from_bytes(env.body)
    anchor = next(e for e in head.catalog if e.kind == Kind.ANCHOR and e.version == 16)
    chunk = b.path(chunk_rel(b.manifest(anchor.manifest_id).chunks[0].hash))
    data = chunk.read_bytes()
    if damage == "missing":
        chunk.unlink()
        expected: type[Exception] = ChunkError
    elif damage == "wrong":
        chunk.write_bytes(bytes([data[0] ^ 1]) + data[1:])
        expected = ChunkError
    elif damage == "truncated":
        chunk.write_bytes(data[: len(data) // 2])
        expected = ChunkError
    else:
        chunk.write_bytes(data + b"x" * 100)
        expected = LimitExceededError
    with pytest.raises(expected):
        await pull_dir(b, trust(keys))


@pytest.mark.asyncio
async def test_missing_head(keys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MissingError):
        await pull_dir(Board(tmp_path), trust(keys))


def test_failed_pull_writes_nothing(published, keys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    b = copy_board(published[0], tmp_path)
    b.put_root(1, RootDocument(1, (keys.root.key_id,), (keys.trainer.key_id,)).sign(keys.root).to_bytes())
    keys.root.save(tmp_path / "root.key")
    r = subprocess.run(
        [*PULL, "--from", str(b.root), "--run", RUN, "--trust", "root.key.pub", "--to", "out.safetensors"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "revoked" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out.safetensors").exists()
