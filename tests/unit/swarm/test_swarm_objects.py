"""The board objects a node fetches and re-serves: heads, manifests, certificates and root documents.

Unit tests drive ``SwarmSource`` through a recording transport; the rest run real nodes (loopback
HTTP, or the simulated network for round-trip counts in virtual time)."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import blake3
import pytest

from patchswarm.daemon.board import Board
from patchswarm.protocol.board_names import HEAD_TAG, MANIFEST_TAG, cert_rel, head_rel, manifest_rel, root_rel
from patchswarm.protocol.chunks import ChunkRef
from patchswarm.protocol.errors import ChunkError, PatchswarmError
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.membership_messages import MemberState, NodeInfo
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import Certificate, RootDocument, TrustState
from patchswarm.simulations.clock import SimClock, run_virtual
from patchswarm.simulations.synthetic import synthetic_setup
from patchswarm.swarm import sources
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.sources import SwarmSource
from patchswarm.swarm.transport import Missing, TransportError
from tests.support.sim_streams import stream
from tests.support.swarmkit import RUN, SECRET, Swarm

ROOT_1 = root_rel(1)
ROOT, TRAINER = SigningKey.generate(), SigningKey.generate()


def certificate(key: SigningKey = TRAINER, signer: SigningKey = ROOT) -> bytes:
    now = int(time.time() * 1000)
    return Certificate(key.key_id, RUN, now - 1000, now + 60_000).sign(signer).to_bytes()


@dataclass
class Recorder:
    """A transport answering ``get_object`` from per-address tables; records who was asked for what.
    ``withhold``: addresses answering a request that does not insist with Missing naming holders."""

    have: dict[str, dict[str, bytes]] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)
    withhold: dict[str, tuple[str, ...]] = field(default_factory=dict)
    asked: list[tuple[str, str]] = field(default_factory=list)

    async def get_object(
        self, addr: str, path: str, limit: int, timeout: float, requester: str = "", insist: bool = False
    ) -> bytes | Missing | None:
        self.asked.append((addr, path) if not insist else (addr + "!", path))
        if addr in self.down:
            raise TransportError(f"{addr}: connection refused")
        if addr in self.withhold and not insist:
            return Missing(self.withhold[addr])
        return self.have.get(addr, {}).get(path)


NO_TRANSPORT: Any = Recorder()  # for nodes whose handlers are called directly: they send nothing


def view(addr: str, *, seed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(info=SimpleNamespace(addr=addr), ann=SimpleNamespace(seed=seed, complete=[], partial=[]))


def source(transport: Recorder, peers: int = 5) -> SwarmSource:
    views = {f"p{i}": view(f"p{i}") for i in range(peers)} | {"seed": view("seed", seed=True)}
    node: Any = SimpleNamespace(
        info=SimpleNamespace(node_id="me", addr="me"),
        peers=views,
        objects={},
        transport=transport,
        rng=random.Random(0),
        config=SimpleNamespace(seed_urls=[]),
        policy=TrustState(ROOT.key_id),
    )
    return SwarmSource(node, node.config.seed_urls)


@pytest.mark.asyncio
async def test_a_root_probe_asks_the_seed_once_and_takes_its_no_for_an_answer() -> None:
    t = Recorder()
    assert await source(t).get(ROOT_1, 1 << 16, prefer="p1") is None
    assert t.asked == [("seed", ROOT_1)]  # not the announcer, not random peers: none of them can say "no such root"


@pytest.mark.asyncio
async def test_a_root_probe_falls_back_to_peers_only_while_the_seed_does_not_answer() -> None:
    t = Recorder(have={"p3": {ROOT_1: b"root-1"}}, down={"seed"})
    src = source(t)
    assert await src.get(ROOT_1, 1 << 16) == b"root-1"
    assert t.asked[0] == ("seed", ROOT_1) and ("p3", ROOT_1) in t.asked
    t.have = {"seed": {ROOT_1: b"root-1"}}
    t.down, t.asked = set(), []
    assert await source(t).get(ROOT_1, 1 << 16) == b"root-1"
    assert t.asked == [("seed", ROOT_1)]


@pytest.mark.asyncio
async def test_a_certificate_is_asked_first_of_the_peer_that_served_the_head() -> None:
    head, cert = head_rel(RUN), cert_rel(TRAINER.key_id)
    good = certificate()
    t = Recorder(have={"p4": {head: b"head", cert: good}})
    src = source(t)
    assert await src.get(head, 1 << 20, prefer="p4") == b"head"
    t.asked = []
    assert await src.get(cert, 1 << 16) == good
    assert t.asked == [("p4", cert)]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "junk",
    [b"not an envelope", certificate(signer=SigningKey.generate()), certificate(key=SigningKey.generate())],
    ids=["garbage", "signed-by-no-root-key", "for-another-key"],
)
async def test_a_certificate_that_cannot_be_the_one_asked_for_is_refused_and_the_next_source_asked(
    junk: bytes,
) -> None:
    head, cert = head_rel(RUN), cert_rel(TRAINER.key_id)
    good = certificate()
    t = Recorder(have={"p4": {head: b"head", cert: junk}, "seed": {cert: good}})
    src = source(t)
    await src.get(head, 1 << 20, prefer="p4")
    assert await src.get(cert, 1 << 16) == good  # not the liar's answer, which would fail the head
    assert src.refused == 1 and t.asked[-1] == ("seed", cert)


def manifest_object() -> tuple[str, bytes]:
    """A manifest's board path and bytes (named by the BLAKE3 of its body, as SwarmSource checks)."""
    body = b"a manifest body"
    return f"manifests/{blake3.blake3(body).hexdigest()}", Envelope.sign(MANIFEST_TAG, body, None).to_bytes()


