"""The clients of the daemon's API (an engine's DaemonClient, `patchswarm status`) read its answers as
any JSON from outside: whatever listens on the socket path may answer, and a key given twice, a NaN
or deep nesting is no answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from patchswarm.daemon.engine_client import DaemonClient
from patchswarm.daemon.status_cli import StatusError, fetch_status
from patchswarm.daemon.store_format import StoreError

HOSTILE = [
    b'{"reached": false, "reached": true}',  # the last duplicate used to win
    b'{"reached": true, "x": NaN}',
    b'{"reached": true, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # RecursionError, not a ValueError
]


@pytest_asyncio.fixture
async def answering(tmp_path: Path) -> AsyncIterator[Callable[[bytes], str]]:
    """A unix socket that answers every request with the body last given."""
    body = [b"{}"]

    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=body[0], content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = str(tmp_path / "api.sock")
    await web.UnixSite(runner, sock).start()

    def set_body(b: bytes) -> str:
        body[0] = b
        return sock

    yield set_body
    await runner.cleanup()


@pytest.mark.asyncio
@pytest.mark.parametrize("body", HOSTILE)
async def test_the_engine_client_refuses_an_answer_that_is_not_strict_json(
    answering: Callable[[bytes], str], body: bytes
) -> None:
    client = DaemonClient(answering(body), timeout=5)
    with pytest.raises(StoreError, match="with no JSON"):
        await asyncio.to_thread(client.wait_version, 3, 1.0)
    answering(b'{"reached": true}')
    assert await asyncio.to_thread(client.wait_version, 3, 1.0) is True


@pytest.mark.asyncio
@pytest.mark.parametrize("body", HOSTILE)
async def test_the_status_command_refuses_a_status_that_is_not_strict_json(
    answering: Callable[[bytes], str], body: bytes
) -> None:
    with pytest.raises(StatusError, match="did not send a status"):
        await fetch_status(answering(body.replace(b"reached", b"state")))
    assert await fetch_status(answering(b'{"state": "idle"}')) == {"state": "idle"}
