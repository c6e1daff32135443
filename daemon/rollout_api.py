"""What the rollout daemon's API and metrics answer: an engine registering its buffer (and the
version loaded into it), the store's layout, and the status and metrics refreshed from the swarm
node at each poll or scrape.

``ApiAnswers`` is that part of ``RolloutDaemon`` (daemon/rollout.py); it builds on
daemon/rollout_activation.py, whose activation a registered buffer's load goes through.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from patchswarm.daemon.api import parse_rank
from patchswarm.daemon.exporter import Exporter
from patchswarm.daemon.journal import recover
from patchswarm.daemon.rank_rollout import rank_layout, register_rank
from patchswarm.daemon.rollout_activation import AWAITING_ENGINE, VersionActivation, off_loop
from patchswarm.daemon.status import Phase
from patchswarm.daemon.store_buffer import RegistrationError, check_registration
from patchswarm.daemon.store_format import StoreError, StoreState, StoreTooSmallError
from patchswarm.protocol.head import utc_text

log = logging.getLogger("patchswarm.daemon")

HEAD_REFUSED = "head refused"  # status reason prefix while the newest head fails verification


def _retrying(failures: int) -> str:
    return f" (retrying: {failures} failed in a row)" if failures else ""


class ApiAnswers(VersionActivation):
    """Engine registration, layout, status and metrics: what the daemon's API and metrics ports read."""

    async def _register_store(self, body: Any, peer: int | None = None) -> tuple[int, dict[str, Any]]:
        """POST /v1/store: the engine gives the daemon its buffer; the current version is loaded into it.
        ``peer``: the pid of the registering process, watched from now on (daemon/exporter.py)."""
        if not self.engine_kind:
            msg = "store.kind is 'shm': the daemon allocates the store; attach with GET /v1/layout"
            return 409, {"error": "NotEngineStore", "message": msg}
        if self.ranks is not None:
            return await register_rank(self, self.ranks, body, peer)
        try:  # the one rank check (daemon/api.py): `False in (None, 0)` and 0.0 == 0 let those through here
            parse_rank(body.get("rank") if isinstance(body, dict) else None, 1)
        except ValueError:
            return 400, {"error": "BadRequest", "message": "rank must be 0: this daemon feeds one store"}
        if self.store is None:
            msg = "the daemon holds no version yet, so the store has no layout: register once GET /v1/layout answers"
            return 409, {"error": "NotReady", "message": msg}
        store = self.store
        try:
            engine, handle = check_registration(
                store.segment.name, store.layout, body, kind=self.cfg["store.kind"], device_uuid=self.device_uuid
            )
        except RegistrationError as e:
            return (400 if e.code == "BadRequest" else 422), {"error": e.code, "message": str(e)}
        async with self._activating:
            store.check_exporter()
            if store.buffer_id != handle["buffer_id"] or store.data is None:
                exporter = Exporter.of_pid(peer) if peer is not None else None
                if peer is not None and exporter is None:
                    return 422, {"error": "BadHandle", "message": f"the registering process {peer} is gone"}
                try:
                    store.attach_buffer(handle, exporter=exporter)  # a new buffer: EMPTY until loaded
                except StoreTooSmallError as e:
                    if exporter is not None:
                        exporter.close()
                    return 422, {"error": "BufferTooSmall", "message": f"the engine's buffer: {e}"}
                except (StoreError, ValueError, OSError) as e:  # a name or file that is no buffer: one line, no 500
                    if exporter is not None:
                        exporter.close()
                    return 422, {"error": "BadHandle", "message": f"cannot map the engine's buffer: {e}"}
                # A journal for an earlier buffer is void now (off the loop: it may wait for the readers' lock).
                await off_loop(recover, store, self.journal_dir)
                self.status.update(version=None, root=None)
                log.info("engine %r registered buffer %x (%s)", engine, handle["buffer_id"], handle["kind"])
            hdr = store.header()
            loading = hdr.state != StoreState.READY and self.shadow is not None
            if loading:
                self._loading = asyncio.create_task(self._load_registered())
        state = "loading" if loading else ("ready" if hdr.state == StoreState.READY else "waiting_for_version")
        return 202 if loading else 200, {
            "engine": engine,
            "buffer_id": handle["buffer_id"],
            "state": state,
            "version": hdr.version if hdr.state == StoreState.READY else None,
            "target": self.shadow.version if self.shadow is not None else None,
        }

    def _layout_info(self, rank: int = 0) -> dict[str, Any] | None:
        if self.ranks is not None:
            return rank_layout(self.ranks, rank, self.engine_kind)
        if self.store is None:
            return None
        # An engine store is published before it holds a version: the engine allocates from it.
        if not self.engine_kind and self.store.header().state != StoreState.READY:
            return None
        return {"layout": self.store.layout.to_json(), "attach": self.store.attach_info()}

    def _metrics_text(self) -> bytes:
        # Status and metrics as of this scrape, together: a metric (say, run halted) must never be ahead
        # of the status a client reads right after it.
        self._refresh()
        return self.metrics.render()

    def _refresh(self) -> None:
        if self.tls is not None:
            self.metrics.tls_expiry.labels(file=str(self.tls.files.cert)).set(self.tls.not_after)
        if self.node is None:
            return
        n = self.node.node
        head_version = n.head.version if n.head else None
        progress = [(s.have.count(), s.have.n) for s in n.partial.values()]
        done = sum(p[0] for p in progress)
        total = sum(p[1] for p in progress)
        changes: dict[str, Any] = {
            "target": head_version,
            "chunks_done": done,
            "chunks_total": total,
            "peers": [
                {"node": v.info.node_id, "addr": v.info.addr, "zone": v.info.zone, "version": v.ann.version}
                for v in n.peers.values()
            ],
            "held_versions": [n.held.version] if n.held else [],
        }
        if self.status.phase in (Phase.IDLE, Phase.FETCHING) and not self._activating.locked():
            if n.phase == "fetching":
                changes["phase"] = Phase.FETCHING
            elif n.phase == "idle" and self.status.phase == Phase.FETCHING:
                changes["phase"] = Phase.IDLE
        if n.error and self.status.phase == Phase.IDLE and head_version != self.status.version:
            changes["reason"] = n.error + _retrying(n.failures)
        elif self.status.phase == Phase.ERROR and self._failed_because and n.failures:
            changes["reason"] = self._failed_because + _retrying(n.failures)  # (the node retries, with backoff)
        frozen_ms = n.puller.stats.frozen_since_ms if n.head_error else None
        changes["head_expired_since"] = None if frozen_ms is None else frozen_ms / 1000
        if frozen_ms is not None and self.status.phase == Phase.IDLE:
            # One line, the same at every poll: the engine keeps the last verified version meanwhile.
            changes["reason"] = f"{HEAD_REFUSED}: board frozen since {utc_text(frozen_ms)} (the newest head expired)"
        elif n.head_error and self.status.phase == Phase.IDLE:
            changes["reason"] = f"{HEAD_REFUSED}: {n.head_error}"
        elif "reason" not in changes and (self.status.reason or "").startswith(HEAD_REFUSED):
            changes["reason"] = None
        # (never while an activation holds the lock: it checks the engine itself, before writing)
        watched = [s for s in self.ranks.stores if s is not None] if self.ranks is not None else [self.store]
        if self.engine_kind and not self._activating.locked():
            for store in watched:
                if store is not None:
                    store.check_exporter()
        died = next((s.released_because for s in watched if s is not None and s.released_because), None)
        if self._awaiting_engine() and self.status.phase in (Phase.IDLE, Phase.FETCHING):
            changes["reason"] = f"{died}; {AWAITING_ENGINE}" if died else AWAITING_ENGINE
            if died and self.status.version is not None:
                changes.update(version=None, root=None)
        if n.puller.tracker.halted:  # equivocation: the engine keeps its version, the operator must act
            changes.update(phase=Phase.ERROR, reason=f"run halted: {n.puller.tracker.halted}")
        if self.ranks is not None:
            changes["ranks"] = self.ranks.entries()
        self.status.update(**changes)
        if self.gate is not None and head_version is not None:
            self.gate.set_target(head_version)
        self.metrics.sync(n.metrics, self.status.version, head_version, swarm=n)