@pytest.mark.asyncio
async def test_a_seed_withholding_a_manifest_sends_the_requester_to_the_holders_it_names() -> None:
    rel, data = manifest_object()
    t = Recorder(have={"p8": {rel: data}, "seed": {rel: data}}, withhold={"seed": ("p7", "me", "p8")})
    assert await source(t, peers=0).get(rel, 1 << 20) == data
    # The named holders, insisting (a holder does not send anyone on), never itself; the seed served nobody.
    assert t.asked == [("seed", rel), ("p7!", rel), ("p8!", rel)]


@pytest.mark.asyncio
async def test_when_no_named_holder_has_it_the_seed_serves_the_requester_that_insists() -> None:
    rel, data = manifest_object()
    t = Recorder(have={"seed": {rel: data}}, withhold={"seed": ("p7", "p8")}, down={"p8"})
    assert await source(t, peers=0).get(rel, 1 << 20) == data
    assert t.asked == [("seed", rel), ("p7!", rel), ("p8!", rel), ("seed!", rel)]


@pytest.mark.asyncio
async def test_names_from_a_peer_that_is_not_a_seed_are_not_followed() -> None:
    rel, data = manifest_object()
    t = Recorder(have={"seed": {rel: data}}, withhold={f"p{i}": ("elsewhere",) for i in range(5)})
    assert await source(t).get(rel, 1 << 20) == data
    assert not any(addr.startswith("elsewhere") for addr, _ in t.asked)
    assert t.asked[-1] == ("seed", rel)


def test_only_accepted_trust_documents_are_taken_and_unverified_ones_are_bounded() -> None:
    root, trainer, other = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    now = int(time.time() * 1000)
    trust = TrustState(root.key_id)
    good = Certificate(trainer.key_id, RUN, now - 1000, now + 60_000).sign(root).to_bytes()
    trust.add_certificate(good)
    src = source(Recorder())
    src.fetched = {
        cert_rel(trainer.key_id): good,
        cert_rel(other.key_id): b"never verified",
        ROOT_1: b"never accepted",
        "manifests/00": b"m",
    }
    assert src.take_trusted(trust) == {cert_rel(trainer.key_id): good}
    root_1 = RootDocument(1, (root.key_id,)).sign(root).to_bytes()
    trust.update_root(root_1)
    # Only the document accepted is re-served: other bytes under its name (a lying peer's answer to a
    # concurrent fetch) are dropped, never served in its place.
    assert src.take_trusted(trust) == {}
    assert set(src.fetched) == {cert_rel(other.key_id), "manifests/00"}
    src.fetched[ROOT_1] = root_1
    assert src.take_trusted(trust) == {ROOT_1: root_1}
    for i in range(sources.UNCLAIMED + 10):
        src._hold(f"certs/{i:064x}", b"junk")
    assert len(src.fetched) == sources.UNCLAIMED
    assert "manifests/00" not in src.fetched  # the oldest went first


