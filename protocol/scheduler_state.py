"""What the chunk scheduler (protocol/scheduler.py) keeps, and the bookkeeping that keeps it consistent.

A record per peer and per request in flight; the pool of chunks still to ask for, kept in
rarest-first order as peers announce what they hold; when each pooled chunk started waiting (seed
and tree patience); and the heaps that say when the next deadline, rest, ban or patience ends.
Internal to the scheduler's modules: ``ChunkScheduler`` is the interface.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from dataclasses import dataclass

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.peer_timing import PeerTiming
from patchswarm.protocol.scheduler_types import PeerInfo, Request, SchedulerConfig

_MIN_ELAPSED = 1e-6  # seconds: a zero elapsed time would be an infinite rate
_ALL = -1  # a peer's chunks as an int when it holds every chunk: every bit set, whatever the count


def _indices(bits: int) -> list[int]:
    """The set bits of a non-negative int, ascending (bit i: chunk i)."""
    out = []
    if bits.bit_count() <= 4:  # peeling off the lowest bit makes two ints per bit: cheaper for a few
        while bits:
            low = bits & -bits
            out.append(low.bit_length() - 1)
            bits ^= low
        return out
    digits = bin(bits)[:1:-1]  # bit i is character i (many bits: a whole bitfield at a peer's first word)
    i = digits.find("1")
    while i >= 0:
        out.append(i)
        i = digits.find("1", i + 1)
    return out


@dataclass(slots=True, eq=False, init=False)  # identity: ``list.remove`` on a round's peers compared every field
class _Peer:
    # The fields ``_round``'s walk reads come first, next to the object's header (whose reference
    # count the walk touches anyway): the walk is mostly cache misses (thousands of nodes' peers), and
    # this keeps them within the first 56 bytes where they were spread over 128.
    free_at: float  # max(resting_until, banned_until): one comparison in ``_round``'s walk
    cap: int  # requests it may have in flight (``_peer_cap``), set with ``remote``
    # len(inflight), kept with it: ``_round``'s walk reads this field, not the set (whose header is
    # elsewhere in memory: a cache miss per peer per round, most of the walk's time)
    load: int
    # The chunks it holds as an int (bit i: chunk i), -1 for "every chunk": a round tests each peer
    # against the pool with one AND, and an announcement's change is an XOR (no Bitfield copies).
    bits: int
    seq: int  # its place in ``ChunkScheduler._peers``' order (a round lists free peers in that order)
    info: PeerInfo
    inflight: set[int]
    rate: float | None  # EWMA of delivered bytes/s, None until measured
    banned_until: float
    resting_until: float
    failures: int  # consecutive
    bytes: int
    missing: dict[int, float]  # chunk -> until when its claims are ignored
    remote: bool  # in another region: its requests count against max_inflight_remote
    timing: PeerTiming  # its round trip and how far its transfers stray from the rate's prediction

    def __init__(self, info: PeerInfo, bits: int, seq: int) -> None:
        self.info = info
        self.bits = bits
        self.seq = seq
        self.inflight = set()
        self.rate = None
        self.banned_until = self.resting_until = self.free_at = -math.inf
        self.failures = self.bytes = self.cap = self.load = 0
        self.missing = {}
        self.remote = False
        self.timing = PeerTiming()

    def holds(self, chunk: int) -> bool:
        return bool(self.bits >> chunk & 1)


def _seq_of(p: _Peer) -> int:
    return p.seq


@dataclass(slots=True, eq=False, init=False)
class _Flight:
    request: Request
    start: float
    remote: bool  # counted against the remote budget (the peer's class when it was asked)

    def __init__(self, request: Request, start: float, remote: bool) -> None:
        self.request = request
        self.start = start
        self.remote = remote


_NO_FLIGHTS: dict[str, _Flight] = {}  # (never written: a lookup's default without a new dict per call)


_COUNTERS: tuple[str, ...] = ("requests", "duplicates", "seed_requests", "successes", "bytes", "seed_bytes")
_COUNTERS += ("duplicate_bytes", "cancelled", "timeouts", "errors", "busy", "missing", "bans")


class SchedulerState:
    """The scheduler's state; ``ChunkPlacement`` and ``ChunkScheduler`` add the decisions."""

    def __init__(
        self,
        sizes: list[int],
        me: PeerInfo,
        config: SchedulerConfig,
        rng: random.Random,
        have: Bitfield | None = None,
    ) -> None:
        if any(s < 0 for s in sizes):
            raise ValueError("chunk sizes must be >= 0")
        n = len(sizes)
        if have is not None and have.n != n:
            raise ValueError(f"have describes {have.n} chunks, sizes {n}")
        self._sizes = list(sizes)
        self._me = me
        self._cfg = config
        self._rng = rng
        self._have = have.copy() if have is not None else Bitfield(n)
        self._missing = ((1 << n) - 1) & ~self._have.to_int()  # the chunks not held, as an int
        self._peers: dict[str, _Peer] = {}
        # The peers that may hold a chunk this node lacks: every peer whose bits meet _missing, and
        # some that no longer do (pruned by the rounds that find them so).  Most peers of a large swarm
        # hold nothing this node lacks at any one time (68% of a 300-host swarm's round visits), and
        # each visit is a cache miss or two: rounds walk this instead of _peers.
        self._live: dict[str, _Peer] = {}
        self._seq = 0  # the next _Peer.seq
        self._seeds: dict[str, _Peer] = {}  # the seeds among _peers
        self._banned: set[str] = set()  # peers that may still be banned (pruned as bans expire)
        self._wakes: list[tuple[float, str]] = []  # heap: (end of a rest or ban, peer); stale entries dropped lazily
        self._avail = [0] * n  # non-seed peers with an explicit bitfield holding each chunk
        self._n_full = 0  # non-seed peers holding everything (has=None): add to every chunk
        self._perm = list(range(n))
        rng.shuffle(self._perm)  # the random tiebreak among equally rare chunks
        self._rank = [0] * n
        for r, c in enumerate(self._perm):
            self._rank[c] = r
        self._pool = Bitfield(n)  # missing and not in flight
        for c in self._have.missing():
            self._pool.set(c)
        # The pooled chunks by (availability, rank), sorted, as one int each: availability x n + rank
        # (ints sort and bisect several times faster than pairs; re-sorting was ~8% of a node's work).
        self._order: list[int] = []
        self._order_dirty = True
        self._since: dict[int, float] = {}  # pooled chunk -> waiting since (default: _epoch)
        self._since_heap: list[tuple[float, int]] = []  # (since, chunk), stale entries dropped lazily
        self._tree_heap: list[tuple[float, int]] = []  # the same, for tree_patience (kept only with parents)
        self._flights: dict[int, dict[str, _Flight]] = {}
        self._n_inflight = 0
        # heap: (deadline, chunk, peer) of the requests in flight; entries of dropped ones are removed lazily
        self._deadlines: list[tuple[float, int, str]] = []
        self._n_remote = 0  # of _n_inflight, counted against max_inflight_remote
        self._remote_peers = 0  # known peers that count as remote (none: the remote budget is no room)
        self._random_left = max(0, config.random_first - self._have.count())
        self._parents: tuple[str | None, ...] = ()  # per stripe (chunk % len): the peer to ask, None: the seeds
        self._max_local = config.max_inflight  # requests in flight to peers of this region (see set_parents)
        self._epoch: float | None = None
        self._now = -math.inf
        self._counters = dict.fromkeys(_COUNTERS, 0.0)

    # ------------------------------------------------------------------ bookkeeping

    def _tick(self, now: float) -> None:
        if math.isnan(now):
            raise ValueError("now is NaN")
        if self._epoch is None:
            self._epoch = now
        self._now = max(self._now, now)

    def _index(self, chunk: int) -> int:
        if not 0 <= chunk < len(self._sizes):
            raise ValueError(f"chunk {chunk} outside a version of {len(self._sizes)} chunks")
        return chunk

    def _drop_flight(self, chunk: int, peer_id: str) -> _Flight:
        flights = self._flights[chunk]
        flight = flights.pop(peer_id)
        if not flights:
            del self._flights[chunk]
        p = self._peers.get(peer_id)
        if p is not None:
            p.inflight.discard(chunk)
            p.load = len(p.inflight)
        self._n_inflight -= 1
        self._n_remote -= flight.remote
        return flight

    def _set_since(self, chunk: int, now: float) -> None:
        self._since[chunk] = now
        heapq.heappush(self._since_heap, (now, chunk))
        if len(self._since_heap) > 4 * len(self._since) + 64:  # compact the stale entries
            self._since_heap = [(t, c) for c, t in self._since.items()]
            heapq.heapify(self._since_heap)
        if self._parents:
            heapq.heappush(self._tree_heap, (now, chunk))
            if len(self._tree_heap) > 4 * len(self._since) + 64:
                self._tree_heap = [(t, c) for c, t in self._since.items()]
                heapq.heapify(self._tree_heap)

    def _maybe_repool(self, chunk: int, now: float) -> None:
        if chunk in self._have or chunk in self._flights or chunk in self._pool:
            return
        self._pool.set(chunk)
        self._set_since(chunk, now)
        if not self._order_dirty:
            bisect.insort(self._order, self._order_key(chunk))

    def _pool_remove(self, chunk: int) -> None:
        if not self._pool.clear(chunk):
            return
        self._since.pop(chunk, None)
        if not self._order_dirty:
            del self._order[bisect.bisect_left(self._order, self._order_key(chunk))]

    def _order_key(self, chunk: int) -> int:
        return self._avail[chunk] * len(self._sizes) + self._rank[chunk]

    def _ensure_order(self) -> None:
        if self._order_dirty:
            n, avail, rank = len(self._sizes), self._avail, self._rank
            self._order = sorted([avail[c] * n + rank[c] for c in self._pool.held()])
            self._order_dirty = False

    def _avail_change(self, chunk: int, delta: int, now: float) -> None:
        old = self._avail[chunk]
        self._avail[chunk] = old + delta
        if not self._pool.has(chunk):
            return
        if delta > 0 and old + self._n_full == 0:
            self._set_since(chunk, now)  # its first holder appeared: seed patience starts now
        if not self._order_dirty:
            key = self._order_key(chunk)  # (the new availability's; the old key is delta x n below)
            del self._order[bisect.bisect_left(self._order, key - delta * len(self._sizes))]
            bisect.insort(self._order, key)

    def _apply_availability(self, removed: list[int], added: list[int], full_delta: int, now: float) -> None:
        if len(removed) + len(added) > self._pool.count() // 8 + 16:
            self._order_dirty = True  # cheaper to re-sort once than to move every entry
        if full_delta > 0:  # increments before decrements: no chunk passes through "no holder" on the way
            if self._n_full == 0:
                for c in self._pool.held():
                    if self._avail[c] == 0:
                        self._set_since(c, now)  # its first holder appeared: seed patience starts now
            self._n_full += full_delta
        for c in added:
            self._avail_change(c, +1, now)
        for c in removed:
            self._avail_change(c, -1, now)
        if full_delta < 0:
            self._n_full += full_delta

    # ------------------------------------------------------------------ timers

    def _first_deadline(self) -> float | None:
        """The earliest deadline of a request in flight (entries of requests since dropped are popped on the way)."""
        heap = self._deadlines
        while heap:
            t, chunk, pid = heap[0]
            flight = self._flights.get(chunk, _NO_FLIGHTS).get(pid)
            if flight is not None and flight.request.deadline == t:
                return t
            heapq.heappop(heap)
        return None

    def _first_wake(self) -> float | None:
        """The earliest future end of a peer's rest or ban (the heap's stale or past entries are dropped)."""
        heap, after = self._wakes, self._now
        while heap:
            t, pid = heap[0]
            p = self._peers.get(pid)
            if t > after and p is not None and (p.resting_until == t or p.banned_until == t):
                return t
            heapq.heappop(heap)
        return None

    def _first_patience_end(self, heap: list[tuple[float, int]], patience: float) -> float | None:
        """The earliest future end of ``patience`` (seed or tree) among pooled chunks somebody holds,
        whose waiting clock was restarted (``heap``: their (since, chunk) entries)."""
        after = self._now
        while heap:
            t, c = heap[0]
            if c in self._pool and self._since.get(c) == t and t + patience > after and self._avail[c] + self._n_full:
                return t + patience
            heapq.heappop(heap)  # stale, already past, or nobody holds it (a new holder restarts the clock)
        return None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
