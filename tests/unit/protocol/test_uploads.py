"""The upload rules (protocol/uploads.py), driven without asyncio: slots and the line, a seed's line
for requesters it is not serving yet, shares per requester, and when a refused requester returns."""

from __future__ import annotations

import math
import random

import pytest

from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.seeding import SeedPolicy
from patchswarm.protocol.uploads import UploadPolicy


def _policy(**cfg: object) -> UploadPolicy:
    config = NodeConfig("n", "run", b"k" * 32, **cfg)  # type: ignore[arg-type]
    return UploadPolicy(config, SeedPolicy(config, {}, lambda mid: [], random.Random(0)))


def test_slots_and_shares_follow_the_config() -> None:
    node = _policy(max_uploads=4)
    assert node.slots.capacity == 4 and node.requesters.per_requester == 3  # all slots but one
    seed = _policy(is_seed=True, seed_max_uploads=6, tree_fanout=4)
    assert seed.slots.capacity == max(6, 4 * seed.config.scheduler.max_inflight_per_parent)


def test_a_request_is_taken_while_a_slot_is_free_or_the_line_has_room() -> None:
    node = _policy(max_uploads=1, upload_queue=2)
    assert node.may_serve("a", waiting=0)
    assert node.slots.acquire()
    assert node.may_serve("a", waiting=1)
    assert not node.may_serve("a", waiting=2)


def test_a_seed_line_is_for_requesters_it_is_not_serving() -> None:
    seed = _policy(is_seed=True, seed_max_uploads=1, seed_upload_queue=4)
    assert seed.slots.acquire()
    seed.seed_begin("b")
    assert not seed.may_serve("b", waiting=0) and seed.may_serve("c", waiting=0)
    seed.seed_begin("b")
    seed.seed_end("b")
    seed.seed_end("b")
    assert seed.seed_uploading == {} and seed.may_serve("b", waiting=0)


def test_with_trees_a_requester_with_a_transfer_under_way_follows_it() -> None:
    node = _policy(tree_fanout=2)
    assert node.tracks("x") and not node.follows("x")
    node.sending_begin("x")
    assert node.follows("x")
    node.sending_end("x")
    assert not node.follows("x") and node.sending_to == {}
    assert not _policy(tree_fanout=2, is_seed=True).tracks("x")


def test_a_resting_or_capped_requester_is_told_when_to_return() -> None:
    node = _policy(max_uploads=2, upload_stall_rest=30.0)
    assert node.requester_retry("ip", capped=True, now=0.0, waiting=0) is None
    node.requesters.begin("ip")  # one of 2 - 1 = 1 allowed
    assert node.requester_retry("ip", capped=True, now=0.0, waiting=0) == node.config.busy_retry_after
    assert node.requester_retry("ip", capped=False, now=0.0, waiting=0) is None
    node.requesters.end("ip")
    node.requesters.stalled("ip", 0.0)
    assert node.requester_retry("ip", capped=False, now=10.0, waiting=0) == pytest.approx(20.0)


def test_an_unpaced_uplink_sends_requesters_back_after_half_the_line() -> None:
    node = _policy(max_uploads=6, busy_retry_after=0.02)
    assert node.busy_retry_after(0.0, waiting=0) == 0.02  # nothing timed yet
    node.sent(0.012)
    assert node.upload_seconds == 0.012
    assert node.busy_retry_after(0.0, waiting=0) == pytest.approx(0.001)
    assert node.busy_retry_after(0.0, waiting=3) == pytest.approx(0.004)
    node.sent(0.022)
    assert node.upload_seconds == pytest.approx(0.7 * 0.012 + 0.3 * 0.022)


def test_a_paced_uplink_counts_its_backlog() -> None:
    node = _policy(upload_rate=1e6, busy_retry_after=10.0)
    assert math.isfinite(node.config.upload_rate)
    node.sending(100_000)  # 0.1 s per upload at 1 MB/s
    node.bucket.reserve(0.0, 1_000_000)  # a second booked (less the burst)
    back = node.busy_retry_after(0.0, waiting=2)
    assert back == pytest.approx((0.9 + 2 * 0.1) / 2)


def test_a_seed_books_the_returns_of_those_it_refuses() -> None:
    seed = _policy(is_seed=True, seed_max_uploads=6, busy_retry_after=0.02)
    seed.sent(0.012)
    assert [seed.busy_retry_after(0.0, 0) for _ in range(3)] == pytest.approx([0.001, 0.002, 0.003])
