"""The unix-socket API against its OpenAPI spec (docs/api/openapi.yaml), on a real socket."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from patchswarm.daemon.api import make_api_app, serve_unix
from patchswarm.daemon.status import MAX_SUBSCRIBERS, Phase, Status
from tests.support.openapi import SPEC, check


@pytest_asyncio.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[aiohttp.ClientSession, Status]]:
    st = Status("host-1", "run-1")
    layout = {"layout": {"slots": []}, "attach": {"kind": "shm", "name": "x"}}
    app = make_api_app(st, lambda: layout if st.version is not None else None, lambda: b"# metrics\n")
    sock = tmp_path / "run" / "api.sock"
    runner = await serve_unix(app, sock)
    session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock)))
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    yield session, st
    await session.close()
    await runner.cleanup()


async def get(s: aiohttp.ClientSession, path: str) -> tuple[int, Any]:
    async with s.get(f"http://d{path}") as r:
        return r.status, await r.json()


@pytest.mark.asyncio
async def test_every_documented_path_is_served_and_matches(api: tuple[aiohttp.ClientSession, Status]) -> None:
    s, st = api
    code, body = await get(s, "/v1/status")
    check("/v1/status", "get", code, body)
    code, body = await get(s, "/v1/version")
    check("/v1/version", "get", code, body)
    code, body = await get(s, "/v1/layout")
    check("/v1/layout", "get", code, body)
    assert code == 409
    st.update(phase=Phase.IDLE, version=3, root="ab" * 32, target=3)
    code, body = await get(s, "/v1/layout")
    check("/v1/layout", "get", code, body)
    code, body = await get(s, "/v1/wait?version=3&timeout=1")
    check("/v1/wait", "get", code, body)
    assert body["reached"] is True
    code, body = await get(s, "/v1/wait?version=4&timeout=0.2")
    assert body["reached"] is False
    code, body = await get(s, "/v1/wait?version=x")
    check("/v1/wait", "get", code, body)
    async with s.post("http://d/v1/ack", json={"engine": "e1", "version": 3}) as r:
        check("/v1/ack", "post", r.status, await r.json())
    async with s.post("http://d/v1/ack", json={"nope": 1}) as r:
        check("/v1/ack", "post", r.status, await r.json())
    code, body = await get(s, "/v1/status")
    check("/v1/status", "get", code, body)
    assert body["acks"] == {"e1": 3}
    async with s.get("http://d/metrics") as r:
        assert r.status == 200 and "text/plain" in r.headers["Content-Type"]


@pytest.mark.asyncio
async def test_wait_returns_when_the_version_lands(api: tuple[aiohttp.ClientSession, Status]) -> None:
    s, st = api
    waiter = asyncio.create_task(get(s, "/v1/wait?version=5&timeout=30"))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    st.update(phase=Phase.ACTIVATING, target=5)
    st.update(phase=Phase.IDLE, version=5)
    code, body = await waiter
    assert code == 200 and body["reached"] and body["version"] == 5


@pytest.mark.asyncio
async def test_wait_for_the_served_version_follows_the_engines_ack(api: tuple[aiohttp.ClientSession, Status]) -> None:
    s, st = api
    waiter = asyncio.create_task(get(s, "/v1/wait?version=6&timeout=30&served=true"))
    st.update(phase=Phase.IDLE, version=6, served_version=5)  # written, not acknowledged by the engine
    code, body = await get(s, "/v1/wait?version=6&timeout=0.2&served=true")
    check("/v1/wait", "get", code, body)
    assert code == 200 and body["reached"] is False and body["served_version"] == 5
    code, body = await get(s, "/v1/wait?version=6&timeout=0")  # (the store's version: reached)
    assert body["reached"] is True and body["version"] == 6
    assert not waiter.done()
    st.update(served_version=6)
    code, body = await waiter
    assert code == 200 and body["reached"] and body["served_version"] == 6
    code, body = await get(s, "/v1/wait?version=6&served=maybe")
    check("/v1/wait", "get", code, body)
    assert code == 400


@pytest.mark.asyncio
async def test_events_stream_state_changes(api: tuple[aiohttp.ClientSession, Status]) -> None:
    s, st = api
    async with s.get("http://d/v1/events") as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events: list[dict[str, Any]] = []

        async def read() -> None:
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        return

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.1)
        st.update(phase=Phase.FETCHING, target=2)
        st.update(phase=Phase.ERROR, reason="disk full")
        await asyncio.wait_for(reader, 10)
    for ev in events:
        check("/v1/events", "get", 200, ev, "text/event-stream")
    assert [e["state"] for e in events] == ["starting", "fetching", "error"]
    assert events[2]["reason"] == "disk full"


@pytest.mark.asyncio
async def test_event_streams_are_capped_and_short_requests_still_answered(
    api: tuple[aiohttp.ClientSession, Status],
) -> None:
    """Long-lived streams must not take the connections short requests need (outside review: 1,100
    /v1/events clients locked out /v1/version, acks and status)."""
    s, _ = api
    streams = [await s.get("http://d/v1/events") for _ in range(MAX_SUBSCRIBERS)]
    try:
        assert all(r.status == 200 for r in streams)
        async with s.get("http://d/v1/events") as extra:
            body = await extra.json()
            check("/v1/events", "get", extra.status, body)
            assert (extra.status, body["error"]) == (503, "TooManyStreams") and extra.headers["Retry-After"]
        async with s.get("http://d/v1/version") as r:
            assert r.status == 200
    finally:
        for r in streams:
            r.close()
    for _ in range(100):  # the closed streams free their places once the server sees them gone
        async with s.get("http://d/v1/events") as again:
            if again.status == 200:
                break
        await asyncio.sleep(0.1)
    assert again.status == 200


def test_spec_paths_match_the_routes() -> None:
    app = make_api_app(Status("h", "r"), lambda: None, lambda: b"")
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    documented = {(m, p) for p, item in SPEC["paths"].items() for m in item}
    assert documented <= routes | {("head", p) for _, p in routes}
    assert {(m, p) for m, p in routes if m != "head"} == documented
