"""``patchswarm seed`` over a real loopback socket: caching headers, ranges, ETags, confinement.

A CDN in front of the seed relies on these headers being right: immutable files cached forever,
the head always revalidated.  Raw requests check that no path escapes the board's five folders.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import torch
from aiohttp import web

from patchswarm.daemon.board import Board
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.trust import RootDocument
from patchswarm.swarm.board_http import IMMUTABLE, MUTABLE, board_app
from tests.support.boards import Keys

RUN = "seed-run"


@dataclass
class Seed:
    url: str
    port: int
    board: Board
    chunk: str  # relative path of one chunk (over 20 bytes)


@pytest_asyncio.fixture
async def seed(tmp_path: Path) -> AsyncIterator[Seed]:
    keys = Keys(SigningKey.generate(), SigningKey.generate())
    board = Board(tmp_path / "board")
    pub = Publisher(board, keys.trainer, run_id=RUN, certificate=keys.certificate(RUN))
    torch.manual_seed(0)
    pub.publish({"w": torch.randn(256, 256)})
    board.put_root(1, RootDocument(1, (keys.root.key_id,), ()).sign(keys.root).to_bytes())
    # Things that must never be served: hidden files, other folders, files next to the board.
    (board.root / "runs" / RUN / ".head.tmp").write_bytes(b"partial")
    (board.root / ".git").mkdir()
    (board.root / ".git" / "config").write_bytes(b"secret")
    (board.root / "private").mkdir()
    (board.root / "private" / "key").write_bytes(b"secret")
    (tmp_path / "outside.txt").write_bytes(b"secret")
    chunk = next(f"chunks/{p.name}" for p in sorted((board.root / "chunks").iterdir()) if p.stat().st_size > 20)
    runner = web.AppRunner(board_app(board.root))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Seed(f"http://127.0.0.1:{port}", port, board, chunk)
    finally:
        await runner.cleanup()


def immutable_files(board: Board) -> list[str]:
    out: list[str] = []
    for folder in ("chunks", "manifests", "certs", "trust"):
        files = sorted(p for p in (board.root / folder).iterdir() if not p.name.startswith("."))
        assert files, folder
        out.append(f"{folder}/{files[0].name}")
    return out


@pytest.mark.asyncio
async def test_cache_control_immutable_files_and_head(seed: Seed) -> None:
    async with aiohttp.ClientSession() as s:
        for rel in immutable_files(seed.board):
            async with s.get(f"{seed.url}/{rel}") as r:
                assert r.status == 200, rel
                assert r.headers["Cache-Control"] == IMMUTABLE == "public, max-age=31536000, immutable"
                assert await r.read() == seed.board.path(rel).read_bytes()
        async with s.get(f"{seed.url}/{head_rel(RUN)}") as r:
            assert r.status == 200
            assert r.headers["Cache-Control"] == MUTABLE == "no-cache"
            assert await r.read() == seed.board.read(head_rel(RUN))


@pytest.mark.asyncio
async def test_ranges(seed: Seed) -> None:
    data = seed.board.path(seed.chunk).read_bytes()
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{seed.url}/{seed.chunk}", headers={"Range": "bytes=10-19"}) as r:
            assert r.status == 206
            assert await r.read() == data[10:20]
            assert r.headers["Content-Range"] == f"bytes 10-19/{len(data)}"
            assert r.headers["Cache-Control"] == IMMUTABLE
        async with s.get(f"{seed.url}/{seed.chunk}", headers={"Range": "bytes=-7"}) as r:  # suffix range
            assert r.status == 206
            assert await r.read() == data[-7:]
            assert r.headers["Content-Range"] == f"bytes {len(data) - 7}-{len(data) - 1}/{len(data)}"
        async with s.get(f"{seed.url}/{seed.chunk}", headers={"Range": f"bytes={len(data) - 3}-"}) as r:
            assert r.status == 206 and await r.read() == data[-3:]
        async with s.get(f"{seed.url}/{seed.chunk}", headers={"Range": f"bytes={len(data) + 5}-"}) as r:
            assert r.status == 416


@pytest.mark.asyncio
async def test_etag_and_if_none_match(seed: Seed) -> None:
    async with aiohttp.ClientSession() as s:
        for rel in (seed.chunk, head_rel(RUN)):
            async with s.get(f"{seed.url}/{rel}") as r:
                assert r.status == 200
                etag = r.headers["ETag"]
            async with s.get(f"{seed.url}/{rel}", headers={"If-None-Match": etag}) as r:
                assert r.status == 304 and await r.read() == b""
            async with s.get(f"{seed.url}/{rel}", headers={"If-None-Match": '"something-else"'}) as r:
                assert r.status == 200


async def raw_get(port: int, target: str) -> tuple[int, bytes]:
    """A GET with the request target exactly as given (no client-side normalization)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "target",
    [
        "/chunks/../../outside.txt",
        "/chunks/%2e%2e/%2e%2e/outside.txt",
        "/chunks%2F..%2F..%2Foutside.txt",
        "/../outside.txt",
        "/runs/../../outside.txt",
        f"/runs/{RUN}/.head.tmp",
        "/.git/config",
        "/private/key",
        "/chunks/",
        "/chunks",
        "/runs",
        "/manifests/../private/key",
        "/chunks/./../private/key",
        "//etc/passwd",
        "/chunks//etc/passwd",
    ],
)
async def test_paths_outside_the_board_are_404(seed: Seed, target: str) -> None:
    status, body = await raw_get(seed.port, target)
    assert status == 404, (target, status)
    assert b"secret" not in body and b"partial" not in body


@pytest.mark.asyncio
async def test_raw_requests_for_real_files_work(seed: Seed) -> None:
    status, body = await raw_get(seed.port, f"/{seed.chunk}")
    assert status == 200 and body == seed.board.path(seed.chunk).read_bytes()