def test_a_new_head_costs_a_host_a_few_round_trips_not_one_per_peer_asked_for_the_next_root() -> None:
    """Simulated, 12 hosts, 1 ms one way, 3 versions: a host hears of a head within two gossip hops, asks
    the seed for the next root document while the head travels, then fetches the certificate (the first
    time) and the manifest.  Asking peers for the root first (they cannot say it does not exist) cost
    every head 4 round trips more: 20-22 ms, 240 object requests."""
    r = stream(synthetic_setup(patch_bytes=20_000_000, chunk_bytes=1 << 20, versions=3))
    assert r.complete, r.errors
    hosts = 12
    for v in r.versions:
        lat = [t - v.published for m in r.marks.values() for what, ver, t in m if what == "head" and ver == v.version]
        assert len(lat) == hosts
        assert max(lat) <= 0.008 and statistics.median(lat) <= 0.006, lat
    # A root probe, the head and the manifest per host and version; the certificate once per host.
    assert r.messages.object_requests <= hosts * (3 * len(r.versions) + 2)


@pytest.mark.asyncio
async def test_nodes_serve_the_certificate_and_roots_they_verified_and_only_the_catalog_s_manifests(
    tmp_path: Path,
) -> None:
    s = Swarm(tmp_path)
    s.publish()
    await s.start_seed()
    try:
        for name in ("a", "b"):
            await s.start_node(name)
        await s.wait_all(1)
        cert = cert_rel(s.trainer.key_id)
        first_manifests = set()
        for r in s.nodes.values():
            assert await r.node.handle_object(cert) == s.board.read(cert)
            first_manifests |= {k for k in r.node.objects if k.startswith("manifests/")}
        assert first_manifests
        # The trust admin publishes root document 1; the next head makes every node fetch and re-serve it.
        root1 = RootDocument(1, (s.root.key_id,)).sign(s.root).to_bytes()
        s.board.put_root(1, root1)
        for _ in range(12):  # (anchors every 4, two kept: version 1 leaves the catalog)
            v = s.publish()
        await s.wait_all(v)
        s.assert_bitwise()
        head_manifests = {manifest_rel(e.manifest_id) for e in _head(s).catalog}
        for r in s.nodes.values():
            assert await r.node.handle_object(ROOT_1) == root1
            served = {k for k in r.node.objects if k.startswith("manifests/")}
            assert served and served <= head_manifests
            assert not served & first_manifests
            assert len(r.node.source.fetched) <= 2  # the head, maybe an identified manifest: nothing piles up
    finally:
        await s.close()


def _head(s: Swarm) -> Any:
    from patchswarm.protocol.head import Head
    from patchswarm.protocol.signed import Envelope

    return Head.from_bytes(Envelope.from_bytes(s.board.read(head_rel(RUN)) or b"", HEAD_TAG).body)


def test_a_seed_hands_a_manifest_to_a_few_and_names_them_to_the_rest() -> None:
    """40 simulated hosts, 3 versions: with ``seed_object_copies`` 4 the seed sends less than 60% of
    the object bytes it sends when it serves every requester (measured: 48 KB against 112 KB; heads
    and certificates it still serves), and every host gets every version."""
    run = synthetic_setup(patch_bytes=20_000_000, chunk_bytes=1 << 20, versions=3)
    every, few = (stream(run, n=40, node_options={"seed_object_copies": c}) for c in (0, 4))
    assert every.complete and few.complete, (every.errors, few.errors)
    objects = [r.sent["seed"] - r.seed_uploaded for r in (every, few)]  # objects (gossip only as flows, rare)
    assert objects[1] < 0.6 * objects[0]


