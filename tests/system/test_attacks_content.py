"""Attacks on content through a real daemon: a peer (tests.support.adversary) that holds, or claims to hold,
every chunk and lies about it in every way the wire allows.

One daemon, one honest seed and one adversary are shared by the module.  Each test leaks a new
version to the adversary first, so the daemon faces the attacker alone, checks the specific
counter that shows the attack was seen, that the engine still serves the old version with its root
and that the persisted high-water mark did not move; then the honest copy is released and the
daemon must reach exactly the trainer's bits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web

from patchswarm.protocol.board_names import HEAD_TAG, head_rel, manifest_rel
from patchswarm.protocol.head import Head
from patchswarm.protocol.membership_messages import NodeInfo
from patchswarm.protocol.signed import Envelope
from tests.support.adversary import AttackWorld, foreign_run, inject_gossip, mirror

pytestmark = pytest.mark.asyncio(loop_scope="module")

FAILURES = "patchswarm_chunk_failures_total"
BANS = "patchswarm_peer_bans_total"
REFUSED_OBJECTS = "patchswarm_objects_refused_total"
FROM_SEED = 'patchswarm_received_bytes_total{source="seed"}'


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AttackWorld]:
    w = AttackWorld(tmp_path_factory.mktemp("attacks-content"))
    try:
        await w.start()
        yield w
    finally:
        await w.close()


def head_of(world: AttackWorld) -> Head:
    return Head.from_bytes(Envelope.from_bytes(world.head_bytes(), HEAD_TAG).body)


async def converges(world: AttackWorld, version: int) -> None:
    world.adversary.behave()
    world.release()
    st = await world.d.wait_version(version, timeout=60)
    assert st["root"] == world.sw.served[version].root().hex()


async def bad_chunks(world: AttackWorld, mode: str) -> dict[str, float]:
    """Leak a version to the adversary serving ``mode`` chunks: refused, sender banned, nothing served."""
    before = await world.status()
    counter = world.persisted_counter()
    m0 = await world.metrics()
    world.adversary.behave(chunks=mode)
    v = world.publish(to_adversary=True)
    m = await world.metric_above(FAILURES, m0.get(FAILURES, 0))
    assert m[BANS] > m0.get(BANS, 0)
    await world.assert_unchanged(before["version"], counter)
    await converges(world, v)
    return m


async def test_forged_chunk_is_refused_and_its_sender_banned(world: AttackWorld) -> None:
    await bad_chunks(world, "corrupt")


async def test_truncated_chunk_is_refused_and_its_sender_banned(world: AttackWorld) -> None:
    await bad_chunks(world, "truncate")


async def test_endless_chunk_reply_is_cut_at_its_size_and_its_sender_banned(world: AttackWorld) -> None:
    sent = world.adversary.sent_bytes
    await bad_chunks(world, "endless")
    # The daemon hung up after size + 1 bytes: what got out is socket buffers, not the 1 GiB on offer.
    assert world.adversary.sent_bytes - sent < 256 << 20


async def test_decompression_bomb_is_cut_at_the_chunk_size_and_its_sender_banned(world: AttackWorld) -> None:
    await bad_chunks(world, "bomb")


async def unresponsive(
    world: AttackWorld, asked_for: tuple[str, ...] = ("chunk", "object"), **behaviour: object
) -> dict[str, float]:
    """Leak a version to an adversary that answers ``behaviour``-ly, let the daemon ask it for one of
    ``asked_for``, then release the honest copy: the version must land from the seed, with no hash
    failure counted."""
    m0 = await world.metrics()
    asked = sum(world.adversary.requests[k] for k in asked_for)
    world.adversary.behave(**behaviour)
    v = world.publish(to_adversary=True)  # the adversary is the only holder: it is asked first

    async def tried() -> bool:
        return sum(world.adversary.requests[k] for k in asked_for) > asked

    await world.until("a request to the adversary", tried)
    world.release()
    st = await world.d.wait_version(v, timeout=90)
    assert st["root"] == world.sw.served[v].root().hex()
    m = await world.metrics()
    assert m[FROM_SEED] > m0.get(FROM_SEED, 0)  # the deadlines moved the work to an honest source
    assert m.get(FAILURES, 0) == m0.get(FAILURES, 0)  # slowness is not a hash failure: no ban for it
    world.adversary.behave()
    return m


async def test_slow_retrieval_does_not_stall_the_download(world: AttackWorld) -> None:
    chunks = world.adversary.requests["chunk"]
    # It serves the manifest, then promises each chunk and sends one byte every 0.2 s; the honest
    # copy is released only once a chunk was asked of it (not just the manifest).
    await unresponsive(world, asked_for=("chunk",), chunks="slow")
    assert world.adversary.requests["chunk"] > chunks


async def test_peer_that_advertises_everything_and_never_answers(world: AttackWorld) -> None:
    # Chunk and board requests alike are accepted and never answered (hung requests also fill the
    # daemon's connection pool to it, so some later ones time out before they reach it).
    await unresponsive(world, chunks="hang", hang_objects=True)


async def foreign_manifest(world: AttackWorld, wrong: bytes) -> None:
    """The adversary answers the new version's manifest address with ``wrong`` (validly signed bytes)."""
    before = await world.status()
    counter = world.persisted_counter()
    m0 = await world.metrics()
    v = world.sw.publish(scale=3e-4)
    head = head_of(world)
    world.adversary.behave(objects={manifest_rel(e.manifest_id): wrong for e in head.catalog if e.version == v})
    mirror(world.sw.board, world.adversary.board)
    await world.metric_above(REFUSED_OBJECTS, m0.get(REFUSED_OBJECTS, 0))
    await world.assert_unchanged(before["version"], counter)
    await converges(world, v)


