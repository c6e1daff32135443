"""ChunkScheduler: one test per rule, then a randomized discrete-event simulation checking the
invariants after every step and that the download completes (liveness), and determinism."""

from __future__ import annotations

import hashlib
import heapq
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.scheduler_state import _indices
from patchswarm.protocol.scheduler_types import FailureReason, PeerInfo, Request, SchedulerConfig
from tests.support.scheduler_sim import MB, ME, SEED, bits, simulate

WIDE = SchedulerConfig(
    max_inflight=100,
    max_inflight_per_peer=100,
    max_inflight_per_remote_peer=100,
    max_inflight_seed=100,
    random_first=0,
    endgame_remaining=0,
    max_inflight_remote=0,  # one budget for every peer (most peers here are in region r9, ME in r1)
)  # endgame off: tested on its own


def make(n: int, config: SchedulerConfig = WIDE, seed: int = 0, have: Bitfield | None = None) -> ChunkScheduler:
    return ChunkScheduler([MB] * n, ME, config, random.Random(seed), have)


def peer(pid: str, zone: str = "z9", region: str = "r9") -> PeerInfo:
    return PeerInfo(pid, zone=zone, region=region)


# ---------------------------------------------------------------------------- chunk order


def test_rarest_first_order() -> None:
    s = make(6)
    s.update_peer(peer("a"), bits(6, range(6)), 0.0)
    s.update_peer(peer("b"), bits(6, {0, 1, 2, 3}), 0.0)
    s.update_peer(peer("c"), bits(6, {0, 1}), 0.0)
    s.update_peer(peer("d"), bits(6, {0}), 0.0)
    order = [r.chunk for r in s.next_requests(0.0)]
    assert set(order[:2]) == {4, 5}
    assert set(order[2:4]) == {2, 3}
    assert order[4:] == [1, 0]


def test_rarity_ties_are_broken_by_the_rng() -> None:
    firsts = set()
    for seed in range(30):
        s = make(8, seed=seed)
        s.update_peer(peer("a"), None, 0.0)
        firsts.add(s.next_requests(0.0)[0].chunk)
    assert len(firsts) > 3


def test_rarity_follows_have_announcements_and_ignores_the_seed() -> None:
    s = make(3, replace(WIDE, endgame_remaining=0))
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), bits(3, {0, 1, 2}), 0.0)
    s.update_peer(peer("b"), bits(3, {0, 1}), 0.0)
    s.on_have("b", 2, 0.0)
    s.on_have("b", 2, 0.0)  # repeated announcement: no double count
    s.update_peer(peer("c"), bits(3, {0, 2}), 0.0)
    order = [r.chunk for r in s.next_requests(0.0)]  # held by 3, 2 and 3 peers
    assert order[0] == 1 and sorted(order[1:]) == [0, 2]


def test_random_first_then_rarest() -> None:
    cfg = replace(WIDE, random_first=4)
    first_picks: Counter[int] = Counter()
    for seed in range(300):
        s = make(20, cfg, seed=seed)
        s.update_peer(peer("a"), None, 0.0)
        s.update_peer(peer("b"), bits(20, range(10, 20)), 0.0)  # 0..9 rarer than 10..19
        order = [r.chunk for r in s.next_requests(0.0)]
        assert sorted(order) == list(range(20))
        first_picks.update(order[:4])
        rest = order[4:]
        rare_left = [i for i, c in enumerate(rest) if c < 10]
        common_left = [i for i, c in enumerate(rest) if c >= 10]
        assert not rare_left or not common_left or max(rare_left) < min(common_left)  # rarest first after 4
    assert set(first_picks) == set(range(20))  # uniformly random: every chunk comes up
    assert max(first_picks.values()) < 3 * min(first_picks.values())


def test_random_first_counts_chunks_already_held() -> None:
    cfg = replace(WIDE, random_first=4)
    s = make(20, cfg, have=bits(20, {0, 1, 2, 3}))
    s.update_peer(peer("a"), None, 0.0)
    s.update_peer(peer("b"), bits(20, range(10, 20)), 0.0)
    order = [r.chunk for r in s.next_requests(0.0)]
    assert sorted(order[:6]) == list(range(4, 10))


def test_refreshed_bitfields_and_role_changes_update_rarity() -> None:
    s = make(3, replace(WIDE, endgame_remaining=0))
    s.update_peer(peer("a"), bits(3, {0, 1, 2}), 0.0)
    s.update_peer(peer("b"), bits(3, {0, 1}), 0.0)
    s.update_peer(peer("c"), bits(3, {0, 1}), 0.0)
    s.update_peer(peer("b"), bits(3, {0, 2}), 0.0)  # refresh: b lost 1, gained 2
    s.update_peer(PeerInfo("c", zone="z9", region="r9", is_seed=True), None, 0.0)  # now a seed: not counted
    s.on_have("nobody", 1, 0.0)  # unknown peer: ignored
    order = [r.chunk for r in s.next_requests(0.0)]  # held by 2, 1 and 2 non-seed peers
    assert order[0] == 1 and sorted(order[1:]) == [0, 2]


