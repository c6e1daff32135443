"""A randomized discrete-event simulation around one ChunkScheduler: peers that are honest, slow,
lying, corrupt or flaky, a seed that is sometimes busy, joins and departures; `simulate` asserts the
scheduler's invariants after every step and that the download completes.  Shared by
tests/unit/protocol/test_scheduler.py and the subprocess it starts to check that the result does not
depend on string hashing."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.scheduler_types import FailureReason, PeerInfo, Request, SchedulerConfig

ME = PeerInfo("me", zone="z1", region="r1")
MB = 1_000_000
SEED = PeerInfo("seed", is_seed=True)


def bits(n: int, held: set[int] | range) -> Bitfield:
    bf = Bitfield(n)
    for i in held:
        bf.set(i)
    return bf


@dataclass
class SimPeer:
    info: PeerInfo
    kind: str  # honest | slow | liar | corrupt | flaky | seed
    actual: set[int] | None  # what it really holds (None: everything)
    advertised: Bitfield | None
    join: float = 0.0
    leave: float | None = None


@dataclass
class World:
    n: int
    sizes: list[int]
    peers: dict[str, SimPeer]
    config: SchedulerConfig
    have: Bitfield
    busy_p: float
    log: list[tuple[float, str, int, str, bool]] = field(default_factory=list)


def build_world(seed: int) -> World:
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    sizes = [rng.randint(1, 4 * MB) for _ in range(n)]
    kinds = ["honest", "slow", "liar", "corrupt", "flaky"]
    peers: dict[str, SimPeer] = {}
    with_seed = rng.random() < 0.6
    for i in range(rng.randint(0 if with_seed else 1, 6)):
        kind = rng.choice(kinds)
        actual = {c for c in range(n) if rng.random() < 0.5}
        adv = set(actual) | ({c for c in range(n) if rng.random() < 0.5} if kind == "liar" else set())
        full = rng.random() < 0.15 and kind != "liar"
        info = PeerInfo(f"p{i}", zone=rng.choice(["z1", "z2"]), region=rng.choice(["r1", "r2"]))
        join = 0.0 if rng.random() < 0.7 else rng.uniform(0, 5)
        leave = rng.uniform(1, 20) if kind in ("flaky", "corrupt") and rng.random() < 0.3 else None
        peers[info.peer_id] = SimPeer(info, kind, None if full else actual, None if full else bits(n, adv), join, leave)
    if with_seed:
        peers["seed"] = SimPeer(SEED, "seed", None, None, join=rng.choice([0.0, 3.0]))
    else:  # liveness needs an honest holder for every chunk
        honest = [p for p in peers.values() if p.kind in ("honest", "slow")] or [next(iter(peers.values()))]
        for p in honest:
            p.kind = "honest" if p.kind not in ("honest", "slow") else p.kind
            p.leave = None
        for c in range(n):
            p = rng.choice(honest)
            if p.actual is not None and p.advertised is not None and c not in p.actual:
                p.actual.add(c)
                p.advertised.set(c)
    config = SchedulerConfig(
        max_inflight=rng.randint(1, 16),
        max_inflight_per_peer=rng.randint(1, 3),
        max_inflight_per_remote_peer=rng.randint(1, 3),
        max_inflight_seed=rng.randint(1, 5),
        random_first=rng.randint(0, 4),
        endgame_remaining=rng.randint(0, 3),
        seed_patience=rng.choice([0.0, 1.0]),
        max_inflight_remote=rng.choice([0, rng.randint(1, 16)]),
    )
    have = bits(n, {c for c in range(n) if rng.random() < 0.2})
    return World(n, sizes, peers, config, have, busy_p=rng.choice([0.0, 0.3, 0.7]))


def simulate(seed: int) -> World:
    """A toy discrete-event loop driving one scheduler; asserts the invariants after every step."""
    w = build_world(seed)
    rng = random.Random(seed + 1)
    cfg = w.config
    sched = ChunkScheduler(w.sizes, ME, cfg, random.Random(seed + 2), w.have)
    told: dict[str, Bitfield | None] = {}  # what the scheduler was told each peer holds
    banned: dict[str, float] = {}
    resting: dict[str, float] = {}
    failures: Counter[str] = Counter()
    measured: set[str] = set()  # peers with a rate estimate (a success or a timeout): deadlines of their own
    out: dict[tuple[int, str], tuple[Request, float]] = {}  # outstanding (chunk, peer) -> (request, start)
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    for p in w.peers.values():
        push(p.join, "join", p.info.peer_id)
        if p.leave is not None:
            push(max(p.leave, p.join), "leave", p.info.peer_id)

    def rest(pid: str, now: float, retry_after: float | None = None) -> None:
        failures[pid] += 1
        base = min(cfg.backoff_cap, cfg.failure_backoff * 2.0 ** (failures[pid] - 1))
        resting[pid] = max(resting.get(pid, 0.0), now + (base if retry_after is None else retry_after))

    def outcome(r: Request, now: float) -> None:
        p = w.peers[r.peer_id]
        lat = rng.uniform(0.01, 1.5)
        if p.actual is not None and r.chunk not in p.actual:
            push(now + lat, "missing", r)
        elif p.kind == "seed" and rng.random() < w.busy_p:
            push(now + 0.01, "busy", r)
        elif p.kind == "corrupt" and rng.random() < 0.5:
            push(now + lat, "hash", r)
        elif p.kind == "flaky" and rng.random() < 0.5:
            if rng.random() < 0.5:
                push(now + lat, "error", r)  # else: never answers, times out
        elif p.kind == "slow":
            push(now + rng.uniform(0.5, 6.0), "ok", r)
        else:
            push(now + lat, "ok", r)

    def check(new: list[Request], now: float) -> None:
        have = sched.have
        for r in new:
            key = (r.chunk, r.peer_id)
            assert key not in out, "the same chunk asked twice of one peer"
            assert r.chunk not in have, "requested a held chunk"
            assert r.peer_id in told, "requested from an unknown or departed peer"
            adv = told[r.peer_id]
            assert adv is None or r.chunk in adv, "requested from a non-holder"
            assert banned.get(r.peer_id, -1.0) <= now, "requested from a banned peer"
            assert resting.get(r.peer_id, -1.0) <= now + 1e-9, "requested from a resting peer"
            assert r.duplicate == any(c == r.chunk for c, _ in out), "duplicate flag wrong"
            if r.peer_id in measured and cfg.deadline_slack:  # its own deadline (protocol/peer_timing.py)
                fixed = cfg.deadline_base + w.sizes[r.chunk] / cfg.deadline_rate
                assert now + fixed - 1e-9 <= r.deadline <= now + max(fixed, cfg.deadline_max) + 1e-9
            else:
                assert r.deadline == pytest.approx(now + cfg.deadline_base + w.sizes[r.chunk] / cfg.deadline_rate)
            out[key] = (r, now)
            w.log.append((now, r.peer_id, r.chunk, f"{r.deadline:.9f}", r.duplicate))
            outcome(r, now)

        def remote(pid: str) -> bool:
            return bool(cfg.max_inflight_remote) and w.peers[pid].info.region not in ("", ME.region)

        per_peer = Counter(pid for _, pid in out)
        for pid, k in per_peer.items():
            if w.peers[pid].kind == "seed":
                cap = cfg.max_inflight_seed
            else:
                cap = cfg.max_inflight_per_remote_peer if remote(pid) else cfg.max_inflight_per_peer
            assert k <= cap, "per-peer cap exceeded"
        far = [pid for _, pid in out if remote(pid)]
        assert len(out) - len(far) <= cfg.max_inflight, "per-node cap exceeded"
        assert len(far) <= cfg.max_inflight_remote, "remote cap exceeded"
        assert sched.inflight == len(out)
        assert {(q.chunk, q.peer_id) for q in sched.inflight_requests()} == set(out)
        assert all(c not in have for c, _ in out)

    now = 0.0
    for _step in range(20_000):
        if sched.complete:
            break
        while events and events[0][0] <= now:
            _, _, kind, payload = heapq.heappop(events)
            if kind == "join":
                p = w.peers[str(payload)]
                told[p.info.peer_id] = None if p.advertised is None else p.advertised.copy()
                sched.update_peer(p.info, p.advertised, now)
                continue
            if kind == "leave":
                pid = str(payload)
                told.pop(pid, None)
                measured.discard(pid)
                for r in sched.remove_peer(pid):
                    del out[(r.chunk, r.peer_id)]
                continue
            assert isinstance(payload, Request)
            r = payload
            key = (r.chunk, r.peer_id)
            if key not in out or out[key][0] is not r:
                continue  # cancelled, expired or dropped: the driver would have aborted it
            start = out.pop(key)[1]
            if kind == "ok":
                failures[r.peer_id] = 0
                measured.add(r.peer_id)
                for c in sched.on_success(now, r.chunk, r.peer_id, w.sizes[r.chunk], now - start):
                    assert c.chunk == r.chunk and c.peer_id != r.peer_id
                    del out[(c.chunk, c.peer_id)]
            elif kind == "hash":
                banned[r.peer_id] = now + cfg.ban_seconds
                sched.on_failure(now, r.chunk, r.peer_id, FailureReason.HASH)
            elif kind == "missing":
                adv = told[r.peer_id]
                if adv is not None:
                    adv.clear(r.chunk)
                sched.on_failure(now, r.chunk, r.peer_id, FailureReason.MISSING)
            elif kind == "busy":
                retry = rng.uniform(0.1, 3.0)
                rest(r.peer_id, now, retry)
                sched.on_failure(now, r.chunk, r.peer_id, FailureReason.BUSY, retry_after=retry)
            else:
                rest(r.peer_id, now)
                sched.on_failure(now, r.chunk, r.peer_id, FailureReason.ERROR)
        for r in sched.expired(now):
            assert r.deadline <= now
            del out[(r.chunk, r.peer_id)]
            rest(r.peer_id, now)
            measured.add(r.peer_id)
        assert all(r.deadline > now for r, _ in out.values()), "a late request not reported as expired"
        check_live_index(sched, now)
        check(sched.next_requests(now), now)
        if sched.complete:
            break
        deadline = sched.next_deadline()
        if out:  # never later than the earliest request in flight
            assert deadline is not None and deadline <= min(r.deadline for r, _ in out.values())
        wake = [t for t in (events[0][0] if events else None, deadline) if t is not None]
        assert wake, f"deadlock at t={now}: nothing in flight, nothing to wait for"
        nxt = min(wake)
        assert nxt > now, "the timer would spin"
        now = nxt
    assert sched.complete, f"download did not complete (t={now})"
    assert sched.stats()["successes"] == w.n - w.have.count()
    return w


def check_live_index(sched: ChunkScheduler, now: float) -> None:
    """A round walks only the peers indexed as holding something the node lacks, and lists the free
    ones in the order a walk over every peer would."""
    missing = ((1 << sched.have.n) - 1) & ~sched.have.to_int()
    assert sched._missing == missing
    for pid, p in sched._peers.items():
        if p.bits & missing:
            assert sched._live.get(pid) is p, "a peer holding a missing chunk is left out of the rounds"
    for pool_bits in (sched._pool.to_int(), -1):
        everyone = [
            p for p in sched._peers.values() if p.free_at <= now and p.load < p.cap and p.bits & pool_bits & missing
        ]
        if sched._cfg.max_inflight_remote and not (sched._room(False) and sched._room(True)):
            full = not sched._room(True)  # (the class whose budget is spent sits the round out)
            everyone = [p for p in everyone if p.remote != full]
        assert sched._round(now, pool_bits).free == everyone
