"""Daemon + reference engine + sidecar, as an operator would run them: requests pinned to a version
get 409 until that version lands in the engine's memory, then run on it and say so."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from patchswarm.daemon.engine import attach
from patchswarm.daemon.publisher import Publisher
from patchswarm.daemon.ref_sources import StoreViewSource
from patchswarm.daemon.refengine import start_engine
from patchswarm.daemon.trajectory import generate
from patchswarm.protocol.trust import Certificate
from tests.support.boards import free_port
from tests.support.daemonkit import make_daemon
from tests.support.swarmkit import RUN, Swarm


@pytest.mark.asyncio
async def test_pinned_requests_wait_for_their_version_then_report_it(tmp_path: Path) -> None:
    traj = generate("tiny", steps=2)
    sw = Swarm(tmp_path)
    now = int(time.time() * 1000)
    cert = Certificate(sw.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(sw.root).to_bytes()
    (tmp_path / "board").mkdir(exist_ok=True)
    pub = Publisher(sw.board, sw.trainer, run_id=RUN, served_format="as_is", certificate=cert, chunk_size=16 << 10)
    pub.publish(traj.bf16[0])  # version 1
    await sw.start_seed()
    engine_port, sidecar_port = free_port(), free_port()
    extra = (
        f'[sidecar]\nenabled = true\nlisten = "127.0.0.1:{sidecar_port}"\nupstream = "http://127.0.0.1:{engine_port}"\n'
    )
    d = make_daemon(sw, "d1", tmp_path, extra=extra)
    d.start()
    engine = None
    try:
        await d.wait_version(1)
        view = attach((await d.get("/v1/layout"))["attach"])
        engine = await start_engine(StoreViewSource(view), port=engine_port)
        url = f"http://127.0.0.1:{sidecar_port}/generate"
        body = {"prompt": [2, 5, 6, 7, 1], "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={**body, "weight_version": {"exact_version": 2}}) as r:
                assert r.status == 409
                refusal = await r.json()
                assert refusal["error"] == "WeightVersionNotReady" and refusal["retryable"] is True
                assert refusal["applied_version"] == 1
            async with http.post(url, json=body, headers={"X-Weight-Version-Min": "1"}) as r:
                assert r.status == 200, await r.text()
                out = await r.json()
                assert out["weight_version"] == {"start": 1, "end": 1}
                assert r.headers["X-Weight-Version-Start"] == "1"
            pub.publish(traj.bf16[1])  # version 2
            for _ in range(600):
                async with http.post(url, json={**body, "weight_version": {"exact_version": 2}}) as r:
                    if r.status == 200:
                        out = await r.json()
                        break
                    assert r.status == 409
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("version 2 never became servable")
            assert out["weight_version"] == {"start": 2, "end": 2}
            assert out["engine_version"] == {"before": 2, "after": 2}
            st = await d.get("/v1/status")
            assert st["version"] == 2
        view.close()
        assert await d.stop() == 0
    finally:
        if engine is not None:
            await engine.close()
        d.cleanup()
        await sw.close()
