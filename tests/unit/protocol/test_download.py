"""What downloads know of their peers (protocol/download.py), driven without asyncio: announcements
and hints reach the scheduler once per change, a stuck end asks the seeds again, trees are planted
only over a settled member list, and the retry backoff."""

from __future__ import annotations

import random

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.download import Downloads, retry_delay
from patchswarm.protocol.membership_messages import MemberState, NodeInfo
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.peers import LiveMembers, PeerView
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.scheduler_types import FailureReason, PeerInfo
from patchswarm.protocol.wire import Announcement

RUN = "run"
MID = b"m" * 32
ME = NodeInfo("me", "sim://me")


def _downloads(**cfg: object) -> tuple[Downloads, NodeConfig]:
    config = NodeConfig("me", RUN, b"k" * 32, **cfg)  # type: ignore[arg-type]
    return Downloads(config, ME, {}, LiveMembers()), config


def _sched(config: NodeConfig, n: int) -> ChunkScheduler:
    return ChunkScheduler([100] * n, PeerInfo("me"), config.scheduler, random.Random(0))


def _ann(chunks: list[int], n: int, *, seed: bool = False) -> Announcement:
    bits = Bitfield(n)
    for c in chunks:
        bits.set(c)
    return Announcement(RUN, 1, -1, partial=((MID, bits.to_bytes()),), seed=seed)


def test_an_announcement_reaches_the_scheduler_once() -> None:
    downloads, config = _downloads()
    sched = _sched(config, 4)
    downloads.start(MID, sched, 0.0)
    assert downloads.partial[MID] is sched
    downloads.heard(NodeInfo("p", "sim://p"), _ann([1], 4), 0.0)
    downloads.refresh(sched, MID, 4, 0.0)
    assert sched.holders(1) == 1 and sched.holders(0) == 0
    assert downloads.dirty[MID] == {}  # looked at: nothing left to refresh
    downloads.finish(MID)
    assert MID not in downloads.partial and MID not in downloads.dirty


def test_a_refusal_naming_holders_is_a_hint_until_they_deny_it() -> None:
    downloads, config = _downloads()
    sched = _sched(config, 4)
    downloads.start(MID, sched, 0.0)
    downloads.heard(NodeInfo("p", "sim://p"), Announcement(RUN, 1, -1), 0.0)
    downloads.refresh(sched, MID, 4, 0.0)
    assert not downloads.take_hints(MID, 2, (), missing=4, now=0.0)
    assert downloads.take_hints(MID, 2, ("p", "me"), missing=4, now=0.0)
    assert downloads.hints[MID] == {"p": {2}}  # (never this node itself)
    downloads.refresh(sched, MID, 4, 0.0)
    assert sched.holders(2) == 1
    downloads.missing_at(MID, "p", 2)
    assert downloads.hints[MID] == {"p": set()} and "p" in downloads.dirty[MID]


def test_near_the_end_a_hinted_live_member_is_asked_though_it_never_announced() -> None:
    downloads, config = _downloads()
    downloads.live.track(NodeInfo("q", "sim://q"), MemberState.ALIVE, 0.0)
    downloads.start(MID, _sched(config, 4), 0.0)
    downloads.take_hints(MID, 0, ("q",), missing=config.scheduler.endgame_remaining + 1, now=0.0)
    assert "q" not in downloads.peers
    downloads.take_hints(MID, 0, ("q",), missing=config.scheduler.endgame_remaining, now=0.0)
    assert downloads.peers["q"].info.addr == "sim://q"


def test_a_member_gone_leaves_the_peers_and_the_schedulers() -> None:
    downloads, config = _downloads()
    sched = _sched(config, 2)
    downloads.start(MID, sched, 0.0)
    downloads.heard(NodeInfo("p", "sim://p"), _ann([0, 1], 2), 0.0)
    downloads.refresh(sched, MID, 2, 0.0)
    downloads.gone("p")
    assert "p" not in downloads.peers and sched.holders(0) == 0


def test_a_stuck_end_asks_the_seeds_again_at_most_every_busy_retry_after() -> None:
    downloads, config = _downloads(busy_retry_after=0.2)
    downloads.peers["seed"] = PeerView(NodeInfo("seed", "sim://seed"), Announcement(RUN, 1, 1, seed=True), 0.0)
    sched = _sched(config, 3)
    sched.update_peer(PeerInfo("seed", is_seed=True), None, 0.0)
    for r in sched.next_requests(0.0):
        sched.on_failure(0.01, r.chunk, "seed", FailureReason.MISSING)  # withheld
    assert sched.next_requests(0.02) == []  # stuck
    asked: dict[int, float] = {}
    assert downloads.ask_seeds_again(sched, 3, asked, 0.02)
    again = sched.next_requests(0.02)
    assert sorted(r.chunk for r in again) == [0, 1, 2]
    for r in again:
        sched.on_failure(0.03, r.chunk, "seed", FailureReason.MISSING)
    assert not downloads.ask_seeds_again(sched, 3, asked, 0.1)
    assert downloads.ask_seeds_again(sched, 3, asked, 0.25)
    many = _sched(config, config.scheduler.endgame_remaining + 1)
    assert not downloads.ask_seeds_again(many, config.scheduler.endgame_remaining + 1, {}, 0.0)


def test_trees_are_planted_only_once_the_member_list_has_settled() -> None:
    downloads, config = _downloads(tree_fanout=2, tree_settle=1.0)
    for x in "abcde":
        downloads.live.track(NodeInfo(x, f"sim://{x}"), MemberState.ALIVE, 0.0)
    downloads.start(MID, _sched(config, 4), 0.5)
    assert MID not in downloads.tree_children  # changed 0.5 s ago
    downloads.finish(MID)
    downloads.start(MID, _sched(config, 4), 1.0)
    children = downloads.tree_children[MID]
    assert len(children) == 2
    assert downloads.children(MID, 0) == children[0] and downloads.children(MID, 3) == children[1]
    assert downloads.children(b"other", 0) == ()


def test_a_settled_list_plants_at_once() -> None:
    downloads, config = _downloads(tree_fanout=2, tree_settle=1.0)
    downloads.live.settle(0.0)  # (a warm start: the view given now is old news)
    downloads.live.track(NodeInfo("a", "sim://a"), MemberState.ALIVE, 0.0)
    downloads.start(MID, _sched(config, 4), 0.0)
    assert MID in downloads.tree_children


def test_the_retry_backoff_doubles_up_to_its_bound_with_jitter() -> None:
    config = NodeConfig("me", RUN, b"k" * 32, retry_backoff=0.5, retry_backoff_max=8.0)
    rng = random.Random(0)
    for failures, step in ((1, 0.5), (2, 1.0), (3, 2.0), (10, 8.0)):
        delay = retry_delay(config, failures, rng)
        assert step / 2 <= delay <= step
