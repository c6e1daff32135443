"""Version attribution end to end through real processes: a rollout daemon driving a zero-copy engine
(``engine.kind = "zero-copy"``: the reference engine's commit and version routes), with its sidecar.

A version is attributed to responses only once the engine acknowledged it: requests pinned to it
wait (or get 409) until the ack, never before; a commit the engine refuses leaves the daemon's
status in error with the engine's answer, the sidecar on the version acknowledged before, and is
retried until the engine takes it, also by a daemon restarted with its store ahead of the engine."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from patchswarm.daemon.engine import attach
from patchswarm.daemon.publisher import Publisher
from patchswarm.daemon.ref_sources import StoreViewSource
from patchswarm.daemon.refengine import make_engine_app
from patchswarm.daemon.sidecar import RunningServer, serve_app
from patchswarm.daemon.trajectory import Trajectory, generate
from patchswarm.protocol.trust import Certificate
from tests.support.boards import free_port
from tests.support.daemonkit import Daemon, make_daemon
from tests.support.swarmkit import RUN, Swarm

BODY = {"prompt": [2, 5, 6, 7, 1], "max_tokens": 3}
COMMIT = "/patchswarm/v1/commit"


@dataclass
class Control:
    """What the test does to the engine's commits: refuse them (409), or hold them until released."""

    refuse: bool = False
    hold: asyncio.Event | None = None
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    released: bool = False
    asked: list[int] = field(default_factory=list)  # the versions the daemon asked the engine to commit

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == COMMIT:
            self.asked.append((await request.json())["version"])  # (the body is read once, then cached)
            if self.refuse:
                return web.json_response({"error": "Refused", "message": "the test engine refuses commits"}, status=409)
            if self.hold is not None:
                self.holding.set()
                await self.hold.wait()
        return await handler(request)

    def release(self) -> None:
        assert self.hold is not None
        self.released = True
        self.hold.set()
        self.hold = None


@dataclass
class Rig:
    sw: Swarm
    pub: Publisher
    traj: Trajectory
    d: Daemon
    control: Control
    sidecar: str
    engine_port: int
    engine: RunningServer | None = None

    async def status_until(self, ok: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = await self.d.status()
            if st is not None and ok(st):
                return st
            if not self.d.alive:
                raise AssertionError(f"daemon exited: {self.d.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"status never matched: {st}; log: {self.d.log.read_text()[-3000:]}")
            await asyncio.sleep(0.05)

    async def gate(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.sidecar + "/_patchswarm/version") as r:
            out: dict[str, Any] = await r.json()
            return out

    async def generate(self, exact: int | None = None) -> tuple[int, dict[str, Any]]:
        body = {**BODY, "weight_version": {"exact_version": exact}} if exact is not None else BODY
        async with aiohttp.ClientSession() as s, s.post(self.sidecar + "/generate", json=body) as r:
            return r.status, await r.json()

    async def engine_health(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{self.engine_port}/health") as resp:
            out: dict[str, Any] = await resp.json()
            return out

    async def metrics(self) -> str:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.d.socket)) as s,
            s.get("http://d/metrics") as resp,
        ):
            return await resp.text()

    async def start_engine(self) -> None:
        view = attach((await self.d.get("/v1/layout"))["attach"])
        app = make_engine_app(StoreViewSource(view))
        app.middlewares.append(self.control.middleware)
        self.engine = await serve_app(app, "127.0.0.1", self.engine_port)

    async def publish(self, step: int) -> None:
        await asyncio.to_thread(self.pub.publish, self.traj.bf16[step])


@pytest.fixture(scope="module")
def traj() -> Trajectory:
    return generate("tiny", steps=3)  # (training it takes seconds: once for the module)


@contextlib.asynccontextmanager
async def rig(tmp_path: Path, mode: str, traj: Trajectory) -> AsyncIterator[Rig]:
    sw = Swarm(tmp_path)
    now = int(time.time() * 1000)
    cert = Certificate(sw.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(sw.root).to_bytes()
    pub = Publisher(sw.board, sw.trainer, run_id=RUN, served_format="as_is", certificate=cert, chunk_size=16 << 10)
    pub.publish(traj.bf16[0])  # version 1
    await sw.start_seed()
    engine_port, sidecar_port = free_port(), free_port()
    extra = (
        f'[sidecar]\nenabled = true\nlisten = "127.0.0.1:{sidecar_port}"\nupstream = "http://127.0.0.1:{engine_port}"\n'
        f'commit_mode = "{mode}"\n[engine]\nkind = "zero-copy"\n'
    )
    d = make_daemon(sw, "d1", tmp_path, extra=extra)
    r = Rig(sw, pub, traj, d, Control(), f"http://127.0.0.1:{sidecar_port}", engine_port)
    d.start()
    try:
        # The store holds version 1 before any engine runs; the engine is not there to acknowledge it.
        await r.status_until(lambda st: st["version"] == 1)
        await r.start_engine()
        await r.status_until(lambda st: st["served_version"] == 1 and st["state"] == "idle")  # (a commit retried)
        yield r
    finally:
        if r.engine is not None:
            await r.engine.close()
        d.cleanup()
        await sw.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["quiesce", "in_place"])