def test_rate_estimate_is_an_ewma() -> None:
    s = make(3, replace(WIDE, rate_alpha=0.5, endgame_remaining=0))
    s.update_peer(peer("a"), None, 0.0)
    a, b, _ = s.next_requests(0.0)
    s.on_success(1.0, a.chunk, "a", MB, 1.0)
    assert s.stats()["rate:a"] == pytest.approx(1e6)
    s.on_success(1.5, b.chunk, "a", MB, 0.25)
    assert s.stats()["rate:a"] == pytest.approx(0.5 * 4e6 + 0.5 * 1e6)


def test_never_requests_a_held_chunk() -> None:
    s = make(10, have=bits(10, {1, 3, 5}))
    s.update_peer(peer("a"), None, 0.0)
    s.update_peer(SEED, None, 0.0)
    assert sorted(r.chunk for r in s.next_requests(0.0)) == [0, 2, 4, 6, 7, 8, 9]


# ---------------------------------------------------------------------------- peer choice and caps


def test_zone_then_region_then_elsewhere() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=3)
    s = make(20, cfg)
    s.update_peer(peer("far"), None, 0.0)
    s.update_peer(peer("region", zone="z2", region="r1"), None, 0.0)
    s.update_peer(peer("zone", zone="z1", region="r1"), None, 0.0)
    got = [r.peer_id for r in s.next_requests(0.0)]
    assert got == ["zone"] * 3 + ["region"] * 3 + ["far"] * 3


def test_same_zone_name_in_another_region_is_not_the_same_zone() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1)
    s = make(5, cfg)
    s.update_peer(peer("other", zone="z1", region="r2"), None, 0.0)
    s.update_peer(peer("region", zone="z2", region="r1"), None, 0.0)
    assert [r.peer_id for r in s.next_requests(0.0)] == ["region", "other"]


def test_load_is_spread_among_equal_peers() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=3)
    s = make(20, cfg)
    for pid in ("a", "b", "c"):
        s.update_peer(peer(pid), None, 0.0)
    got = [r.peer_id for r in s.next_requests(0.0)]
    assert Counter(got[:3]) == Counter({"a": 1, "b": 1, "c": 1})
    assert Counter(got) == Counter({"a": 3, "b": 3, "c": 3})


def test_faster_peer_preferred_within_a_tier() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1)
    s = make(6, cfg)
    s.update_peer(peer("a"), None, 0.0)
    s.update_peer(peer("b"), None, 0.0)
    first = s.next_requests(0.0)
    for r in first:  # a at 5 MB/s, b at 10 MB/s
        s.on_success(1.0, r.chunk, r.peer_id, MB, 0.2 if r.peer_id == "a" else 0.1)
    nxt = s.next_requests(1.0)
    assert [r.peer_id for r in nxt] == ["b", "a"]


def test_caps_per_node_peer_and_seed() -> None:
    # One budget: the peers here (region r9) are not remote, so the per-peer cap is max_inflight_per_peer.
    cfg = SchedulerConfig(
        max_inflight=16, max_inflight_per_peer=3, max_inflight_seed=5, random_first=0, max_inflight_remote=0
    )
    s = make(100, cfg)
    for i in range(10):
        s.update_peer(peer(f"p{i}"), None, 0.0)
    reqs = s.next_requests(0.0)
    assert len(reqs) == 16 == s.inflight
    assert max(Counter(r.peer_id for r in reqs).values()) <= 3
    assert s.next_requests(0.0) == []

    s = make(100, cfg)
    s.update_peer(SEED, None, 0.0)
    assert len(s.next_requests(0.0)) == 5

    s = make(100, cfg)
    s.update_peer(peer("a"), None, 0.0)
    s.update_peer(peer("b"), None, 0.0)
    assert Counter(r.peer_id for r in s.next_requests(0.0)) == Counter({"a": 3, "b": 3})


def test_only_holders_are_asked() -> None:
    s = make(4)
    s.update_peer(peer("a"), bits(4, {0}), 0.0)
    s.update_peer(peer("b"), bits(4, {1}), 0.0)
    reqs = {r.chunk: r.peer_id for r in s.next_requests(0.0)}
    assert reqs == {0: "a", 1: "b"}


# ---------------------------------------------------------------------------- the seed


def test_seed_only_for_chunks_no_peer_holds() -> None:
    s = make(4)
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), bits(4, {0, 1}), 0.0)
    reqs = {r.chunk: r.peer_id for r in s.next_requests(0.0)}
    assert reqs == {0: "a", 1: "a", 2: "seed", 3: "seed"}
    assert s.stats()["seed_requests"] == 2


def test_seed_after_patience_when_holders_are_busy() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1)
    s = make(4, cfg)
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), Bitfield.full(4), 0.0)
    assert [r.peer_id for r in s.next_requests(0.0)] == ["a"]
    assert s.next_deadline() == pytest.approx(1.0)  # patience runs out before a's deadline (2.5)
    assert s.next_requests(0.5) == []
    late = s.next_requests(1.0)
    assert [r.peer_id for r in late] == ["seed"] * 3
    assert s.next_deadline() == pytest.approx(2.5)


