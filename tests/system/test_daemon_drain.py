"""A request that never ends does not hold an activation (and every other request) forever.

A real daemon runs the sidecar in front of a fake engine whose ``/stream`` streams until the test
lets it finish.  With that request in flight a new version cannot drain: after
``sidecar.drain_timeout`` admission reopens on the old version (other requests get through, not
503), the store keeps the old version, status says why, and the activation is retried until the
long request ends and the version lands.  SIGTERM during a drain cancels it and the daemon exits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from patchswarm.daemon.engine import attach
from patchswarm.daemon.sidecar import STATUS_PATH
from tests.support.boards import free_port
from tests.support.daemonkit import Daemon, make_daemon
from tests.support.swarmkit import Swarm


class FakeEngine:
    """``/stream`` streams a byte every 50 ms until ``finish`` is set; anything else answers at once."""

    def __init__(self) -> None:
        self.finish = asyncio.Event()
        self.streaming = 0

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        self.streaming += 1
        try:
            while not self.finish.is_set():
                await resp.write(b".")
                await asyncio.sleep(0.05)
            await resp.write_eof()
        finally:
            self.streaming -= 1
        return resp

    async def quick(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})


@asynccontextmanager
async def fake_engine(port: int) -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    app = web.Application()
    app.router.add_post("/stream", engine.stream)
    app.router.add_route("*", "/{tail:.*}", engine.quick)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield engine
    finally:
        engine.finish.set()
        await runner.cleanup()


def sidecar_daemon(sw: Swarm, tmp_path: Path, engine_port: int, drain_timeout: str) -> tuple[Daemon, str]:
    port = free_port()
    extra = (
        f'[sidecar]\nenabled = true\nlisten = "127.0.0.1:{port}"\n'
        f'upstream = "http://127.0.0.1:{engine_port}"\ndrain_timeout = "{drain_timeout}"\n'
        'allow_routes = ["/stream"]\n'  # the fake engine's route, forwarded only as an operator's route
    )
    return make_daemon(sw, "d1", tmp_path, extra=extra), f"http://127.0.0.1:{port}"


async def wait_for(what: str, check: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def start_long_request(http: aiohttp.ClientSession, sidecar: str) -> aiohttp.ClientResponse:
    resp = await http.post(f"{sidecar}/stream", json={"prompt": [1]})
    assert resp.status == 200, await resp.text()
    await resp.content.readexactly(1)  # in flight: admitted, streaming
    return resp


@pytest.mark.asyncio
async def test_a_request_that_never_ends_puts_off_the_activation_not_everyone(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    engine_port = free_port()
    d, sidecar = sidecar_daemon(sw, tmp_path, engine_port, "1s")
    try:
        async with fake_engine(engine_port) as engine, aiohttp.ClientSession() as http:
            d.start()
            await d.wait_version(1)
            view = attach((await d.get("/v1/layout"))["attach"])
            long = await start_long_request(http, sidecar)
            async with http.post(f"{sidecar}/other", json={}) as r:  # the engine answers any path; the sidecar not
                assert r.status == 404 and (await r.json())["error"] == "RouteNotServed"
            v2 = sw.publish()

            async def timed_out() -> dict[str, Any] | None:
                st = await d.status()
                return st if st is not None and "sidecar drain timed out" in (st["reason"] or "") else None

            st = await wait_for("the drain to time out", timed_out)
            assert "1 requests in flight" in st["reason"] and st["version"] == 1, st
            # Admission is open between tries: honest requests get through (a request that meets a
            # retried drain waits at the gate, at most drain_timeout, then goes on the old version).
            for _ in range(8):
                async with http.post(f"{sidecar}/generate", json={"prompt": [2]}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Weight-Version-Start"] == "1"
                await asyncio.sleep(0.2)
            async with http.get(f"{sidecar}{STATUS_PATH}") as r:
                assert (await r.json())["applied_version"] == 1
            assert view.read_version() == (1, sw.served[1].root())  # the store was not touched
            # Journaled before the drain (daemon/prepared.py), removed when the drain gave up.
            assert not (d.dir / "data" / "journal" / "activation.journal").exists()
            assert engine.streaming == 1 and not long.content.at_eof()
            # The long request ends: the next try drains and the version lands.
            engine.finish.set()
            await long.read()
            long.release()
            await d.wait_version(v2)
            assert view.read_version() == (v2, sw.served[v2].root())
            async with http.post(f"{sidecar}/generate", json={"prompt": [2]}) as r:
                assert r.status == 200 and r.headers["X-Weight-Version-Start"] == str(v2)
            view.close()
            assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_sigterm_during_a_drain_cancels_it_and_exits(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    engine_port = free_port()
    # A drain that would outlast the test: only cancelling it lets the daemon stop.
    d, sidecar = sidecar_daemon(sw, tmp_path, engine_port, "10m")
    try:
        async with fake_engine(engine_port), aiohttp.ClientSession() as http:
            d.start()
            await d.wait_version(1)
            long = await start_long_request(http, sidecar)
            v2 = sw.publish()

            async def draining() -> bool:
                async with http.get(f"{sidecar}{STATUS_PATH}") as r:
                    return bool((await r.json())["activating_version"] == v2)

            await wait_for("the drain to begin", draining)
            assert await d.stop() == 0  # (waits 60 s at most; the drain alone would hold it 10 min)
            log = d.log.read_text()
            assert "abandoned: the daemon is stopping" in log and "drain timed out" not in log, log[-3000:]
            assert not (d.dir / "data" / "journal" / "activation.journal").exists()  # (abandoned: removed)
            long.close()
    finally:
        d.cleanup()
        await sw.close()
