"""What the daemon is doing, in one place: the state machine the API, the CLI and metrics read.

Phases: starting -> idle <-> fetching -> staging -> activating -> idle; error (with a reason)
from anywhere, cleared by the next successful version; stopping at shutdown.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# Engines whose acknowledged version is kept (any client of the socket may name one): the oldest
# heard from goes first, so the table stays bounded and the engines that keep acking stay in it.
MAX_ACKS = 64
MAX_SUBSCRIBERS = 64  # open /v1/events streams
MAX_REASON = 1024


class Phase(StrEnum):
    STARTING = "starting"
    IDLE = "idle"
    FETCHING = "fetching"
    STAGING = "staging"
    ACTIVATING = "activating"
    ERROR = "error"
    STOPPING = "stopping"


@dataclass
class Status:
    node: str
    run_id: str
    phase: Phase = Phase.STARTING
    reason: str | None = None
    version: int | None = None  # the version the store holds (written and verified)
    served_version: int | None = None  # the version the engine acknowledged serving (engine.kind none: the store's)
    root: str | None = None
    target: int | None = None  # newest version the host knows of
    chunks_done: int = 0
    chunks_total: int = 0
    peers: list[dict[str, Any]] = field(default_factory=list)
    held_versions: list[int] = field(default_factory=list)
    acks: dict[str, int] = field(default_factory=dict)  # engine name -> version it acknowledged
    last_activation_pause_s: float | None = None
    head_expired_since: float | None = None  # unix seconds: the newest head expired then (frozen board), else None
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank store: rank, store, version, root, state
    started: float = field(default_factory=time.time)
    _changed: asyncio.Condition | None = None
    _subscribers: set[asyncio.Queue[dict[str, Any]]] = field(default_factory=set)

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def snapshot(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "run_id": self.run_id,
            "state": str(self.phase),
            "reason": self.reason,
            "version": self.version,
            "served_version": self.served_version,
            "root": self.root,
            "target": self.target,
            "progress": {
                "chunks_done": self.chunks_done,
                "chunks_total": self.chunks_total,
                "fraction": (self.chunks_done / self.chunks_total) if self.chunks_total else None,
            },
            "peers": len(self.peers),
            "held_versions": list(self.held_versions),
            "acks": dict(self.acks),
            "last_activation_pause_s": self.last_activation_pause_s,
            "uptime_s": round(time.time() - self.started, 3),
            "head_expired_since": self.head_expired_since,
            "ranks": [dict(r) for r in self.ranks],
        }

    def update(self, **changes: Any) -> None:
        """Change fields and tell waiters and event subscribers (only when something changed)."""
        before = self.snapshot()
        for k, v in changes.items():
            if k == "phase":
                v = Phase(v)
            elif k == "reason" and isinstance(v, str) and len(v) > MAX_REASON:
                v = v[: MAX_REASON - 1] + "…"  # (errors may quote what a peer or server sent)
            setattr(self, k, v)
        if changes.get("phase") not in (None, Phase.ERROR) and "reason" not in changes:
            self.reason = None
        after = self.snapshot()
        interesting = {
            k: after[k]
            for k in ("state", "reason", "version", "served_version", "target", "progress")
            if after[k] != before[k]
        }
        if not interesting:
            return
        keys = ("state", "reason", "version", "served_version", "target", "progress")
        event = {"event": "state", **{k: after[k] for k in keys}}
        for q in list(self._subscribers):
            if q.full():
                self._subscribers.discard(q)  # a reader that stopped reading: drop it, not the daemon
            else:
                q.put_nowait(event)
        asyncio.get_running_loop().create_task(self._notify())

    def ack(self, engine: str, version: int) -> None:
        """An engine's acknowledged version (the table is capped at MAX_ACKS, oldest heard dropped)."""
        acks = dict(self.acks)
        acks.pop(engine, None)  # (re-inserted last: most recently heard)
        acks[engine] = version
        for stale in list(acks)[: max(0, len(acks) - MAX_ACKS)]:
            del acks[stale]
        self.update(acks=acks)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def subscribe(self) -> asyncio.Queue[dict[str, Any]] | None:
        """A queue of state events, or None when MAX_SUBSCRIBERS streams are open already (long-lived
        streams must not take the connections short requests need)."""
        if len(self._subscribers) >= MAX_SUBSCRIBERS:
            return None
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1024)
        self._subscribers.add(q)
        return q

    def subscribed(self, q: asyncio.Queue[dict[str, Any]]) -> bool:
        """False once a reader that stopped reading was dropped: its stream should end, not go quiet."""
        return q in self._subscribers

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers.discard(q)

    async def wait_version(self, version: int, timeout: float, *, served: bool = False) -> bool:
        """Until the store's version (``served``: the engine's acknowledged one) is at least ``version``
        (True) or the timeout passes (False)."""

        def reached() -> bool:
            v = self.served_version if served else self.version
            return v is not None and v >= version

        if reached():  # (timeout 0 is a poll: asyncio.wait_for would time out before looking)
            return True
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(reached), timeout)
            except TimeoutError:
                return False
        return True