def test_seed_patience_starts_when_the_first_holder_appears() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1, max_inflight_seed=1)
    s = make(4, cfg)
    s.update_peer(SEED, None, 0.0)
    (r,) = s.next_requests(0.0)
    assert r.peer_id == "seed"  # nobody else holds anything
    s.update_peer(peer("a"), None, 5.0)
    assert s.on_success(5.0, r.chunk, "seed", MB, 5.0) == []
    assert [q.peer_id for q in s.next_requests(5.0)] == ["a"]
    assert s.next_requests(5.5) == []  # the seed is free, but the chunks have waited only 0.5 s
    assert [q.peer_id for q in s.next_requests(6.0)] == ["seed"]


def test_seed_busy_backs_off_for_retry_after() -> None:
    s = make(3)
    s.update_peer(SEED, None, 0.0)
    reqs = s.next_requests(0.0)
    assert len(reqs) == 3
    for r in reqs:
        s.on_failure(0.1, r.chunk, "seed", FailureReason.BUSY, retry_after=5.0)
    assert s.inflight == 0
    assert s.next_requests(0.2) == []
    assert s.next_deadline() == pytest.approx(5.1)
    again = s.next_requests(5.1)
    assert [r.peer_id for r in again] == ["seed"] * 3
    assert s.stats()["busy"] == 3
    s = make(1)
    s.update_peer(SEED, None, 0.0)
    (r,) = s.next_requests(0.0)
    s.on_failure(0.2, r.chunk, "seed", FailureReason.BUSY, retry_after=float("inf"))  # ignored: the usual rest
    assert s.next_deadline() == pytest.approx(1.2)


def test_seed_busy_lets_peers_wait_for_each_other() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1, seed_patience=0.0)
    s = make(3, cfg)
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), None, 0.0)
    reqs = s.next_requests(0.0)
    assert Counter(r.peer_id for r in reqs) == Counter({"a": 1, "seed": 2})
    for r in reqs:
        if r.peer_id == "seed":
            s.on_failure(0.1, r.chunk, "seed", FailureReason.BUSY, retry_after=10.0)
    assert s.next_requests(0.2) == []
    a_req = next(r for r in reqs if r.peer_id == "a")
    s.on_success(0.5, a_req.chunk, "a", MB, 0.5)
    assert [r.peer_id for r in s.next_requests(0.5)] == ["a"]


def test_seed_used_when_every_holder_is_too_slow() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1)
    s = make(4, cfg)
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), bits(4, {0, 1, 2}), 0.0)
    reqs = {r.peer_id: r.chunk for r in s.next_requests(0.0)}
    assert reqs == {"a": reqs["a"], "seed": 3}
    s.on_success(0.01, 3, "seed", MB, 0.01)  # the seed: 100 MB/s
    s.on_success(1.0, reqs["a"], "a", MB, 1.0)  # a: 1 MB/s, below 100 / slow_factor
    assert {r.peer_id for r in s.next_requests(1.0)} == {"seed"}


def test_slow_holders_still_used_when_the_seed_is_unavailable() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1, max_inflight_seed=1)
    s = make(4, cfg)
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), bits(4, {0, 1, 2}), 0.0)
    reqs = {r.peer_id: r.chunk for r in s.next_requests(0.0)}
    s.on_success(0.01, 3, "seed", MB, 0.01)
    s.on_success(1.0, reqs["a"], "a", MB, 1.0)
    got = s.next_requests(1.0)
    assert sorted(r.peer_id for r in got) == ["a", "seed"]


# ---------------------------------------------------------------------------- failures


def test_hash_failure_bans_until_expiry() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1)
    s = make(10, cfg)
    s.update_peer(peer("a"), None, 0.0)
    s.update_peer(peer("b"), None, 0.0)
    reqs = {r.peer_id: r for r in s.next_requests(0.0)}
    s.on_failure(1.0, reqs["a"].chunk, "a", FailureReason.HASH)
    assert s.stats()["bans"] == 1
    assert s.next_requests(1.0) == []  # b is busy, a banned
    t = 1.0
    b_req = reqs["b"]
    while t < 60.0:
        s.on_success(t + 1, b_req.chunk, "b", MB, 1.0)
        t += 1
        if s.complete:
            break
        (b_req,) = s.next_requests(t)
        assert b_req.peer_id == "b"
    s2 = make(10, cfg)
    s2.update_peer(peer("a"), None, 0.0)
    (r,) = s2.next_requests(0.0)
    s2.on_failure(1.0, r.chunk, "a", FailureReason.HASH)
    assert s2.next_deadline() == pytest.approx(61.0)
    assert s2.next_requests(60.9) == []
    assert [q.peer_id for q in s2.next_requests(61.0)] == ["a"]


