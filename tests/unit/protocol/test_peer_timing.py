"""Per-peer request deadlines (protocol/peer_timing.py) and how the chunk scheduler uses them."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from patchswarm.protocol.peer_timing import PeerTiming
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.scheduler_types import FailureReason, PeerInfo, SchedulerConfig
from tests.support.scheduler_sim import MB, ME, bits

CFG = SchedulerConfig(random_first=0, endgame_remaining=0, max_inflight_remote=0)
FIXED = CFG.deadline_base + MB / CFG.deadline_rate  # a never-measured peer's deadline (2.5 s)


def test_round_trip_follows_rfc6298() -> None:
    t = PeerTiming()
    t.answer(0.2)  # first sample: SRTT = R, RTTVAR = R / 2
    assert (t.srtt, t.rttvar) == (pytest.approx(0.2), pytest.approx(0.1))
    t.answer(0.6)  # RTTVAR = 3/4 RTTVAR + 1/4 |SRTT - R|, then SRTT = 7/8 SRTT + 1/8 R
    assert t.rttvar == pytest.approx(0.75 * 0.1 + 0.25 * 0.4)
    assert t.srtt == pytest.approx(0.875 * 0.2 + 0.125 * 0.6)


def test_timeout_is_slack_times_prediction_plus_deviations_within_bounds() -> None:
    t = PeerTiming()
    assert t.timeout(1.0, 2.0, 0.5, 30.0) == pytest.approx(2.0)  # nothing but the prediction yet
    t.transfer(3.0, None)  # no prediction: no deviation sample
    assert t.dev is None
    t.transfer(3.0, 1.0)
    t.transfer(1.0, 1.0)  # dev = 3/4 x 2 + 1/4 x 0
    assert t.dev == pytest.approx(1.5)
    t.answer(0.1)
    assert t.timeout(1.0, 2.0, 0.5, 30.0) == pytest.approx(2.0 + 4 * 1.5 + 0.1 + 4 * 0.05)
    assert t.timeout(1.0, 2.0, 0.5, 3.0) == 3.0  # the cap
    assert PeerTiming().timeout(0.01, 2.0, 0.5, 3.0) == 0.5  # the floor


def _one_peer(cfg: SchedulerConfig) -> ChunkScheduler:
    s = ChunkScheduler([MB] * 8, ME, cfg, random.Random(0))
    s.update_peer(PeerInfo("far", region="r9"), bits(8, range(8)), 0.0)
    return s


def _run(cfg: SchedulerConfig, transfer: float, until: float = 60.0) -> tuple[int, int]:
    """One peer that delivers every chunk in ``transfer`` seconds; (successes, timeouts) by ``until``."""
    s = _one_peer(cfg)
    now = 0.0
    ends: dict[tuple[int, str], float] = {}
    starts: dict[tuple[int, str], float] = {}
    while now < until and not s.complete:
        for r in s.expired(now):
            ends.pop((r.chunk, r.peer_id), None)
        for r in s.next_requests(now):
            ends[(r.chunk, r.peer_id)] = now + transfer
            starts[(r.chunk, r.peer_id)] = now
        for key, end in sorted(ends.items(), key=lambda kv: kv[1]):
            if end <= now:
                del ends[key]
                s.on_success(now, key[0], key[1], MB, now - starts[key])
        now += 0.01
    stats = s.stats()
    return int(stats["successes"]), int(stats["timeouts"])


def test_a_slow_peer_gets_a_deadline_of_its_own() -> None:
    """A peer that takes 3 s per chunk (a cross-region flow in slow start): with the fixed 2.5 s deadline
    every request times out and nothing ever arrives; measured, the first timeout's rate sets a
    deadline it meets, and every chunk arrives."""
    got, timeouts = _run(replace(CFG, deadline_slack=0.0), 3.0)
    assert got == 0 and timeouts > 5
    got, timeouts = _run(CFG, 3.0)
    assert got == 8
    assert timeouts == 1  # only the first, before anything was measured


def test_a_fast_peer_keeps_the_floor() -> None:
    s = _one_peer(CFG)
    (r,) = s.next_requests(0.0)
    assert r.deadline == pytest.approx(FIXED)  # never measured: the fixed deadline
    s.on_success(0.1, r.chunk, "far", MB, 0.1)  # 10 MB/s
    (r2,) = s.next_requests(0.1)
    assert r2.deadline == pytest.approx(0.1 + FIXED)  # 2 x 0.1 s: never shorter than the fixed deadline


def test_busy_answers_lengthen_the_deadline_by_the_round_trip() -> None:
    s = _one_peer(replace(CFG, deadline_base=0.0, deadline_rate=1e12))  # (a floor of ~0)
    (r,) = s.next_requests(0.0)
    s.on_success(1.0, r.chunk, "far", MB, 1.0)  # 1 MiB/s: 1 s predicted, 2 s allowed
    (r2,) = s.next_requests(1.0)
    assert r2.deadline == pytest.approx(1.0 + 2.0)
    s.on_failure(1.3, r2.chunk, "far", FailureReason.BUSY, retry_after=0.0, elapsed=0.3)
    (r3,) = s.next_requests(1.3)
    assert r3.deadline == pytest.approx(1.3 + 2.0 + 0.3 + 4 * 0.15)


def test_config_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(deadline_max=-1.0)
    with pytest.raises(ValueError):
        SchedulerConfig(deadline_slack=-1.0)