def test_a_seed_names_only_live_holders_and_counts_afresh(tmp_path: Path) -> None:
    """``seed_object_copies`` 2: a and b are served, c is told to ask them (and served once it
    insists); once both are gone c and d are served and counted, e told of them; after 4 copy
    windows the count starts again.  A requester the seed cannot name (not a member) is served but
    not counted; one that does not name itself is served."""
    board = Board(tmp_path / "board")
    rel = "manifests/ab"
    board.path(rel).parent.mkdir(parents=True, exist_ok=True)
    board.path(rel).write_bytes(b"m")

    async def main() -> list[object]:
        cfg = NodeConfig("s", RUN, SECRET, is_seed=True, seed_object_copies=2, seed_copy_window=2.0)
        seed = SwarmNode(
            cfg, "sim://s", NO_TRANSPORT, SimClock(0.0), TrustState(b"k" * 32), random.Random(0), board=board
        )
        for x in "abcde":
            seed.live.track(NodeInfo(x, f"sim://{x}"), MemberState.ALIVE, seed.clock.now())
        got = [await seed.handle_object(rel, x) for x in ("stranger", "a", "b", "c")]
        got.append(await seed.handle_object(rel, "c", insist=True))
        for x in "ab":
            seed.live.track(NodeInfo(x, f"sim://{x}"), MemberState.DEAD, seed.clock.now())
        got += [await seed.handle_object(rel, x) for x in "cde"]  # a and b gone: c and d are served, e told of them
        await asyncio.sleep(8.5)
        got.append(await seed.handle_object(rel, "e"))  # counted afresh
        got.append(await seed.handle_object("certs/00", "e"))  # only manifests are withheld
        got += [await seed.handle_object(rel, x) for x in ("d", "c")]  # d the second copy, c told of d and e
        got.append(await seed.handle_object(rel, ""))  # a client that does not name itself cannot follow names
        return got

    got = run_virtual(main())
    assert got[:3] == [b"m"] * 3
    assert isinstance(got[3], Missing) and set(got[3].holders) == {"sim://a", "sim://b"}
    assert got[4:7] == [b"m"] * 3
    assert isinstance(got[7], Missing) and set(got[7].holders) == {"sim://c", "sim://d"}
    assert got[8] == b"m" and got[9] is None
    assert got[10] == b"m" and isinstance(got[11], Missing) and set(got[11].holders) == {"sim://d", "sim://e"}
    assert got[12] == b"m"


def test_a_failed_root_refresh_does_not_leave_the_head_fetch_running() -> None:
    """The root probe and the head fetch run side by side; when the probe fails, the head request is
    cancelled (it used to run on in the background, up to its 5 s timeout) and the failure is reported."""

    async def main() -> tuple[list[str], str | None, float]:
        cfg = NodeConfig("n", RUN, SECRET)
        node = SwarmNode(cfg, "sim://n", NO_TRANSPORT, SimClock(0.0), TrustState(b"k" * 32), random.Random(0))
        cancelled: list[str] = []

        async def slow_get(rel: str, limit: int, prefer: str | None = None) -> bytes | None:
            try:
                await asyncio.sleep(10.0)
            except asyncio.CancelledError:
                cancelled.append(rel)
                raise
            return b"head"

        async def failing_refresh() -> None:
            await asyncio.sleep(0.1)
            raise PatchswarmError("root 2 is not signed by root 1")

        node.source.get = slow_get  # type: ignore[method-assign]
        node.puller.refresh_trust = failing_refresh  # type: ignore[method-assign]
        await node.heads.fetch_once(None)
        await asyncio.sleep(0)  # the cancellation lands
        return (
            list(cancelled),
            node.head_error,
            asyncio.get_running_loop().time(),
        )  # (a copy: shutdown cancels leftovers)

    cancelled, error, when = run_virtual(main())
    assert cancelled == [head_rel(RUN)]
    assert error == "root 2 is not signed by root 1" and when < 1.0


@pytest.mark.asyncio
async def test_a_liar_s_answer_for_an_odd_length_key_s_certificate_is_refused_and_the_next_source_asked() -> None:
    """A head envelope's key id is any bytes: a certificate asked for under a name no certificate can
    have (31 bytes of key) is checked like any answer, and a liar's is refused (the issue 32 review)."""
    head, cert = head_rel(RUN), cert_rel(b"\x01" * 31)  # a forged head's signer: 31 bytes
    liar = {cert: b"not a certificate"}
    t = Recorder(have={f"p{i}": dict(liar) for i in range(5)} | {"seed": dict(liar)})
    t.have["p4"][head] = b"head"
    src = source(t)
    await src.get(head, 1 << 20, prefer="p4")
    assert await src.get(cert, 1 << 16) is None  # refused, every source asked, nothing held
    assert src.refused >= 1
    assert cert not in src.fetched


