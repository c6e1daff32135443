"""Faults of the fleet through real daemon processes on loopback: churn while a version distributes,
a partitioned region healing, the seed crashing and restarting on its address.  Every live daemon
converges to the head, and every engine view shows only whole, published versions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from patchswarm.daemon.engine import EngineView, attach
from tests.support.boards import free_port
from tests.support.faultkit import (
    EnvDaemon,
    FenceWatcher,
    Partition,
    SeedProc,
    engine_sees,
    fleet_daemon,
    wait_all,
    wait_status,
)
from tests.support.swarmkit import Swarm

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
RATE = "400KB"  # a download limit per daemon, so that a version takes a few seconds to spread


@dataclass
class Fleet:
    sw: Swarm
    seed: SeedProc
    daemons: list[EnvDaemon]
    views: dict[str, EngineView] = field(default_factory=dict)

    def live(self) -> list[EnvDaemon]:
        return [d for d in self.daemons if d.alive]

    async def attach_all(self) -> None:
        for d in self.daemons:
            self.views[d.name] = attach((await d.get("/v1/layout"))["attach"])

    def engine_versions(self) -> dict[str, int | None]:
        return {name: engine_sees(v, self.sw.served) for name, v in self.views.items()}


@asynccontextmanager
async def fleet(tmp: Path, n: int, partition: Partition | None = None, regions: str = "") -> AsyncIterator[Fleet]:
    """A seed process and n daemons at version 1.  With a partition, every node sits behind a proxy
    of its region (``regions[i]`` for daemon i; the seed is in region "B")."""
    sw = Swarm(tmp)
    sw.publish()
    seed_proxy = free_port() if partition else 0
    seed = SeedProc(sw, tmp, advertise=f"http://127.0.0.1:{seed_proxy}" if partition else None)
    f = Fleet(sw, seed, [])
    try:
        seed.start()
        if partition is not None:
            await partition.proxy(seed_proxy, seed.port, "B")
            assert seed.proc is not None
            partition.place(seed.proc.pid, "B")
        for i in range(n):
            d = fleet_daemon(sw, seed.url, f"d{i}", tmp, proxied=partition is not None)
            d.env["PATCHSWARM_SWARM_DOWNLOAD_RATE"] = RATE
            f.daemons.append(d)
            if partition is not None:
                await partition.proxy(d.proxy_port, d.listen_port, regions[i])
            d.start()
            if partition is not None:
                assert d.proc is not None
                partition.place(d.proc.pid, regions[i])
        await wait_all(f.daemons, 1, timeout=120)
        await f.attach_all()
        yield f
    finally:
        for v in f.views.values():
            v.close()
        for d in f.daemons:
            d.cleanup()
        seed.kill()
        if partition is not None:
            await partition.close()
        await sw.close()


async def test_a_third_of_the_daemons_killed_and_some_restarted_mid_distribution(tmp_path: Path) -> None:
    async with fleet(tmp_path, 6) as f:
        victims = [f.daemons[1], f.daemons[4]]  # 2 of 6
        watchers = [FenceWatcher(f.views[d.name], f.sw.served) for d in victims]
        for w in watchers:
            w.start()
        v = f.sw.publish(scale=1e-3)  # a bigger patch: there is a transfer to interrupt
        await wait_status(victims[0], lambda s: s["target"] == v and s["progress"]["chunks_done"] > 0)
        for d in victims:
            d.kill()
        await asyncio.sleep(1.0)
        victims[0].start()  # rejoins (same store, same data dir); victims[1] stays dead
        await wait_all(f.live(), v, timeout=120)
        for w in watchers:
            w.finish()
        seen = f.engine_versions()
        assert {d.name for d in f.live()} == {f"d{i}" for i in (0, 1, 2, 3, 5)}
        assert all(seen[d.name] == v for d in f.live()), seen
        assert seen[victims[1].name] == 1  # the dead host still holds version 1, whole
        assert sum(w.observations for w in watchers) > 0


async def test_partitioned_region_converges_after_healing(tmp_path: Path) -> None:
    part = Partition()
    async with fleet(tmp_path, 4, part, regions="AABB") as f:
        a, b = f.daemons[:2], f.daemons[2:]
        part.cut()
        v = f.sw.publish(scale=3e-4)
        await wait_all(b, v)
        await asyncio.sleep(3.0)  # long enough for each side to suspect the other
        for d in a:  # the cut is real: region A saw nothing of version 2
            st = await d.status()
            assert st is not None and st["version"] == 1 and st["target"] == 1, st
        assert part.refused > 0
        part.heal()
        await wait_all(a, v, timeout=120)
        assert f.engine_versions() == {d.name: v for d in f.daemons}


async def test_seed_crash_and_restart_on_its_address_mid_distribution(tmp_path: Path) -> None:
    async with fleet(tmp_path, 3) as f:
        v = f.sw.publish(scale=1e-3)
        await wait_status(f.daemons[0], lambda s: s["target"] == v and s["progress"]["chunks_done"] > 0)
        f.seed.kill()
        await asyncio.sleep(2.0)
        f.seed.start()  # same port: the address every daemon was configured with
        await wait_all(f.daemons, v, timeout=120)
        v2 = f.sw.publish(scale=3e-4)  # and the restarted seed keeps serving new heads
        await wait_all(f.daemons, v2, timeout=120)
        assert f.engine_versions() == {d.name: v2 for d in f.daemons}