def test_missing_clears_the_bit() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1)
    s = make(1, cfg)
    s.update_peer(peer("a"), Bitfield.full(1), 0.0)
    s.update_peer(peer("b"), None, 0.0)
    (r,) = s.next_requests(0.0)
    other = "b" if r.peer_id == "a" else "a"
    s.on_failure(0.1, 0, r.peer_id, FailureReason.MISSING)
    assert s.stats()["missing"] == 1
    (r2,) = s.next_requests(0.1)  # no rest for an honest "don't have"
    assert r2.peer_id == other
    s.on_failure(0.2, 0, other, FailureReason.ERROR)
    for t in (0.3, 1.5, 10.0):
        assert all(q.peer_id == other for q in s.next_requests(t))


def test_missing_survives_a_stale_announcement_for_a_while() -> None:
    cfg = replace(WIDE, failure_backoff=1.0)
    s = make(2, cfg)
    s.update_peer(peer("a"), None, 0.0)
    reqs = s.next_requests(0.0)
    for r in reqs:
        s.on_failure(0.1, r.chunk, "a", FailureReason.MISSING)
    s.update_peer(peer("a"), None, 0.5)  # the driver re-reads an old announcement
    assert s.next_requests(0.5) == []
    s.on_have("a", 1, 0.6)  # news: a now holds chunk 1
    assert [r.chunk for r in s.next_requests(0.6)] == [1]
    s.update_peer(peer("a"), None, 1.2)  # the quarantine is over: the claim counts again
    assert [r.chunk for r in s.next_requests(1.2)] == [0]


def test_stale_error_reports_are_not_counted_twice() -> None:
    s = make(1)
    s.update_peer(peer("a"), None, 0.0)
    (r,) = s.next_requests(0.0)
    assert s.expired(2.5) == [r]
    s.on_failure(2.6, 0, "a", FailureReason.ERROR)  # the transport gave up at the same deadline
    assert s.stats()["errors"] == 0
    assert s.next_deadline() == pytest.approx(3.5)  # one rest, not a doubled one


def test_missing_changes_rarity() -> None:
    s = make(2)
    s.update_peer(peer("a"), Bitfield.full(2), 0.0)
    s.update_peer(peer("b"), bits(2, {0, 1}), 0.0)
    s.update_peer(peer("c"), bits(2, {1}), 0.0)
    first = s.next_requests(0.0)
    assert [r.chunk for r in first] == [0, 1]  # 0 is rarer
    for r in first:
        s.on_failure(0.1, r.chunk, r.peer_id, FailureReason.BUSY, retry_after=0.0)
    s.on_failure(0.1, 1, "a", FailureReason.MISSING)
    s.on_failure(0.1, 1, "b", FailureReason.MISSING)
    assert [r.chunk for r in s.next_requests(0.2)] == [1, 0]  # 1 now held by c only


def test_errors_rest_the_peer_doubling_up_to_the_cap() -> None:
    cfg = replace(WIDE, failure_backoff=1.0, backoff_cap=5.0)
    s = make(1, cfg)
    s.update_peer(peer("a"), None, 0.0)
    t = 0.0
    rests = []
    for _ in range(5):
        assert len(s.next_requests(t)) == 1
        s.on_failure(t, 0, "a", FailureReason.ERROR)
        deadline = s.next_deadline()
        assert deadline is not None
        rests.append(deadline - t)
        assert s.next_requests(deadline - 0.01) == []
        t = deadline
    assert rests == pytest.approx([1.0, 2.0, 4.0, 5.0, 5.0])
    assert len(s.next_requests(t)) == 1
    s.on_success(t + 0.1, 0, "a", MB, 0.1)
    assert s.complete


def test_success_resets_the_doubling() -> None:
    s = make(3, replace(WIDE, max_inflight_per_peer=1))
    s.update_peer(peer("a"), None, 0.0)
    (r,) = s.next_requests(0.0)
    s.on_failure(0.0, r.chunk, "a", FailureReason.ERROR)
    (r,) = s.next_requests(1.0)
    s.on_success(1.5, r.chunk, "a", MB, 0.5)
    (r,) = s.next_requests(1.5)
    s.on_failure(1.5, r.chunk, "a", FailureReason.ERROR)
    assert s.next_deadline() == pytest.approx(2.5)


def test_deadline_scales_with_chunk_size() -> None:
    cfg = replace(WIDE, deadline_base=2.0, deadline_rate=2e6)
    s = ChunkScheduler([1 * MB, 8 * MB, 0], ME, cfg, random.Random(0))
    s.update_peer(peer("a"), None, 10.0)
    got = {r.chunk: r.deadline for r in s.next_requests(10.0)}
    assert got == {0: pytest.approx(12.5), 1: pytest.approx(16.0), 2: pytest.approx(12.0)}


