"""A flow-level network model in virtual time: max-min fair sharing by progressive filling.

Hosts have an uplink and a downlink; hosts sit in regions; regions are joined by full-duplex
backbone links with a capacity and a latency.  A flow from ``src`` to ``dst``:

* pays the one-way latency between them first (no bytes move), then becomes *active*;
* while active, shares every resource it crosses (``src`` uplink, ``dst`` downlink, each
  directed backbone link on the route) with the other active flows, max-min fairly;
* never runs faster than ``window / RTT`` (RTT = twice the one-way latency), the ceiling a
  TCP connection with that window reaches;
* completes when its bytes are through.

This is SimGrid's CM02 model without its bandwidth/latency correction factors; see
docs/simulation.md for the golden case it reproduces and for the derivations.

The allocation is recomputed at events only (activations, completions, cancellations), and
only for the flows an event can affect: the flows sharing a resource with the changed flow,
recomputed against the capacity the other flows leave them, and then widened until every flow
near the change again satisfies the max-min condition (each flow is capped, or crosses a
saturated resource where no flow runs faster).  That condition characterises the max-min
allocation, so the incremental result equals a recomputation from scratch, which
``Network.full_allocation`` provides for tests.

Pure and deterministic: no clock, no randomness, no I/O; every iteration follows insertion
order (flow ids), never hashing order.  Units: bytes and seconds (rates in bytes/s).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_WINDOW = float(4 << 20)  # bytes: the per-flow ceiling is window / RTT
TOLERANCE = 1e-9  # relative: "saturated", "at its cap", "no flow runs faster"


class NetworkError(Exception):
    """A flow the topology cannot carry (unknown host, no route between regions)."""


@dataclass(frozen=True, slots=True)
class Host:
    """A host's access links, in bytes/s (``math.inf``: not a constraint)."""

    id: str
    region: str = ""
    up: float = math.inf
    down: float = math.inf


@dataclass(frozen=True, slots=True)
class Region:
    """``latency``: one-way seconds between two hosts of this region."""

    name: str
    latency: float = 0.0


@dataclass(frozen=True, slots=True)
class Backbone:
    """A full-duplex link between two regions: ``capacity`` bytes/s in each direction."""

    a: str
    b: str
    capacity: float = math.inf
    latency: float = 0.0


class Resource:
    """One shared capacity: a host's uplink or downlink, or one direction of a backbone link."""

    __slots__ = ("capacity", "flows", "held", "index", "load", "name", "peak")

    def __init__(self, index: int, name: str, capacity: float) -> None:
        self.index = index
        self.name = name
        self.capacity = capacity
        self.flows: dict[int, Flow] = {}  # active flows crossing it, by id (insertion order)
        self.held: dict[int, Flow] = {}  # those of them bottlenecked here
        self.load = 0.0  # sum of their rates, refreshed whenever they change
        self.peak = 0.0  # the fastest of them

    def refresh(self) -> None:
        load = peak = 0.0
        for f in self.flows.values():
            load += f.rate
            peak = max(peak, f.rate)
        self.load, self.peak = load, peak

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
        "done_at",
        "dst",
        "id",
        "last",
        "latency",
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
        self.on_done = on_done
        self.tag = tag
        self.state = "pending"  # pending -> active -> done | cancelled
        self.rate = 0.0
        self.remaining = float(size)
        self.last = self.active_at  # time `remaining` was last settled
        self.done_at = math.nan
        self.version = 0  # bumps whenever the scheduled completion changes
        self.bottleneck: Resource | None = None  # where its rate is decided (None: its cap, or nothing)

    def settle(self, now: float) -> None:
        if now > self.last:
            if self.rate == math.inf:
                self.remaining = 0.0
            else:
                self.remaining = max(0.0, self.remaining - self.rate * (now - self.last))
            self.last = now

    def finish_time(self) -> float:
        if self.remaining <= 0.0 or self.rate == math.inf:
            return self.last
        if self.rate <= 0.0:
            return math.inf
        return self.last + self.remaining / self.rate

    def __repr__(self) -> str:
        return f"Flow({self.id}, {self.src}->{self.dst}, {self.size:g} B, {self.state}, {self.rate:g} B/s)"


@dataclass
class Traffic:
    """Bytes moved, per host: what each sent and received (completed flows, plus cancelled flows' part)."""

    sent: dict[str, float] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)

    def add(self, src: str, dst: str, nbytes: float) -> None:
        self.sent[src] = self.sent.get(src, 0.0) + nbytes
        self.received[dst] = self.received.get(dst, 0.0) + nbytes


