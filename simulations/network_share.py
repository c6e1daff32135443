"""Max-min fair sharing for the flow-level network model: from scratch, and incrementally after an event.

``progressive_filling`` computes the max-min rates of a set of flows from scratch.  ``Sharer``
updates an existing max-min allocation after flows start or leave, visiting only the resources
whose fill level can change; docs/simulation.md#incremental-recomputation gives the argument.

Progressive filling raises all rates together; a resource *saturates* at the level where its
capacity is used up and freezes its still-rising flows there.  So a resource's level depends only
on the flows frozen below it, and a flow's rate is the lowest level among its resources (or its
cap).  After an event, ``Sharer`` replays that filling in level order, but only for the resources
it *touches*; every other resource is assumed to saturate at its old level, with its old flows,
until a touched resource changes one of its flows below that level, which touches it in turn.
A touched resource is examined at the lower of its old level and its new water level: at its old
level, if it would not fill yet, it releases its flows (they rise on); at its new level it freezes
every flow still rising there.  A flow whose rate changed, or that was released, touches its
other resources.  The filling order is the same as from scratch, so the rates are the same.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

TOLERANCE = 1e-9  # relative: "saturated", "at its cap", "no flow runs faster"
SAME = 1e-12  # relative: two levels this close are one (float noise must not spread re-sharing)
INF = math.inf

_RISING = 1  # a flow released or started in this re-sharing, not yet frozen
_FROZEN = 2  # a flow frozen in this re-sharing (its rate is final)


class Resource:
    """One shared capacity: a host's uplink or downlink, or one direction of a backbone link."""

    __slots__ = (
        "capacity",
        "epoch",
        "expired",
        "filled",
        "flows",
        "held",
        "index",
        "level",
        "name",
        "others",
        "others_max",
        "queued",
        "risers",
        "rising",
        "version",
        "water",
    )

    def __init__(self, index: int, name: str, capacity: float) -> None:
        self.index = index
        self.name = name
        self.capacity = capacity
        self.flows: dict[int, Flow] = {}  # active flows crossing it, by id (insertion order)
        self.held: dict[int, Flow] = {}  # those of them bottlenecked here (their rate is `level`)
        self.level = INF  # the rate of the flows held here (inf: none; may outlive them when a tie moves them)
        # Scratch state of the re-sharing in progress (valid while `epoch` is the Sharer's).
        self.epoch = 0
        self.water = INF  # the level it would fill at, given what its flows are known to do
        self.version = 0  # invalidates its older queue entries
        self.expired = False  # passed its old level without filling: its held flows were released
        self.filled = False  # saturated in this re-sharing: its flows are final
        self.queued = -1.0  # the key of its live queue entry (-1: none)
        self.risers: list[Flow] = []  # flows released or started across it (some frozen since)
        # Running sums for the water level (see Sharer).
        self.rising = 0
        self.others = 0.0
        self.others_max = 0.0

    @property
    def load(self) -> float:
        """Sum of the rates of its flows."""
        return sum(f.rate for f in self.flows.values())

    @property
    def peak(self) -> float:
        """The fastest of its flows."""
        return max((f.rate for f in self.flows.values()), default=0.0)

    def saturated(self) -> bool:
        return self.load >= self.capacity * (1.0 - TOLERANCE)

    def __repr__(self) -> str:
        return f"Resource({self.name!r}, {self.capacity:g})"