def test_expired_requests_return_to_the_pool() -> None:
    s = make(1)
    s.update_peer(peer("a"), None, 0.0)
    s.update_peer(peer("b"), None, 0.0)
    (r,) = s.next_requests(0.0)
    assert s.expired(2.4) == []
    assert s.expired(2.5) == [r]
    assert s.inflight == 0
    assert s.stats()["timeouts"] == 1
    (r2,) = s.next_requests(2.5)
    assert r2.peer_id != r.peer_id  # the timed-out peer rests
    assert s.on_success(2.6, 0, r.peer_id, MB, 2.6) == [r2]  # a late answer still counts
    assert s.complete
    assert s.inflight == 0


def test_slow_peer_loses_to_a_fast_one_after_expiry() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1)
    s = make(6, cfg)
    s.update_peer(peer("slow", zone="z1", region="r1"), None, 0.0)  # same zone: preferred at first
    s.update_peer(peer("fast"), None, 0.0)
    reqs = {r.peer_id: r for r in s.next_requests(0.0)}
    assert set(reqs) == {"slow", "fast"}
    s.on_success(1.0, reqs["fast"].chunk, "fast", MB, 1.0)  # 1 MB/s
    (again,) = s.next_requests(1.0)
    assert again.peer_id == "fast"
    s.on_success(2.0, again.chunk, "fast", MB, 1.0)
    assert [r.peer_id for r in s.expired(2.5)] == ["slow"]
    (r,) = s.next_requests(2.5)  # slow is resting
    assert r.peer_id == "fast"
    s.on_success(3.0, r.chunk, "fast", MB, 0.5)
    got = s.next_requests(5.0)  # both free: slow is demoted behind every tier, fast wins
    assert [q.peer_id for q in got] == ["fast", "slow"]


def test_remove_peer_drops_its_requests() -> None:
    s = make(4, replace(WIDE, max_inflight_per_peer=2))
    s.update_peer(peer("a"), None, 0.0)
    reqs = s.next_requests(0.0)
    assert len(reqs) == 2
    assert sorted(s.remove_peer("a"), key=lambda r: r.chunk) == sorted(reqs, key=lambda r: r.chunk)
    assert s.remove_peer("a") == []
    assert s.inflight == 0
    assert s.next_requests(0.1) == []
    s.on_failure(0.2, reqs[0].chunk, "a", FailureReason.ERROR)  # stale report: tolerated
    s.update_peer(peer("b"), None, 0.3)
    assert len(s.next_requests(0.3)) == 2


# ---------------------------------------------------------------------------- endgame


def test_endgame_duplicates_and_cancel_list() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=3, endgame_remaining=3)
    s = make(3, cfg)
    s.update_peer(peer("a"), None, 0.0)
    s.update_peer(peer("b"), None, 0.0)
    reqs = s.next_requests(0.0)
    originals = [r for r in reqs if not r.duplicate]
    dups = [r for r in reqs if r.duplicate]
    assert sorted(r.chunk for r in originals) == [0, 1, 2]
    assert sorted(r.chunk for r in dups) == [0, 1, 2]
    by_chunk = {r.chunk: r.peer_id for r in originals}
    assert all(d.peer_id != by_chunk[d.chunk] for d in dups)
    assert s.inflight == 6
    assert s.next_requests(0.0) == []  # one duplicate per chunk
    d = dups[0]
    cancel = s.on_success(0.5, d.chunk, d.peer_id, MB, 0.5)
    assert cancel == [next(r for r in originals if r.chunk == d.chunk)]
    assert s.inflight == 4
    assert s.stats()["duplicates"] == 3 and s.stats()["cancelled"] == 1


def test_no_endgame_while_chunks_remain_or_above_threshold() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=2, endgame_remaining=3)
    s = make(4, cfg)
    s.update_peer(peer("a"), None, 0.0)
    s.update_peer(peer("b"), None, 0.0)
    assert not any(r.duplicate for r in s.next_requests(0.0))  # 4 left > 3
    s2 = make(3, replace(cfg, max_inflight_per_peer=1))
    s2.update_peer(peer("a"), None, 0.0)
    s2.update_peer(peer("b"), None, 0.0)
    assert not any(r.duplicate for r in s2.next_requests(0.0))  # one chunk still waits in the pool


def test_endgame_respects_caps_and_asks_the_seed_only_after_patience() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1, endgame_remaining=3)
    s = make(1, cfg)
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), None, 0.0)
    (r,) = s.next_requests(0.0)
    assert r.peer_id == "a"
    assert s.next_requests(0.5) == []
    assert s.next_deadline() == pytest.approx(1.0)
    (d,) = s.next_requests(1.0)
    assert (d.chunk, d.peer_id, d.duplicate) == (0, "seed", True)
    assert d.deadline == pytest.approx(3.5)
    assert s.on_success(1.2, 0, "seed", MB, 0.2) == [r]


# ---------------------------------------------------------------------------- API edges


def test_next_deadline_does_not_spin() -> None:
    cfg = replace(WIDE, max_inflight_per_peer=1, max_inflight_seed=1)
    s = make(5, cfg)
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), None, 0.0)
    s.next_requests(0.0)
    t = s.next_deadline()
    assert t == pytest.approx(1.0)
    s.next_requests(t)
    nxt = s.next_deadline()
    assert nxt is not None and nxt > t


