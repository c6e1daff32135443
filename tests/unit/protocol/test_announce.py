"""What a node announces and to whom (protocol/announce.py), driven without asyncio."""

from __future__ import annotations

import random

from patchswarm.protocol.announce import AnnouncePolicy
from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.membership import Membership
from patchswarm.protocol.membership_messages import MemberState, NodeInfo
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.peers import LiveMembers, PeerView
from patchswarm.protocol.scheduler import ChunkScheduler
from patchswarm.protocol.scheduler_types import PeerInfo
from patchswarm.protocol.seeding import SeedPolicy
from patchswarm.protocol.wire import Announcement

RUN = "run"
MID = b"m" * 32


def _policy(n_members: int = 6, **cfg: object) -> AnnouncePolicy:
    config = NodeConfig("me", RUN, b"k" * 32, **cfg)  # type: ignore[arg-type]
    me = NodeInfo("me", "sim://me")
    rng = random.Random(0)
    peers: dict[str, PeerView] = {}
    live = LiveMembers()
    for i in range(n_members):
        live.track(NodeInfo(f"p{i}", f"sim://p{i}"), MemberState.ALIVE, 0.0)
    membership = Membership(me, config.membership, rng, 0.0)
    seeding = SeedPolicy(config, peers, lambda mid: [b"a" * 32, b"b" * 32], rng)
    return AnnouncePolicy(config, me, peers, live, membership, seeding, {}, rng)


def test_a_node_announces_its_downloads_and_newest_versions() -> None:
    policy = _policy()
    have = Bitfield(3)
    have.set(1)
    policy.partial[MID] = ChunkScheduler([1] * 3, PeerInfo("me"), policy.config.scheduler, random.Random(0), have)
    done = [bytes([i]) * 32 for i in range(10)]
    ann = policy.announcement(4, 2, done, 0.0)
    assert (ann.head_counter, ann.version, ann.seed) == (4, 2, False)
    assert ann.partial == ((MID, have.to_bytes()),) and ann.complete == tuple(done[-8:])


def test_a_seed_announces_its_offer() -> None:
    policy = _policy(is_seed=True)
    policy.seeding.hand_out(b"a" * 32, "x", 0.0)
    older, old = b"o" * 32, b"p" * 32
    ann = policy.announcement(1, -1, [older, old, MID], 0.5)  # the two newest are offered
    offers = dict(ann.partial)
    assert ann.seed and set(offers) == {old, MID} and ann.complete == (older,)
    assert Bitfield.mask_from_bytes(2, offers[MID]) == 0b10  # chunk a went out 0.5 s ago


def test_a_new_head_goes_to_those_behind() -> None:
    policy = _policy(announce_fanout=3)
    for i in range(4):
        policy.peers[f"p{i}"] = PeerView(policy.live.members[i], Announcement(RUN, 5, -1), 0.0)
    behind = policy.behind(5)
    assert sorted(i.node_id for i in behind) == ["p4", "p5"]
    assert len(policy.behind(6)) == 3


def test_peers_that_want_our_chunks_hear_first() -> None:
    policy = _policy(n_members=6, announce_sample=5)  # (sampled from the live list: 5 of 6)
    have = Bitfield(3)
    have.set(0)
    policy.partial[MID] = ChunkScheduler([1] * 3, PeerInfo("me"), policy.config.scheduler, random.Random(0), have)
    for i in (2, 4):  # they lack chunk 0
        ann = Announcement(RUN, 1, -1, partial=((MID, Bitfield(3).to_bytes()),))
        policy.peers[f"p{i}"] = PeerView(policy.live.members[i], ann, 0.0)
    targets = policy.targets(5, 1, [])
    wanting = [i for i, t in enumerate(targets) if t.node_id in ("p2", "p4")]
    assert wanting and wanting == list(range(len(wanting)))  # first, whichever were drawn


def test_the_same_seed_draws_the_same_targets() -> None:
    a, b = _policy(announce_sample=3), _policy(announce_sample=3)
    assert [i.node_id for i in a.targets(2, 1, [])] == [i.node_id for i in b.targets(2, 1, [])]
    assert [i.node_id for i in a.behind(1)] == [i.node_id for i in b.behind(1)]
