"""The chunk scheduler for one version being downloaded: which chunk to ask of which peer, and when.

Sans-IO: the driver tells it what happened (``update_peer``, ``on_success``, ``on_failure``,
``remove_peer``), asks it what to do (``next_requests``, ``expired``) and arms one timer
(``next_deadline``).  It never reads a clock and draws every random choice from the injected
``random.Random``, so one seed gives one request sequence in the asyncio driver and in a
simulation alike.  A driver loop::

    on any event or timer at time t:
        for r in sched.expired(t): cancel r            # counted as TIMEOUT already
        for r in sched.next_requests(t): start r       # arm its deadline r.deadline
        arm the timer for sched.next_deadline()
    on a verified chunk: for r in sched.on_success(t, ...): cancel r
    on a failed request: sched.on_failure(t, ..., reason, retry_after)

Requests handed back for cancelling (by ``on_success``, ``expired``, ``remove_peer``) are
already forgotten; reports about requests the scheduler no longer tracks are tolerated.

Rules (after Kraken, BitTorrent and Dragonfly: docs/design.md#swarm-distribution):

* Caps: ``max_inflight`` per node, ``max_inflight_per_peer`` per peer (``max_inflight_per_remote_peer``
  per peer in another region), ``max_inflight_seed`` per seed; requests to peers in another region
  (both regions known) count against their own ``max_inflight_remote`` instead of ``max_inflight``
  (0: they share ``max_inflight``, and such peers count as local), since a flow across regions is
  capped at window / RTT and filling a downlink takes more of them; a
  chunk already held is never requested; only a peer whose bitfield has the chunk
  is asked (``has=None``: every chunk); a banned or resting peer is not asked.
* Chunk order: the first ``random_first`` picks uniformly at random among the chunks that can
  be requested now, then rarest first.  Rarity counts the non-seed peers known to hold a chunk;
  ties follow a random permutation drawn once from the rng.  (Counting the holders of this node's
  region first was measured 2-5% slower across regions: docs/simulation.md#measured-and-not-adopted.)
* Peer order for a chunk: same zone, then same region, then elsewhere; a peer whose rate estimate
  is below ``1/slow_factor`` of the best candidate's is demoted behind every tier.  Within a tier
  the highest ``rate / (1 + in flight)`` wins (fast peers first, load spread among equals), with
  a random tiebreak.  Unknown peers are assumed to deliver ``initial_rate`` so they get tried.
* The seed is a last resort: asked for a chunk only when no non-banned non-seed peer holds it,
  or the chunk has waited ``seed_patience`` (since it entered the pool or since its first holder
  appeared) while every holder was at its cap or resting, or every holder's measured rate is
  below the seed's measured rate divided by ``slow_factor``.  A holder left out only because
  this node's own budget for its class (local or remote) is spent still counts as a holder: the
  chunk waits for the node's requests, not for the seed.  A refusal (BUSY) rests the seed
  for ``retry_after`` and the peers wait for each other.
* Stripe trees (``set_parents``, protocol/trees.py): a chunk is asked of its stripe's parent alone
  (a root's: of the seeds at once), in line for it while the parent is busy or lacks the chunk,
  until others have held the chunk ``tree_patience``; a banned or gone (``orphan``) parent leaves
  its stripe to the rules above.  A parent gets ``max_inflight_per_parent``, and the node's budget
  grows to that times the stripes.
* Endgame: once every missing chunk is in flight and at most ``endgame_remaining`` remain, each
  gets one duplicate request to another eligible peer (to the seed only after ``seed_patience``
  or when the holders are too slow); the first success returns the other to cancel.
* Deadlines: ``deadline_base + size / deadline_rate`` after the request.  An expired request is
  a TIMEOUT: the chunk goes back to the pool, the peer rests and its rate estimate is cut to at
  most half of what it could have delivered, so faster peers win next time.
* Failures: HASH bans the peer for ``ban_seconds``; ERROR, TIMEOUT and BUSY rest it for
  ``failure_backoff`` doubling per consecutive failure up to ``backoff_cap`` (BUSY with
  ``retry_after`` rests exactly that long); MISSING clears that bit of the peer's bitfield, and
  for ``failure_backoff`` seconds ``update_peer`` cannot set it again (a stale announcement);
  ``on_have`` can (it is news).  ERROR/TIMEOUT reports for requests no longer tracked are ignored.

Cost: ``next_requests`` walks the pooled chunks in rarest-first order (kept sorted incrementally)
and stops as soon as the caps are reached; free peers that hold nothing pooled are skipped with
one big-integer AND, and while only seeds are free in the first ``seed_patience`` seconds the walk
stops at the first chunk somebody holds.  Worst case O(pooled chunks x free peers) per call (a
free peer holding only the last chunk in order); measured here ~0.15 ms per completed chunk at
20k chunks and 30 peers.  ``on_have`` is the O(log n) way to report one new chunk of a peer.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from patchswarm.protocol import draws
from patchswarm.protocol.bitfield import Bitfield

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


class FailureReason(enum.Enum):
    HASH = "hash"  # the chunk failed its hash: ban the peer
    ERROR = "error"  # connection or protocol error: rest the peer
    TIMEOUT = "timeout"  # past its deadline: rest the peer and cut its rate estimate
    BUSY = "busy"  # refused for load (the seed's answer when overloaded): rest for retry_after
    MISSING = "missing"  # the peer says it does not hold the chunk: clear that bit


@dataclass(frozen=True, slots=True, init=False)
class PeerInfo:
    peer_id: str
    zone: str
    region: str
    is_seed: bool  # the trainer seed: has everything, asked only as a last resort

    # __init__ written out (init=False) here and below: the native build compiles its stores
    # (simulations/build.py) where the generated one stays interpreted, ~20x the cost per object.
    def __init__(self, peer_id: str, zone: str = "", region: str = "", is_seed: bool = False) -> None:
        object.__setattr__(self, "peer_id", peer_id)
        object.__setattr__(self, "zone", zone)
        object.__setattr__(self, "region", region)
        object.__setattr__(self, "is_seed", is_seed)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_inflight: int = 6  # per node (more only polls busy uplinks faster: each refusal costs both ends CPU)
    # Requests to peers in other regions, besides max_inflight (0: counted in it).  A remote flow runs at
    # most window / RTT (4 MiB / 120 ms: ~35 MB/s), so 16 fill ~550 MB/s of downlink from across an ocean.
    max_inflight_remote: int = 16
    # Per peer in this region: one flow fills a link here, and a second request to the same peer only
    # waits in its line while other holders sit idle (simulated swarms: 0.61 -> 0.59 s at N = 300).
    max_inflight_per_peer: int = 1
    # Per peer in another region (a "remote" peer, see max_inflight_remote): a flow there runs at
    # window / RTT, so one peer's uplink takes several (regions3 N = 30: 2.40 s with 2, 2.60 s with 1).
    max_inflight_per_remote_peer: int = 2
    max_inflight_seed: int = 5  # Kraken: 5 to origins
    random_first: int = 4  # BitTorrent: first pieces random, then rarest-first
    endgame_remaining: int = 3  # Kraken: endgame at <= 3 chunks left: duplicate in-flight requests
    deadline_base: float = 2.0  # per-request deadline = base + size / deadline_rate
    deadline_rate: float = 2e6  # bytes/s assumed as the slowest acceptable peer
    ban_seconds: float = 60.0  # a peer that sent a chunk failing its hash is not asked for this long
    failure_backoff: float = 1.0  # rest after error / timeout / refusal, doubling per consecutive failure
    seed_patience: float = 1.0  # seconds a chunk may wait while a peer holds it before the seed may be asked
    slow_factor: float = 4.0  # holders below seed_rate / slow_factor are "too slow": the seed may be used
    rate_alpha: float = 0.3  # EWMA weight for delivered-rate estimates
    backoff_cap: float = 30.0  # the doubling rest stops growing here
    initial_rate: float = 1.25e9  # bytes/s assumed for a peer never measured (10 Gbit/s: optimistic)
    # >0: an active set of at most this many non-seed peers, the most recently heard from (BitTorrent
    # keeps ~50 connections); a round walks every known peer, so this bounds its cost in large swarms
    # (simulated 1,000 hosts: the same time to all, 0.596 / 0.595 s).  0: every peer heard from.
    max_peers: int = 64
    # With stripe trees (``set_parents``): how long a chunk some peer holds waits for this node's
    # parent in its stripe before the usual rules may place it elsewhere (a slow or stuck relay).
    # Each such request loads a relay outside the plan: 1,000 simulated hosts took 0.5005 s with
    # 0.1, 0.4934 s with 0.2 or 0.3.
    tree_patience: float = 0.2
    # Per stripe parent: the second waits behind the first at the parent (swarm/node.py ``_follow``),
    # so the parent's flow to this node has no round trip's gap between chunks.
    max_inflight_per_parent: int = 2

    def __post_init__(self) -> None:
        for name in (
            "max_inflight",
            "max_inflight_per_peer",
            "max_inflight_per_remote_peer",
            "max_inflight_seed",
            "max_inflight_per_parent",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("random_first", "endgame_remaining", "max_inflight_remote", "max_peers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in (
            "deadline_base",
            "ban_seconds",
            "failure_backoff",
            "seed_patience",
            "backoff_cap",
            "tree_patience",
        ):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be finite and >= 0")
        for name in ("deadline_rate", "slow_factor", "initial_rate"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be finite and > 0")
        if not 0 < self.rate_alpha <= 1:
            raise ValueError("rate_alpha must be in (0, 1]")


@dataclass(frozen=True, slots=True, init=False)
class Request:
    chunk: int
    peer_id: str
    deadline: float
    duplicate: bool  # endgame duplicate

    def __init__(self, chunk: int, peer_id: str, deadline: float, duplicate: bool = False) -> None:
        object.__setattr__(self, "chunk", chunk)
        object.__setattr__(self, "peer_id", peer_id)
        object.__setattr__(self, "deadline", deadline)
        object.__setattr__(self, "duplicate", duplicate)


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


@dataclass(slots=True, eq=False, init=False)
class _Round:
    """What one ``next_requests`` call computes once: the peers that can take requests, and more."""

    now: float
    free: list[_Peer]
    any_banned: bool
    slow_below: float | None  # a holder measured below this is "too slow" (None: seed rate unknown)
    peers: dict[str, _Peer]
    held: int  # the chunks some free peer holds (an OR of their masks; a superset once peers fill up)
    blocked: int  # the chunks held by peers left out only because this node's budget for their class is spent
    _fast: list[_Peer] | None

    def __init__(
        self,
        now: float,
        free: list[_Peer],
        any_banned: bool,
        slow_below: float | None,
        peers: dict[str, _Peer],
        held: int = -1,
        blocked: int = 0,
    ) -> None:
        self.now = now
        self.free = free
        self.any_banned = any_banned
        self.slow_below = slow_below
        self.peers = peers
        self.held = held
        self.blocked = blocked
        self._fast = None

    @property
    def fast(self) -> list[_Peer]:
        """Non-banned non-seed peers not too slow (computed on first use: most rounds never ask)."""
        if self._fast is None:
            now, slow_below = self.now, self.slow_below
            self._fast = [
                p
                for p in self.peers.values()
                if not p.info.is_seed
                and p.banned_until <= now
                and (slow_below is None or p.rate is None or p.rate >= slow_below)
            ]
        return self._fast


_COUNTERS: tuple[str, ...] = ("requests", "duplicates", "seed_requests", "successes", "bytes", "seed_bytes")
_COUNTERS += ("duplicate_bytes", "cancelled", "timeouts", "errors", "busy", "missing", "bans")


class ChunkScheduler:
    """Chunk scheduling for one download; see the module docstring for the rules."""

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
        draws.shuffle(rng, self._perm)  # the random tiebreak among equally rare chunks
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

    # ------------------------------------------------------------------ state

    @property
    def have(self) -> Bitfield:
        """A copy of the chunks held."""
        return self._have.copy()

    @property
    def complete(self) -> bool:
        return self._have.complete

    def holds(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` is held (no copy, unlike ``have``)."""
        return chunk in self._have

    def holders(self, chunk: int) -> int:
        """Non-seed peers known to hold ``chunk``."""
        return self._avail[self._index(chunk)] + self._n_full

    @property
    def held_count(self) -> int:
        return self._have.count()

    @property
    def inflight(self) -> int:
        return self._n_inflight

    @property
    def full(self) -> bool:
        """Every request this node may have in flight is out: the local budget spent, and the remote
        one too while some known peer is remote."""
        return not self._room()

    def inflight_requests(self) -> list[Request]:
        """Every request in flight, by chunk."""
        return [f.request for c in sorted(self._flights) for f in self._flights[c].values()]

    def stats(self) -> dict[str, float]:
        """Counters (requests, duplicates, seed_requests, bytes, seed_bytes, timeouts, bans, ...),
        plus ``bytes:<peer>`` and ``rate:<peer>`` per known peer."""
        out = dict(self._counters)
        out["have"] = float(self._have.count())
        out["inflight"] = float(self._n_inflight)
        out["inflight_remote"] = float(self._n_remote)
        for pid, p in self._peers.items():
            out[f"bytes:{pid}"] = float(p.bytes)
            if p.rate is not None:
                out[f"rate:{pid}"] = p.rate
        return out

    # ------------------------------------------------------------------ peers

    def update_peer(self, peer: PeerInfo, has: Bitfield | int | None, now: float) -> None:
        """Add or refresh a peer; ``has=None``: it holds every chunk (the seed, or a complete node).

        ``has`` is a Bitfield, or the same as an int (bit i: chunk i; what ``Bitfield.mask_from_bytes``
        makes of a wire bitfield, saving the driver a Bitfield per announcement).  It is not kept:
        later changes to it are not seen.  Rate estimate, rest and ban survive a refresh.
        """
        self._tick(now)
        if peer.peer_id == self._me.peer_id:
            raise ValueError("update_peer() about this node itself")
        n = len(self._sizes)
        if has is None:
            new_bits = _ALL
        elif isinstance(has, Bitfield):
            if has.n != n:
                raise ValueError(f"bitfield of {has.n} chunks for a version of {n}")
            new_bits = has.to_int()
        else:
            if has < 0 or has >> n:
                raise ValueError(f"bitfield int names chunks outside a version of {n}")
            new_bits = has
        p = self._peers.get(peer.peer_id)
        if p is not None and p.missing:  # a stale announcement must not undo a fresh MISSING
            p.missing = {c: t for c, t in p.missing.items() if t > now}
            if p.missing:
                if new_bits == _ALL:
                    new_bits = (1 << n) - 1
                for c in p.missing:
                    new_bits &= ~(1 << c)
        if p is None:
            p = self._peers[peer.peer_id] = _Peer(peer, 0, self._next_seq())
            old_counted = False
            if self._cfg.max_peers and not peer.is_seed:
                self._make_room(peer.peer_id)
        else:
            old_counted = not p.info.is_seed
            if self._cfg.max_peers:  # the most recently heard from last: the first to go is the stalest
                self._peers[peer.peer_id] = self._peers.pop(peer.peer_id)
                p.seq = self._next_seq()
        new_counted = not peer.is_seed
        old_bits = p.bits
        p.info, p.bits = peer, new_bits
        if new_bits & self._missing:
            self._live[peer.peer_id] = p
        me = self._me
        remote = bool(self._cfg.max_inflight_remote and me.region and peer.region and peer.region != me.region)
        self._remote_peers += remote - p.remote
        p.remote = remote
        p.cap = self._peer_cap(p)
        if peer.is_seed:
            self._seeds[peer.peer_id] = p
        else:
            self._seeds.pop(peer.peer_id, None)
        removed: list[int] = []
        added: list[int] = []
        full_delta = 0
        # (an announcement usually differs from the last one by a chunk or two)
        if old_counted and new_counted and old_bits != _ALL and new_bits != _ALL:
            changed = old_bits ^ new_bits
            removed = _indices(old_bits & changed)
            added = _indices(new_bits & changed)
        else:
            if old_counted:
                if old_bits == _ALL:
                    full_delta -= 1
                else:
                    removed = _indices(old_bits)
            if new_counted:
                if new_bits == _ALL:
                    full_delta += 1
                else:
                    added = _indices(new_bits)
        self._apply_availability(removed, added, full_delta, now)

    def _make_room(self, newcomer: str) -> None:
        """Over ``max_peers`` non-seed peers: forget the one heard from longest ago that has nothing
        in flight and is neither resting nor banned (forgetting those would cut a rest or a ban short)."""
        count = len(self._peers) - len(self._seeds)
        if count <= self._cfg.max_peers:
            return
        now = self._now
        for pid, p in self._peers.items():
            if (
                pid != newcomer
                and not p.info.is_seed
                and not p.inflight
                and p.free_at <= now
                and pid not in self._parents
            ):
                self.remove_peer(pid)
                return

    def on_have(self, peer_id: str, chunk: int, now: float) -> None:
        """A peer announced one more chunk (cheaper than ``update_peer`` with a new bitfield)."""
        self._tick(now)
        p = self._peers.get(peer_id)
        if p is None:
            return
        p.missing.pop(chunk, None)  # news newer than its MISSING answer
        bits = p.bits
        if bits == _ALL or bits >> self._index(chunk) & 1:
            return
        p.bits = bits | 1 << chunk
        if self._missing >> chunk & 1:
            self._live[peer_id] = p
        if not p.info.is_seed:
            self._avail_change(chunk, +1, now)

    def set_parents(self, parents: tuple[str | None, ...]) -> None:
        """Stripe trees (protocol/trees.py): chunk ``c`` is asked of ``parents[c % len(parents)]``
        (None: the seeds; "": no parent, the usual rules) unless that peer is banned, even if it does
        not hold the chunk yet, for up to ``tree_patience`` after some other peer does; () turns the
        trees off."""
        if self._me.peer_id in parents:
            raise ValueError("a node is not its own parent")
        self._parents = tuple(parents)
        # Room for every parent's requests: a root's seed requests must not crowd out its other stripes.
        self._max_local = max(self._cfg.max_inflight, len(parents) * self._cfg.max_inflight_per_parent)
        for p in self._peers.values():
            p.cap = self._peer_cap(p)

    def orphan(self, peer_id: str) -> None:
        """``peer_id`` is gone for good: the stripes it was the parent of follow the usual rules."""
        if peer_id in self._parents:
            self._parents = tuple("" if p == peer_id else p for p in self._parents)

    def remove_peer(self, peer_id: str) -> list[Request]:
        """Forget a peer (dead or gone); returns its in-flight requests, now dropped (cancel them)."""
        p = self._peers.pop(peer_id, None)
        if p is None:
            return []
        self._live.pop(peer_id, None)
        self._seeds.pop(peer_id, None)
        self._banned.discard(peer_id)
        self._remote_peers -= p.remote
        dropped = [self._drop_flight(c, peer_id).request for c in sorted(p.inflight)]
        if not p.info.is_seed:
            if p.bits == _ALL:
                self._apply_availability([], [], -1, self._now)
            else:
                self._apply_availability(_indices(p.bits), [], 0, self._now)
        for r in dropped:
            self._maybe_repool(r.chunk, self._now)
        return dropped

    # ------------------------------------------------------------------ decisions

    def next_requests(self, now: float) -> list[Request]:
        """New requests to start now, obeying every cap and rule."""
        self._tick(now)
        out: list[Request] = []
        if self._have.complete or not self._room():
            return out
        # Peers holding nothing in the pool cannot take a new chunk: one pass lists the free peers that do.
        pool = self._pool
        pool_bits = pool.to_int()
        scan = self._round(now, pool_bits) if pool_bits else None
        if scan is not None and scan.free:
            self._ensure_order()
            self._new_requests(now, scan, out)
        if pool.count() == 0 and self._in_endgame() and self._room():
            rnd = self._round(now)
            for c in sorted(self._flights):
                if not rnd.free:
                    break
                flights = self._flights[c]
                if len(flights) != 1:
                    continue
                (first,) = flights.values()
                peer = self._choose(c, rnd, waiting_since=first.start)
                if peer is not None:
                    out.append(self._issue(c, peer, rnd, duplicate=True))
        return out

    def _new_requests(self, now: float, scan: _Round, out: list[Request]) -> None:
        """Random-first, then rarest-first requests for pooled chunks, to the free peers of ``scan``."""
        cfg = self._cfg
        early = self._epoch is not None and now - self._epoch < cfg.seed_patience
        n = len(self._sizes)  # (the keys of _order: availability x n + rank)
        while self._random_left > 0 and scan.free:
            candidates = []
            held = scan.held
            for key in self._order:
                if early and key // n + self._n_full and self._only_seeds_can_help(scan):
                    break  # as below
                c = self._perm[key % n]
                if held >> c & 1 and self._candidates(c, scan):
                    candidates.append(c)
            if not candidates:
                break
            c = draws.choice(self._rng, candidates)
            peer = self._choose(c, scan)
            assert peer is not None
            out.append(self._issue(c, peer, scan, duplicate=False))
            self._random_left -= 1
        if self._random_left == 0:
            order, i = self._order, 0
            while i < len(order) and scan.free:
                key = order[i]
                c = self._perm[key % n]
                if early and key // n + self._n_full and self._only_seeds_can_help(scan):
                    break  # from here on every chunk has a holder and none has waited its patience yet
                if not scan.held >> c & 1:
                    i += 1  # no free peer holds it: _choose would find nobody (O(1) instead of O(free peers))
                    continue
                peer = self._choose(c, scan)
                if peer is None:
                    i += 1
                else:  # issuing removes order[i]: the next chunk moves into place i
                    out.append(self._issue(c, peer, scan, duplicate=False))

    def on_success(self, now: float, chunk: int, peer_id: str, nbytes: int, elapsed: float) -> list[Request]:
        """A chunk arrived from ``peer_id`` and passed its hash; returns duplicate requests to cancel."""
        self._tick(now)
        self._index(chunk)
        p = self._peers.get(peer_id)
        if p is not None:
            sample = nbytes / max(elapsed, _MIN_ELAPSED)
            a = self._cfg.rate_alpha
            p.rate = sample if p.rate is None else a * sample + (1 - a) * p.rate
            p.failures = 0
            p.bytes += nbytes
        own = self._drop_flight(chunk, peer_id) if peer_id in self._flights.get(chunk, _NO_FLIGHTS) else None
        cancel = [self._drop_flight(chunk, pid).request for pid in list(self._flights.get(chunk, _NO_FLIGHTS))]
        self._counters["cancelled"] += len(cancel)
        if not self._have.set(chunk):
            return cancel
        self._missing &= ~(1 << chunk)
        self._pool_remove(chunk)
        self._counters["successes"] += 1
        self._counters["bytes"] += nbytes
        if p is not None and p.info.is_seed:
            self._counters["seed_bytes"] += nbytes
        if own is not None and own.request.duplicate:
            self._counters["duplicate_bytes"] += nbytes
        return cancel

    def on_failure(
        self, now: float, chunk: int, peer_id: str, reason: FailureReason, retry_after: float | None = None
    ) -> None:
        """A request failed; the chunk becomes requestable again unless another request covers it."""
        self._tick(now)
        self._index(chunk)
        flight = self._drop_flight(chunk, peer_id) if peer_id in self._flights.get(chunk, _NO_FLIGHTS) else None
        p = self._peers.get(peer_id)
        # An ERROR or TIMEOUT for a request no longer tracked was already accounted for (expired or
        # cancelled); HASH, MISSING and BUSY still say something about the peer.
        stale = flight is None and reason in (FailureReason.ERROR, FailureReason.TIMEOUT)
        if p is not None and not stale:
            self._punish(p, now, chunk, reason, retry_after, flight)
        self._maybe_repool(chunk, now)

    def expired(self, now: float) -> list[Request]:
        """In-flight requests past their deadline, now dropped as TIMEOUT failures (cancel them)."""
        self._tick(now)
        flights = self._flights
        first = self._first_deadline()
        if first is None or first > now:
            return []  # the usual case (deadlines are seconds away): no sort, no list
        late = [f.request for c in sorted(flights) for f in flights[c].values() if f.request.deadline <= now]
        for r in late:
            self.on_failure(now, r.chunk, r.peer_id, FailureReason.TIMEOUT)
        return late

    def next_deadline(self) -> float | None:
        """When to call ``expired``/``next_requests`` next if nothing else happens.

        The earliest in-flight deadline (even if past), or the earliest future end of a rest or
        ban, or moment a waiting chunk's seed patience runs out.  "Future" is relative to the
        latest ``now`` the scheduler was given, so a driver that re-arms after each call never spins.
        """
        first_deadline = self._first_deadline()
        deadlines = [] if first_deadline is None else [first_deadline]
        later: list[float] = []
        wake = self._first_wake()
        if wake is not None:
            later.append(wake)
        seeds = list(self._seeds.values())
        if self._epoch is not None and seeds:  # when a waiting chunk may go to a seed
            ready = min(max(p.resting_until, p.banned_until) for p in seeds)
            patience = self._cfg.seed_patience
            first = self._first_patience_end(self._since_heap, patience)
            if first is not None:
                later.append(max(ready, first))
            later.append(max(ready, self._epoch + patience))  # chunks waiting since the start
            if self._pool.count() == 0 and self._in_endgame():
                later.extend(
                    max(ready, f.start + patience) for fl in self._flights.values() if len(fl) == 1 for f in fl.values()
                )
        if self._parents and (tree := self._first_patience_end(self._tree_heap, self._cfg.tree_patience)) is not None:
            later.append(tree)  # a chunk may leave its stripe's parent for the usual rules
        after = self._now
        return min(deadlines + [t for t in later if t > after], default=None)

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

    # ------------------------------------------------------------------ choosing

    def _room(self, remote: bool | None = None) -> bool:
        """Whether this node may start another request (to a peer of class ``remote``; None: either,
        where the remote budget counts only while some known peer is remote, so that a node in one
        region is "full" when its one budget is, as without a remote budget)."""
        cfg = self._cfg
        local = self._n_inflight - self._n_remote < self._max_local
        if not cfg.max_inflight_remote or remote is False:
            return local
        far = self._n_remote < cfg.max_inflight_remote
        return far if remote else local or (far and self._remote_peers > 0)

    def _round(self, now: float, pool_bits: int = -1) -> _Round:
        """The free peers holding something this node lacks (and in ``pool_bits``), in the order they
        were added (with an active set, ``max_peers``: the order they were last heard from)."""
        cfg = self._cfg
        want = pool_bits & self._missing
        free: list[_Peer] = []
        spent: list[str] = []
        for p in self._live.values():  # (a walk on each call: kept to a few tests on plain fields)
            if p.free_at <= now and p.load < p.cap:
                bits = p.bits
                if bits & want:
                    free.append(p)
                elif not bits & self._missing:
                    spent.append(p.info.peer_id)  # it holds nothing this node lacks: out of the walks
        for pid in spent:
            del self._live[pid]
        if len(free) > 1:
            free.sort(key=_seq_of)
        blocked = 0
        if cfg.max_inflight_remote and not (self._room(False) and self._room(True)):
            full = not self._room(True)  # the class whose budget is spent (only one can be: _room() held)
            blocked = self._holders_of(p for p in free if p.remote == full and not p.info.is_seed)
            free = [p for p in free if p.remote != full]
        if self._banned:
            self._banned = {pid for pid in self._banned if self._peers[pid].banned_until > now}
        seed_rate: float | None = None
        for p in self._seeds.values():
            if p.banned_until <= now and p.rate is not None:
                seed_rate = p.rate if seed_rate is None else max(seed_rate, p.rate)
        slow_below = None if seed_rate is None else seed_rate / cfg.slow_factor
        return _Round(now, free, bool(self._banned), slow_below, self._peers, self._holders_of(free), blocked)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @staticmethod
    def _holders_of(peers: Iterable[_Peer]) -> int:
        """The chunks any of ``peers`` holds (an OR of their masks)."""
        held = 0
        for p in peers:
            held |= p.bits
        return held

    def _choose(self, chunk: int, rnd: _Round, waiting_since: float | None = None) -> _Peer | None:
        """The peer to ask for ``chunk`` now, or None.  ``waiting_since`` marks an endgame duplicate."""
        candidates = self._candidates(chunk, rnd, waiting_since)
        return self._best(candidates) if candidates else None

    def _candidates(self, chunk: int, rnd: _Round, waiting_since: float | None = None) -> list[_Peer]:
        """The free peers that may be asked for ``chunk`` now: non-seed holders, or else the seeds."""
        if self._parents and waiting_since is None:
            tree = self._tree_candidates(chunk, rnd)
            if tree is not None:
                return tree
        holders: list[_Peer] = []
        seeds: list[_Peer] = []
        for p in rnd.free:
            if p.bits >> chunk & 1 and chunk not in p.inflight:
                (seeds if p.info.is_seed else holders).append(p)
        if not seeds:
            return holders
        if self._too_slow(chunk, rnd):
            return seeds
        if holders:
            return holders
        if rnd.blocked >> chunk & 1:
            return []  # its holders wait for this node's own budget (see the module docstring)
        if waiting_since is None:
            if self._no_holder(chunk, rnd):
                return seeds
            waiting_since = self._since.get(chunk, rnd.now if self._epoch is None else self._epoch)
        return seeds if rnd.now - waiting_since >= self._cfg.seed_patience else []

    def _tree_candidates(self, chunk: int, rnd: _Round) -> list[_Peer] | None:
        """The chunk's stripe parent if it may be asked now, [] to wait for it, None: the usual rules."""
        parent_id = self._parents[chunk % len(self._parents)]
        if parent_id == "":  # no parent in this stripe (it left): the usual rules
            return None
        if parent_id is None:  # a root: its stripe comes from the seeds, first hand
            return [p for p in rnd.free if p.info.is_seed and p.bits >> chunk & 1 and chunk not in p.inflight] or None
        parent = self._peers.get(parent_id)
        if parent is not None:
            if parent.banned_until > rnd.now:
                return None
            if parent.bits >> chunk & 1:
                free = parent.load < parent.cap and parent.free_at <= rnd.now and chunk not in parent.inflight
                return [parent] if free and parent in rnd.free else []
        # The parent lacks it (or has not announced this version yet): wait, unless others have held it a while.
        since = self._since.get(chunk)
        if since is None or self._avail[chunk] + self._n_full == 0:
            return []
        return [] if rnd.now < since + self._cfg.tree_patience else None  # (as next_deadline computes it)

    @staticmethod
    def _only_seeds_can_help(rnd: _Round) -> bool:
        """Only seeds are free, and only "nobody holds it" could let them be asked (no bans, no slow rule)."""
        return not rnd.any_banned and rnd.slow_below is None and all(p.info.is_seed for p in rnd.free)

    def _no_holder(self, chunk: int, rnd: _Round) -> bool:
        """No non-banned non-seed peer holds the chunk."""
        if self._avail[chunk] + self._n_full == 0:
            return True
        if not rnd.any_banned:
            return False
        return not any(
            not p.info.is_seed and p.banned_until <= rnd.now and p.holds(chunk) for p in self._peers.values()
        )

    def _too_slow(self, chunk: int, rnd: _Round) -> bool:
        """The chunk has non-banned holders and every one is measured below the seed's rate / slow_factor."""
        if rnd.slow_below is None or self._no_holder(chunk, rnd):
            return False
        return not any(p.holds(chunk) for p in rnd.fast)

    def _best(self, candidates: list[_Peer]) -> _Peer:
        cfg = self._cfg
        rates = [cfg.initial_rate if p.rate is None else p.rate for p in candidates]
        slow_below = max(rates) / cfg.slow_factor
        best: tuple[int, float, float] | None = None
        chosen = candidates[0]
        for p, rate in zip(candidates, rates, strict=True):
            key = (3 if rate < slow_below else self._tier(p.info), -rate / (1 + len(p.inflight)), self._rng.random())
            if best is None or key < best:
                best, chosen = key, p
        return chosen

    def _tier(self, info: PeerInfo) -> int:
        me = self._me
        same_region = info.region == me.region
        if me.zone and info.zone == me.zone and same_region:
            return 0
        if me.region and same_region:
            return 1
        return 2

    def _issue(self, chunk: int, peer: _Peer, rnd: _Round, *, duplicate: bool) -> Request:
        cfg = self._cfg
        pid = peer.info.peer_id
        deadline = rnd.now + cfg.deadline_base + self._sizes[chunk] / cfg.deadline_rate
        req = Request(chunk, pid, deadline, duplicate)
        remote = peer.remote
        self._flights.setdefault(chunk, {})[pid] = _Flight(req, rnd.now, remote)
        heapq.heappush(self._deadlines, (deadline, chunk, pid))
        if len(self._deadlines) > 4 * self._n_inflight + 64:  # compact the entries of dropped requests
            self._deadlines = [(f.request.deadline, c, q) for c, fl in self._flights.items() for q, f in fl.items()]
            heapq.heapify(self._deadlines)
        peer.inflight.add(chunk)
        peer.load = len(peer.inflight)
        self._n_inflight += 1
        self._n_remote += remote
        if not duplicate:
            self._pool_remove(chunk)
        if peer.load >= peer.cap:
            rnd.free.remove(peer)
        if not self._room(remote):  # this class is full: its peers leave the round, their chunks wait
            rnd.blocked |= self._holders_of(p for p in rnd.free if p.remote == remote and not p.info.is_seed)
            rnd.free = [p for p in rnd.free if p.remote != remote]
        self._counters["requests"] += 1
        self._counters["duplicates"] += duplicate
        self._counters["seed_requests"] += peer.info.is_seed
        return req

    def _peer_cap(self, peer: _Peer) -> int:
        cfg = self._cfg
        if peer.info.is_seed:
            return cfg.max_inflight_per_parent if None in self._parents else cfg.max_inflight_seed
        if peer.info.peer_id in self._parents:
            return cfg.max_inflight_per_parent
        return cfg.max_inflight_per_remote_peer if peer.remote else cfg.max_inflight_per_peer

    def _in_endgame(self) -> bool:
        left = self._have.n - self._have.count()
        return 0 < left <= self._cfg.endgame_remaining

    # ------------------------------------------------------------------ failures

    def _punish(
        self,
        p: _Peer,
        now: float,
        chunk: int,
        reason: FailureReason,
        retry_after: float | None,
        flight: _Flight | None,
    ) -> None:
        cfg = self._cfg
        if reason is FailureReason.HASH:
            p.banned_until = max(p.banned_until, now + cfg.ban_seconds)
            p.free_at = max(p.free_at, p.banned_until)
            self._banned.add(p.info.peer_id)
            heapq.heappush(self._wakes, (p.banned_until, p.info.peer_id))
            self._counters["bans"] += 1
            return
        if reason is FailureReason.MISSING:
            self._counters["missing"] += 1
            p.missing[chunk] = now + cfg.failure_backoff
            if p.bits == _ALL:
                p.bits = (1 << len(self._sizes)) - 1
                if not p.info.is_seed:  # from "holds everything" to an explicit bitfield
                    self._apply_availability([], list(range(len(self._sizes))), -1, now)
            if p.bits >> chunk & 1:
                p.bits &= ~(1 << chunk)
                if not p.info.is_seed:
                    self._avail_change(chunk, -1, now)
            return
        p.failures += 1
        rest = min(cfg.backoff_cap, cfg.failure_backoff * 2.0 ** min(p.failures - 1, 60))
        if reason is FailureReason.BUSY:
            self._counters["busy"] += 1
            if retry_after is not None and math.isfinite(retry_after):
                rest = max(0.0, retry_after)
        elif reason is FailureReason.TIMEOUT:
            self._counters["timeouts"] += 1
            size = self._sizes[chunk]
            elapsed = now - flight.start if flight is not None else cfg.deadline_base + size / cfg.deadline_rate
            could = max(size, 1) / max(elapsed, _MIN_ELAPSED)  # it delivered less than this
            p.rate = min(cfg.initial_rate if p.rate is None else p.rate, could) / 2
        else:
            self._counters["errors"] += 1
        p.resting_until = max(p.resting_until, now + rest)
        p.free_at = max(p.free_at, p.resting_until)
        heapq.heappush(self._wakes, (p.resting_until, p.info.peer_id))

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