def test_rejects_misuse() -> None:
    s = make(3)
    with pytest.raises(ValueError):
        s.update_peer(ME, None, 0.0)
    with pytest.raises(ValueError):
        s.update_peer(peer("a"), Bitfield(4), 0.0)
    with pytest.raises(ValueError, match="outside a version of 3"):
        s.update_peer(peer("a"), 0b1000, 0.0)  # an int naming chunk 3 of 0..2
    with pytest.raises(ValueError, match="outside a version of 3"):
        s.update_peer(peer("a"), -1, 0.0)  # "every chunk" is None, not an int
    with pytest.raises(ValueError):
        s.on_success(0.0, 3, "a", 1, 1.0)
    with pytest.raises(ValueError):
        s.on_failure(0.0, -1, "a", FailureReason.ERROR)
    with pytest.raises(ValueError):
        make(3, have=Bitfield(2))
    with pytest.raises(ValueError):
        ChunkScheduler([-1], ME, WIDE, random.Random(0))
    with pytest.raises(ValueError):
        SchedulerConfig(max_inflight=0)
    with pytest.raises(ValueError):
        SchedulerConfig(rate_alpha=0.0)
    with pytest.raises(ValueError):
        SchedulerConfig(deadline_rate=0.0)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.sets(st.integers(0, 11))), min_size=1, max_size=12))
def test_a_peer_given_as_an_int_is_the_same_as_its_bitfield(updates: list[tuple[str, set[int]]]) -> None:
    """``update_peer`` takes the chunks as a Bitfield or as its int (what the node passes); the
    scheduler keeps neither object (changing the Bitfield afterwards changes nothing)."""
    by_bitfield, by_int = make(12, seed=3), make(12, seed=3)
    for pid, held in updates:
        given_bits = bits(12, held)
        by_bitfield.update_peer(peer(pid), given_bits, 0.0)
        by_int.update_peer(peer(pid), given_bits.to_int(), 0.0)
        given_bits.set(11 - min(held, default=0))  # after the call: not seen
    assert [by_bitfield.holders(c) for c in range(12)] == [by_int.holders(c) for c in range(12)]
    assert by_bitfield.next_requests(1.0) == by_int.next_requests(1.0)
    last = {pid: held for pid, held in updates}
    assert [by_int.holders(c) for c in range(12)] == [sum(c in h for h in last.values()) for c in range(12)]


def test_empty_and_complete_downloads() -> None:
    s = ChunkScheduler([], ME, WIDE, random.Random(0))
    assert s.complete and s.next_requests(0.0) == [] and s.next_deadline() is None
    s = make(3, have=Bitfield.full(3))
    s.update_peer(SEED, None, 0.0)
    assert s.complete and s.next_requests(0.0) == []


def test_have_is_a_copy_and_stats_report_bytes() -> None:
    s = make(2)
    s.update_peer(peer("a"), None, 0.0)
    for r in s.next_requests(0.0):
        s.on_success(1.0, r.chunk, "a", 1234, 0.5)
    h = s.have
    h.clear(0)
    assert s.complete
    st_ = s.stats()
    assert st_["bytes:a"] == 2468 and st_["bytes"] == 2468 and st_["rate:a"] == pytest.approx(2468.0)


@given(st.integers(0, 2**32 - 1))
def test_simulation_invariants_and_liveness(seed: int) -> None:
    simulate(seed)


def test_simulation_many_fixed_seeds() -> None:
    for seed in range(40):
        simulate(seed)


def test_large_download_completes() -> None:
    """2,000 chunks from 20 peers and a seed: a guard against per-call costs growing with the pool."""
    n, rng = 2000, random.Random(5)
    s = ChunkScheduler([MB] * n, ME, SchedulerConfig(), random.Random(6))
    s.update_peer(SEED, None, 0.0)
    for i in range(20):
        held = {c for c in range(n) if rng.random() < 0.5}
        s.update_peer(peer(f"p{i}", zone=rng.choice(["z1", "z2"])), bits(n, held), 0.0)
    events: list[tuple[float, int, Request]] = []
    now, k = 0.0, 0
    while not s.complete:
        for r in s.next_requests(now):
            k += 1
            heapq.heappush(events, (now + rng.uniform(0.01, 0.1), k, r))
        wake = [t for t in (events[0][0] if events else None, s.next_deadline()) if t is not None]
        now = min(wake)
        while events and events[0][0] <= now:
            _, _, r = heapq.heappop(events)
            for c in s.on_success(now, r.chunk, r.peer_id, MB, 0.05):
                events = [e for e in events if e[2] is not c]
                heapq.heapify(events)
        s.expired(now)
    stats = s.stats()
    assert stats["successes"] == n
    assert stats["seed_requests"] < n / 10  # the seed is a last resort


def test_same_seed_same_requests() -> None:
    a, b = simulate(7).log, simulate(7).log
    assert a == b and a
    assert simulate(8).log != a


