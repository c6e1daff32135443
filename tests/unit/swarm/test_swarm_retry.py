"""A catch-up that fails after its manifest was verified (the host's activation failed: a journal
directory briefly unwritable, EMFILE, ...) is retried from a clean state, with bounded backoff: the
manifest is taken again, and what the node serves to peers is only ever the bytes that verified."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import blake3
import pytest

from patchswarm.protocol.board_names import manifest_rel
from patchswarm.protocol.held import Held
from patchswarm.protocol.manifest import SignedManifest
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.server import start_http_node
from tests.support.swarmkit import FAST_MEMBERSHIP, RUN, SECRET, Swarm


def retrying_config(name: str, sw: Swarm) -> NodeConfig:
    assert sw.seed is not None
    return NodeConfig(
        name, RUN, SECRET, bootstrap=[sw.seed.url], seed_urls=[sw.seed.url], membership=FAST_MEMBERSHIP,
        head_poll_interval=0.2, retry_backoff=0.05, retry_backoff_max=0.2,
    )  # fmt: skip


async def served_manifests(url: str, node: SwarmNode) -> dict[str, bytes | None]:
    """What the node answers peers for each manifest its head names (None: 404)."""
    assert node.head is not None
    out: dict[str, bytes | None] = {}
    async with aiohttp.ClientSession() as s:
        for e in node.head.catalog:
            rel = manifest_rel(e.manifest_id)
            async with s.get(f"{url}/swarm/v1/board/{rel}") as r:
                out[rel] = await r.read() if r.status == 200 else None
                assert r.status in (200, 404), r.status
    return out


async def until(cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def assert_verifies(rel: str, data: bytes) -> None:
    signed = SignedManifest.from_bytes(data)  # "manifest envelope is malformed" for an empty one
    assert blake3.blake3(signed.body).hexdigest() == rel.removeprefix("manifests/")


@pytest.mark.asyncio
async def test_failed_activations_are_retried_and_only_verified_manifests_are_served(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    fails = {"left": 4}
    seen: list[int] = []
    node = None

    async def activate(held: Held) -> None:
        assert node is not None
        seen.append(held.version)
        # Every try, including the retries, is served nothing but verified manifests.
        for rel, data in (await served_manifests(node.url, node.node)).items():
            if data is not None:
                assert_verifies(rel, data)
        if fails["left"]:
            fails["left"] -= 1
            raise OSError(24, "Too many open files")

    try:
        node = await start_http_node(retrying_config("h", sw), sw.policy(), rng=random.Random(1), on_version=activate)
        await until(lambda: node.node.held is not None and node.node.held.version == 1, 30)
        assert seen == [1] * 5
        assert node.node.error is None and node.node.failures == 0 and node.node.metrics.apply_failures == 4
        assert node.node.held is not None and node.node.held.model.bitwise_equal(sw.served[1])
        fails["left"] = 3
        v2 = sw.publish()  # a patch on top of version 1: the same path again, with a base
        await until(lambda: node.node.held is not None and node.node.held.version == v2, 30)
        assert seen[-4:] == [v2] * 4
        served = await served_manifests(node.url, node.node)
        assert served and all(data is not None for data in served.values())
        for rel, data in served.items():
            assert data is not None
            assert_verifies(rel, data)
        assert node.node.complete.count(node.node.head.catalog[-1].manifest_id) <= 1  # type: ignore[union-attr]
    finally:
        if node is not None:
            await node.stop()
        await sw.close()


def test_retry_backoff_doubles_to_its_bound_with_jitter_from_the_nodes_rng(tmp_path: Path) -> None:
    cfg = NodeConfig("h", RUN, SECRET, retry_backoff=0.5, retry_backoff_max=8.0)

    def delays(seed: int) -> list[float]:
        node = SwarmNode.__new__(SwarmNode)  # (only config, rng and failures are read)
        node.config, node.rng = cfg, random.Random(seed)
        out = []
        for n in range(1, 12):
            node.failures = n
            out.append(node.retry_delay())
        return out

    d = delays(7)
    assert d == delays(7) and d != delays(8)  # the node's seeded RNG, nothing else
    steps = [min(8.0, 0.5 * 2 ** (n - 1)) for n in range(1, 12)]
    assert all(s / 2 <= x <= s for x, s in zip(d, steps, strict=True))
    assert max(d) <= 8.0 and d[-1] >= 4.0
    with pytest.raises(ValueError, match="retry_backoff"):
        NodeConfig("h", RUN, SECRET, retry_backoff=0)
    with pytest.raises(ValueError, match="retry_backoff"):
        NodeConfig("h", RUN, SECRET, retry_backoff=1.0, retry_backoff_max=float("inf"))