class Flow:
    """One transfer.  Read-only for callers; the network updates it."""

    __slots__ = (
        "active_at",
        "bottleneck",
        "cap",
        "ceiling",
        "done_at",
        "dst",
        "due",
        "epoch",
        "id",
        "last",
        "latency",
        "mark",
        "on_done",
        "rate",
        "remaining",
        "resources",
        "size",
        "src",
        "start",
        "state",
        "tag",
        "version",
    )

    def __init__(
        self,
        fid: int,
        src: str,
        dst: str,
        size: float,
        start: float,
        latency: float,
        cap: float,
        resources: tuple[Resource, ...],
        on_done: Callable[[Flow], None] | None,
        tag: object,
    ) -> None:
        self.id = fid
        self.src = src
        self.dst = dst
        self.size = size
        self.start = start
        self.latency = latency
        self.active_at = start + latency
        self.cap = cap  # window / RTT (inf without latency or window)
        self.resources = resources  # finite-capacity resources it crosses
        # its cap where the cap can bind (below every capacity it crosses), else inf: no filling event needed
        self.ceiling = cap if cap < min((r.capacity for r in resources), default=INF) else INF
        self.on_done = on_done
        self.tag = tag
        self.state = "pending"  # pending -> active -> done | cancelled
        self.rate = 0.0
        self.remaining = float(size)
        self.last = self.active_at  # time `remaining` was last settled
        self.done_at = math.nan
        self.version = 0  # bumps whenever the scheduled completion changes
        self.due = INF  # when its scheduled completion is (never later than its true completion)
        self.bottleneck: Resource | None = None  # where its rate is decided (None: its cap, or nothing)
        self.epoch = 0  # the re-sharing that last marked it ...
        self.mark = 0  # ... and how: _RISING or _FROZEN

    def remaining_at(self, now: float) -> float:
        """The bytes left at ``now`` at the current rate (nothing is accounted: see :meth:`settle`)."""
        if now <= self.last:
            return self.remaining
        if self.rate == INF:
            return 0.0
        return max(0.0, self.remaining - self.rate * (now - self.last))

    def settle(self, now: float) -> None:
        """Account the bytes moved at the current rate up to ``now``."""
        if now > self.last:
            self.remaining = self.remaining_at(now)
            self.last = now

    def finish_time(self) -> float:
        if self.remaining <= 0.0 or self.rate == INF:
            return self.last
        if self.rate <= 0.0:
            return INF
        return self.last + self.remaining / self.rate

    def __repr__(self) -> str:
        return f"Flow({self.id}, {self.src}->{self.dst}, {self.size:g} B, {self.state}, {self.rate:g} B/s)"


def has_bottleneck(f: Flow) -> bool:
    """Max-min condition for one flow: at its own cap, or on a saturated resource where none runs faster."""
    if f.rate == INF or f.rate >= f.cap * (1.0 - TOLERANCE):
        return True
    return any(r.saturated() and f.rate >= r.peak * (1.0 - TOLERANCE) for r in f.resources)


def progressive_filling(flows: Sequence[Flow], residual: dict[int, float]) -> dict[int, tuple[float, int]]:
    """Max-min fair rates of ``flows`` given each resource's capacity left to them (by resource index).

    All rates rise together; when a resource fills (or a flow reaches its cap) the flows there
    freeze, and the rest keep rising.  Ties are broken by resource index and flow id.  Returns
    flow id -> (rate, index of the resource it froze at, or -1 for its cap / no constraint).
    """
    rates: dict[int, tuple[float, int]] = {}
    left = dict(residual)
    members: dict[int, list[Flow]] = {}
    for f in flows:
        for r in f.resources:
            members.setdefault(r.index, []).append(f)
    count = {i: len(m) for i, m in members.items()}
    version = dict.fromkeys(members, 0)
    heap = [(max(0.0, left[i]) / n, i, 0) for i, n in count.items()]
    heapq.heapify(heap)
    caps = sorted((f.cap, f.id, f) for f in flows if f.cap < INF)
    ci = 0

    def freeze(f: Flow, rate: float, at: int) -> None:
        rates[f.id] = (rate, at)
        for r in f.resources:
            i = r.index
            left[i] -= rate
            count[i] -= 1
            version[i] += 1
            if count[i] > 0:
                heapq.heappush(heap, (max(0.0, left[i]) / count[i], i, version[i]))

    while len(rates) < len(flows):
        while heap and heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        while ci < len(caps) and caps[ci][1] in rates:
            ci += 1
        share = heap[0][0] if heap else INF
        cap = caps[ci][0] if ci < len(caps) else INF
        if cap <= share:
            if cap == INF:
                for f in flows:  # nothing constrains the rest
                    rates.setdefault(f.id, (INF, -1))
                break
            freeze(caps[ci][2], cap, -1)
            continue
        i = heap[0][1]
        for f in members[i]:
            if f.id not in rates:
                freeze(f, share, i)
    return rates


class Inconsistent(Exception):
    """The incremental re-sharing met a state the filling order excludes (float noise at a tie): start over."""