def test_determinism_does_not_depend_on_string_hashing() -> None:
    code = (
        "import hashlib, sys; sys.path.insert(0, '.');"
        "from tests.support.scheduler_sim import simulate;"
        "print(hashlib.sha256(repr([simulate(s).log for s in range(5)]).encode()).hexdigest())"
    )
    root = Path(__file__).resolve().parents[3]
    digests = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        digests.add(res.stdout.strip())
    assert len(digests) == 1
    here = hashlib.sha256(repr([simulate(s).log for s in range(5)]).encode()).hexdigest()
    assert digests == {here}


# ---------------------------------------------------------------------------- remote budget


def regional(
    max_inflight: int = 2, remote: int = 5, per_peer: int = 1, per_far_peer: int | None = None
) -> SchedulerConfig:
    return replace(
        WIDE,
        max_inflight=max_inflight,
        max_inflight_remote=remote,
        max_inflight_per_peer=per_peer,
        max_inflight_per_remote_peer=per_peer if per_far_peer is None else per_far_peer,
        seed_patience=1.0,
    )


def test_requests_to_other_regions_have_their_own_budget() -> None:
    s = make(40, regional(max_inflight=2, remote=5))
    for i in range(10):
        s.update_peer(peer(f"near{i}", zone="z1", region="r1"), None, 0.0)
        s.update_peer(peer(f"far{i}", region="r2"), None, 0.0)
    s.update_peer(peer("nowhere", region=""), None, 0.0)  # region unknown: local
    out = s.next_requests(0.0)
    far = [r for r in out if r.peer_id.startswith("far")]
    assert len(out) == 7 and len(far) == 5 and s.full and s.stats()["inflight_remote"] == 5
    assert s.next_requests(0.1) == []
    # A remote reply frees a remote place only: the next request goes to another region again.
    r = far[0]
    s.on_success(0.2, r.chunk, r.peer_id, MB, 0.1)
    (nxt,) = s.next_requests(0.2)
    assert nxt.peer_id.startswith("far")
    # One budget when max_inflight_remote is 0.
    shared = make(40, regional(max_inflight=2, remote=0))
    for i in range(10):
        shared.update_peer(peer(f"far{i}", region="r2"), None, 0.0)
    assert len(shared.next_requests(0.0)) == 2 and shared.stats()["inflight_remote"] == 0


def test_a_peer_in_another_region_takes_its_own_per_peer_cap() -> None:
    # One near and one far holder of everything; budgets wide enough that only per-peer caps bind.
    s = make(40, regional(max_inflight=10, remote=10, per_peer=1, per_far_peer=3))
    s.update_peer(peer("near", zone="z1", region="r1"), None, 0.0)
    s.update_peer(peer("far", region="r2"), None, 0.0)
    s.update_peer(peer("nowhere", region=""), None, 0.0)  # region unknown: local, the near cap
    out = Counter(r.peer_id for r in s.next_requests(0.0))
    assert out == {"near": 1, "far": 3, "nowhere": 1}
    # With one budget (max_inflight_remote = 0) no peer counts as remote: the near cap for all.
    shared = make(40, replace(regional(max_inflight=10, remote=0, per_peer=1, per_far_peer=3)))
    shared.update_peer(peer("far", region="r2"), None, 0.0)
    assert [r.peer_id for r in shared.next_requests(0.0)] == ["far"]


def test_holders_left_out_by_the_nodes_own_remote_budget_do_not_send_chunks_to_the_seed() -> None:
    s = make(10, regional(max_inflight=4, remote=2, per_peer=1))
    s.update_peer(SEED, None, 0.0)  # region unknown: counted as local
    s.update_peer(peer("far0", region="r2"), None, 0.0)
    s.update_peer(peer("far1", region="r2"), None, 0.0)
    s.update_peer(peer("far2", region="r2"), None, 0.0)
    first = s.next_requests(0.0)
    assert len(first) == 2 and all(r.peer_id.startswith("far") for r in first)
    # Long past seed patience, every other chunk is held by a third peer in r2, free but for this
    # node's spent remote budget: the chunks wait for the remote requests, the seed is not asked.
    assert s.next_requests(5.0) == []
    assert s.stats()["seed_requests"] == 0
    # Contrast: when the holders themselves are busy (at their per-peer cap), patience sends the seed.
    busy = make(10, regional(max_inflight=4, remote=8, per_peer=1))
    busy.update_peer(SEED, None, 0.0)
    busy.update_peer(peer("far0", region="r2"), None, 0.0)
    assert [r.peer_id for r in busy.next_requests(0.0)] == ["far0"]
    late = busy.next_requests(5.0)
    assert late and all(r.peer_id == "seed" for r in late)