class Network:
    def __init__(
        self,
        hosts: Iterable[Host],
        regions: Iterable[Region] = (),
        backbones: Iterable[Backbone] = (),
        *,
        window: float | None = DEFAULT_WINDOW,
        quantum: float = 0.0,
    ) -> None:
        """``window``: bytes per round trip a flow may carry (None: no cap).  ``quantum``: seconds; when
        positive, events are processed only at multiples of it (each at the first one not before it), so
        that nearby events share one re-sharing: faster, and late by less than ``quantum`` each, never early.
        """
        if quantum < 0 or math.isnan(quantum):
            raise ValueError("quantum must be >= 0")
        self.window = window
        self.quantum = quantum
        self.hosts: dict[str, Host] = {}
        self.regions: dict[str, Region] = {r.name: r for r in regions}
        self._resources: list[Resource] = []
        self._up: dict[str, Resource | None] = {}
        self._down: dict[str, Resource | None] = {}
        for h in hosts:
            if h.id in self.hosts:
                raise NetworkError(f"host {h.id!r} declared twice")
            self.hosts[h.id] = h
            self.regions.setdefault(h.region, Region(h.region))
            self._up[h.id] = self._resource(f"up:{h.id}", h.up)
            self._down[h.id] = self._resource(f"down:{h.id}", h.down)
        self._links: dict[tuple[str, str], tuple[float, Resource | None]] = {}
        for bb in backbones:
            for a, b in ((bb.a, bb.b), (bb.b, bb.a)):
                self.regions.setdefault(a, Region(a))
                self._links[(a, b)] = (bb.latency, self._resource(f"bb:{a}>{b}", bb.capacity))
        self._routes: dict[tuple[str, str], tuple[float, tuple[Resource, ...]]] = {}
        self.now = 0.0
        self.traffic = Traffic()
        self._next_id = 0
        self._pending: list[tuple[float, int, Flow]] = []  # (activation time, id, flow)
        self._completions: list[tuple[float, int, int, Flow]] = []  # (finish time, id, version, flow)
        self._active: dict[int, Flow] = {}

    def _resource(self, name: str, capacity: float) -> Resource | None:
        if capacity < 0 or math.isnan(capacity):
            raise NetworkError(f"{name}: capacity must be >= 0, got {capacity}")
        if capacity == math.inf:
            return None
        r = Resource(len(self._resources), name, capacity)
        self._resources.append(r)
        return r

    # ------------------------------------------------------------ topology

    def _route(self, a: str, b: str) -> tuple[float, tuple[Resource, ...]]:
        """(one-way latency, backbone resources) from region a to region b: the lowest-latency path.

        Ties are broken deterministically (by hop count and region names).
        """
        key = (a, b)
        cached = self._routes.get(key)
        if cached is not None:
            return cached
        if a == b:
            route: tuple[float, tuple[Resource, ...]] = (self.regions[a].latency, ())
        else:
            route = self._shortest(a, b)
        self._routes[key] = route
        return route

    def _shortest(self, a: str, b: str) -> tuple[float, tuple[Resource, ...]]:
        adj: dict[str, list[tuple[str, float, Resource | None]]] = {}
        for (x, y), (lat, res) in sorted(self._links.items()):
            adj.setdefault(x, []).append((y, lat, res))
        best: dict[str, float] = {a: 0.0}
        heap: list[tuple[float, int, str, tuple[Resource, ...]]] = [(0.0, 0, a, ())]
        while heap:
            d, hops, x, path = heapq.heappop(heap)
            if x == b:
                return d, path
            if d > best.get(x, math.inf):
                continue
            for y, lat, res in adj.get(x, ()):
                nd = d + lat
                if nd < best.get(y, math.inf):
                    best[y] = nd
                    heapq.heappush(heap, (nd, hops + 1, y, path + ((res,) if res is not None else ())))
        raise NetworkError(f"no backbone route from region {a!r} to region {b!r}")

    def latency(self, src: str, dst: str) -> float:
        """One-way seconds from host src to host dst."""
        return self._route(self._host(src).region, self._host(dst).region)[0]

    def _host(self, hid: str) -> Host:
        try:
            return self.hosts[hid]
        except KeyError:
            raise NetworkError(f"unknown host {hid!r}") from None

    # ------------------------------------------------------------ flows

    def add_flow(
        self,
        now: float,
        src: str,
        dst: str,
        nbytes: float,
        on_done: Callable[[Flow], None] | None = None,
        tag: object = None,
    ) -> Flow:
        """Start a flow at ``now``: it turns active after the latency and ``on_done`` runs from advance()."""
        if now < self.now:
            raise ValueError(f"add_flow at {now} but the network is at {self.now}")
        if nbytes < 0:
            raise ValueError("a flow cannot carry a negative number of bytes")
        lat, links = self._route(self._host(src).region, self._host(dst).region)
        up, down = self._up[src], self._down[dst]
        resources = tuple(r for r in (up, down, *links) if r is not None)
        rtt = 2.0 * lat
        cap = self.window / rtt if self.window is not None and rtt > 0 else math.inf
        flow = Flow(self._next_id, src, dst, float(nbytes), now, lat, cap, resources, on_done, tag)
        self._next_id += 1
        heapq.heappush(self._pending, (flow.active_at, flow.id, flow))
        return flow

    def cancel(self, now: float, flow: Flow) -> None:
        """Stop a flow; its bytes so far count as traffic.  Process events up to ``now`` first (advance)."""
        if flow.state in ("done", "cancelled"):
            return
        if self.next_event_time() < now:
            raise ValueError("cancel() past unprocessed events: advance() first")
        self.now = max(self.now, now)
        if flow.state == "pending":
            flow.state = "cancelled"  # its entry in the pending heap is skipped when popped
            flow.done_at = self.now
            return
        flow.settle(self.now)
        self._retire(flow, "cancelled")
        self._reallocate([], list(flow.resources))

    def next_event_time(self) -> float:
        """When the next activation or completion happens (``math.inf``: nothing left)."""
        while self._pending and self._pending[0][2].state != "pending":
            heapq.heappop(self._pending)
        while self._completions and not self._valid(self._completions[0]):
            heapq.heappop(self._completions)
        t = math.inf
        if self._pending:
            t = self._pending[0][0]
        if self._completions:
            t = min(t, self._completions[0][0])
        q = self.quantum
        if q > 0 and t < math.inf:
            grid = math.ceil(t / q) * q
            t = max(grid if grid >= t else grid + q, self.now)
        return t

    @staticmethod
    def _valid(entry: tuple[float, int, int, Flow]) -> bool:
        return entry[3].state == "active" and entry[2] == entry[3].version

    def advance(self, t: float) -> list[Flow]:
        """Process every event up to time ``t``; returns the flows completed, in order, after running on_done."""
        done: list[Flow] = []
        while True:
            te = self.next_event_time()
            if te > t:
                break
            self.now = max(self.now, te)
            started: list[Flow] = []
            freed: list[Resource] = []
            while self._pending and self._pending[0][0] <= te:
                _, _, f = heapq.heappop(self._pending)
                if f.state == "pending":
                    f.state = "active"
                    f.last = self.now
                    self._active[f.id] = f
                    for r in f.resources:
                        r.flows[f.id] = f
                    started.append(f)
            while self._completions and self._completions[0][0] <= te:
                entry = heapq.heappop(self._completions)
                if self._valid(entry):
                    f = entry[3]
                    f.settle(self.now)
                    f.remaining = 0.0
                    self._retire(f, "done")
                    freed.extend(f.resources)
                    done.append(f)
            self._reallocate(started, freed)
        self.now = max(self.now, t) if t < math.inf else self.now
        for f in done:
            if f.on_done is not None:
                f.on_done(f)
        return done

    def _retire(self, flow: Flow, state: str) -> None:
        flow.state = state
        flow.done_at = self.now
        del self._active[flow.id]
        self._bottleneck(flow, None)
        for r in flow.resources:
            del r.flows[flow.id]
            r.load -= flow.rate  # refreshed exactly once the freed capacity is re-shared
        self.traffic.add(flow.src, flow.dst, flow.size - flow.remaining)
        flow.rate = 0.0

    # ------------------------------------------------------------ allocation

    def _reallocate(self, started: Sequence[Flow], freed: Sequence[Resource]) -> None:
        """Re-share capacity after flows started (``started``) or left ``freed`` resources."""
        # First guess at who is affected: the new flows, and the flows bottlenecked where they start or
        # where capacity was freed (the others are decided elsewhere); the checks below widen it as needed.
        scope: dict[int, Flow] = {}
        for f in started:
            scope[f.id] = f
            for r in f.resources:
                scope.update(r.held)
        for r in freed:
            scope.update(r.held)
        if not scope:
            for r in freed:
                r.refresh()
            return
        before = {fid: f.rate for fid, f in scope.items()}
        for f in started:
            before[f.id] = -1.0  # always schedule its completion
        while True:
            touched: dict[int, Resource] = {r.index: r for r in freed}
            inside: dict[int, float] = {}  # per resource: the scope's share of its (last refreshed) load
            for f in scope.values():
                f.settle(self.now)
                for r in f.resources:
                    touched[r.index] = r
                    inside[r.index] = inside.get(r.index, 0.0) + f.rate
            residual = {i: max(0.0, r.capacity - (r.load - inside.get(i, 0.0))) for i, r in touched.items()}
            allocation = progressive_filling(list(scope.values()), residual)
            for f in scope.values():
                f.rate, b = allocation[f.id]
                self._bottleneck(f, self._resources[b] if b >= 0 else None)
            for r in touched.values():
                r.refresh()
            size = len(scope)
            for g in self._violators(scope, touched):
                if g.id not in scope:  # a flow outside lost its bottleneck: it must be re-shared too
                    before[g.id] = g.rate
                    scope[g.id] = g
                    continue
                # A flow inside sits where an outside flow runs faster: bring those in (or, failing that, all).
                faster = [h for r in g.resources for h in r.flows.values() if h.id not in scope and h.rate > g.rate]
                for h in faster or [h for r in g.resources for h in r.flows.values()]:
                    before.setdefault(h.id, h.rate)
                    scope[h.id] = h
            if len(scope) == size:  # nothing to widen: the scope already holds every flow concerned
                break
        for fid, f in scope.items():
            if f.rate != before[fid]:
                f.version += 1
                heapq.heappush(self._completions, (f.finish_time(), f.id, f.version, f))

    @staticmethod
    def _bottleneck(f: Flow, r: Resource | None) -> None:
        """Record where ``f`` is bottlenecked (None: at its cap, or unconstrained)."""
        if f.bottleneck is r:
            return
        if f.bottleneck is not None:
            del f.bottleneck.held[f.id]
        f.bottleneck = r
        if r is not None:
            r.held[f.id] = f

    def _violators(self, scope: dict[int, Flow], touched: dict[int, Resource]) -> list[Flow]:
        """Flows whose max-min condition may have broken and does not hold (so the allocation is not max-min).

        A flow outside the scope kept its rate; its condition can only have broken if the resource
        it was bottlenecked at changed, so only those flows (``Resource.held``) are rechecked.
        """
        bad = [f for f in scope.values() if not self._still_bottlenecked(f)]
        for r in touched.values():
            bad.extend(g for g in list(r.held.values()) if g.id not in scope and not self._still_bottlenecked(g))
        return bad

    def _still_bottlenecked(self, f: Flow) -> bool:
        b = f.bottleneck
        if b is None:
            if f.rate == math.inf or f.rate >= f.cap * (1.0 - TOLERANCE):
                return True
        elif b.saturated() and f.rate >= b.peak * (1.0 - TOLERANCE):
            return True
        for r in f.resources:  # another resource may do
            if r is not b and r.saturated() and f.rate >= r.peak * (1.0 - TOLERANCE):
                self._bottleneck(f, r)
                return True
        return False

    def full_allocation(self) -> dict[int, float]:
        """The max-min rates of the active flows computed from scratch (for checking the incremental ones)."""
        residual = {r.index: r.capacity for r in self._resources}
        return {fid: rate for fid, (rate, _) in progressive_filling(list(self._active.values()), residual).items()}

    def active_flows(self) -> list[Flow]:
        return list(self._active.values())

    def resources(self) -> list[Resource]:
        return list(self._resources)


def has_bottleneck(f: Flow) -> bool:
    """Max-min condition for one flow: at its own cap, or on a saturated resource where none runs faster."""
    if f.rate == math.inf or f.rate >= f.cap * (1.0 - TOLERANCE):
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
    caps = sorted((f.cap, f.id, f) for f in flows if f.cap < math.inf)
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
        share = heap[0][0] if heap else math.inf
        cap = caps[ci][0] if ci < len(caps) else math.inf
        if cap <= share:
            if cap == math.inf:
                for f in flows:  # nothing constrains the rest
                    rates.setdefault(f.id, (math.inf, -1))
                break
            freeze(caps[ci][2], cap, -1)
            continue
        i = heap[0][1]
        for f in members[i]:
            if f.id not in rates:
                freeze(f, share, i)
    return rates
