"""Every HTTP server of the project, started by the function its command uses, over a raw socket: a request
line without a version (``GET /``, which aiohttp's parser takes as HTTP/0.9 and answered as one, with a
200), ``HTTP/0.9`` or ``HTTP/2.0`` written out, gets one 400 line in an HTTP/1.0 answer, and the
connection closes; HTTP/1.0 and HTTP/1.1 requests are served as before (swarm/serving.py,
``_http1_only``: the one place every server goes through)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from patchswarm.daemon.api import make_api_app, serve_unix
from patchswarm.daemon.board import Board
from patchswarm.daemon.metrics import serve_metrics
from patchswarm.daemon.openai_api import make_openai_app
from patchswarm.daemon.ref_sources import StaticSource
from patchswarm.daemon.refengine import start_engine
from patchswarm.daemon.sidecar import STATUS_PATH, serve_app, start_sidecar
from patchswarm.daemon.sidecar_gate import VersionGate
from patchswarm.daemon.status import Status
from patchswarm.swarm.board_http import board_app
from patchswarm.swarm.serving import serve_tcp
from tests.support.raw_http import HANG_GUARD_S
from tests.support.swarmkit import Swarm
from tests.support.tinylm import random_export

Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


def _tcp(port: int) -> Opener:
    return lambda: asyncio.open_connection("127.0.0.1", port)


@asynccontextmanager
async def running(name: str, tmp: Path) -> AsyncIterator[tuple[Opener, str]]:
    """The server ``name`` (a way to connect to it, and a path it serves with a 200)."""
    if name == "seed":
        swarm = Swarm(tmp)
        (swarm.board.root / "runs" / "r").mkdir(parents=True)
        (swarm.board.root / "runs" / "r" / "head").write_bytes(b"head")
        seed = await swarm.start_seed()
        try:
            yield _tcp(int(seed.url.rsplit(":", 1)[1])), "/swarm/v1/board/runs/r/head"
        finally:
            await seed.stop(leave=False)
    elif name == "board":
        (tmp / "board" / "runs" / "r").mkdir(parents=True)
        (tmp / "board" / "runs" / "r" / "head").write_bytes(b"head")
        runner, port = await serve_tcp(board_app(Board(tmp / "board").root), "127.0.0.1", 0)
        try:
            yield _tcp(port), "/runs/r/head"
        finally:
            await runner.cleanup()
    elif name == "api":
        with tempfile.TemporaryDirectory() as d:  # (a unix socket's path is short)
            sock = Path(d) / "api.sock"
            api = await serve_unix(make_api_app(Status("h", "r"), lambda: None, lambda: b""), sock)
            try:
                yield (lambda: asyncio.open_unix_connection(str(sock))), "/v1/status"
            finally:
                await api.cleanup()
    elif name == "metrics":
        metrics = await serve_metrics(lambda: b"up 1\n", "127.0.0.1:0")
        try:
            yield _tcp(metrics.addresses[0][1]), "/metrics"
        finally:
            await metrics.cleanup()
    elif name in ("refengine", "sidecar"):
        engine = await start_engine(StaticSource(random_export(1), version=1))
        try:
            if name == "refengine":
                yield _tcp(engine.port), "/health"
            else:
                sidecar = await start_sidecar(engine.url, VersionGate(1))
                try:
                    yield _tcp(sidecar.port), STATUS_PATH
                finally:
                    await sidecar.close()
        finally:
            await engine.close()
    elif name == "openai_api":
        server = await serve_app(make_openai_app(_NoEngine()), "127.0.0.1", 0)  # type: ignore[arg-type]
        try:
            yield _tcp(server.port), "/v1/models"
        finally:
            await server.close()
    else:
        raise AssertionError(name)


class _NoEngine:
    """What the OpenAI app's routes see of an engine here: none of them is reached but GET /v1/models."""

    model_name = "tiny"
    max_positions = 64

    def __getattr__(self, attr: str) -> Any:
        raise AssertionError(f"the engine's {attr} was reached")


async def exchange(open_: Opener, data: bytes) -> bytes:
    reader, writer = await open_()
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), HANG_GUARD_S)  # (to the close: the refusal closes)
    finally:
        writer.close()


SERVERS = ["seed", "board", "api", "sidecar", "metrics", "refengine", "openai_api"]


@pytest.mark.asyncio
@pytest.mark.parametrize("name", SERVERS)
async def test_requests_that_are_not_http1_get_one_400_line(name: str, tmp_path: Path) -> None:
    async with running(name, tmp_path) as (open_, path):
        for line, version in (
            (f"GET {path}", "HTTP/0.9"),
            (f"GET {path} HTTP/0.9", "HTTP/0.9"),
            (f"GET {path} HTTP/2.0", "HTTP/2.0"),
        ):
            reply = await exchange(open_, f"{line}\r\nHost: x\r\n\r\n".encode())
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 400 "), (line, reply[:300])
            assert body.count(b"\n") == 1 and version.encode() in body, (line, body)
        # HTTP/1.x is served as before, on the same path.
        for version in ("HTTP/1.0", "HTTP/1.1"):
            reply = await exchange(open_, f"GET {path} {version}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            assert reply.startswith(f"{version} 200 ".encode()), (version, reply[:300])
