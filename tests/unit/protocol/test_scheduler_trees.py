"""ChunkScheduler with stripe trees (``set_parents``): a chunk goes to its stripe's parent, and
leaves it only when the parent is gone, banned, or has lagged ``tree_patience`` behind others."""

from __future__ import annotations

import random

import pytest

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.scheduler_types import FailureReason, PeerInfo, SchedulerConfig

ME = PeerInfo("me", region="r1")
SEED = PeerInfo("seed", region="r1", is_seed=True)
CFG = SchedulerConfig(random_first=0, endgame_remaining=0, tree_patience=0.1, seed_patience=1.0)


def bits(n: int, held: set[int] | range) -> Bitfield:
    bf = Bitfield(n)
    for i in held:
        bf.set(i)
    return bf


def peer(pid: str) -> PeerInfo:
    return PeerInfo(pid, region="r1")


def make(n: int, parents: tuple[str | None, ...], config: SchedulerConfig = CFG) -> ChunkScheduler:
    s = ChunkScheduler([1000] * n, ME, config, random.Random(0))
    s.set_parents(parents)
    return s


def asked(s: ChunkScheduler, now: float) -> set[tuple[int, str]]:
    return {(r.chunk, r.peer_id) for r in s.next_requests(now)}


def test_a_chunk_goes_to_its_stripes_parent_though_others_hold_it_and_are_idle() -> None:
    s = make(4, ("pa", "pb"))  # stripe 0 (chunks 0, 2) from pa, stripe 1 (1, 3) from pb
    s.update_peer(peer("pa"), bits(4, {0, 1}), 0.0)
    s.update_peer(peer("pb"), bits(4, {1, 2}), 0.0)
    s.update_peer(peer("x"), bits(4, range(4)), 0.0)
    assert asked(s, 0.0) == {(0, "pa"), (1, "pb")}  # 2 and 3: their parents lack them, x must wait


def test_a_lagging_parent_is_left_after_tree_patience() -> None:
    s = make(2, ("pa", "pb"))
    s.update_peer(peer("pa"), bits(2, set()), 0.0)
    s.update_peer(peer("pb"), bits(2, set()), 0.0)
    s.update_peer(peer("x"), bits(2, {0}), 0.5)  # chunk 0's first holder appears at 0.5
    assert asked(s, 0.5) == set()
    assert s.next_deadline() == pytest.approx(0.6)  # the driver wakes when patience runs out
    assert asked(s, 0.59) == set()
    assert asked(s, 0.6) == {(0, "x")}


def test_a_parent_that_holds_the_chunk_is_waited_for_while_busy() -> None:
    s = make(4, ("pa", "pb"), SchedulerConfig(random_first=0, endgame_remaining=0, max_inflight_per_parent=1))
    s.update_peer(peer("pa"), bits(4, {0, 2}), 0.0)
    s.update_peer(peer("x"), bits(4, range(4)), 0.0)
    ((first, who),) = asked(s, 0.0)  # one at a time at pa here; the other waits for pa, not for x
    assert who == "pa" and first in (0, 2)
    assert asked(s, 0.05) == set()  # (1 and 3 wait for pb, which has not been heard from, within patience)
    s.on_success(0.06, first, "pa", 1000, 0.05)
    assert asked(s, 0.06) == {(2 - first, "pa")}
    assert s.next_requests(5.0) and all(r.peer_id == "x" for r in s.inflight_requests() if r.chunk % 2)


def test_a_root_asks_the_seed_at_once_and_keeps_max_inflight_per_parent_there() -> None:
    s = make(6, (None, "pb"))
    s.update_peer(SEED, None, 0.0)
    s.update_peer(peer("pb"), bits(6, set()), 0.0)
    got = asked(s, 0.0)
    # Stripe 0 (0, 2, 4) comes from the seed without seed_patience, two at a time; stripe 1 waits for pb.
    assert len(got) == 2 and {p for _, p in got} == {"seed"} and {c % 2 for c, _ in got} == {0}


def test_a_gone_or_banned_parent_hands_its_stripe_to_the_usual_rules() -> None:
    s = make(2, ("pa", "pb"))
    s.update_peer(peer("pa"), bits(2, {0}), 0.0)
    s.update_peer(peer("pb"), bits(2, set()), 0.0)
    s.update_peer(peer("x"), bits(2, {0, 1}), 0.0)
    assert asked(s, 0.0) == {(0, "pa")}
    s.on_failure(0.01, 0, "pa", FailureReason.HASH)  # banned: chunk 0 may go elsewhere
    s.remove_peer("pb")
    s.orphan("pb")  # gone for good: stripe 1 follows the usual rules
    assert asked(s, 0.02) == {(1, "x")}  # the rarer first; x takes one request at a time
    s.on_success(0.03, 1, "x", 1000, 0.01)
    assert asked(s, 0.03) == {(0, "x")}


def test_the_budget_covers_every_parent() -> None:
    # 4 stripes x 2 per parent = 8 requests, above max_inflight 6: a root's seed requests must not
    # crowd out its other stripes.
    s = make(16, ("a", "b", "c", "d"), SchedulerConfig(random_first=0, endgame_remaining=0, max_inflight=6))
    for p in "abcd":
        s.update_peer(peer(p), bits(16, range(16)), 0.0)
    got = asked(s, 0.0)
    assert len(got) == 8
    assert all(ord(p) - ord("a") == c % 4 for c, p in got)


def test_parents_are_checked_and_can_be_turned_off() -> None:
    s = make(2, ())
    with pytest.raises(ValueError, match="own parent"):
        s.set_parents(("me", None))
    s.set_parents(("pa", "pb"))
    s.set_parents(())  # off again: the usual rules
    s.update_peer(peer("x"), bits(2, {0, 1}), 0.0)
    assert asked(s, 0.0) == {(0, "x")} or asked(s, 0.0) == {(1, "x")}
