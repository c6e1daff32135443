"""TokenBucket (pure rate bookkeeping) and UploadSlots."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.ratelimit import TokenBucket, UploadSlots

rates = st.floats(1.0, 1e9)
bursts = st.floats(0.0, 1e8)
steps = st.lists(st.tuples(st.floats(0.0, 10.0), st.integers(0, 50_000_000)), min_size=1, max_size=60)


def _run(rate: float, burst: float, t0: float, plan: list[tuple[float, int]]) -> list[tuple[float, float, int]]:
    """(now, send time, bytes) of each reservation, ``now`` advancing by the plan's gaps."""
    bucket = TokenBucket(rate, burst)
    now = t0
    out = []
    for gap, n in plan:
        now += gap
        out.append((now, bucket.reserve(now, n), n))
    return out


@given(rates, bursts, st.floats(-1e3, 1e3), steps)
def test_long_run_throughput_never_exceeds_rate_times_t_plus_burst(
    rate: float, burst: float, t0: float, plan: list[tuple[float, int]]
) -> None:
    log = _run(rate, burst, t0, plan)
    start = log[0][0]
    for _, horizon, _ in log:  # the worst horizons are the send times themselves
        sent = sum(n for _, at, n in log if at <= horizon)
        allowed = rate * (horizon - start) + burst
        # Times are floats: a few ulps of the clock are rate * ulp bytes (~1e-5 at 1 GB/s and t=1000).
        slack = 8 * rate * math.ulp(max(abs(horizon), abs(start), 1.0)) + 1e-9 * sent
        assert sent <= allowed + slack


@given(rates, bursts, st.floats(-1e3, 1e3), steps)
def test_reservations_are_monotone_and_never_in_the_past(
    rate: float, burst: float, t0: float, plan: list[tuple[float, int]]
) -> None:
    log = _run(rate, burst, t0, plan)
    assert all(at >= now for now, at, _ in log)
    times = [at for _, at, _ in log]
    assert times == sorted(times)


@given(rates, st.floats(1.0, 1e8), st.integers(1, 10**9))
def test_full_bucket_sends_a_burst_at_once_then_waits(rate: float, burst: float, n: int) -> None:
    bucket = TokenBucket(rate, burst)
    assert bucket.available(5.0) == burst
    at = bucket.reserve(5.0, n)
    if n <= burst:
        assert at == 5.0
    else:
        assert at == pytest.approx(5.0 + (n - burst) / rate, rel=1e-9)


def test_debt_queues_later_reservations() -> None:
    bucket = TokenBucket(rate=100.0, burst=100.0)
    assert bucket.reserve(0.0, 100) == 0.0
    assert bucket.available(0.0) == pytest.approx(0.0)
    assert bucket.reserve(0.0, 50) == pytest.approx(0.5)
    assert bucket.reserve(0.0, 50) == pytest.approx(1.0)
    assert bucket.available(0.0) == pytest.approx(-100.0)
    assert bucket.available(2.0) == pytest.approx(100.0)  # refills, capped at the burst
    assert bucket.available(100.0) == pytest.approx(100.0)
    assert bucket.reserve(10.0, 100) == 10.0


def test_time_going_backwards_never_returns_an_earlier_slot() -> None:
    bucket = TokenBucket(rate=10.0, burst=0.0)
    first = bucket.reserve(5.0, 10)
    assert first == pytest.approx(6.0)
    assert bucket.reserve(1.0, 10) == pytest.approx(7.0)


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 0.0), (-1.0, 5.0), (math.inf, 0.0), (10.0, math.inf)])
def test_unlimited(rate: float, burst: float) -> None:
    bucket = TokenBucket(rate, burst)
    assert bucket.unlimited
    assert bucket.reserve(3.0, 10**12) == 3.0
    assert bucket.reserve(3.0, 10**12) == 3.0
    assert bucket.available(3.0) == math.inf


@pytest.mark.parametrize(("rate", "burst"), [(math.nan, 1.0), (1.0, math.nan), (1.0, -1.0)])
def test_rejects_bad_parameters(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)


def test_rejects_negative_reservation() -> None:
    with pytest.raises(ValueError):
        TokenBucket(1.0, 1.0).reserve(0.0, -1)


def test_upload_slots() -> None:
    slots = UploadSlots(2)
    assert slots.acquire() and slots.acquire()
    assert not slots.acquire()
    assert slots.in_use == 2 and slots.free == 0
    slots.release()
    assert slots.free == 1
    assert slots.acquire()
    slots.release()
    slots.release()
    with pytest.raises(ValueError):
        slots.release()
    assert not UploadSlots(0).acquire()
    with pytest.raises(ValueError):
        UploadSlots(-1)
