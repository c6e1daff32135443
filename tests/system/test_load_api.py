"""The daemon's unix-socket API under a steady stream of version queries while versions distribute
and activate: every reply is valid JSON with a version, none is lost or fails, and the version a
client sees never goes back.  No timing is asserted; benchmarks/api_load.py measures latency with
the same load code at 1,000 requests/s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.daemonkit import make_daemon
from tests.support.loadkit import api_load
from tests.support.swarmkit import Swarm

RATE = 200.0  # requests/s: enough concurrency to interleave with activations on a loaded CI machine


@pytest.mark.asyncio
async def test_version_queries_during_distribution_are_all_answered_and_never_go_back(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "loaded", tmp_path)
    d.start()
    try:
        await d.wait_version(1)
        done = asyncio.Event()
        load = asyncio.create_task(api_load(d.socket, RATE, done.is_set))
        for _ in range(2):
            v = await asyncio.to_thread(sw.publish, 3e-4)
            await d.wait_version(v)
        await asyncio.sleep(0.5)
        done.set()
        result = await asyncio.wait_for(load, 60)
        print(f"{result.sent} requests, {result.completed} answered, versions seen {sorted(result.versions)}")
        assert not result.errors, result.errors[:5]
        assert result.completed == result.sent > 0
        assert {1, 2, 3} <= result.versions
        assert set(result.latencies) == {"/v1/version", "/v1/status"}
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()