def test_a_peer_moving_region_mid_request_keeps_the_budgets_straight() -> None:
    s = make(10, regional(max_inflight=1, remote=1, per_peer=2))
    s.update_peer(peer("a", region="r2"), None, 0.0)
    (r,) = s.next_requests(0.0)
    s.update_peer(peer("a", zone="z1", region="r1"), None, 0.1)  # now local; its request was counted remote
    assert s.stats()["inflight_remote"] == 1
    (local,) = s.next_requests(0.1)  # the local budget is untouched
    assert local.peer_id == "a" and s.full
    s.on_success(0.2, r.chunk, "a", MB, 0.2)
    assert s.stats()["inflight_remote"] == 0 and s.inflight == 1


def test_with_no_peer_in_another_region_the_node_is_full_when_its_one_budget_is() -> None:
    """The remote budget is room only while some known peer is remote: a node of one region is full
    (its download loop sleeps through news, ``next_requests`` returns at once) as without it."""
    s = make(40, regional(max_inflight=3, remote=16))
    for i in range(10):
        s.update_peer(peer(f"near{i}", zone="z1", region="r1"), None, 0.0)
    assert len(s.next_requests(0.0)) == 3 and s.full
    s.update_peer(peer("far", region="r2"), None, 0.1)
    assert not s.full
    assert [r.peer_id for r in s.next_requests(0.1)] == ["far"]
    s.remove_peer("far")
    assert s.full


def test_an_active_set_keeps_the_peers_heard_from_last() -> None:
    """``max_peers`` = 2: a third non-seed peer pushes out the one heard from longest ago, unless it
    has a request in flight, rests after a refusal or is banned (forgetting it would cut the rest or
    ban short); a refresh counts as hearing from it; seeds do not count."""
    s = make(4, replace(WIDE, max_peers=2))
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("a"), bits(4, {0}), 0.0)
    s.update_peer(peer("b"), bits(4, {1}), 0.0)
    s.update_peer(peer("a"), bits(4, {0, 2}), 0.1)  # a refresh: b is now the stalest
    s.update_peer(peer("c"), bits(4, {3}), 0.2)
    known = {k.split(":", 1)[1] for k in s.stats() if k.startswith("bytes:")}
    assert known == {"seed", "a", "c"}
    issued = s.next_requests(0.3)
    to_a = [r for r in issued if r.peer_id == "a"]
    assert to_a and any(r.peer_id == "c" for r in issued)  # a has requests in flight
    s.on_failure(0.3, 3, "c", FailureReason.BUSY, retry_after=5.0)  # c's is refused: c rests
    s.update_peer(peer("d"), bits(4, {1}), 0.4)
    known = {k.split(":", 1)[1] for k in s.stats() if k.startswith("bytes:")}
    assert known == {"seed", "a", "c", "d"}  # nobody could go: over the cap for now
    for r in to_a:
        s.on_success(0.5, r.chunk, "a", MB, 0.1)
    s.update_peer(peer("e"), bits(4, {1}), 6.0)  # a is free again and c's rest is over: a, the stalest, goes
    known = {k.split(":", 1)[1] for k in s.stats() if k.startswith("bytes:")}
    assert known == {"seed", "c", "d", "e"}


def test_without_an_active_set_every_peer_stays() -> None:
    s = make(4, replace(WIDE, max_peers=0))
    for i in range(50):
        s.update_peer(peer(f"p{i}"), bits(4, {i % 4}), float(i))
    assert sum(k.startswith("bytes:") for k in s.stats()) == 50


@given(st.integers(min_value=0, max_value=(1 << 300) - 1))
def test_indices_lists_the_set_bits_in_order(bits: int) -> None:
    """Both ways ``_indices`` takes (a few bits, many) agree with the plain definition."""
    assert _indices(bits) == [i for i in range(bits.bit_length()) if bits >> i & 1]
    dense = bits | ((1 << 64) - 1)  # at least 64 bits set: the string scan
    assert _indices(dense) == [i for i in range(dense.bit_length()) if dense >> i & 1]


@pytest.mark.parametrize("max_peers", [0, 64])
def test_rounds_skip_peers_holding_nothing_missing_and_keep_the_peers_order(max_peers: int) -> None:
    """A round leaves out the peers that hold only chunks this node has (and takes them back when
    they announce one it lacks), and lists the free peers in the order they were heard from."""
    s = make(4, replace(WIDE, max_peers=max_peers), have=bits(4, {0}))
    for pid in "abc":
        s.update_peer(peer(pid), bits(4, {0}), 0.0)  # only what this node has
    assert s.next_requests(0.0) == [] and not s._live  # that round found them holding nothing missing
    s.on_have("c", 1, 0.1)
    s.on_have("a", 2, 0.1)
    s.on_have("b", 3, 0.1)
    assert [p.info.peer_id for p in s._round(0.1, -1).free] == ["a", "b", "c"]
    s.update_peer(peer("a"), bits(4, {0, 2}), 0.2)  # a refresh: with an active set, "a" was heard from last
    assert [p.info.peer_id for p in s._round(0.2, -1).free] == (["b", "c", "a"] if max_peers else ["a", "b", "c"])
    assert sorted(r.chunk for r in s.next_requests(0.2)) == [1, 2, 3]
