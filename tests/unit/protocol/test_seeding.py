"""The seed's serving policy (protocol/seeding.py), driven without asyncio: windows, withholding while
peers announce a chunk, finishing requesters, booked returns and manifest copies."""

from __future__ import annotations

import random

from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.membership_messages import MemberState, NodeInfo
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.peers import LiveMembers, PeerView
from patchswarm.protocol.seeding import SEED_HOLD_WINDOWS, SeedPolicy
from patchswarm.protocol.wire import Announcement

RUN = "run"
MID = b"m" * 32
HASHES = [bytes([i]) * 32 for i in range(5)]


def _policy(**cfg: object) -> tuple[SeedPolicy, dict[str, PeerView]]:
    config = NodeConfig("s", RUN, b"k" * 32, is_seed=True, **cfg)  # type: ignore[arg-type]
    peers: dict[str, PeerView] = {}
    return SeedPolicy(config, peers, lambda mid: list(HASHES), random.Random(0)), peers


def _holder(peers: dict[str, PeerView], node_id: str, chunks: list[int], seen: float) -> None:
    bits = Bitfield(len(HASHES))
    for c in chunks:
        bits.set(c)
    ann = Announcement(RUN, 1, -1, partial=((MID, bits.to_bytes()),))
    peers[node_id] = PeerView(NodeInfo(node_id, f"sim://{node_id}"), ann, seen)


def test_a_chunk_handed_out_is_withheld_for_its_window_naming_who_got_it() -> None:
    seed, _ = _policy(seed_copy_window=2.0)
    assert seed.refusal(HASHES[0], [MID], 0.0) is None
    seed.hand_out(HASHES[0], "a", 0.0)
    assert seed.refusal(HASHES[0], [MID], 1.0) == ("a",)
    assert seed.refusal(HASHES[0], [MID], 2.5) is None  # nobody announces it: served again


def test_after_the_window_a_chunk_peers_announce_stays_withheld_for_a_few_windows() -> None:
    seed, peers = _policy(seed_copy_window=2.0)
    seed.hand_out(HASHES[1], "a", 0.0)
    _holder(peers, "b", [1], seen=3.0)
    assert seed.refusal(HASHES[1], [MID], 4.0) == ("b",)
    _holder(peers, "b", [1], seen=SEED_HOLD_WINDOWS * 2.0)
    assert seed.refusal(HASHES[1], [MID], SEED_HOLD_WINDOWS * 2.0) is None  # a claim keeps it only so long


def test_the_offer_leaves_out_what_was_handed_out_or_is_announced() -> None:
    seed, peers = _policy(seed_copy_window=2.0)
    seed.hand_out(HASHES[0], "a", 0.0)  # within its window at t=1
    seed.hand_out(HASHES[1], "a", -2.5)  # past its window, announced by b
    seed.hand_out(HASHES[2], "a", -2.5)  # past its window, nobody announces it
    _holder(peers, "b", [1], seen=0.5)
    ((mid, bits),) = seed.offers([MID], 1.0)
    offered = Bitfield.mask_from_bytes(len(HASHES), bits)
    assert mid == MID and offered == 0b11100


def test_a_finishing_requester_is_served_what_others_are_not() -> None:
    seed, _ = _policy()
    endgame = seed.config.scheduler.endgame_remaining
    assert seed.requester_finishing(HASHES[0], len(HASHES) - endgame, [MID])
    assert not seed.requester_finishing(HASHES[0], len(HASHES) - endgame - 1, [MID])
    assert not seed.requester_finishing(HASHES[0], -1, [MID])  # not said
    assert seed.chunk_place(b"x" * 32, [MID]) is None


def test_returns_are_booked_half_an_upload_apart_and_wrap_at_the_longest_wait() -> None:
    seed, _ = _policy(busy_retry_after=0.005)
    backs = [seed.return_time(0.0, 0.001, 0.002) for _ in range(6)]
    assert backs == [0.001, 0.002, 0.003, 0.004, 0.001, 0.002]


def test_a_manifest_goes_to_a_few_requesters_then_they_are_named() -> None:
    seed, _ = _policy(seed_object_copies=2)
    live = LiveMembers()
    for x in "abc":
        live.track(NodeInfo(x, f"sim://{x}"), MemberState.ALIVE, 0.0)
    path = "manifests/ab"
    assert seed.object_holders(path, "a", live, 0.0) is None
    assert seed.object_holders(path, "b", live, 0.0) is None
    named = seed.object_holders(path, "c", live, 0.0)
    assert named is not None and sorted(named) == ["sim://a", "sim://b"]
    seed.keep_objects(set())
    assert seed.object_holders(path, "c", live, 0.0) is None  # forgotten: counted afresh
