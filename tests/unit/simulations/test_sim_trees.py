"""Stripe trees (``NodeConfig.tree_fanout``) on real nodes in virtual time: the relay plan, the
requests that wait behind their requester's transfer, and trees kept within a region."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest

from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.scheduler_types import SchedulerConfig
from patchswarm.protocol.trust import TrustState
from patchswarm.simulations.clock import SimClock, run_virtual
from patchswarm.simulations.network import Backbone, Host, Network, Region
from patchswarm.simulations.placeholder import placeholder_held
from patchswarm.simulations.runner import StreamResult, simulate_stream
from patchswarm.simulations.synthetic import synthetic_setup
from patchswarm.simulations.transport import SimNet
from patchswarm.swarm.node import SwarmNode
from tests.support.sim_streams import stream
from tests.support.swarmkit import RUN, SECRET

MB = 1e6
EPOCH = 1_700_000_000.0


def test_a_requesters_next_request_waits_behind_its_transfer_and_takes_over_the_slot() -> None:
    data = b"c" * 10_000

    async def main() -> list[str]:
        net = SimNet(Network([Host("a")], [Region("", 0.001)]))
        cfg = NodeConfig(
            "a",
            RUN,
            SECRET,
            max_uploads=1,
            upload_queue=0,
            upload_rate=10_000.0,
            upload_queue_wait=100.0,
            tree_fanout=2,
        )
        node = SwarmNode(cfg, "sim://a", net.transport("a"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
        node.chunks.put(b"h", data)
        order: list[str] = []

        def sender(tag: str) -> Any:
            async def send(chunk: bytes) -> None:
                order.append(tag)

            return send

        first = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, sender("x1")))  # the one slot, ~1 s
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, sender("x2")))  # behind x1, not refused
        third = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, sender("x3")))
        await asyncio.sleep(0.01)
        # y has no place: the slot is taken and there is no line (upload_queue=0)
        refused = await node.handle_chunk(b"h", "y", -1, sender("y"))
        assert type(refused).__name__ == "Busy"
        third.cancel()  # a follower cancelled while waiting gives up its place and nothing else
        assert await first is None and await second is None
        with contextlib.suppress(asyncio.CancelledError):
            await third
        assert node.upload_slots.in_use == 0 and not node.serving.followers and not node.uploads.sending_to
        # A follower cancelled just as the slot is handed to it passes the slot on (none is lost).
        first = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, sender("x4")))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, sender("x5")))
        await asyncio.sleep(0.01)
        first.add_done_callback(lambda _: second.cancel())
        assert await first is None
        with contextlib.suppress(asyncio.CancelledError):
            await second
        assert node.upload_slots.in_use == 0
        assert await node.handle_chunk(b"h", "z", -1, sender("z")) is None
        net.close()
        return order

    assert run_virtual(main()) == ["x1", "x2", "x4", "z"]


def test_each_stripe_leaves_the_seed_once_to_its_root_and_the_trees_beat_random_pulls() -> None:
    run = synthetic_setup(patch_bytes=24 << 20, chunk_bytes=1 << 18, versions=1)
    trees, usual = stream(run, 16, node_options={"tree_fanout": 4}), stream(run, 16)
    assert trees.complete and usual.complete, (trees.errors, usual.errors)
    from_seed = {row.host: row.from_seed for row in trees.rows}
    # Only the 4 roots fetch from the seed, one stripe (a quarter of the 96 chunks) each.
    assert sorted(b for b in from_seed.values() if b) == [6 << 20] * 4
    assert trees.versions[0].seed_egress == 24 << 20
    # Equal links: a regular relay plan fills them better than requests on random holders.
    assert trees.versions[0].time_to_all < usual.versions[0].time_to_all


def test_trees_stay_within_a_region() -> None:
    # Two regions joined by a thin backbone: every host's trees are made of its own region's hosts,
    # so the far region's hosts fetch across the backbone only what their roots do.
    regions = [Region("r0", 0.001), Region("r1", 0.001)]
    peers = [Host(f"a{i}", "r0", up=50 * MB, down=50 * MB) for i in range(6)]
    peers += [Host(f"b{i}", "r1", up=50 * MB, down=50 * MB) for i in range(6)]
    run = synthetic_setup(patch_bytes=24_000_000, chunk_bytes=1 << 20, versions=1)
    r = simulate_stream(
        run.setup,
        Host("seed", "r0", up=50 * MB, down=50 * MB),
        peers,
        versions=run.versions,
        regions=regions,
        backbones=[Backbone("r0", "r1", capacity=100 * MB, latency=0.02)],
        interval=2.0,
        start_from=placeholder_held(0),
        deadline=60.0,
        seed=4,
        node_options={"tree_fanout": 2},
    )
    assert r.complete, r.errors
    for region in "ab":  # in each region only the 2 roots (fan-out 2) fetch from the seed
        assert 0 < sum(1 for row in r.rows if row.host.startswith(region) and row.from_seed) <= 2


@pytest.mark.slow
def test_no_trees_until_the_member_list_settles() -> None:
    # Published as the hosts join (cold).  While members still arrive no node plans trees, and
    # version 1 spreads by the usual rules: 0.66 s.  Trees planned at once, on lists that differ
    # (tree_settle = 0), took 1.06 s.  4 s later every list has been still for tree_settle, and
    # version 2 flows down the trees, only their 4 roots fetching from the seed.
    run = synthetic_setup(patch_bytes=24 << 20, chunk_bytes=1 << 18, versions=2)

    def cold(**options: Any) -> StreamResult:
        seed = Host("seed", "r0", up=50 * MB, down=50 * MB)
        peers = [Host(f"h{i:02d}", "r0", up=50 * MB, down=50 * MB) for i in range(16)]
        return simulate_stream(
            run.setup,
            seed,
            peers,
            versions=run.versions,
            interval=4.0,
            regions=[Region("r0", 0.001)],
            start_from=placeholder_held(0),
            deadline=60.0,
            seed=4,
            warm_membership=False,
            node_options={"tree_fanout": 4, **options},
        )

    settled, hasty = cold(), cold(tree_settle=0.0)
    assert settled.complete and hasty.complete, (settled.errors, hasty.errors)
    seeded = sorted(row.from_seed for row in settled.rows if row.version == 2 and row.from_seed)
    assert seeded == [6 << 20] * 4
    assert settled.versions[0].time_to_all < hasty.versions[0].time_to_all


def test_tree_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="tree_fanout"):
        NodeConfig("a", RUN, SECRET, tree_fanout=-1)
    with pytest.raises(ValueError, match="tree_settle"):
        NodeConfig("a", RUN, SECRET, tree_settle=float("nan"))
    with pytest.raises(ValueError, match="tree_patience"):
        SchedulerConfig(tree_patience=-1.0)
    with pytest.raises(ValueError, match="max_inflight_per_parent"):
        SchedulerConfig(max_inflight_per_parent=0)
