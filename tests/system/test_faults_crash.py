"""kill -9 of a rollout daemon at points spread over every phase of taking a version (fetching,
staging, each step of activating, and at random times including start-up and recovery), with a
new version published for each kill and an engine reading the store throughout.

After every kill and restart the engine is shown only a whole, published version (fence and
bytes agree with its signed root), never one older than it already served; at the end the daemon
converges to the head.  benchmarks/crash_loop.py runs the same loop 100 times."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.faultkit import PHASES, CrashLoop
from tests.support.swarmkit import Swarm

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("PATCHSWARM_FAULT_KILLS", "10"))


@pytest.mark.asyncio
async def test_kill_9_across_all_phases_never_exposes_a_torn_version_and_converges(tmp_path: Path) -> None:
    async with CrashLoop(Swarm(tmp_path), tmp_path, seed=20261129) as loop:
        for i in range(KILLS):
            await loop.kill_once(PHASES[i % len(PHASES)])
        head = await loop.finish()
    r = loop.report
    print(f"kills: {r.kills}; recoveries: {r.recoveries}; engine reads: {r.engine_reads}; served: {r.versions_served}")
    assert not r.violations, r.violations[:5]
    assert sum(r.kills.values()) == KILLS
    # Each phase was hit: the kills are not all in one place.
    assert any(k.startswith("fetching") for k in r.kills), r.kills
    assert "staging" in r.kills and any(k.startswith("activating:") for k in r.kills), r.kills
    assert head in r.versions_served and r.engine_reads > 0
