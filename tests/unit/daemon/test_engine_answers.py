"""Hostile or broken engines answering the daemon's drivers (daemon/engine_drivers.py, daemon/copy_drivers.py):
whatever the answer (nested past any parser's stack, a number of 10,000 digits, NaN, wrong types, dripped a
byte at a time, too large), every call ends in one EngineError line or the right value, never another exception
(which escaped the daemon's ``except EngineError`` and stopped its commit retries)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from patchswarm.daemon.copy_drivers import SglangEngine, Timeouts, VllmEngine
from patchswarm.daemon.engine_driver import Activation, EngineError
from patchswarm.daemon.engine_drivers import ZeroCopyEngine
from patchswarm.daemon.sidecar import serve_app

HOSTILE = {
    "deep": b"[" * 60_000 + b"]" * 60_000,
    "deep_object": b'{"version":' * 30_000 + b"1" + b"}" * 30_000,
    "long_int": b'{"version": ' + b"7" * 10_000 + b"}",
    "nan": b'{"version": NaN, "weight_version": NaN, "results": NaN, "success": NaN}',
    "twice": b'{"version": 1, "version": 1}',
    "not_utf8": b'{"version": "\xff\xfe"}',
    "huge": b'{"version": 1, "pad": "' + b"x" * (3 << 20) + b'"}',
    "mixed_ranks": b'{"results": [{"rank": "a", "ok": true}, {"rank": 0, "ok": true}]}',
    "list": b"[1, 2, 3]",
}


class Hostile:
    """An engine whose every route answers ``body`` (200), ``drip`` bytes at a time."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.drip = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        step = self.drip or len(self.body) or 1
        for i in range(0, len(self.body), step):
            await resp.write(self.body[i : i + step])
            if self.drip:
                await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[tuple[Hostile, str]]:
    hostile = Hostile()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hostile.handle)
    server = await serve_app(app, "127.0.0.1", 0)
    try:
        yield hostile, server.url
    finally:
        await server.close()


def calls(url: str) -> tuple[dict[str, Callable[[], Awaitable[Any]]], list[Any]]:
    act = Activation(1, 0, True, {}, True)
    zero = ZeroCopyEngine(url, commit_timeout_s=5)
    vllm = VllmEngine(url, 2, '{"socket": "/nonexistent"}', Timeouts(5, 5))
    sgl = SglangEngine(url, 1, '{"socket": "/nonexistent"}', Timeouts(5, 5))
    return {
        "zero.served": zero.served_version,
        "zero.commit": lambda: zero.commit(act),
        "vllm.served": vllm.served_version,
        "vllm.attach": vllm.attach,
        "vllm.commit": lambda: vllm.commit(act),
        "sglang.served": sgl.served_version,
        "sglang.commit": lambda: sgl.commit(act),
    }, [zero, vllm, sgl]


@pytest.mark.asyncio
@pytest.mark.parametrize("answer", sorted(HOSTILE))
async def test_a_hostile_answer_is_one_engine_error_line(engine: tuple[Hostile, str], answer: str) -> None:
    hostile, url = engine
    hostile.body = HOSTILE[answer]
    routes, drivers = calls(url)
    try:
        for name, call in routes.items():
            try:
                got = await call()
            except EngineError as e:
                assert "\n" not in str(e) and len(str(e)) <= 400, (name, str(e)[:500])
            else:  # only an answer that says nothing of a version may pass, as "no version"
                assert got is None, (name, answer, got)
    finally:
        for d in drivers:
            await d.close()


@pytest.mark.asyncio
async def test_an_answer_dripped_byte_by_byte_is_read_whole(engine: tuple[Hostile, str]) -> None:
    hostile, url = engine
    hostile.body, hostile.drip = b'{"version": 12345, "weight_version": "12345"}', 1
    zero, vllm = ZeroCopyEngine(url), VllmEngine(url, 1, "{}")
    try:
        assert await zero.served_version() == 12345
        assert await vllm.served_version() == 12345
        hostile.body = b'{"version": 1}'
        assert await zero.commit(Activation(1, 0, True, {}, True)) == 1
    finally:
        await zero.close()
        await vllm.close()


class RestartingVllm:
    """vLLM's /collective_rpc as the worker extension answers it, with workers that lose their store
    mapping when vLLM restarts (``attached`` False), and the routes a commit calls after it."""

    def __init__(self) -> None:
        self.attached = False
        self.attaches = 0

    async def handle(self, request: web.Request) -> web.Response:
        if request.path != "/collective_rpc":
            return web.json_response({"success": True})
        body = await request.json()
        if body["method"] == "patchswarm_attach":
            self.attached, self.attaches = True, self.attaches + 1
            return web.json_response({"results": [{"rank": 0, "entries": 1, "loader": [], "loader_count": 0}]})
        version = json.loads(body["args"][0])["version"]
        if not self.attached:
            error = "rank 0: patchswarm_attach was not called"
            return web.json_response(
                {"results": [{"ok": False, "rank": 0, "error": error, "copied": False, "attached": False}]}
            )
        return web.json_response({"results": [{"ok": True, "rank": 0, "version": version}]})


@pytest.mark.asyncio
async def test_the_vllm_driver_attaches_again_after_vllm_restarted() -> None:
    fake = RestartingVllm()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    server = await serve_app(app, "127.0.0.1", 0)
    driver = VllmEngine(server.url, 1, '{"socket": "/nonexistent"}', Timeouts(5, 5))
    try:
        assert await driver.commit(Activation(1, None, True, {}, True)) == 1
        fake.attached = False  # vLLM restarted: its workers hold no store
        with pytest.raises(EngineError, match="patchswarm_attach was not called"):
            await driver.commit(Activation(2, 1, True, {}, True))
        assert await driver.commit(Activation(2, 1, True, {}, True)) == 2  # (before: refused for ever)
        assert fake.attaches == 2
    finally:
        await driver.close()
        await server.close()
