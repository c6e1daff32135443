"""The rollout daemon's end of an activation (daemon/rollout_engine.py ``EngineControl._end_activation``):
after a commit the engine did not acknowledge, the sidecar's gate reopens on the old version only when
the engine still computes with it (a copy engine whose parameters were not written); an engine that
reads the store (zero-copy) or a torn copy engine keeps admission closed and its pause on until a
commit is acknowledged."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from patchswarm.daemon.engine_driver import Activation
from patchswarm.daemon.metrics import DaemonMetrics
from patchswarm.daemon.rollout_engine import EngineControl
from patchswarm.daemon.sidecar_gate import VersionGate
from patchswarm.daemon.status import Status


class Driver:
    """An engine driver that records pauses and resumes (its commits are not called here)."""

    name = "test"

    def __init__(self, *, copies: bool, torn: bool = False) -> None:
        self.copies, self.torn = copies, torn
        self.calls: list[str] = []

    async def served_version(self) -> int | None:
        return None

    async def pause(self) -> None:
        self.calls.append("pause")

    async def commit(self, activation: Activation) -> int:
        raise AssertionError("not called")

    async def resume(self) -> None:
        self.calls.append("resume")

    async def close(self) -> None:
        pass


class Host(EngineControl):
    def __init__(self, driver: Driver, gate: VersionGate) -> None:
        self.cfg: Any = {"sidecar.commit_mode": "in_place", "sidecar.enabled": True, "engine.flush_cache": True}
        self.status = Status("node", "run")
        self.metrics = DaemonMetrics()
        self.gate, self.store, self.ranks = gate, None, None
        self.driver = driver
        self.served = 1
        self._activating = asyncio.Lock()
        self._stopping = True  # (no commit retries in these tests)
        self._behind, self._recommit = None, None
        self._holding = self._held_paused = False


async def _failed_commit_of_2(driver: Driver) -> Host:
    host = Host(driver, VersionGate(applied=1))
    await host.gate.begin_activation("in_place", 2)
    await host._engine_pause()
    await host._end_activation(None, attempted=True, paused=True)
    return host


@pytest.mark.asyncio
async def test_a_copy_engine_left_untouched_reopens_on_the_old_version() -> None:
    host = await _failed_commit_of_2(Driver(copies=True))
    assert (host.gate.applied, host.gate.activating) == (1, None)
    assert host.driver.calls == ["pause", "resume"] and not host._holding  # type: ignore[attr-defined]


@pytest.mark.asyncio
@pytest.mark.parametrize("driver", [Driver(copies=False), Driver(copies=True, torn=True)], ids=["zero-copy", "torn"])
async def test_an_engine_that_may_compute_with_the_new_version_stays_closed_until_acknowledged(driver: Driver) -> None:
    host = await _failed_commit_of_2(driver)
    assert (host.gate.applied, host.gate.activating) == (1, 2)  # closed: no response says 1 (or 2)
    assert driver.calls == ["pause"] and host._holding and host._held_paused
    # A write that fails next (nothing attempted) keeps it closed too; so does another refusal.
    await host._end_activation(None, attempted=False, paused=False)
    assert host.gate.activating == 2 and driver.calls == ["pause"]
    await host._engine_pause()  # (the retry's pause: the engine is paused already)
    assert driver.calls == ["pause"]
    await host._end_activation(2, attempted=True, paused=True)  # acknowledged at last
    assert (host.gate.applied, host.gate.activating) == (2, None)
    assert driver.calls == ["pause", "resume"] and not host._holding and not host._held_paused
