"""The rollout daemon's side of the engine driver (daemon/engine_driver.py): pause and resume around
an activation, the commit whose acknowledged version is the only one reported as served, and the
commits retried (with backoff) while the engine is behind the store.

A commit the engine refuses leaves the store on the new version (it is written and verified: only
the commit is redone, never the write) and the engine, the sidecar's gate and ``served_version`` on
the version acknowledged before; the status reads ``state: error`` with the engine's reason until a
retry is acknowledged.  At start-up the daemon asks the engine what it serves and commits the store's
version when the engine is behind (a daemon restarted between a write and its commit).

The gate reopens on the version served before only when the engine still computes with it: a copy
engine whose parameters were not touched.  A zero-copy engine reads the store, which holds the new
version already, and a copy engine may hold part of it (``torn``): then no version can be
attributed, so the sidecar's admission stays closed (requests wait, then 503) and an in-place pause
stays on until a retried commit is acknowledged (``_holding``); so does a daemon started with its
store ahead of the engine.

``EngineControl`` is a base of ``VersionActivation`` (daemon/rollout_activation.py), which sets
what it declares and supplies the sidecar drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from patchswarm.daemon.config import DaemonConfig
from patchswarm.daemon.engine_driver import Activation, EngineDriver, EngineError
from patchswarm.daemon.engine_drivers import copies_regions
from patchswarm.daemon.metrics import DaemonMetrics
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.status import Phase, Status
from patchswarm.daemon.store_format import StoreError, StoreState
from patchswarm.daemon.weightstore import WeightStore

log = logging.getLogger("patchswarm.daemon")

RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0  # as the swarm node's activation retries


class EngineControl:
    """Driving the engine around each activation; the daemon state it reads."""

    cfg: DaemonConfig
    status: Status
    metrics: DaemonMetrics
    gate: Any
    store: WeightStore | None
    ranks: RankStores | None
    driver: EngineDriver
    served: int | None  # the version the engine acknowledged last (None: none yet)
    _activating: asyncio.Lock
    _stopping: bool
    _behind: str | None  # why the engine does not serve the store's version (None: it does)
    _recommit: asyncio.Task[None] | None
    _holding: bool  # the gate left closed after a commit that failed (the engine serves no known version)
    _held_paused: bool  # the engine left paused with it (in_place)

    async def _drain_sidecar(self, mode: str, version: int) -> None:
        raise NotImplementedError  # (daemon/rollout_activation.py)

    def _store_holds(self) -> int | None:
        """The version the store (every rank store) holds ready, or None."""
        if self.ranks is not None:
            return self.ranks.common_version()
        if self.store is None or self.store.data is None:
            return None
        hdr = self.store.header()
        return hdr.version if hdr.state == StoreState.READY else None

    def _engine_intact(self) -> bool:
        """Whether, after a failed commit, the engine still computes with the version it served
        before: only a copy engine whose parameters were not written (daemon/engine_driver.py)."""
        return copies_regions(self.driver) and not getattr(self.driver, "torn", False)

    async def _engine_pause(self) -> None:
        """Hold the engine's requests between steps (in_place); StoreError when it cannot.  An engine
        left paused by a failed commit (``_held_paused``) is not paused twice."""
        if self._held_paused:
            return
        try:
            await self.driver.pause()
        except EngineError as e:
            raise StoreError(str(e)) from None
        log.info("engine paused for activation")

    async def _end_activation(self, ack: int | None, *, attempted: bool, paused: bool) -> None:
        """Reopen the gate at ``ack`` and resume the engine (``paused``); when no ack came for a commit
        attempted (or an earlier hold) and the engine may not compute with the old version, keep both
        closed instead: a retried commit ends them."""
        if ack is None and (attempted or self._holding) and not self._engine_intact():
            self._holding = self.gate is not None
            self._held_paused = self._held_paused or paused
            if self._holding or self._held_paused:
                log.warning("admission stays closed until the engine acknowledges the store's version")
            return
        # The engine's acknowledged version, or the one it served before.  (A start-up commit retry may
        # begin before the sidecar's gate exists, which then opens closed: _hold_if_behind.)
        if self.gate is not None and self.gate.activating is not None:
            self.gate.end_activation(ack if ack is not None else self.gate.applied)
        self._holding = False
        if paused or self._held_paused:  # (after end_activation: no request reports a version it did not see)
            self._held_paused = False
            await self._engine_resume()

    async def _engine_resume(self) -> None:
        try:
            await self.driver.resume()
        except EngineError as e:  # (the engine may have restarted: it serves unpaused then)
            log.warning("engine resume failed: %s", e)

    def _activation(self, version: int, *, full: bool, regions: Any = None) -> Activation:
        """The activation of ``version``: whole when the engine is not on the store's previous version."""
        chosen = {} if full else dict(regions or {})
        return Activation(version, self.served, full, chosen, self.cfg["engine.flush_cache"])

    async def _engine_commit(self, activation: Activation) -> int | None:
        """Commit ``activation`` (the store holds it): the acknowledged version, or None when the engine
        refused (recorded in the status, retried with backoff)."""
        try:
            ack = await self.driver.commit(activation)
        except EngineError as e:
            self._engine_behind(activation.version, str(e))
            return None
        self._acked(ack)
        return ack

    def _acked(self, version: int) -> None:
        self.served, self._behind = version, None
        self.status.update(served_version=version)
        self.metrics.served.set(version)

    def _engine_behind(self, version: int, why: str) -> None:
        self._behind = f"the engine does not serve version {version} yet (serves {self.served}): {why}"
        log.error("%s; retrying", self._behind, extra={"version": version})
        self.status.update(phase=Phase.ERROR, reason=f"{self._behind} (retrying)")
        if not self._stopping and (self._recommit is None or self._recommit.done()):
            self._recommit = asyncio.get_running_loop().create_task(self._commit_until_served())

    async def _engine_start(self) -> None:
        """Start-up: what the engine serves; the store's version is committed when the engine is behind."""
        held = self._store_holds()
        try:
            served = await self.driver.served_version()
        except EngineError as e:
            served = None
            log.warning("the engine does not say what it serves: %s", e)
        if served is not None and (held is None or served <= held):
            self._acked(served)
        elif served is not None:
            log.warning("the engine says it serves version %s, but the store holds %s", served, held)
        if held is not None and self.served != held:
            self._engine_behind(held, "the daemon started with the store ahead of the engine")
        elif self.cfg["sidecar.enabled"] and self.cfg["sidecar.commit_mode"] == "in_place":
            # A daemon that died between pause and resume left the engine holding every request (vLLM
            # and SGLang for ever); nothing is left to activate, so it goes on (a no-op when running).
            try:
                await self.driver.resume()
            except EngineError as e:  # (not up yet: then nobody paused it)
                log.info("engine resume at start-up: %s", e)

    async def _hold_if_behind(self) -> None:
        """Start-up, once the sidecar's gate exists: closed while the engine is behind the store (what
        it computes with is unknown: a zero-copy engine reads the new version, a copy engine may hold
        part of it) until the retried commit is acknowledged."""
        held = self._store_holds()
        if self.gate is not None and self._behind is not None and held is not None and held > self.gate.applied:
            await self.gate.begin_activation("quiesce", held)  # (nothing in flight yet: returns at once)
            self._holding = True

    async def _commit_until_served(self) -> None:
        """Commit the store's version again (backoff 0.5 s doubling to 8 s) until the engine acknowledges it."""
        delay = RETRY_FIRST_S
        while not self._stopping:
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            async with self._activating:
                version = self._store_holds()
                if self._stopping or version is None or (self.served is not None and self.served >= version):
                    return
                try:
                    if await self._commit_again(version):
                        self.status.update(phase=Phase.IDLE, reason=None)
                        log.info("the engine serves version %s", version, extra={"version": version})
                        return
                except StoreError as e:  # (a drain that timed out, a pause that failed: the next try)
                    self.status.update(phase=Phase.ERROR, reason=f"{self._behind or e}; {e} (retrying)")

    async def _commit_again(self, version: int) -> bool:
        """One commit of the version the store holds already, around the sidecar's gate (no write)."""
        mode = self.cfg["sidecar.commit_mode"]
        in_place = self.gate is not None and mode == "in_place"
        if self.gate is not None:
            await self._drain_sidecar(mode, version)
        ack: int | None = None
        paused = attempted = False
        try:
            if in_place:
                await self._engine_pause()
                paused = True
            attempted = True
            ack = await self._engine_commit(self._activation(version, full=True))
        finally:
            await self._end_activation(ack, attempted=attempted, paused=paused)
        return ack is not None

    async def _engine_stop(self) -> None:
        if self._recommit is not None:
            self._recommit.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recommit
        await self.driver.close()
