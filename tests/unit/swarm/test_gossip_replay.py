"""Gossip frames carry their freshness (protocol/wire.py, version 2): a frame captured once cannot be
replayed, within its window (same sender and seq) or after it (too old).  Unit, hypothesis, and a
capture between two node processes on loopback."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.protocol.membership_config import MembershipConfig
from patchswarm.protocol.membership_messages import NodeInfo, Ping
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.trust import TrustState
from patchswarm.protocol.wire import (
    REPLAY_BITS,
    REPLAYED,
    STALE,
    Announcement,
    FrameGuard,
    GossipFrame,
    decode_frame,
    encode_frame,
)
from patchswarm.simulations.clock import SimClock, run_virtual
from patchswarm.simulations.network import Host, Network, Region
from patchswarm.simulations.transport import SimNet
from patchswarm.swarm.http import PREFIX
from patchswarm.swarm.node import SwarmNode
from tests.support.node_worker_client import NodeWorker
from tests.support.swarmkit import RUN, SECRET

EPOCH = 1_700_000_000.0
NOW = 1_700_000_000_000  # ms
WINDOW, SKEW = 60_000, 5_000


def test_a_frame_is_accepted_once() -> None:
    guard = FrameGuard(WINDOW, SKEW)
    assert guard.check("a", NOW, 7, NOW) is None
    assert guard.check("a", NOW, 7, NOW + 1) == REPLAYED
    assert guard.check("b", NOW, 7, NOW) is None  # seqs are per sender


def test_frames_too_old_or_too_far_ahead_are_stale() -> None:
    guard = FrameGuard(WINDOW, SKEW)
    assert guard.check("a", NOW - WINDOW - SKEW - 1, 1, NOW) == STALE
    assert guard.check("a", NOW - WINDOW - SKEW, 2, NOW) is None  # the edge is in
    assert guard.check("a", NOW + SKEW + 1, 3, NOW) == STALE
    assert guard.check("a", NOW + SKEW, 4, NOW) is None


def test_frames_reordered_within_the_window_are_each_accepted_once() -> None:
    guard = FrameGuard(WINDOW, SKEW)
    order = [10, 8, 12, 9, 11]
    assert [guard.check("a", NOW, s, NOW) for s in order] == [None] * 5
    assert [guard.check("a", NOW, s, NOW) for s in order] == [REPLAYED] * 5
    top = 12 + REPLAY_BITS
    assert guard.check("a", NOW, top, NOW) is None
    assert guard.check("a", NOW, top - REPLAY_BITS + 1, NOW) is None  # the oldest seq still told apart
    assert guard.check("a", NOW, top - REPLAY_BITS, NOW) == REPLAYED  # beyond the bitmap: refused


def test_the_sender_table_is_bounded_and_an_eviction_opens_no_replay() -> None:
    guard = FrameGuard(WINDOW, SKEW, senders=2)
    assert guard.check("a", NOW, 1, NOW) is None
    assert guard.check("b", NOW + 10, 1, NOW + 10) is None
    # Once every frame they recorded is stale, entries go to make room.
    later = NOW + WINDOW + SKEW + 11
    assert guard.check("c", later, 1, later) is None
    assert len(guard) == 1
    # A table full of live senders: the oldest is evicted...
    assert guard.check("d", later + 1, 1, later + 1) is None
    assert guard.check("e", later + 2, 1, later + 2) is None
    assert len(guard) == 2
    # ...and its frames from before the eviction are refused, fresh ones taken.
    assert guard.check("c", later, 1, later + 3) == STALE
    assert guard.check("c", later + 3, 2, later + 3) is None
    assert guard.check("c", later, 1, later + 3) == STALE  # re-entered: its old seqs still refused


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 40), st.integers(-2 * SKEW, WINDOW + 2 * SKEW)),
        max_size=120,
    )
)
def test_no_frame_is_ever_accepted_twice_nor_out_of_its_window(frames: list[tuple[str, int, int]]) -> None:
    """A frame is (sender, seq, sent_ms): its bytes are MAC'd, so a replay repeats all three (an honest
    sender never sends one seq twice).  A tiny sender table, so that evictions happen."""
    guard = FrameGuard(WINDOW, SKEW, senders=2)
    accepted: set[tuple[str, int, int]] = set()
    for sender, seq, age in frames:
        if guard.check(sender, NOW - age, seq, NOW) is None:
            assert (sender, seq, age) not in accepted
            assert -SKEW <= age <= WINDOW + SKEW
            accepted.add((sender, seq, age))


@settings(max_examples=100, deadline=None)
@given(sent_ms=st.integers(0, (1 << 63) - 1), seq=st.integers(0, (1 << 63) - 1), tamper=st.integers(0, 400))
def test_frames_round_trip_and_any_flipped_bit_fails_authentication(sent_ms: int, seq: int, tamper: int) -> None:
    frame = GossipFrame(NodeInfo("n1", "http://n1"), Announcement(RUN, 3, 2), Ping(5, "n2", ()), sent_ms, seq)
    data = encode_frame(SECRET, frame)
    got = decode_frame(SECRET, data)
    assert (got.sent_ms, got.seq, got.sender, got.message) == (sent_ms, seq, frame.sender, frame.message)
    flipped = bytearray(data)
    flipped[tamper % len(data)] ^= 0x01
    with pytest.raises(Exception, match=r"gossip|patchswarm") as err:
        decode_frame(SECRET, bytes(flipped))
    assert type(err.value).__name__ == "WireError"


def test_a_node_drops_a_replayed_frame_and_a_stale_one() -> None:
    """The node's handler, in virtual time: a frame is acted on once; the same bytes again are
    counted as a replay; a frame from beyond the window is counted stale."""

    async def main() -> None:
        net = SimNet(Network([Host("a", "r")], [Region("r", 0.001)]))
        membership = MembershipConfig(frame_window=10.0, frame_skew=1.0)
        cfg = NodeConfig("a", RUN, SECRET, membership=membership)
        clock = SimClock(EPOCH)
        node = SwarmNode(cfg, "sim://a", net.transport("a"), clock, TrustState(b"k" * 32), random.Random(0))
        sent = round(clock.wall() * 1000)
        frame = encode_frame(SECRET, GossipFrame(NodeInfo("b", "sim://b"), Announcement(RUN, -1, -1), None, sent, 1))
        node.handle_gossip(frame)
        assert "b" in node.peers
        seen = node.peers["b"].seen
        await asyncio.sleep(1.0)
        node.handle_gossip(frame)
        assert node.metrics.gossip_replayed == 1
        assert node.peers["b"].seen == seen  # not acted on again
        await asyncio.sleep(11.0)
        node.handle_gossip(frame)
        old = GossipFrame(NodeInfo("b", "sim://b"), Announcement(RUN, -1, -1), None, sent, 2)  # a new seq, old time
        node.handle_gossip(encode_frame(SECRET, old))
        assert node.metrics.gossip_stale == 2
        assert node.peers["b"].seen == seen
        net.close()

    run_virtual(main())


def test_a_nodes_frames_count_up_from_its_start_and_carry_its_clock() -> None:
    async def main() -> None:
        net = SimNet(Network([Host("a", "r")], [Region("r", 0.001)]))
        clock = SimClock(EPOCH)
        node = SwarmNode(
            NodeConfig("a", RUN, SECRET), "sim://a", net.transport("a"), clock, TrustState(b"k" * 32), random.Random(0)
        )
        first = decode_frame(SECRET, node._frame(None))
        await asyncio.sleep(2.0)
        second = decode_frame(SECRET, node._frame(None))
        assert first.seq >= round(EPOCH * 1000) * 1024 and second.seq == first.seq + 1
        assert second.sent_ms - first.sent_ms == 2000
        net.close()

    run_virtual(main())


@pytest.mark.asyncio
async def test_a_captured_frame_replayed_to_a_node_process_is_refused() -> None:
    """Two node processes; the first joins through a recording relay in front of the second, so the
    test holds real frames the first sent to the second.  Replayed within the window (same seq) and
    after it, each is refused and counted by the second; the swarm goes on."""
    target = NodeWorker("target", "--frame-window", "5.0", "--frame-skew", "0.2")
    captured: list[bytes] = []
    session = aiohttp.ClientSession()

    async def relay(request: web.Request) -> web.Response:
        data = await request.read()
        captured.append(data)
        async with session.post(f"{target.url}{PREFIX}/gossip", data=data) as r:
            return web.Response(status=r.status)

    app = web.Application()
    app.router.add_post(f"{PREFIX}/gossip", relay)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    relay_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    joiner = NodeWorker("joiner", "--bootstrap", relay_url)
    try:
        give_up = time.monotonic() + 30
        while not (captured and "joiner" in target.ask("peers")):
            assert time.monotonic() < give_up, "the joiner's frames never reached the target"
            await asyncio.sleep(0.05)
        base = target.metrics()
        frame = captured[-1]
        sent_ms = decode_frame(SECRET, frame).sent_ms
        assert time.time() * 1000 - sent_ms < 4000, "too slow to replay within the window"
        async with session.post(f"{target.url}{PREFIX}/gossip", data=frame) as r:
            assert r.status == 204  # (gossip is fire-and-forget: the sender learns nothing)
        assert target.metrics()["gossip_replayed"] == base["gossip_replayed"] + 1
        while time.time() * 1000 - sent_ms <= 5300:  # past window + skew, by the same host's clock
            await asyncio.sleep(0.05)
        async with session.post(f"{target.url}{PREFIX}/gossip", data=frame) as r:
            assert r.status == 204
        after = target.metrics()
        assert after["gossip_stale"] == base["gossip_stale"] + 1
        assert after["gossip_replayed"] == base["gossip_replayed"] + 1
        assert "joiner" in target.ask("peers")  # the joiner's own fresh gossip still gets through
    finally:
        joiner.close()
        target.close()
        await session.close()
        await runner.cleanup()


@pytest.mark.parametrize("bad", [{"frame_window": -1.0}, {"frame_skew": -1.0}, {"frame_window": float("inf")}])
def test_frame_windows_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="frame_window and frame_skew"):
        MembershipConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        FrameGuard(-1, 0)


def test_a_sender_restarted_with_its_clock_set_back_is_heard_once_its_old_frames_are_stale() -> None:
    guard = FrameGuard(WINDOW, SKEW)
    assert guard.check("a", NOW, 5_000_000, NOW) is None
    assert guard.check("a", NOW + 10, 1_000, NOW + 10) == REPLAYED  # restarted, counting from lower
    later = NOW + WINDOW + SKEW + 1
    assert guard.check("a", later, 1_001, later) is None
    assert guard.check("a", NOW, 5_000_000, later) == STALE  # and the old frames stay refused


def test_a_restarted_node_counts_on_from_above_its_last_run() -> None:
    async def main() -> None:
        net = SimNet(Network([Host("a", "r")], [Region("r", 0.001)]))
        clock = SimClock(EPOCH)
        cfg = NodeConfig("a", RUN, SECRET)
        guard = FrameGuard(WINDOW, SKEW)
        for _ in range(2):
            node = SwarmNode(cfg, "sim://a", net.transport("a"), clock, TrustState(b"k" * 32), random.Random(0))
            for _ in range(3):
                f = decode_frame(SECRET, node._frame(None))
                assert guard.check("a", f.sent_ms, f.seq, round(clock.wall() * 1000)) is None
            await asyncio.sleep(0.01)  # restarted 10 ms later
        net.close()

    run_virtual(main())
