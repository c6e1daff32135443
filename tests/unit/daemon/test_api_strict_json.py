"""The unix-socket API reads request bodies strictly and answers strict JSON even when a status float
is not finite (a real socket, as engines and operators reach it)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from patchswarm.daemon.api import make_api_app, serve_unix
from patchswarm.daemon.status import Status
from tests.support.openapi import check

Api = tuple[aiohttp.ClientSession, Status, list[Any]]


@pytest_asyncio.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    st = Status("host-1", "run-1")
    registered: list[Any] = []

    async def register(body: Any, pid: int | None) -> tuple[int, dict[str, Any]]:
        registered.append(body)
        return 409, {"error": "LayoutMismatch", "message": "test registrar"}

    app = make_api_app(st, lambda: None, lambda: b"", register_store=register)
    sock = tmp_path / "api.sock"
    runner = await serve_unix(app, sock)
    session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock)))
    yield session, st, registered
    await session.close()
    await runner.cleanup()


def _refuse(name: str) -> Any:
    raise ValueError(f"bare {name}")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body",
    [
        b'{"engine": "e", "version": 3, "version": 7}',  # the last duplicate used to win
        b'{"engine": "e", "engine": "f", "version": 3}',
        b'{"engine": "e", "version": 3, "x": NaN}',
        b'{"engine": "e", "version": 3, "x": 1e999}',
        b'{"engine": "\\ud800", "version": 3}',
        b'{"engine": "e", "version": 3, "x": ' + b"[" * 100 + b"]" * 100 + b"}",
    ],
)
async def test_ack_refuses_what_strict_json_refuses(api: Api, body: bytes) -> None:
    s, st, _ = api
    async with s.post("http://d/v1/ack", data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400, await r.text()
        assert (await r.json())["error"] == "BadRequest"
    assert st.acks == {}


@pytest.mark.asyncio
@pytest.mark.parametrize("body", [b'{"engine": "e", "buffer": NaN}', b'{"engine": "e", "engine": "f"}'])
async def test_store_registration_never_hands_a_non_strict_body_to_the_registrar(api: Api, body: bytes) -> None:
    s, _, registered = api
    async with s.post("http://d/v1/store", data=body) as r:
        assert r.status == 400
    assert registered == []
    async with s.post("http://d/v1/store", data=b'{"engine": "e"}') as r:  # (the registrar is reached)
        assert r.status == 409
    assert registered == [{"engine": "e"}]


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
async def test_a_non_finite_status_float_is_answered_as_null_not_a_500(api: Api, bad: float) -> None:
    s, st, _ = api
    st.last_activation_pause_s = bad
    st.head_expired_since = bad
    async with s.get("http://d/v1/status") as r:
        assert r.status == 200
        body = json.loads(await r.read(), parse_constant=_refuse)
    check("/v1/status", "get", 200, body)
    assert body["last_activation_pause_s"] is None and body["head_expired_since"] is None


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "query", ["version=3&timeout=0&served=true&served=false", "version=3&version=0&timeout=0", "version=٣&timeout=0"]
)
async def test_wait_refuses_a_query_it_would_have_to_guess(api: Api, query: str) -> None:
    # the first of two values used to win (served=true&served=false waited for the engine's ack)
    s, _, _ = api
    async with s.get(f"http://d/v1/wait?{query}") as r:
        assert r.status == 400
