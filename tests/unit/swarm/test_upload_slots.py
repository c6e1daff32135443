"""A serving node's upload slot covers the transfer, not only the chunk lookup (swarm/node.py
``handle_chunk`` sends through the transport's ``send``), and a seed withholding a chunk answers
"not this one, ask them" (Missing with holders) rather than Busy.  In virtual time and over real
HTTP on loopback."""

from __future__ import annotations

import asyncio
import http.client
import math
import random
import socket
import time
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from patchswarm.protocol.membership_config import MembershipConfig
from patchswarm.protocol.membership_messages import NodeInfo
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.requesters import RequesterLimits
from patchswarm.protocol.trust import TrustState
from patchswarm.simulations.clock import SimClock, run_virtual
from patchswarm.simulations.network import Host, Network, Region
from patchswarm.simulations.transport import SimNet
from patchswarm.swarm.http import HELD_HEADER, NODE_HEADER, PREFIX, HttpTransport, _origin, add_routes
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.transport import Busy, Handlers, Missing, SendChunk, TransportError
from tests.support.node_worker_client import NodeWorker
from tests.support.swarmkit import RUN, SECRET

MB = 1_000_000
EPOCH = 1_700_000_000.0  # any fixed wall time


def test_an_unpaced_node_holds_its_slot_while_the_chunk_travels() -> None:
    """One slot, no waiting line, an unpaced node on a 1 MB/s uplink: a second requester is refused
    for as long as the first chunk is on the wire, then served; the refusal's retry estimate comes
    from the timed upload, not the configured default."""

    async def main() -> tuple[float, object, object, float]:
        hosts = [Host("a", "r", up=1 * MB), Host("b", "r"), Host("c", "r")]
        net = SimNet(Network(hosts, [Region("r", 0.001)]))
        cfg = NodeConfig("a", RUN, SECRET, max_uploads=1, upload_queue=0, busy_retry_after=5.0)
        node = SwarmNode(cfg, "sim://a", net.transport("a"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
        node.chunks.put(b"h", b"x" * MB)
        net.register("sim://a", "a", node.handlers())
        loop = asyncio.get_running_loop()
        b, c = net.transport("b"), net.transport("c")
        first = asyncio.ensure_future(b.get_chunk("sim://a", b"h", MB, 60.0, "b"))
        await asyncio.sleep(0.5)  # the first chunk is half way
        refused = await c.get_chunk("sim://a", b"h", MB, 60.0, "c")
        assert await first == b"x" * MB
        done = loop.time()
        again = await c.get_chunk("sim://a", b"h", MB, 60.0, "c")
        busy_after_timing = node.serving.busy_retry_after()
        net.close()
        return done, refused, again, busy_after_timing

    done, refused, again, retry = run_virtual(main())
    assert done == pytest.approx(0.001 + 1.0 + 0.001)
    # Refused before any upload was timed: the configured default.
    assert refused == Busy(5.0)
    assert again == b"x" * MB
    # After two timed uploads of ~1 s each: half the time one slot takes to free, not 5 s.
    assert 0.4 < retry < 0.6


def test_the_refusal_given_at_once_is_the_handlers_own() -> None:
    """``refuse_chunk`` (what a transport may ask before giving a request its own task) answers as
    ``handle_chunk`` would at that moment: Missing for a chunk not held, nothing while a slot or a
    place in line is free, then the same Busy, counted once per refusal."""

    async def main() -> tuple[list[object], object, list[int]]:
        hosts = [Host("a", "r", up=1 * MB), Host("b", "r"), Host("c", "r")]
        net = SimNet(Network(hosts, [Region("r", 0.001)]))
        cfg = NodeConfig("a", RUN, SECRET, max_uploads=1, upload_queue=1, upload_queue_wait=5.0, busy_retry_after=5.0)
        node = SwarmNode(cfg, "sim://a", net.transport("a"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
        node.chunks.put(b"h", b"x" * MB)
        net.register("sim://a", "a", node.handlers())
        answers: list[object] = [node.refuse_chunk(b"nope", "d", -1), node.refuse_chunk(b"h", "d", -1)]
        b, c = net.transport("b"), net.transport("c")
        served = asyncio.ensure_future(b.get_chunk("sim://a", b"h", MB, 60.0, "b"))  # takes the slot
        waiting = asyncio.ensure_future(c.get_chunk("sim://a", b"h", MB, 60.0, "c"))  # the place in line
        await asyncio.sleep(0.1)
        counts = [node.metrics.busy_replies]
        answers.append(node.refuse_chunk(b"h", "d", -1))
        counts.append(node.metrics.busy_replies)

        async def never(data: bytes) -> None:
            raise AssertionError("a refused request sends nothing")

        direct = await node.handle_chunk(b"h", "d", -1, never)
        counts.append(node.metrics.busy_replies)
        assert await served == b"x" * MB and await waiting == b"x" * MB
        net.close()
        return answers, direct, counts

    answers, direct, counts = run_virtual(main())
    assert answers == [Missing(), None, Busy(5.0)]
    assert direct == Busy(5.0)
    assert counts == [0, 1, 2]


def test_a_seed_keeps_its_own_longer_line() -> None:
    """One slot each; peers' lines hold nobody (``upload_queue=0``), the seed's one
    (``seed_upload_queue=1``): of three requesters at once, one is served at once, one waits at the
    seed and is served next, one is refused.  The seed holds what nobody else does: a request it refuses has nowhere
    else to go, and its uplink idles until the refused come back."""

    async def main() -> list[object]:
        hosts = [Host("s", "r", up=1 * MB), Host("b", "r"), Host("c", "r"), Host("d", "r")]
        net = SimNet(Network(hosts, [Region("r", 0.001)]))
        cfg = NodeConfig(
            "s",
            RUN,
            SECRET,
            is_seed=True,
            seed_max_uploads=1,
            upload_queue=0,
            seed_upload_queue=1,
            upload_queue_wait=5.0,
        )
        seed = SwarmNode(cfg, "sim://s", net.transport("s"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
        seed.chunks.put(b"h", b"x" * MB)
        net.register("sim://s", "s", seed.handlers())
        # Finishing requesters (held = its last chunk's place): the seed does not withhold from them.
        seed.seeding.chunk_place = lambda h, complete: (b"m", 0, 1)  # type: ignore[method-assign]
        asks = [asyncio.ensure_future(net.transport(x).get_chunk("sim://s", b"h", MB, 60.0, x, held=0)) for x in "bcd"]
        replies = list(await asyncio.gather(*asks))
        net.close()
        return replies

    replies = run_virtual(main())
    assert sum(r == b"x" * MB for r in replies) == 2  # one served at once, one after waiting in line
    assert sum(isinstance(r, Busy) for r in replies) == 1


def _seed_on(net: SimNet, slots: int, line: int) -> SwarmNode:
    """A seed ``s`` on ``net`` holding chunk ``h`` (1 MB), serving every requester (as to one finishing)."""
    cfg = NodeConfig(
        "s", RUN, SECRET, is_seed=True, seed_max_uploads=slots, seed_upload_queue=line, upload_queue_wait=5.0
    )
    seed = SwarmNode(cfg, "sim://s", net.transport("s"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
    seed.chunks.put(b"h", b"x" * MB)
    net.register("sim://s", "s", seed.handlers())
    seed.seeding.chunk_place = lambda h, complete: (b"m", 0, 1)  # type: ignore[method-assign]
    return seed


def test_a_seed_line_is_for_requesters_it_is_not_serving() -> None:
    """One slot, a line of two.  ``b`` asks twice, then ``c`` once: ``b``'s second request finds the
    slot taken by its first and is refused (no place in line), ``c`` waits in line and is served.
    Before, ``b`` took the line's place and ``c`` was refused: a host keeping several requests at
    the seed took several shares of the one copy."""

    async def main() -> dict[str, list[object]]:
        hosts = [Host("s", "r", up=1 * MB), Host("b", "r"), Host("c", "r")]
        net = SimNet(Network(hosts, [Region("r", 0.001)]))
        seed = _seed_on(net, slots=1, line=2)
        ask = {x: net.transport(x) for x in "bc"}
        b1 = asyncio.ensure_future(ask["b"].get_chunk("sim://s", b"h", MB, 60.0, "b", held=0))
        await asyncio.sleep(0.01)
        b2 = asyncio.ensure_future(ask["b"].get_chunk("sim://s", b"h", MB, 60.0, "b", held=0))
        await asyncio.sleep(0.01)
        c1 = asyncio.ensure_future(ask["c"].get_chunk("sim://s", b"h", MB, 60.0, "c", held=0))
        replies = {"b": [await b1, await b2], "c": [await c1]}
        assert seed.uploads.seed_uploading == {}  # every count given back
        net.close()
        return replies

    replies = run_virtual(main())
    assert replies["b"][0] == b"x" * MB and isinstance(replies["b"][1], Busy)
    assert replies["c"] == [b"x" * MB]


def test_a_lone_requester_gets_every_free_seed_slot() -> None:
    """Three slots, nobody else asking: all three of one requester's requests are served at once
    (over a long path one request at a time would leave the seed's uplink idle between chunks)."""

    async def main() -> list[object]:
        hosts = [Host("s", "r", up=1 * MB), Host("b", "r")]
        net = SimNet(Network(hosts, [Region("r", 0.001)]))
        _seed_on(net, slots=3, line=0)
        b = net.transport("b")
        replies = await asyncio.gather(*(b.get_chunk("sim://s", b"h", MB, 60.0, "b", held=0) for _ in range(3)))
        net.close()
        return list(replies)

    assert run_virtual(main()) == [b"x" * MB] * 3


def test_a_requester_that_gives_up_frees_the_slot() -> None:
    async def main() -> tuple[int, object]:
        hosts = [Host("a", "r", up=1 * MB), Host("b", "r")]
        net = SimNet(Network(hosts, [Region("r", 0.001)]))
        cfg = NodeConfig("a", RUN, SECRET, max_uploads=1, upload_queue=0)
        node = SwarmNode(cfg, "sim://a", net.transport("a"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
        node.chunks.put(b"h", b"x" * MB)
        net.register("sim://a", "a", node.handlers())
        b = net.transport("b")
        with pytest.raises(Exception, match="timed out"):
            await b.get_chunk("sim://a", b"h", MB, 0.3, "b")
        await asyncio.sleep(0.01)
        in_use = node.upload_slots.in_use
        reply = await b.get_chunk("sim://a", b"h", MB, 60.0, "b")
        assert net.network.active_flows() == []
        net.close()
        return in_use, reply

    in_use, reply = run_virtual(main())
    assert in_use == 0
    assert reply == b"x" * MB


@pytest.mark.asyncio
async def test_http_route_sends_inside_the_handler_and_carries_holders() -> None:
    """Over real HTTP: the handler's ``send`` writes the body before the handler returns, and a
    Missing or Busy reply's holders reach the requester (for chunks and board objects)."""
    events: list[str] = []
    replies: dict[bytes, Busy | Missing | bytes] = {
        b"\x01": b"y" * 300_000,
        b"\x02": Missing(("n1", "n2")),
        b"\x03": Busy(0.25, ("n3",)),
        b"\x04": Missing(),
    }
    helds: list[int] = []

    gossiped: list[bytes] = []

    def gossip(data: bytes) -> None:
        gossiped.append(data)

    async def chunk(h: bytes, requester: str, held: int, send: SendChunk) -> Busy | Missing | None:
        helds.append(held)
        reply = replies[h]
        if isinstance(reply, bytes):
            events.append("send")
            await send(reply)
            events.append("sent")
            return None
        return reply

    asked: list[tuple[str, str, bool]] = []

    async def obj(path: str, requester: str, insist: bool) -> bytes | Missing | None:
        asked.append((path, requester, insist))
        if path == "manifests/ab" and not insist:
            return Missing(("http://10.0.0.1:7000", "http://10.0.0.2:7000"))  # a seed withholding it
        return b"m" if path == "manifests/ab" else None

    app = web.Application()
    add_routes(app, Handlers(gossip, chunk, obj))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = HttpTransport()
    try:
        addr = f"http://127.0.0.1:{port}"
        assert await client.get_chunk(addr, b"\x01", 300_000, 10.0, "me") == b"y" * 300_000
        assert events == ["send", "sent"]
        assert await client.get_chunk(addr, b"\x02", 10, 10.0, "me") == Missing(("n1", "n2"))
        assert await client.get_chunk(addr, b"\x03", 10, 10.0, "me") == Busy(0.25, ("n3",))
        assert await client.get_chunk(addr, b"\x04", 10, 10.0, "me", held=17) == Missing()
        # The requester's count of chunks held travels with the request; anything but a plain count
        # (negative, non-ASCII digits, huge, text) reads as "not said".
        url = f"{addr}{PREFIX}/chunks/04"
        async with aiohttp.ClientSession() as raw:
            for bad in ("-3", "\u00b2", "1" * 10, "many", ""):
                async with raw.get(url, headers={HELD_HEADER: bad}) as r:
                    assert r.status == 404
        assert helds == [-1, -1, -1, 17, -1, -1, -1, -1, -1]
        # Objects: "not here" is None; a withheld manifest names addresses; the requester's id and
        # its insisting travel with the request.
        assert await client.get_object(addr, "manifests/ab", 10, 10.0, "me") == Missing(
            ("http://10.0.0.1:7000", "http://10.0.0.2:7000")
        )
        assert await client.get_object(addr, "manifests/ab", 10, 10.0, "me", insist=True) == b"m"
        assert await client.get_object(addr, "certs/cd", 10, 10.0) is None
        assert asked == [("manifests/ab", "me", False), ("manifests/ab", "me", True), ("certs/cd", "", False)]
        # Gossip: post returns at once and the datagram arrives in the background; one that cannot
        # be delivered (nobody listens there) is dropped without an error.
        client.post(addr, b"news")
        client.post("http://127.0.0.1:9", b"lost")
        for _ in range(500):
            if gossiped:
                break
            await asyncio.sleep(0.01)
        assert gossiped == [b"news"]
    finally:
        await client.close()
        client.post(addr, b"after close")  # dropped: a closed transport sends nothing
        assert not client._posts
        await runner.cleanup()


def _node(node_id: str, **cfg: object) -> SwarmNode:
    config = NodeConfig(node_id, RUN, SECRET, **cfg)  # type: ignore[arg-type]
    hosts = [Host(node_id, "r")]
    net = SimNet(Network(hosts, [Region("r", 0.001)]))
    return SwarmNode(
        config, f"sim://{node_id}", net.transport(node_id), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0)
    )


def test_a_seed_books_the_returns_of_those_it_refuses() -> None:
    """Refused at the same moment, requesters of a seed are told to come back half an upload apart
    (6 slots, 12 ms per upload: one slot frees every 2 ms), the first after half the line.  A plain
    node tells everyone
    the same."""

    async def main() -> tuple[list[float], list[float]]:
        seed = _node("s", is_seed=True, seed_max_uploads=6, busy_retry_after=0.02)
        peer = _node("p", max_uploads=6, busy_retry_after=0.02)
        for node in (seed, peer):
            node.uploads.upload_seconds = 0.012
        return [seed.serving.busy_retry_after() for _ in range(12)], [peer.serving.busy_retry_after() for _ in range(3)]

    seed_waits, peer_waits = run_virtual(main())
    # 1 ms (half of one slot's 2 ms), then 1 ms more for each requester refused before.
    assert seed_waits == pytest.approx([0.001 * k for k in range(1, 13)])
    assert peer_waits == pytest.approx([0.001] * 3)


def test_a_seed_wraps_its_bookings_at_the_longest_wait() -> None:
    """Bookings that would reach ``busy_retry_after`` start again from the earliest return."""

    async def main() -> list[float]:
        seed = _node("s", is_seed=True, seed_max_uploads=6, busy_retry_after=0.005)
        seed.uploads.upload_seconds = 0.012
        return [seed.serving.busy_retry_after() for _ in range(6)]

    assert run_virtual(main()) == pytest.approx([0.001, 0.002, 0.003, 0.004, 0.001, 0.002])


def test_news_does_not_wake_a_downloader_with_every_request_out() -> None:
    """An announcement wakes the download loop only when it could start a request; a fetch that ends
    (or a peer that dies) wakes it always."""

    async def main() -> tuple[bool, bool, bool]:
        node = _node("a")
        loop = asyncio.get_running_loop()
        results = []
        for full, news in ((True, True), (True, False), (False, True)):
            node.fetcher.full = full
            node.fetcher.change_waiter = waiter = loop.create_future()
            node.fetcher.wake(news=news)
            results.append(waiter.done())
        return results[0], results[1], results[2]

    assert run_virtual(main()) == (False, True, True)


def test_a_seed_serves_a_finishing_requester_a_chunk_it_withholds() -> None:
    """Handed out a moment ago, chunk 0 is withheld (Missing, naming who got it) from a requester
    that lacks most of the version, and served to one that says it lacks at most
    ``endgame_remaining`` (3) of the 5 chunks."""

    async def main() -> tuple[object, object, object]:
        seed = _node("s", is_seed=True)
        hashes = [bytes([i]) * 32 for i in range(5)]
        for h in hashes:
            seed.chunks.put(h, b"z" * 100)
        seed.complete = [b"m"]
        seed.seeding.chunk_lists[b"m"] = hashes
        seed.seeding.served[hashes[0]] = (seed.clock.now(), ("x",))
        sent: list[bytes] = []

        async def send(data: bytes) -> None:
            sent.append(data)

        far = await seed.handle_chunk(hashes[0], "y", 1, send)  # lacks 4
        unsaid = await seed.handle_chunk(hashes[0], "y", -1, send)
        near = await seed.handle_chunk(hashes[0], "y", 2, send)  # lacks 3
        return far, unsaid, (near, sent)

    far, unsaid, (near, sent) = run_virtual(main())
    assert far == Missing(("x",)) and unsaid == Missing(("x",))
    assert near is None and sent == [b"z" * 100]


def test_a_stuck_downloader_asks_the_seeds_again() -> None:
    """A seed's refusal of a withheld chunk reads as MISSING and keeps the seed from being asked for it
    (``failure_backoff``).  With nothing in flight, no one else to ask and at most
    ``endgame_remaining`` (3) chunks left, the downloader takes that back (the seed holds every chunk),
    at most every ``busy_retry_after`` per chunk; with more left it waits for holders."""
    from patchswarm.protocol.peers import PeerView
    from patchswarm.protocol.scheduler import ChunkScheduler
    from patchswarm.protocol.scheduler_types import FailureReason, PeerInfo, SchedulerConfig
    from patchswarm.protocol.wire import Announcement

    async def main(n: int) -> tuple[bool, list[tuple[int, str]], bool, bool]:
        node = _node("a", busy_retry_after=0.2)
        seed_info = NodeInfo("seed", "sim://seed")
        node.peers["seed"] = PeerView(seed_info, Announcement(RUN, 1, 1, seed=True), 0.0)
        sched = ChunkScheduler([100] * n, PeerInfo("a"), SchedulerConfig(), random.Random(0))
        sched.update_peer(PeerInfo("seed", is_seed=True), None, 0.0)
        asked: dict[int, float] = {}
        for r in sched.next_requests(0.0):
            sched.on_failure(0.01, r.chunk, "seed", FailureReason.MISSING)
        assert sched.next_requests(0.02) == []  # stuck
        took_back = node.downloads.ask_seeds_again(sched, n, asked, 0.02)
        again = [(r.chunk, r.peer_id) for r in sched.next_requests(0.02)]
        for c, _ in again:
            sched.on_failure(0.03, c, "seed", FailureReason.MISSING)
        too_soon = node.downloads.ask_seeds_again(sched, n, asked, 0.1)
        later = node.downloads.ask_seeds_again(sched, n, asked, 0.25)
        return took_back, sorted(again), too_soon, later

    assert run_virtual(main(3)) == (True, [(c, "seed") for c in range(3)], False, True)
    assert run_virtual(main(4)) == (False, [], False, False)


def test_warm_membership_gives_every_node_every_member() -> None:
    """Full membership: every node knows every other, and nothing is left to gossip about them (old
    news in a running swarm).  A bounded view of k is warmed from the seed (the first node) and 4k
    others drawn at random: it holds k members, not all the same ones."""
    from patchswarm.simulations.runner import WARM_HEARD_PER_MEMBER, _warm

    async def main() -> tuple[list[int], list[int], list[set[str]], list[int], list[int]]:
        full = [_node(f"n{i}") for i in range(6)]
        _warm(full, 0.0, random.Random(0))
        k = 2
        bounded = [_node(f"b{i:02d}", membership=MembershipConfig(max_members=k)) for i in range(40)]
        _warm(bounded, 0.0, random.Random(0))
        pending = [n.membership.pending_broadcasts for n in [*full, *bounded]]
        views = [{info.node_id for info in n.membership.alive()} for n in bounded]
        heard = [len(n.membership._heard) + n.membership.alive_count() for n in bounded]
        return [n.membership.alive_count() for n in full], [len(v) for v in views], views, pending, heard

    full, sizes, views, pending, heard = run_virtual(main())
    assert full == [5] * 6
    assert sizes == [2] * 40
    assert max(heard) <= WARM_HEARD_PER_MEMBER * 2 + 2 < 39  # a sample and the seed, not everyone
    assert len(set().union(*views)) > 10  # the views spread over the swarm
    assert pending == [0] * 46


def test_a_duplicate_cancelled_before_it_ran_leaves_the_download_loop_nothing_to_wake_on() -> None:
    """Endgame: chunk 0 is asked of two peers.  The first answers in the same instant as the
    duplicate's task is created, so the duplicate is cancelled before it ever ran and never reaches
    its own ``finally``; the winner must take it out of ``running``, or the download loop, which
    waits on every task there, would wake at once forever (a simulated 3-region swarm spun at one
    virtual instant)."""
    from types import SimpleNamespace

    from patchswarm.protocol.peers import PeerView
    from patchswarm.protocol.scheduler import ChunkScheduler
    from patchswarm.protocol.scheduler_types import PeerInfo, SchedulerConfig
    from patchswarm.protocol.wire import Announcement

    async def main() -> tuple[dict[tuple[int, str], asyncio.Task[None]], bool, bool]:
        node = _node("a")
        node.fetcher.verify_chunk = lambda index, data, ref: None
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        sched = ChunkScheduler([100], PeerInfo("a"), SchedulerConfig(endgame_remaining=1), random.Random(0))
        for pid in ("p", "q"):
            node.peers[pid] = PeerView(NodeInfo(pid, f"sim://{pid}"), Announcement(RUN, 1, 1), 0.0)
            sched.update_peer(PeerInfo(pid), None, 0.0)
        first, dup = sched.next_requests(0.0)
        assert dup.duplicate

        async def get_chunk(addr: str, *args: object) -> bytes:
            if addr == f"sim://{first.peer_id}":
                await gate
                return b"x" * 100
            await loop.create_future()  # the duplicate's peer never answers
            raise AssertionError

        node.transport = SimpleNamespace(get_chunk=get_chunk)  # type: ignore[assignment]
        manifest = SimpleNamespace(chunks=[SimpleNamespace(hash=b"h" * 32, size=100)], version=1)
        running: dict[tuple[int, str], asyncio.Task[None]] = {}
        winner = asyncio.create_task(node.fetcher.fetch(sched, manifest, b"m", first, running))  # type: ignore[arg-type]
        running[(first.chunk, first.peer_id)] = winner
        for _ in range(5):
            await asyncio.sleep(0)  # the winner now waits for its reply
        gate.set_result(None)  # its reply is due before the duplicate's task first runs
        loser = asyncio.create_task(node.fetcher.fetch(sched, manifest, b"m", dup, running))  # type: ignore[arg-type]
        running[(dup.chunk, dup.peer_id)] = loser
        for _ in range(5):
            await asyncio.sleep(0)
        return running, loser.cancelled(), sched.complete

    running, cancelled, complete = run_virtual(main())
    assert complete and cancelled
    assert running == {}


@pytest.mark.parametrize(
    ("near_region", "is_seed", "told_near"),
    [("asia", False, True), ("us", False, False), ("asia", True, False)],
    ids=["nearer-and-stale", "stale-but-no-nearer", "at-a-seed"],
)
def test_a_stale_view_of_a_nearer_peer_counts_as_interest(near_region: str, is_seed: bool, told_near: bool) -> None:
    """Two us peers are known to want our chunks (they announced the current head, holding none); a
    third peer last spoke before that head.  With two announcement places it is told first when it is
    nearer (our region, asia) than every peer known to want our chunks, not when it is as far as they
    are, and never by a seed (whose one copy of each chunk would go to its neighbours)."""
    from patchswarm.protocol.bitfield import Bitfield
    from patchswarm.protocol.peers import PeerView
    from patchswarm.protocol.scheduler import ChunkScheduler
    from patchswarm.protocol.scheduler_types import PeerInfo, SchedulerConfig
    from patchswarm.protocol.wire import Announcement
    from patchswarm.simulations.runner import _warm

    async def main() -> set[str]:
        me = _node("me", region="asia", is_seed=is_seed)
        others = [_node("far0", region="us"), _node("far1", region="us"), _node("near", region=near_region)]
        _warm([me, *others], 0.0, random.Random(0))
        me.head_counter = 5
        mid = b"m" * 32
        have = Bitfield(4)
        have.set(0)
        me.partial[mid] = ChunkScheduler([100] * 4, PeerInfo("me"), SchedulerConfig(), random.Random(0), have)
        for far in ("far0", "far1"):
            ann = Announcement(RUN, 5, 1, partial=((mid, Bitfield(4).to_bytes()),))
            me.peers[far] = PeerView(NodeInfo(far, f"sim://{far}", region="us"), ann, 0.0)
        stale = Announcement(RUN, 4, 1)  # spoke before head 5: no partial download listed
        me.peers["near"] = PeerView(NodeInfo("near", "sim://near", region=near_region), stale, 0.0)
        return {i.node_id for i in me.announce.targets(2, me.head_counter, me.complete)}

    targets = run_virtual(main())
    assert ("near" in targets) == told_near
    if not told_near:
        assert targets == {"far0", "far1"}


# ------------------------------------------------------------ deadlines and per-requester limits


class _SlotWorker(NodeWorker):
    """tests/support/node_worker.py: a node process serving one chunk over real HTTP."""

    def __init__(self, slots: int, deadline: float, size: int) -> None:
        super().__init__("server", "--slots", str(slots), "--deadline", str(deadline), "--chunk-bytes", str(size))
        self.path = f"{PREFIX}/chunks/{self.hello['hash']}"

    def stall(self, node: str) -> socket.socket:
        """A client that asks for the chunk and never reads: a tiny receive buffer, so the server's
        writes back up at once."""
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", self.port))
        s.sendall(f"GET {self.path} HTTP/1.1\r\nHost: x\r\nX-Patchswarm-Node: {node}\r\n\r\n".encode())
        return s

    def status_of(self, node: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", self.path, headers={"X-Patchswarm-Node": node})
            r = conn.getresponse()
            r.read()
            return r.status
        finally:
            conn.close()


def _reply_of(s: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the server sent on ``s``, and whether it closed it (EOF or reset): a 200 is read until the
    connection ends or ``timeout`` passes; a 503 (kept alive) only as far as its status line."""
    s.settimeout(timeout)
    got = bytearray()
    try:
        while piece := s.recv(1 << 16):
            got += piece
            if got.startswith(b"HTTP/1.1 503"):
                return bytes(got), False
    except (ConnectionResetError, BrokenPipeError):
        return bytes(got), True
    except TimeoutError:
        return bytes(got), False
    return bytes(got), True


def test_clients_that_never_read_do_not_lock_honest_requesters_out() -> None:
    """Known defect 3: more clients than slots ask for a chunk and never read.  Each transfer ends at
    its deadline with the connection aborted (the client gets a cut reply, then EOF or a reset), the
    slot goes back, an honest requester gets the chunk, and a client that stalled is refused while it rests."""
    slots, size = 2, 8 << 20  # 8 MiB: far more than loopback's socket buffers hold
    worker = _SlotWorker(slots, deadline=1.0, size=size)
    stalled: list[socket.socket] = []
    try:
        stalled = [worker.stall(f"staller-{i}") for i in range(slots + 3)]
        # Without deadlines the slots stay taken and every honest request is a 503, forever.
        statuses: list[int] = []
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and (not statuses or statuses[-1] != 200):
            statuses.append(worker.status_of("honest"))
            time.sleep(0.05)
        assert statuses[-1] == 200, statuses[-5:]
        give_up = time.monotonic() + 60
        while (stalls := worker.metrics()["upload_stalls"]) < slots and time.monotonic() < give_up:
            time.sleep(0.05)
        assert stalls == slots  # the clients that got a slot; the others were refused at once
        served = []
        for i, s in enumerate(stalled):
            got, ended = _reply_of(s, timeout=30)
            if got.startswith(b"HTTP/1.1 200"):
                served.append(i)
                assert ended, f"staller-{i}: the server never closed a transfer past its deadline"
                assert len(got) < size, f"staller-{i}: got the whole chunk"
            else:
                assert got.startswith(b"HTTP/1.1 503"), got[:40]
        assert len(served) == slots
        # A requester that stalled rests: refused at once, however many slots are free.
        assert worker.status_of(f"staller-{served[0]}") == 503
        assert worker.status_of("honest") == 200
        metrics = worker.metrics()
        assert metrics["requester_refusals"] >= 1
    finally:
        for s in stalled:
            s.close()
        worker.close()


def _sim_server(slots: int, **cfg: object) -> tuple[SimNet, SwarmNode]:
    net = SimNet(Network([Host("a", "r", up=1 * MB)], [Region("r", 0.001)]))
    config = NodeConfig("a", RUN, SECRET, max_uploads=slots, upload_queue=0, **cfg)  # type: ignore[arg-type]
    node = SwarmNode(config, "sim://a", net.transport("a"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
    node.chunks.put(b"h", b"x" * 1000)
    return net, node


async def _never(data: bytes) -> None:
    await asyncio.get_running_loop().create_future()  # a requester that never reads


async def _at_once(data: bytes) -> None:
    return None


def _no_slot_leaked(node: SwarmNode) -> None:
    assert node.upload_slots.in_use == 0
    assert node.requesters.busy_requesters == 0
    assert (
        not node.serving.queue
        and not node.serving.followers
        and not node.uploads.sending_to
        and not node.uploads.seed_uploading
    )


def test_a_transfer_past_its_deadline_frees_its_slot_once_and_rests_the_requester() -> None:
    async def main() -> None:
        net, node = _sim_server(1, upload_deadline=2.0, upload_stall_rest=10.0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await node.handle_chunk(b"h", "x", -1, _never, "198.51.100.7") is None
        assert loop.time() - start == pytest.approx(2.0)
        assert node.metrics.upload_stalls == 1
        _no_slot_leaked(node)
        # It rests (by origin, whatever node id it sends now); others are served.
        rested = await node.handle_chunk(b"h", "y", -1, _at_once, "198.51.100.7")
        assert isinstance(rested, Busy) and rested.retry_after == pytest.approx(10.0)
        assert await node.handle_chunk(b"h", "y", -1, _at_once, "198.51.100.8") is None
        await asyncio.sleep(10.0)
        assert await node.handle_chunk(b"h", "x", -1, _at_once, "198.51.100.7") is None
        # A second stall within memory: twice the rest.
        assert await node.handle_chunk(b"h", "x", -1, _never, "198.51.100.7") is None
        again = await node.handle_chunk(b"h", "x", -1, _at_once, "198.51.100.7")
        assert isinstance(again, Busy) and again.retry_after == pytest.approx(20.0)
        assert node.metrics.requester_refusals == 2
        _no_slot_leaked(node)
        net.close()

    run_virtual(main())


def test_the_deadline_grows_with_the_chunk() -> None:
    async def main() -> float:
        net, node = _sim_server(1, upload_deadline=1.0, upload_floor_rate=100.0)  # 1000 bytes: 10 s
        loop = asyncio.get_running_loop()
        start = loop.time()
        await node.handle_chunk(b"h", "x", -1, _never)
        net.close()
        return loop.time() - start

    assert run_virtual(main()) == pytest.approx(10.0)


def test_a_cancelled_transfer_frees_its_slot_and_rests_nobody() -> None:
    async def main() -> None:
        net, node = _sim_server(1)
        task = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, _never, "198.51.100.7"))
        await asyncio.sleep(1.0)
        assert node.upload_slots.in_use == 1 and node.requesters.active("198.51.100.7") == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        _no_slot_leaked(node)
        assert node.metrics.upload_stalls == 0
        assert await node.handle_chunk(b"h", "x", -1, _at_once, "198.51.100.7") is None
        net.close()

    run_virtual(main())


def test_a_follower_takes_over_a_stalled_transfers_slot_and_nothing_leaks() -> None:
    """With trees, a requester's second request waits behind its transfer (``_follow``); the first
    passing its deadline hands the slot to it once (not to the line, not freed twice)."""

    async def main() -> None:
        net, node = _sim_server(1, tree_fanout=2, upload_deadline=2.0, upload_queue_wait=5.0)
        first = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, _never))
        await asyncio.sleep(0.1)
        sent: list[bytes] = []

        async def record(data: bytes) -> None:
            sent.append(data)

        second = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, record))
        await asyncio.sleep(0.1)
        assert len(node.serving.followers["x"]) == 1
        assert await first is None
        assert await second is None
        assert sent == [b"x" * 1000]
        assert node.metrics.upload_stalls == 1
        _no_slot_leaked(node)
        assert node.upload_slots.acquire()  # the one slot is free again, and only one
        assert not node.upload_slots.acquire()
        net.close()

    run_virtual(main())


def test_one_origin_holds_at_most_its_share_of_the_slots() -> None:
    """The node id is unverified: uploads are counted by the address a request comes from, and one
    address gets all slots but one; a request from elsewhere still finds the last."""

    async def main() -> None:
        net, node = _sim_server(4)
        held = [asyncio.ensure_future(node.handle_chunk(b"h", f"n{i}", -1, _never, "203.0.113.9")) for i in range(3)]
        await asyncio.sleep(0.1)
        refused = await node.handle_chunk(b"h", "n9", -1, _at_once, "203.0.113.9")
        assert isinstance(refused, Busy)
        assert node.metrics.requester_refusals == 1
        assert node.upload_slots.in_use == 3
        assert await node.handle_chunk(b"h", "m", -1, _at_once, "203.0.113.10") is None
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        _no_slot_leaked(node)
        net.close()

    run_virtual(main())


def test_requester_limits_forget_the_oldest_stall_first_and_cap_the_rest() -> None:
    limits = RequesterLimits(2, rest=1.0, max_rest=3.0, memory=100.0, table=3)
    assert [limits.stalled("a", 0.0), limits.stalled("a", 1.0), limits.stalled("a", 2.0)] == [1.0, 2.0, 3.0]
    for key in "bcd":
        limits.stalled(key, 3.0)
    assert limits.remembered == 3
    assert limits.rest_left("a", 3.0) == 0.0  # forgotten: the table is full of later stalls
    assert limits.rest_left("d", 3.5) == pytest.approx(0.5)
    assert limits.stalled("d", 500.0) == 1.0  # past memory: counted afresh
    limits.begin("x")
    limits.begin("x")
    assert limits.at_share("x")
    limits.end("x")
    limits.end("x")
    assert limits.busy_requesters == 0
    with pytest.raises(ValueError):
        RequesterLimits(0, rest=1.0, max_rest=1.0, memory=1.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"upload_deadline": 0.0},
        {"upload_deadline": math.inf},
        {"upload_floor_rate": 0.0},
        {"upload_stall_rest": -1.0},
        {"upload_stall_rest": 10.0, "upload_stall_max_rest": 5.0},
        {"uploads_per_requester": -1},
    ],
)
def test_upload_limits_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        NodeConfig("a", RUN, SECRET, **bad)  # type: ignore[arg-type]


def test_a_slow_simulated_requester_is_cut_at_the_deadline_and_its_flow_stopped() -> None:
    """The same deadline in the simulator: a requester on a 1 kB/s downlink asking for 1 MB gets a
    reset after 2 s (its flow stopped, no bytes delivered), and the next requester is served."""

    async def main() -> None:
        hosts = [Host("a", "r"), Host("slow", "r", down=1000), Host("c", "r")]
        net = SimNet(Network(hosts, [Region("r", 0.001)]))
        cfg = NodeConfig("a", RUN, SECRET, max_uploads=1, upload_queue=0, upload_deadline=2.0, upload_floor_rate=1e9)
        node = SwarmNode(cfg, "sim://a", net.transport("a"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
        node.chunks.put(b"h", b"x" * MB)
        net.register("sim://a", "a", node.handlers())
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TransportError, match="connection reset"):
            await net.transport("slow").get_chunk("sim://a", b"h", MB, 60.0, "slow")
        assert loop.time() - start == pytest.approx(2.0 + 0.002, abs=0.01)
        assert net.network.active_flows() == []
        assert node.metrics.upload_stalls == 1
        _no_slot_leaked(node)
        assert await net.transport("c").get_chunk("sim://a", b"h", MB, 60.0, "c") == b"x" * MB
        net.close()

    run_virtual(main())


def test_requesters_are_counted_by_address_key() -> None:
    """Where the address enters (swarm/http.py), an IPv6 requester is its /64 and an IPv4-mapped one
    its IPv4 address: a host cannot take a share of the slots per address it owns."""

    def origin(ip: str, node: str = "") -> str:
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda name, default=None: (ip, 4321) if name == "peername" else default
        headers = {NODE_HEADER: node} if node else {}
        return _origin(make_mocked_request("GET", "/", headers=headers, transport=transport))

    assert origin("2001:db8:1:2::1", "a") == origin("2001:db8:1:2:ab::9", "b") == "2001:db8:1:2::/64"
    assert origin("2001:db8:1:3::1") != origin("2001:db8:1:2::1")
    assert origin("::ffff:203.0.113.9", "a") == origin("203.0.113.9", "b") == "203.0.113.9"
    assert origin("127.0.0.1", "a") != origin("127.0.0.1", "b")  # this machine's processes: by node id