async def test_manifest_of_another_run_and_layout_is_refused(world: AttackWorld) -> None:
    board, _ = foreign_run(world.tmp, world.sw.root)
    other = Head.from_bytes(Envelope.from_bytes(board.read(head_rel("other-run")) or b"", HEAD_TAG).body)
    wrong = board.read(manifest_rel(other.manifest_id))
    assert wrong is not None
    await foreign_manifest(world, wrong)


async def test_mix_and_match_older_manifest_at_the_new_address_is_refused(world: AttackWorld) -> None:
    wrong = world.sw.board.read(manifest_rel(head_of(world).manifest_id))  # the current, genuine one
    assert wrong is not None
    await foreign_manifest(world, wrong)


async def test_partial_chunk_set_is_never_applied(world: AttackWorld) -> None:
    before = await world.status()
    counter = world.persisted_counter()
    v = world.sw.publish(scale=1e-3)
    manifest = world.sw.board.manifest(head_of(world).manifest_id)
    assert len(manifest.chunks) >= 2
    world.adversary.behave(chunks="withhold", withhold=frozenset([manifest.chunks[-1].hash]))
    mirror(world.sw.board, world.adversary.board)

    async def all_but_one() -> dict[str, int] | None:
        p = (await world.status())["progress"]
        return p if p["chunks_total"] == len(manifest.chunks) and p["chunks_done"] == p["chunks_total"] - 1 else None

    await world.until("every chunk but the withheld one", all_but_one)
    await asyncio.sleep(1.0)  # holding all but one chunk for a while changes nothing
    await world.assert_unchanged(before["version"], counter)
    await converges(world, v)


async def test_gossip_from_outsiders_is_dropped(world: AttackWorld) -> None:
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    honeypot = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        before = await world.status()
        intruder = NodeInfo("intruder", honeypot, "z0", "r0")
        mids = tuple(e.manifest_id for e in head_of(world).catalog)[:8]
        addr = world.daemon_addr()
        for _ in range(3):
            await inject_gossip(addr, secret=b"guessed-secret", sender=intruder, head_counter=1 << 40, complete=mids)
        await world.until("the daemon logging the refusal", lambda: _logged(world, "fails authentication"))
        await asyncio.sleep(2.0)  # a membership round or two: an accepted intruder would be probed by now
        st = await world.status()
        assert hits == []  # never pinged, never asked for a chunk or a head
        assert st["peers"] == before["peers"] and st["target"] == before["target"]
        v = world.publish(everywhere=True)  # and the daemon still follows the real swarm
        await world.d.wait_version(v, timeout=60)
    finally:
        await runner.cleanup()


async def _logged(world: AttackWorld, text: str) -> bool:
    return text in world.d.log.read_text()
