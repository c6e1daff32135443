"""Attacks on trust through a real daemon: forged, foreign, stale, frozen, fast-forwarded and forked
signed heads, a revoked trainer key, and equivocation with a leaked trainer key.

One daemon (clock skew 1 s, so a frozen board shows within seconds), one honest seed and one
adversary are shared by the module; the tests run in file order because the world moves forward
(a key is revoked, the daemon restarts talking only to the adversary, the run is finally halted),
but each asserts only what its own attack must and must not change: the specific refusal counted
in ``patchswarm_heads_refused_total{reason=...}``, the served version and root, the persisted head
counter and the head version the daemon targets.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import pytest_asyncio

from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.board_names import HEAD_TAG, cert_rel, head_rel
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.head import Head
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.patchfile import build_version
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import Certificate, RootDocument
from tests.support.adversary import AttackWorld, foreign_run, mirror
from tests.support.swarmkit import RUN

pytestmark = pytest.mark.asyncio(loop_scope="module")
HEAD = head_rel(RUN)
DAY_MS = 86_400_000


def refused(reason: str) -> str:
    return f'patchswarm_heads_refused_total{{reason="{reason}"}}'


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AttackWorld]:
    w = AttackWorld(tmp_path_factory.mktemp("attacks-trust"))
    try:
        await w.start(clock_skew="1s")
        yield w
    finally:
        await w.close()


def current(world: AttackWorld) -> tuple[Head, Envelope]:
    env = Envelope.from_bytes(world.head_bytes(), HEAD_TAG)
    return Head.from_bytes(env.body), env


async def refused_head(world: AttackWorld, reason: str, data: bytes, **objects: bytes) -> dict[str, float]:
    """The adversary lures the daemon (a head counter far ahead) and serves ``data`` as the head."""
    before = await world.status()
    counter = world.persisted_counter()
    m0 = await world.metrics()
    world.adversary.behave(objects={HEAD: data, **objects}, head_counter=1 << 40)
    try:
        m = await world.metric_above(refused(reason), m0.get(refused(reason), 0))
        st = await world.assert_unchanged(before["version"], counter)
        assert st["target"] == before["target"]
    finally:
        world.adversary.behave()
    return m


async def test_head_with_a_forged_signature_is_refused(world: AttackWorld) -> None:
    head, env = current(world)
    bumped = dataclasses.replace(head, counter=head.counter + 1, version=head.version)
    forged = Envelope(HEAD_TAG, bumped.to_bytes(), env.key_id, env.signature)  # the genuine signature, moved
    await refused_head(world, "SignatureError", forged.to_bytes())


async def test_head_signed_by_an_unknown_key_is_refused(world: AttackWorld) -> None:
    head, _ = current(world)
    mallory, fake_root = SigningKey.generate(), SigningKey.generate()
    now = int(time.time() * 1000)
    cert = Certificate(mallory.key_id, RUN, now - DAY_MS, now + DAY_MS).sign(fake_root).to_bytes()
    forged = dataclasses.replace(head, counter=head.counter + 1).sign(mallory).to_bytes()
    await refused_head(world, "UntrustedKeyError", forged, **{cert_rel(mallory.key_id): cert})


async def test_head_of_another_run_is_refused(world: AttackWorld) -> None:
    board, key = foreign_run(world.tmp, world.sw.root, "other-run")
    other = Head.from_bytes(Envelope.from_bytes(board.read(head_rel("other-run")) or b"", HEAD_TAG).body)
    # Genuine: signed by a key the same root certified, for its own run, with a counter far ahead.
    data = dataclasses.replace(other, counter=1 << 30).sign(key).to_bytes()
    cert = board.read(cert_rel(key.key_id)) or b""
    await refused_head(world, "FormatError", data, **{cert_rel(key.key_id): cert})


async def test_fast_forward_claim_is_ignored_and_later_versions_still_land(world: AttackWorld) -> None:
    before = await world.status()
    counter = world.persisted_counter()
    m0 = await world.settled_metrics()  # refusals of the previous attack may still be in flight
    asked = world.adversary.requests["object"]
    # "My head is at counter 2**62": the daemon asks, gets only the genuine head, and moves nowhere.
    world.adversary.behave(head_counter=1 << 62)
    await world.until("a head request to the liar", lambda: _above(world.adversary.requests["object"], asked + 2))
    st = await world.assert_unchanged(before["version"], counter)
    assert st["target"] == before["target"]
    v = world.publish(everywhere=True)
    st = await world.d.wait_version(v, timeout=60)
    assert st["root"] == world.sw.served[v].root().hex() and world.persisted_counter() > counter
    m = await world.metrics()
    refusals = {k: v for k, v in m.items() if k.startswith("patchswarm_heads_refused_total")}
    assert refusals == {k: v for k, v in m0.items() if k.startswith("patchswarm_heads_refused_total")}
    world.adversary.behave()


async def test_frozen_board_is_noticed_when_the_head_expires(world: AttackWorld) -> None:
    assert world.sw.pub is not None
    ttl = world.sw.pub.head_ttl_ms
    world.sw.pub.head_ttl_ms = 3000  # the trainer's last head, then silence: every mirror keeps serving it
    try:
        v = world.publish(everywhere=True)
    finally:
        world.sw.pub.head_ttl_ms = ttl
    await world.d.wait_version(v, timeout=60)
    counter = world.persisted_counter()
    m0 = await world.metrics()
    m = await world.metric_above(refused("ExpiredError"), m0.get(refused("ExpiredError"), 0))
    assert m["patchswarm_head_ttl_seconds"] < 0
    assert "the board may be frozen" in world.d.log.read_text()
    await world.assert_unchanged(v, counter)  # nothing is lost: the engine keeps serving the last version


async def test_revoked_trainer_key_is_refused_and_its_successor_trusted(world: AttackWorld) -> None:
    sw = world.sw
    assert sw.pub is not None and world.seed is not None
    old = sw.trainer
    new = SigningKey.generate()
    now = int(time.time() * 1000)
    head, _ = current(world)
    # Before anyone notices, the leaked key fast-forwards the daemon: a valid head at counter 2**40.
    ahead = dataclasses.replace(head, counter=1 << 40, created_ms=now, expires_ms=now + 60_000).sign(old).to_bytes()
    world.adversary.behave(objects={HEAD: ahead}, head_counter=1 << 40)

    async def fast_forwarded() -> bool:
        view = world.seed.node.peers.get(world.d.name) if world.seed else None  # what the daemon announces
        return view is not None and view.ann.head_counter == 1 << 40

    await world.until("the daemon following the leaked key's head", fast_forwarded)
    world.adversary.behave()
    # The trust admin: root document 1 revokes the leaked key, the root certifies its successor.
    sw.board.put_root(1, RootDocument(1, (sw.root.key_id,), (old.key_id,)).sign(sw.root).to_bytes())
    sw.board.put_certificate(
        new.key_id, Certificate(new.key_id, RUN, now - DAY_MS, now + DAY_MS).sign(sw.root).to_bytes()
    )
    world.release()
    stolen = dataclasses.replace(head, counter=(1 << 40) + 5, created_ms=now, expires_ms=now + 60_000)
    await refused_head(world, "UntrustedKeyError", stolen.sign(old).to_bytes())
    assert "is revoked (root version 1)" in world.d.log.read_text()
    # The trainer goes on with its new key, at its own counter: far below the leaked 2**40, yet it
    # lands, because a mark set by a key revoked since is dropped.
    sw.pub.key, sw.trainer = new, new
    v = world.publish(everywhere=True)
    st = await world.d.wait_version(v, timeout=60)
    assert st["root"] == sw.served[v].root().hex()
    assert world.persisted_counter() == current(world)[0].counter < 1 << 40
    assert "its mark is dropped" in world.d.log.read_text()


async def test_replayed_head_is_refused_after_a_restart(world: AttackWorld) -> None:
    old_head = world.head_bytes()  # genuine, signed by the current key
    v = world.publish(everywhere=True)
    await world.d.wait_version(v, timeout=60)
    assert await world.d.stop() == 0
    counter = world.persisted_counter()
    assert counter == current(world)[0].counter
    # Back up talking only to the adversary, as its peer and its board mirror, which replays the older head.
    world.configure(bootstrap=[world.adversary.url], seed_urls=[world.adversary.url])
    world.adversary.behave(objects={HEAD: old_head}, head_counter=1 << 40)
    world.d.start()
    await world.until("the daemon's API", world.d.status)
    await world.metric_above(refused("RollbackError"), 0)
    await world.assert_unchanged(v, counter)
    world.adversary.behave()


async def test_equivocation_keeps_both_heads_halts_the_run_and_reports_it(world: AttackWorld) -> None:
    sw = world.sw
    head, env = current(world)
    held = (await world.status())["version"]
    assert held == head.version
    counter = world.persisted_counter()
    # The trainer's key leaked: a second, different manifest for the version hosts serve, and a head naming it.
    fork = {k: w + 0.01 for k, w in sw.weights.items()}
    served = ServedModel.from_tensors(ServedFormat("bf16").convert(fork))
    now = int(time.time() * 1000)
    version = build_version(None, served, run_id=RUN, version=held, now_ms=now, key=sw.trainer, chunk_size=16 << 10)
    mid = world.adversary.board.put_version(version)
    entry = CatalogEntry(held, Kind.ANCHOR, None, version.manifest.payload_size, mid)
    forked = Head(RUN, held, mid, head.counter + 1, now, now + 60_000, (entry,)).sign(sw.trainer).to_bytes()
    m0 = await world.metrics()
    world.adversary.behave(objects={HEAD: forked}, head_counter=1 << 40)
    m = await world.metric_above(refused("EquivocationError"), m0.get(refused("EquivocationError"), 0))
    assert m["patchswarm_run_halted"] == 1
    st = await world.assert_unchanged(held, counter)
    assert st["state"] == "error" and "run halted" in st["reason"], st
    # The proof on disk: both signed heads, each verifiable, naming two manifests for one version.
    files = world.evidence_files()
    assert len(files) == 1
    proof = msgpack.unpackb(files[0].read_bytes(), raw=False)
    first, second = (Envelope.from_bytes(proof[k], HEAD_TAG) for k in ("first", "second"))
    for e in (first, second):
        e.check_signature()
        assert e.key_id == sw.trainer.key_id
    assert first.body == env.body and second.to_bytes() == forked
    # Halted: the honest trainer's next version is refused too (an operator decides which history is real).
    world.adversary.behave()
    v = world.publish(everywhere=True)
    mirror(sw.board, world.adversary.board)
    again = await world.metric_above(refused("EquivocationError"), m[refused("EquivocationError")])
    assert again["patchswarm_version_applied"] == held
    await world.assert_unchanged(held, counter)
    assert v > held


async def _above(value: int, floor: int) -> bool:
    return value > floor