class Sharer:
    """Keeps the rates of the active flows max-min fair as flows start and leave.

    Each flow records where its rate was decided (``Flow.bottleneck``: a resource, or None for its
    cap) and each resource the flows held there and their rate (``Resource.held``, ``level``).
    Each resource also keeps, for its water level, how many of its flows rise with it (``rising``:
    those it holds, and during a re-sharing those released or started and not yet frozen) and the
    sum and an upper bound of the rates of the others (``others``, ``others_max``).
    """

    def __init__(self, resources: Sequence[Resource]) -> None:
        self.resources = resources
        self.epoch = 0
        self.visits = 0  # resources examined (a measure of the work, for benchmarks)
        self.restarts = 0  # re-sharings that fell back to a full recomputation

    @staticmethod
    def join(f: Flow) -> None:
        """``f`` becomes active (at rate 0, held nowhere); ``reshare`` must then get it as started."""
        for r in f.resources:
            r.flows[f.id] = f

    @staticmethod
    def leave(f: Flow) -> None:
        """``f`` stops; ``reshare`` must then get its resources as touched."""
        b = f.bottleneck
        for r in f.resources:
            del r.flows[f.id]
            if r is b:
                r.rising -= 1
            else:
                r.others -= f.rate
        if b is not None:
            del b.held[f.id]
            f.bottleneck = None

    def reshare(self, now: float, started: Sequence[Flow], touched: Iterable[Resource]) -> list[Flow]:
        """Re-share after ``started`` flows joined their resources and other flows left ``touched`` ones.

        Every flow whose rate changed has its progress settled at ``now``.  Returns the flows whose
        completion may have moved earlier: those that got faster, and the started ones.
        """
        try:
            return self._reshare(now, started, touched)
        except Inconsistent:
            self.restarts += 1
            active = {f.id: f for r in self.resources for f in r.flows.values()}
            return self.recompute(now, [active[i] for i in sorted(active)])

    def recompute(self, now: float, flows: Sequence[Flow]) -> list[Flow]:
        """Progressive filling from scratch over ``flows`` (every active flow); returns them all."""
        self.epoch += 1
        allocation = progressive_filling(flows, {r.index: r.capacity for r in self.resources})
        for r in self.resources:
            r.held.clear()
            r.level = INF
            r.rising = 0
            r.others = r.others_max = 0.0
        for f in flows:
            rate, at = allocation[f.id]
            b = self.resources[at] if at >= 0 else None
            f.bottleneck = b
            if b is not None:
                b.held[f.id] = f
                b.level = rate
            f.settle(now)
            f.rate = rate
            for r in f.resources:
                if r is b:
                    r.rising += 1
                else:
                    r.others += rate
                    r.others_max = max(r.others_max, rate)
        return list(flows)

    def _reshare(self, now: float, started: Sequence[Flow], touched: Iterable[Resource]) -> list[Flow]:
        self.epoch += 1
        epoch = self.epoch
        p = _Pass(epoch, now)
        queue = p.queue
        pop = heapq.heappop
        push = heapq.heappush
        for f in started:
            p.release(f)
        first = {r.index: r for f in started for r in f.resources}
        for r in touched:
            first.setdefault(r.index, r)
        for r in first.values():
            p.touch(r)
        while queue:
            key, index, version, what = pop(queue)
            if index < 0:  # a flow's cap
                f = what
                if f.epoch == epoch and f.mark == _RISING:
                    p.level = key
                    p.freeze(f, key, None, True)
                continue
            r = what
            if version != r.version:
                continue
            r.queued = -1.0
            p.level = key
            self.visits += 1
            if not r.expired and key < r.water:  # its old level, where it no longer fills: release its flows
                r.expired = True
                r.level = INF  # it holds none of them now; a fill below sets it again
                held = list(r.held.values())
                for f in held:
                    p.release(f)
                for f in held:
                    for s in f.resources:
                        if s is not r:
                            p.touch(s)
                if r.water == INF:
                    continue
                if queue and queue[0][0] <= r.water:
                    r.version += 1
                    r.queued = r.water
                    push(queue, (r.water, r.index, r.version, r))
                    continue
                key = p.level = r.water  # nothing comes before its fill: fill it now
            r.filled = True
            r.water = key
            if r.expired or key != r.level:  # the flows it holds move to the new level
                for f in r.held.values():
                    if f.epoch != epoch:
                        p.freeze(f, key, r, False)
                    elif f.mark == _RISING:
                        p.freeze(f, key, r, True)
                r.level = key
            for f in r.risers:
                if f.mark == _RISING and f.epoch == epoch:
                    p.freeze(f, key, r, True)
            floor = key * (1.0 - SAME)
            if r.others_max >= floor:  # flows bound elsewhere at or above this level: they freeze here
                rising = 0
                others = top = 0.0
                for f in r.flows.values():
                    if f.epoch != epoch and f.bottleneck is not r and f.rate >= floor:
                        p.freeze(f, key, r, False)
                    if f.bottleneck is r:
                        rising += 1
                    else:
                        x = f.rate
                        others += x
                        if x > top:
                            top = x
                r.rising = rising  # counted afresh: no drift in the running sums
                r.others = others
                r.others_max = top
        p.faster.extend(f for f in started if f.rate == 0.0)  # a started flow always gets a completion
        return p.faster