@pytest.mark.asyncio
async def test_a_failing_board_is_logged_once_per_distinct_failure(caplog: pytest.LogCaptureFixture) -> None:
    """A board that cannot be read (wrong credentials, a store down) is polled at every head: one
    warning line until the failure changes or the board answers again, not one per poll."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    t = Recorder(down={f"p{i}" for i in range(5)} | {"seed"})
    node: Any = SimpleNamespace(
        info=SimpleNamespace(node_id="me", addr="me"),
        peers={},
        objects={},
        transport=t,
        rng=random.Random(0),
        policy=TrustState(ROOT.key_id),
    )
    src = SwarmSource(node, [url])
    try:
        with caplog.at_level(logging.WARNING, logger="patchswarm.swarm.sources"):
            for _ in range(3):
                assert await src.get(head_rel(RUN), 1 << 20) is None
        lines = [r.getMessage() for r in caplog.records if r.name == "patchswarm.swarm.sources"]
        assert len(lines) == 1 and "connection refused" in lines[0], lines
    finally:
        await src.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("with_seed", [False, True])
async def test_a_head_poll_asks_the_board_first_only_in_a_swarm_without_a_seed(tmp_path: Path, with_seed: bool) -> None:
    """Without a seed nobody announces new heads: peers hold only what they polled, so a poll asks the
    board (here a directory, read as a store board is) before them.  With a seed, peers come first
    as before (the seed announces every head, so the board is not every host's poll target)."""
    head = head_rel(RUN)
    board = tmp_path / "board"
    (board / "runs" / RUN).mkdir(parents=True)
    (board / head).write_bytes(b"the board's head")
    t = Recorder(have={f"p{i}": {head: b"a peer's head"} for i in range(3)} | {"seed": {head: b"a peer's head"}})
    views = {f"p{i}": view(f"p{i}") for i in range(3)} | ({"seed": view("seed", seed=True)} if with_seed else {})
    node: Any = SimpleNamespace(
        info=SimpleNamespace(node_id="me", addr="me"),
        peers=views,
        objects={},
        transport=t,
        rng=random.Random(0),
        policy=TrustState(ROOT.key_id),
    )
    src = SwarmSource(node, [str(board)])
    got = await src.get(head, 1 << 20)
    assert got == (b"a peer's head" if with_seed else b"the board's head")
    assert (t.asked == []) is not with_seed
    assert await src.get(head, 1 << 20, prefer="p1") == b"a peer's head"  # an announcement: its announcer first


@pytest.mark.parametrize("answer", ["missing", "wrong"])
def test_a_board_that_gives_no_chunk_is_asked_again_only_after_a_growing_pause(answer: str) -> None:
    """A node without a seed takes chunks nobody has from the board.  When the board has none to give
    (a 403/404, a throttled or failing store) or gives wrong bytes, it used to be asked again at once:
    four GETs per round trip, every host, for as long as the download lasted.  Now a failure leaves the
    board alone for 1 s, doubling up to 30 s; 60 virtual seconds of a board that never answers cost a
    few dozen requests, not thousands."""
    refs = tuple(ChunkRef(1024, blake3.blake3(bytes([i])).digest()) for i in range(8))
    manifest: Any = SimpleNamespace(manifest_id=b"m" * 32, chunks=refs, version=1)

    async def main() -> list[float]:
        node = SwarmNode(NodeConfig("n", RUN, SECRET), "sim://n", NO_TRANSPORT, SimClock(0.0), POLICY, random.Random(0))
        asked: list[float] = []

        async def board(ref: ChunkRef) -> bytes | None:
            asked.append(node.clock.now())
            await asyncio.sleep(0.01)  # a store's round trip
            return None if answer == "missing" else b"x" * ref.size

        node.fetcher.from_board = board
        node.fetcher.verify_chunk = check_chunk
        task = asyncio.get_running_loop().create_task(node.fetcher.download(manifest))
        await asyncio.sleep(60.0)
        task.cancel()
        return asked

    asked = run_virtual(main())
    # Rounds of four at 0 s, then after pauses of 0.5-1, 1-2, 2-4, 4-8, 8-16, 15-30 s: at most 8 rounds.
    assert 8 <= len(asked) <= 4 * 8, len(asked)
    assert asked[4] >= 0.5  # the second round waited


POLICY = TrustState(b"k" * 32)


def check_chunk(index: int, data: bytes, ref: ChunkRef) -> None:
    if blake3.blake3(data).digest() != ref.hash:
        raise ChunkError(index, "does not match its hash")
