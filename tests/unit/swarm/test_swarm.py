"""The swarm on real HTTP over loopback: convergence, seed load, late joiners, churn, liars."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from patchswarm.protocol.board_names import HEAD_TAG, head_rel
from patchswarm.protocol.catalog import plan
from patchswarm.protocol.head import Head
from patchswarm.protocol.held import Held
from patchswarm.protocol.membership_messages import MemberState
from patchswarm.protocol.signed import Envelope
from patchswarm.swarm.server import start_http_node
from patchswarm.swarm.transport import Busy, Missing, SendChunk
from tests.support.swarmkit import RUN, Swarm

pytestmark = pytest.mark.asyncio


def head_of(s: Swarm) -> Head:
    return Head.from_bytes(Envelope.from_bytes(s.board.read(head_rel(RUN)) or b"", HEAD_TAG).body)


@pytest.mark.slow
async def test_sixteen_nodes_converge_and_spare_the_seed(tmp_path: Path) -> None:
    s = Swarm(tmp_path)
    s.publish()
    await s.start_seed(zone="z0")
    try:
        for i in range(16):
            await s.start_node(f"n{i:02d}", zone=f"z{i % 4}", region="r0")
        await s.wait_all(1)
        s.assert_bitwise()
        same_zone = [r.node for r in s.nodes.values() if r.node.info.zone == "z0"]
        for _ in range(2):
            before = s.seed.node.metrics.bytes_uploaded  # type: ignore[union-attr]
            from_seed = [n.metrics.bytes_from_seed for n in same_zone]
            v = s.publish(scale=3e-4)
            await s.wait_all(v)
            s.assert_bitwise()
            egress = s.seed.node.metrics.bytes_uploaded - before  # type: ignore[union-attr]
            ratio = egress / s.patch_bytes(v)
            print(f"version {v}: seed egress / patch bytes = {ratio:.2f}")
            assert ratio <= 2.0
            assert any(n.metrics.bytes_from_seed == b for n, b in zip(same_zone, from_seed, strict=True))
    finally:
        await s.close()


async def test_late_joiner_and_stale_node_take_the_byte_minimal_path(tmp_path: Path) -> None:
    s = Swarm(tmp_path)
    for _ in range(3):
        s.publish()
    await s.start_seed()
    try:
        await s.start_node("a")
        await s.wait_all(3)
        for _ in range(5):
            s.publish()
        await s.wait_all(8)
        head = head_of(s)
        # A node holding version 3 (five behind) and a node holding nothing.
        held3 = Held(3, s.served[3].clone(), s.served[3].digests())
        import random

        from patchswarm.protocol.node_config import NodeConfig
        from tests.support.swarmkit import FAST_MEMBERSHIP, SECRET

        cfg = NodeConfig(
            "stale", RUN, SECRET, bootstrap=[s.seed.url], seed_urls=[s.seed.url], membership=FAST_MEMBERSHIP
        )  # type: ignore[union-attr]
        s.nodes["stale"] = await start_http_node(cfg, s.policy(), held=held3, rng=random.Random(7))
        await s.start_node("late")
        await s.wait_all(8)
        s.assert_bitwise()
        assert s.nodes["stale"].node.applied == plan(head.catalog, 3, 8)
        assert s.nodes["late"].node.applied == plan(head.catalog, None, 8)
        assert s.nodes["late"].node.applied[0].kind.value == "anchor"
    finally:
        await s.close()


async def test_churn_quarter_killed_mid_transfer_two_restarted(tmp_path: Path) -> None:
    s = Swarm(tmp_path)
    s.publish()
    await s.start_seed()
    try:
        for i in range(12):
            await s.start_node(f"n{i:02d}", zone=f"z{i % 3}")
        await s.wait_all(1)
        v = s.publish(scale=1e-3)  # a bigger patch, so there is a transfer to interrupt
        await asyncio.sleep(0.15)
        victims = sorted(s.nodes)[::4][:3]  # 25% of the nodes
        for name in victims:
            await s.crash(name)
        for name in victims[:2]:
            await s.start_node(name + "-restarted")
        await s.wait_all(v, timeout=90)
        s.assert_bitwise()  # every held version is complete and verified: nothing partial applied
    finally:
        await s.close()


async def test_corrupting_peer_is_banned_and_chunks_refetched(tmp_path: Path) -> None:
    s = Swarm(tmp_path)
    s.publish()
    await s.start_seed()
    try:
        liar = await s.start_node("liar")
        await s.wait_all(1)
        real = liar.node.handle_chunk

        async def corrupt(
            h: bytes, requester: str, held: int, send: SendChunk, origin: str = ""
        ) -> Busy | Missing | None:
            async def flipped(data: bytes) -> None:
                await send(bytes([data[0] ^ 0xFF]) + data[1:])

            return await real(h, requester, held, flipped, origin)

        liar.node.handle_chunk = corrupt  # type: ignore[method-assign]
        for i in range(5):
            await s.start_node(f"n{i}")
        v = s.publish(scale=1e-3)
        await s.wait_all(v, timeout=90)
        s.assert_bitwise()
        honest = [r for n, r in s.nodes.items() if n != "liar"]
        assert sum(r.node.metrics.hash_failures for r in honest) > 0
    finally:
        await s.close()


async def test_silent_peer_is_declared_dead(tmp_path: Path) -> None:
    s = Swarm(tmp_path)
    s.publish()
    await s.start_seed()
    try:
        for i in range(4):
            await s.start_node(f"n{i}")
        await s.wait_all(1)
        await s.crash("n3")
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            views = [dict((i.node_id, st) for i, st in r.node.membership.members()) for r in s.nodes.values()]
            if all(v.get("n3") in (MemberState.DEAD, None) for v in views):
                break
            assert asyncio.get_running_loop().time() < deadline, views
            await asyncio.sleep(0.1)
    finally:
        await s.close()


async def test_slow_peer_loses_its_requests(tmp_path: Path) -> None:
    s = Swarm(tmp_path)
    s.publish()
    await s.start_seed()
    try:
        await s.start_node("slow", upload_rate=20_000.0)
        for i in range(3):
            await s.start_node(f"fast{i}")
        await s.wait_all(1)
        await s.start_node("fresh")
        v = s.publish(scale=1e-3)
        await s.wait_all(v, timeout=90)
        s.assert_bitwise()
        slow = s.nodes["slow"].node.metrics.bytes_uploaded
        fast = max(s.nodes[f"fast{i}"].node.metrics.bytes_uploaded for i in range(3))
        print(f"uploaded: slow {slow}, fastest {fast}")
        assert slow < fast
    finally:
        await s.close()