async def test_a_version_is_attributed_only_once_the_engine_acknowledged_it(
    tmp_path: Path, mode: str, traj: Trajectory
) -> None:
    async with rig(tmp_path, mode, traj) as r:
        status, out = await r.generate(exact=1)
        assert status == 200 and out["weight_version"] == {"start": 1, "end": 1}, out
        status, out = await r.generate(exact=2)
        assert status == 409 and out["error"] == "WeightVersionNotReady" and out["applied_version"] == 1
        r.control.hold = asyncio.Event()
        await r.publish(1)  # version 2: written into the store, its commit held by the engine
        await asyncio.wait_for(r.control.holding.wait(), 60)
        st = await r.status_until(lambda st: True)
        assert st["state"] == "activating" and st["served_version"] == 1  # written, not acknowledged: not served
        assert (await r.engine_health())["version"] == 2  # (the engine's fence reads the store: written)
        gate = await r.gate()
        assert gate["applied_version"] == 1 and gate["activating_version"] == 2, gate
        pinned = asyncio.create_task(r.generate(exact=2))  # waits at the gate for the activation's outcome
        while (await r.gate())["waiting"] < 1:
            await asyncio.sleep(0.02)
        assert not pinned.done()
        r.control.release()
        status, out = await asyncio.wait_for(pinned, 60)
        assert r.control.released  # (answered only after the engine acknowledged version 2)
        assert status == 200 and out["weight_version"] == {"start": 2, "end": 2}, out
        assert out["engine_version"] == {"before": 2, "after": 2}
        await r.status_until(lambda st: st["served_version"] == 2 and st["state"] == "idle")
        assert (await r.gate())["applied_version"] == 2
        metrics = await r.metrics()
        assert "patchswarm_version_served 2.0" in metrics
        paused = r.d.log.read_text().count("engine paused for activation")
        assert (paused > 0) == (mode == "in_place"), paused
        assert await r.d.stop() == 0


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_refused_commit_keeps_the_old_version_served_and_is_retried_also_after_a_restart(
    tmp_path: Path, traj: Trajectory
) -> None:
    async with rig(tmp_path, "in_place", traj) as r:
        r.control.refuse = True
        await r.publish(1)  # version 2
        st = await r.status_until(lambda st: st["version"] == 2 and st["state"] == "error")
        assert st["served_version"] == 1
        assert "answered 409: Refused; the test engine refuses commits" in st["reason"], st["reason"]
        assert "retrying" in st["reason"]
        # The engine reads the store, which holds version 2: no response may say version 1 (nor 2, not
        # acknowledged), so admission stays closed until a retried commit is acknowledged.
        unpinned, pinned = asyncio.create_task(r.generate()), asyncio.create_task(r.generate(exact=2))
        asked = len(r.control.asked)
        while len(r.control.asked) < asked + 1:  # (retried: only the commit, the store holds version 2)
            await asyncio.sleep(0.05)
        gate = await r.gate()
        assert gate["applied_version"] == 1 and gate["activating_version"] == 2, gate
        r.control.refuse = False
        st = await r.status_until(lambda st: st["served_version"] == 2 and st["state"] == "idle")
        assert st["reason"] is None and st["version"] == 2
        for task in (unpinned, pinned):
            status, out = await asyncio.wait_for(task, 60)
            assert status == 200, out
            engine = out["engine_version"]
            assert out["weight_version"] == {"start": engine["before"], "end": engine["after"]}, out
            assert out["weight_version"] == {"start": 2, "end": 2}, out

        # Refused again, then the daemon dies: restarted, it finds its store ahead of the engine.
        r.control.refuse = True
        await r.publish(2)  # version 3
        await r.status_until(lambda st: st["version"] == 3 and st["served_version"] == 2)
        r.d.kill()
        r.control.refuse = False
        r.d.start()
        st = await r.status_until(lambda st: st["served_version"] == 3 and st["state"] == "idle")
        assert st["version"] == 3
        status, out = await r.generate(exact=3)
        assert status == 200 and out["weight_version"] == {"start": 3, "end": 3}, out
        assert out["engine_version"] == {"before": 3, "after": 3}
        assert set(r.control.asked) == {1, 2, 3}
        assert await r.d.stop() == 0


@pytest.mark.asyncio
async def test_a_daemon_restarted_after_dying_between_pause_and_resume_resumes_the_engine(
    tmp_path: Path, traj: Trajectory
) -> None:
    """kill -9 while the engine is paused (in_place, between pause and resume): the engine would hold
    every request for ever (vLLM, SGLang); the restarted daemon, with nothing left to activate,
    resumes it."""
    async with rig(tmp_path, "in_place", traj) as r:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://127.0.0.1:{r.engine_port}/pause_generation", json={"mode": "in_place"}) as resp,
        ):
            assert resp.status == 200
        assert (await r.engine_health())["paused"] is True
        r.d.kill()
        r.d.start()
        await r.status_until(lambda st: st["served_version"] == 1 and st["state"] == "idle")
        deadline = time.monotonic() + 30
        while (await r.engine_health())["paused"]:
            assert time.monotonic() < deadline, "the engine was left paused"
            await asyncio.sleep(0.05)
        status, out = await r.generate(exact=1)
        assert status == 200 and out["weight_version"] == {"start": 1, "end": 1}, out
        assert await r.d.stop() == 0
