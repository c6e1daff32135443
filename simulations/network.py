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
only where an event can change it: ``network_share.Sharer`` replays progressive filling in level
order over the resources whose level can move, and leaves the rest alone; the result equals a
recomputation from scratch, which ``Network.full_allocation`` provides for tests.

Pure and deterministic: no clock, no randomness, no I/O; every iteration follows insertion
order (flow ids), never hashing order.  Units: bytes and seconds (rates in bytes/s).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from patchswarm.simulations.network_share import TOLERANCE, Flow, Resource, Sharer, has_bottleneck, progressive_filling
from patchswarm.simulations.tcp_window import TcpModel

__all__ = [
    "DEFAULT_WINDOW",
    "TOLERANCE",
    "Backbone",
    "Flow",
    "Host",
    "Network",
    "NetworkError",
    "Region",
    "Resource",
    "Traffic",
    "has_bottleneck",
    "progressive_filling",
]

DEFAULT_WINDOW = float(4 << 20)  # bytes: the per-flow ceiling is window / RTT


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
    """A full-duplex link between two regions: ``capacity`` bytes/s in each direction.

    ``pinned``: flows between ``a`` and ``b`` always take this link, even where a path through other
    regions has less latency (Internet routes between two regions are not shortest-delay paths; measured
    RTTs such as 20 / 80 / 150 ms between three regions break the triangle inequality)."""

    a: str
    b: str
    capacity: float = math.inf
    latency: float = 0.0
    pinned: bool = False


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
        tcp: TcpModel | None = None,
    ) -> None:
        """``window``: bytes per round trip a flow may carry (None: no cap).  ``tcp``: slow start and
        restart after idle on the transport's connections (simulations/tcp_window.py; None: flows get
        their share from their first byte); the network only carries it for the transport.  ``quantum``: seconds; when
        positive, events are processed only at multiples of it (each at the first one not before it), so
        that nearby events share one re-sharing: faster, and late by less than ``quantum`` each, never early.
        """
        if quantum < 0 or math.isnan(quantum):
            raise ValueError("quantum must be >= 0")
        self.window = window
        self.quantum = quantum
        self.tcp = tcp
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
        self._pinned: set[tuple[str, str]] = set()
        for bb in backbones:
            for a, b in ((bb.a, bb.b), (bb.b, bb.a)):
                self.regions.setdefault(a, Region(a))
                self._links[(a, b)] = (bb.latency, self._resource(f"bb:{a}>{b}", bb.capacity))
                if bb.pinned:
                    self._pinned.add((a, b))
        self._routes: dict[tuple[str, str], tuple[float, tuple[Resource, ...]]] = {}
        self.now = 0.0
        self.traffic = Traffic()
        self._next_id = 0
        self._pending: list[tuple[float, int, Flow]] = []  # (activation time, id, flow)
        self._completions: list[tuple[float, int, int, Flow]] = []  # (finish time, id, version, flow)
        self._checked: tuple[float, int, int, Flow] | None = None  # the first completion, known valid
        self._active: dict[int, Flow] = {}
        self.sharer = Sharer(self._resources)  # the max-min allocator (its counters: visits, restarts)

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
        """(one-way latency, backbone resources) from region a to region b: a pinned backbone between
        them if there is one, else the lowest-latency path.

        Ties are broken deterministically (by hop count and region names).
        """
        key = (a, b)
        cached = self._routes.get(key)
        if cached is not None:
            return cached
        if a == b:
            route: tuple[float, tuple[Resource, ...]] = (self.regions[a].latency, ())
        elif key in self._pinned:
            lat, res = self._links[key]
            route = (lat, (res,) if res is not None else ())
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
        *,
        latency: float | None = None,
        window: float | None = None,
    ) -> Flow:
        """Start a flow at ``now``: it turns active after the latency and ``on_done`` runs from advance().
        ``latency``: seconds before it turns active instead of the route's one-way latency (0 for a
        round of a transfer already under way); ``window``: its cap's window instead of the network's
        (a round of slow start), the RTT still the route's."""
        if nbytes < 0:
            raise ValueError("a flow cannot carry a negative number of bytes")
        route_lat, links = self._route(self._host(src).region, self._host(dst).region)
        lat = route_lat if latency is None else latency
        if now + lat < self.now - 1e-9:  # (a nanosecond's slack for rounding: it activates at the next event)
            raise ValueError(f"add_flow at {now} turns active at {now + lat}, but the network is at {self.now}")
        up, down = self._up[src], self._down[dst]
        resources = tuple(r for r in (up, down, *links) if r is not None)
        rtt = 2.0 * route_lat
        win = self.window if window is None else window
        cap = win / rtt if win is not None and rtt > 0 else math.inf
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
        self._reshare([], flow.resources)

    def next_event_time(self) -> float:
        """When the next activation or completion happens (``math.inf``: nothing left)."""
        while self._pending and self._pending[0][2].state != "pending":
            heapq.heappop(self._pending)
        t = self._first_completion()
        if self._pending:
            t = min(t, self._pending[0][0])
        q = self.quantum
        if q > 0 and t < math.inf:
            grid = math.ceil(t / q) * q
            t = max(grid if grid >= t else grid + q, self.now)
        return t

    def _first_completion(self) -> float:
        """The earliest completion: superseded entries dropped, early ones (the rate fell since) moved on."""
        heap = self._completions
        if heap and heap[0] is self._checked:  # validated, and no rate changed since
            return heap[0][0]
        while heap:
            t, _, version, f = heap[0]
            if f.state != "active" or version != f.version:
                heapq.heappop(heap)
                continue
            actual = f.finish_time()
            if actual > t:
                f.version += 1
                f.due = actual
                heapq.heapreplace(heap, (actual, f.id, f.version, f))
                continue
            self._checked = heap[0]
            return t
        return math.inf

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
                    if f.resources:
                        Sharer.join(f)
                        started.append(f)
                    else:  # nothing shared: only its cap limits it
                        f.rate = f.cap
                        f.due = f.finish_time()
                        heapq.heappush(self._completions, (f.due, f.id, f.version, f))
            while self._first_completion() <= te:
                f = heapq.heappop(self._completions)[3]
                f.settle(self.now)
                f.remaining = 0.0
                self._retire(f, "done")
                freed.extend(f.resources)
                done.append(f)
            self._reshare(started, freed)
        self.now = max(self.now, t) if t < math.inf else self.now
        for f in done:
            if f.on_done is not None:
                f.on_done(f)
        return done

    def _retire(self, flow: Flow, state: str) -> None:
        flow.state = state
        flow.done_at = self.now
        del self._active[flow.id]
        self._checked = None
        Sharer.leave(flow)
        self.traffic.add(flow.src, flow.dst, flow.size - flow.remaining)
        flow.rate = 0.0

    def _reshare(self, started: Sequence[Flow], freed: Sequence[Resource]) -> None:
        """Re-share capacity after flows started or left ``freed`` resources; reschedule the completions."""
        if not started and not freed:
            return
        self._checked = None
        heap = self._completions
        for f in self.sharer.reshare(self.now, started, freed):
            t = f.finish_time()
            if t < f.due:  # earlier than its entry: a new one (a later one keeps it: see _first_completion)
                f.version += 1
                f.due = t
                heapq.heappush(heap, (t, f.id, f.version, f))
        if len(heap) > 4 * len(self._active) + 1024:  # drop the superseded entries
            self._completions = [e for e in heap if self._valid(e)]
            heapq.heapify(self._completions)

    # ------------------------------------------------------------ allocation

    def full_allocation(self) -> dict[int, float]:
        """The max-min rates of the active flows computed from scratch (for checking the incremental ones)."""
        residual = {r.index: r.capacity for r in self._resources}
        return {fid: rate for fid, (rate, _) in progressive_filling(list(self._active.values()), residual).items()}

    def active_flows(self) -> list[Flow]:
        return list(self._active.values())

    def resources(self) -> list[Resource]:
        return list(self._resources)