class _Pass:
    """One incremental re-sharing (``Sharer._reshare``): its epoch, time, queue and water level, and the
    steps that update a resource or flow.  (A class, not closures in ``_reshare``: closures that call
    each other form a reference cycle per call, which only the cyclic collector frees, and a large
    simulation makes hundreds of thousands of calls.)"""

    __slots__ = ("epoch", "faster", "level", "now", "queue")

    def __init__(self, epoch: int, now: float) -> None:
        self.epoch = epoch
        self.now = now
        self.queue: list[tuple[float, int, int, Any]] = []  # (key, index, version, resource or flow)
        self.faster: list[Flow] = []
        self.level = 0.0  # how far the filling has risen

    def water_of(self, r: Resource) -> float:
        """r's water level, counted flow by flow (exact; also refreshes r's running sums)."""
        frozen = 0.0
        rising = 0
        top = 0.0
        later: list[float] = []  # rates of flows expected to freeze elsewhere above ``level``
        for f in r.flows.values():
            if (f.epoch == self.epoch and f.mark == _RISING) or f.bottleneck is r:
                rising += 1
            else:
                x = f.rate
                if x > top:
                    top = x
                if x <= self.level:
                    frozen += x
                else:
                    later.append(x)
        r.rising = rising
        r.others = frozen + sum(later)
        r.others_max = top
        left = r.capacity - frozen
        n = rising + len(later)
        if later:
            later.sort()
            for x in later:
                if x * n >= left:
                    break
                left -= x
                n -= 1
        return left / n if n else INF

    def begin(self, r: Resource) -> None:
        r.epoch = self.epoch
        r.expired = r.filled = False
        r.queued = -1.0
        r.risers = []

    def touch(self, r: Resource) -> None:
        """(Re)compute r's water level from what its flows are known to do, and queue it."""
        if r.epoch != self.epoch:
            self.begin(r)
        elif r.filled:
            raise Inconsistent(r.name)
        n = r.rising
        left = r.capacity - r.others
        if n and left >= r.others_max * n:  # the others all freeze below its water level
            water = left / n
        elif not n and left >= 0.0:
            water = INF
        else:
            water = self.water_of(r)
        if water < self.level:
            if water < self.level * (1.0 - TOLERANCE):
                raise Inconsistent(r.name)
            water = self.level
        if r.expired:
            key = water
        else:
            old = r.level
            if old < INF and -SAME * old <= water - old <= SAME * old:
                water = old
            if water < old:
                key = water
            elif water > old:
                key = old  # examine it at its old level: it will not fill there
            elif n > len(r.held):  # released or started flows rise with it: freeze them there
                key = water
            else:
                key = INF
        r.water = water
        if key != r.queued:
            r.version += 1
            r.queued = key
            if key < INF:
                heapq.heappush(self.queue, (key, r.index, r.version, r))

    def release(self, f: Flow) -> None:
        """``f`` rises again (started, or its bottleneck did not fill at its old level)."""
        f.epoch = self.epoch
        f.mark = _RISING
        b = f.bottleneck
        x = f.rate
        for r in f.resources:
            if r is not b:
                r.others -= x
                r.rising += 1
                if r.epoch != self.epoch:
                    self.begin(r)
                r.risers.append(f)
        if f.ceiling < INF:
            heapq.heappush(self.queue, (f.ceiling, -1 - f.id, 0, f))

    def freeze(self, f: Flow, rate: float, at: Resource | None, rising: bool) -> None:
        """``f``'s rate is final: ``rate``, decided at ``at`` (None: its cap)."""
        f.epoch = self.epoch
        f.mark = _FROZEN
        old = f.rate
        moved = not -SAME * old <= rate - old <= SAME * old
        if not moved:
            rate = old
        b = f.bottleneck
        if b is not at:
            if b is not None:
                del b.held[f.id]
            if at is not None:
                at.held[f.id] = f
            f.bottleneck = at
        if moved:
            if self.now > f.last:  # f.settle(now), inlined
                left = f.remaining - old * (self.now - f.last)
                f.remaining = left if left > 0.0 else 0.0
                f.last = self.now
            f.rate = rate
            if rate > old:  # (slower: its completion entry is early, and moved on when reached)
                self.faster.append(f)
        # The running sums of its resources, and a touch for each whose water level moved.
        for r in f.resources:
            if rising or r is b:  # it rose with r
                if r is not at:
                    r.rising -= 1
                    r.others += rate
                    if rate > r.others_max:
                        r.others_max = rate
                    if moved or rising or r.epoch != self.epoch or not r.filled:
                        self.touch(r)  # (not moved, not rising: a tie; it no longer rises with its old bottleneck)
            elif r is at:
                r.others -= old
                r.rising += 1
            elif moved:
                r.others += rate - old
                if rate > r.others_max:
                    r.others_max = rate
                self.touch(r)
