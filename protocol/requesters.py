"""Per-requester limits on a node's uploads, as pure bookkeeping (the node reads the clock).

A requester is keyed by where its connection comes from (the transport says: its IP address, since
the node id a request carries is unverified and one client could send any number of them).  Two
limits keep a few clients from taking every upload slot:

- at most ``per_requester`` of the node's uploads under way or waiting for one requester at once;
- a requester whose transfer passed its deadline (it stopped reading) is refused for ``rest``
  seconds, twice as long for each further stall remembered (``memory``), at most ``max_rest``.

The stall table is bounded (``table`` requesters, the least recently stalled forgotten first); the
count of uploads under way is bounded by the uploads themselves (an entry lives while one runs).
"""

from __future__ import annotations

import math


class RequesterLimits:
    __slots__ = ("_active", "_max_rest", "_memory", "_per", "_rest", "_stalls", "_table")

    def __init__(self, per_requester: int, *, rest: float, max_rest: float, memory: float, table: int = 4096) -> None:
        if per_requester < 1:
            raise ValueError(f"per_requester must be >= 1, got {per_requester}")
        if not (0 <= rest <= max_rest < math.inf and 0 <= memory < math.inf):
            raise ValueError("rests and memory must be finite, >= 0, and rest <= max_rest")
        if table < 1:
            raise ValueError(f"table must be >= 1, got {table}")
        self._per = per_requester
        self._rest = rest
        self._max_rest = max_rest
        self._memory = memory
        self._table = table
        self._active: dict[str, int] = {}
        # requester -> (stalls remembered, when it last stalled, refused until); oldest stall first
        self._stalls: dict[str, tuple[int, float, float]] = {}

    @property
    def per_requester(self) -> int:
        return self._per

    def rest_left(self, key: str, now: float) -> float:
        """Seconds ``key`` still rests after a stall (0: it does not)."""
        entry = self._stalls.get(key)
        return entry[2] - now if entry is not None and now < entry[2] else 0.0

    def at_share(self, key: str) -> bool:
        """``key`` has its share of uploads under way or waiting already."""
        return self._active.get(key, 0) >= self._per

    def begin(self, key: str) -> None:
        self._active[key] = self._active.get(key, 0) + 1

    def end(self, key: str) -> None:
        left = self._active[key] - 1
        if left:
            self._active[key] = left
        else:
            del self._active[key]

    def stalled(self, key: str, now: float) -> float:
        """Record a transfer to ``key`` that passed its deadline; returns how long it now rests."""
        count, last, _ = self._stalls.pop(key, (0, -math.inf, 0.0))
        count = count + 1 if now - last <= self._memory else 1
        rest = min(self._max_rest, self._rest * 2.0 ** min(count - 1, 32))
        while len(self._stalls) >= self._table:
            del self._stalls[next(iter(self._stalls))]  # the least recently stalled
        self._stalls[key] = (count, now, now + rest)
        return rest

    def active(self, key: str) -> int:
        return self._active.get(key, 0)

    @property
    def busy_requesters(self) -> int:
        """Requesters with uploads under way or waiting (0 once every upload ended: nothing leaked)."""
        return len(self._active)

    @property
    def remembered(self) -> int:
        return len(self._stalls)
