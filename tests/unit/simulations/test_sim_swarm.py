"""Real SwarmNodes in virtual time: a seed and peers on a simulated network with rate limits; placeholder streams."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from patchswarm.protocol.errors import ChunkError, PatchswarmError
from patchswarm.protocol.held import Held
from patchswarm.protocol.served import state_root
from patchswarm.protocol.trust import TrustState
from patchswarm.simulations.network import Backbone, Host, Region
from patchswarm.simulations.placeholder import apply_nothing, placeholder_held, verify_size
from patchswarm.simulations.runner import (
    Churn,
    Outage,
    SwarmResult,
    SwarmSetup,
    simulate_swarm,
)
from patchswarm.simulations.synthetic import SyntheticRun, synthetic_setup
from patchswarm.simulations.transport import placeholder_bytes
from tests.support.sim_streams import stream
from tests.support.swarmkit import RUN, SECRET, Swarm

MB = 1e6
EPOCH = 1_700_000_000.0  # any wall time inside the certificate's validity would do; fixed for reproducibility


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Swarm:
    """A board whose head is version 1 (an anchor), with real manifests and chunks."""
    s = Swarm(Path(tmp_path_factory.mktemp("board")))
    s.publish()
    return s


@pytest.fixture(scope="module")
def patched(tmp_path_factory: pytest.TempPathFactory) -> Swarm:
    """A board whose head is version 2, a patch over version 1."""
    s = Swarm(Path(tmp_path_factory.mktemp("board")))
    s.publish()
    s.publish(scale=3e-4)
    return s


def setup_of(s: Swarm) -> SwarmSetup:
    import time

    return SwarmSetup(s.board, RUN, SECRET, s.policy, epoch=float(int(time.time())))


def lan(n: int, up: float = 1 * MB, down: float = 4 * MB) -> tuple[Host, list[Host]]:
    return Host("seed", "r0", up=2 * MB), [Host(f"n{i}", "r0", up=up, down=down) for i in range(n)]


def root_of(s: Swarm, version: int) -> bytes:
    m = s.served[version]
    return state_root(m.specs, m.digests())


def check(s: Swarm, r: SwarmResult, version: int, peers: int) -> None:
    assert r.complete, (r.reached, r.errors)
    assert len(r.reached) == peers
    assert r.errors == {}
    assert set(r.roots.values()) == {root_of(s, version)}  # every peer holds the published bits
    assert r.time_to_all >= r.lower_bound > 0
    assert sum(r.from_seed.values()) + sum(r.from_peers.values()) == peers * r.payload_bytes


def test_eight_peers_reach_the_anchor_no_faster_than_the_kumar_ross_bound(published: Swarm) -> None:
    seed, peers = lan(8)
    r = simulate_swarm(setup_of(published), seed, peers, 1, regions=[Region("r0", 0.005)], seed=1, deadline=120)
    check(published, r, 1, 8)
    # The seed hands out about one copy; the peers trade the rest among themselves.
    assert r.seed_uploaded <= 2 * r.payload_bytes
    assert sum(r.from_peers.values()) > sum(r.from_seed.values())
    # Nobody's uplink carried more than its limit allows over the run.
    for host in [seed, *peers]:
        assert r.sent.get(host.id, 0.0) <= host.up * r.time_to_all * (1 + 1e-9)
    print(f"time to all {r.time_to_all:.3f} s, bound {r.lower_bound:.3f} s, {r.loop_jumps} virtual-time jumps")


def test_the_same_seed_gives_identical_results(published: Swarm) -> None:
    seed, peers = lan(8)
    setup = setup_of(published)
    runs = [
        simulate_swarm(setup, seed, peers, 1, regions=[Region("r0", 0.005)], seed=7, deadline=120) for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert runs[0].complete


def test_peers_holding_version_1_fetch_only_the_patch(patched: Swarm) -> None:
    s = patched
    held = Held(1, s.served[1].clone(), s.served[1].digests())
    seed, peers = lan(8)
    r = simulate_swarm(setup_of(s), seed, peers, 2, regions=[Region("r0", 0.005)], seed=3, start_from=held)
    check(s, r, 2, 8)
    assert r.payload_bytes == s.patch_bytes(2)


def test_two_regions_over_a_narrow_backbone(published: Swarm) -> None:
    seed = Host("seed", "east", up=4 * MB)
    peers = [Host(f"e{i}", "east", up=2 * MB, down=8 * MB) for i in range(4)]
    peers += [Host(f"w{i}", "west", up=2 * MB, down=8 * MB) for i in range(4)]
    r = simulate_swarm(
        setup_of(published),
        seed,
        peers,
        1,
        regions=[Region("east", 0.002), Region("west", 0.002)],
        backbones=[Backbone("east", "west", capacity=0.5 * MB, latency=0.04)],
        seed=5,
        deadline=300,
    )
    check(published, r, 1, 8)
    # Everything the west needs crosses a 0.5 MB/s backbone at least once.
    assert r.time_to_all >= r.payload_bytes / (0.5 * MB)


def test_gossip_as_flows_still_converges(published: Swarm) -> None:
    seed, peers = lan(4)
    r = simulate_swarm(
        setup_of(published), seed, peers, 1, regions=[Region("r0", 0.005)], seed=2, deadline=120, gossip_flows=True
    )
    check(published, r, 1, 4)
    assert sum(r.sent.values()) > 4 * r.payload_bytes  # gossip bytes now count as traffic


# ---------------------------------------------------------------- upload slots


def test_a_request_cancelled_while_queued_for_an_upload_slot_loses_no_slot() -> None:
    """A handler cancelled in the slot queue must not keep the slot (docs/simulation.md#what-the-node-provides)."""
    import asyncio
    import contextlib
    import random

    from patchswarm.protocol.node_config import NodeConfig
    from patchswarm.protocol.trust import TrustState
    from patchswarm.simulations.clock import SimClock, run_virtual
    from patchswarm.simulations.network import Network
    from patchswarm.simulations.transport import SimNet
    from patchswarm.swarm.node import SwarmNode

    data = b"c" * 10_000

    async def main() -> list[tuple[int, int]]:
        net = SimNet(Network([Host("a")], [Region("", 0.001)]))
        cfg = NodeConfig("a", RUN, SECRET, max_uploads=1, upload_rate=10_000.0, upload_queue_wait=100.0)
        node = SwarmNode(cfg, "sim://a", net.transport("a"), SimClock(EPOCH), TrustState(b"k" * 32), random.Random(0))
        node.chunks.put(b"h", data)
        sent: list[bytes] = []

        async def send(chunk: bytes) -> None:
            sent.append(chunk)

        seen: list[tuple[int, int]] = []
        for handed_over in (False, True):
            first = asyncio.ensure_future(node.handle_chunk(b"h", "x", -1, send))  # holds the one slot for ~0.9 s
            await asyncio.sleep(0.01)
            queued = asyncio.ensure_future(node.handle_chunk(b"h", "y", -1, send))
            await asyncio.sleep(0.01)
            seen.append((node.upload_slots.in_use, len(node.serving.queue)))
            if handed_over:
                # Cancel it right after `first` hands it the slot, before it runs again.
                first.add_done_callback(lambda _, q=queued: q.cancel())  # type: ignore[misc]
            else:
                queued.cancel()
            assert await first is None and sent.pop() == data
            with contextlib.suppress(asyncio.CancelledError):
                await queued
            assert queued.cancelled() and not sent
            seen.append((node.upload_slots.in_use, len(node.serving.queue)))
            assert await node.handle_chunk(b"h", "z", -1, send) is None  # the slot is still there to take
            assert sent.pop() == data
        net.close()
        return seen

    assert run_virtual(main()) == [(1, 1), (0, 0), (1, 1), (0, 0)]


# ---------------------------------------------------------------- placeholder streams


@pytest.fixture(scope="module")
def synthetic() -> SyntheticRun:
    return synthetic_setup(patch_bytes=20_000_000, chunk_bytes=1 << 20, versions=3)


def test_synthetic_manifests_and_heads_are_real_signed_documents(synthetic: SyntheticRun) -> None:
    from patchswarm.protocol.head import verify_head
    from patchswarm.protocol.manifest import SignedManifest

    policy = synthetic.setup.policy()
    assert isinstance(policy, TrustState)
    board = synthetic.board
    cert = board.read(next(k for k in board.files if k.startswith("certs/")))
    assert cert is not None
    policy.add_certificate(cert)
    now_ms = int(synthetic.setup.epoch * 1000)
    for v in (0, *synthetic.versions):
        head, _ = verify_head(board.heads[v], policy, now_ms=now_ms, skew_ms=0)
        assert (head.version, head.counter, len(head.catalog)) == (v, v, v + 1)
        m = SignedManifest.from_bytes(board.read(f"manifests/{head.manifest_id.hex()}") or b"").verify(
            policy, now_ms=now_ms
        )
        assert m.payload_size == (20_000_000 if v else synthetic.anchor_bytes)
        assert m.base_version == (v - 1 if v else None) and len(m.chunks) == 20
    forged = bytearray(board.heads[1])
    forged[-1] ^= 1
    with pytest.raises(PatchswarmError):
        verify_head(bytes(forged), policy, now_ms=now_ms, skew_ms=0)


def test_placeholder_checks_sizes_and_applies_nothing(synthetic: SyntheticRun) -> None:
    from patchswarm.protocol.chunks import ChunkRef

    verify_size(0, placeholder_bytes(5), ChunkRef(5, b"\0" * 32))
    with pytest.raises(ChunkError):
        verify_size(3, placeholder_bytes(4), ChunkRef(5, b"\0" * 32))
    m = synthetic.board.manifest(synthetic.board.manifest_ids[2])
    held = apply_nothing(placeholder_held(1), m, [placeholder_bytes(r.size) for r in m.chunks])
    assert held.version == 2 and held.model.specs == []
    with pytest.raises(ChunkError):
        apply_nothing(placeholder_held(1), m, [])
    with pytest.raises(ValueError):
        synthetic_setup(patch_bytes=0)


def test_a_stream_of_placeholder_versions_reaches_every_host(synthetic: SyntheticRun) -> None:
    r = stream(synthetic)
    assert r.complete, r.errors
    assert r.errors == {}
    assert [v.version for v in r.versions] == [1, 2, 3]
    assert [v.published for v in r.versions] == [0.0, 2.0, 4.0]
    for v in r.versions:
        assert v.payload_bytes == 20_000_000 and v.hosts_done == 12
        assert v.time_to_all >= v.lower_bound > 0
        assert v.seed_egress >= v.payload_bytes  # every chunk left the seed at least once
    for row in r.rows:
        assert row.from_seed + row.from_peers == 20_000_000, row
        assert row.done >= row.published
    assert sum(row.from_peers for row in r.rows) > sum(row.from_seed for row in r.rows)
    assert r.events > 0 and r.wall_seconds > 0


def test_the_same_seed_gives_identical_stream_results(synthetic: SyntheticRun) -> None:
    churn = Churn(rate=0.05, downtime=1.0)
    a, b = stream(synthetic, churn=churn), stream(synthetic, churn=churn)
    assert a == b
    assert a.outages  # the churn happened
    assert stream(synthetic, churn=churn, seed=5) != a


def test_a_host_that_crashes_mid_download_loses_its_transfers_and_catches_up(synthetic: SyntheticRun) -> None:
    # h03 dies 0.3 s after version 2 appears (mid-download), comes back 3 s later holding version 1.
    r = stream(synthetic, churn=Churn(schedule=((2.3, "h03", 3.0),)))
    assert r.complete, r.errors
    assert r.outages == (Outage("h03", pytest.approx(2.3), pytest.approx(5.3)),)
    rows = {(row.host, row.version): row for row in r.rows}
    assert rows[("h03", 2)].done > 5.3 and rows[("h03", 3)].done > 5.3
    assert rows[("h03", 1)].done < 2.0  # done before the crash
    others = max(row.done for row in r.rows if row.host != "h03" and row.version == 2)
    assert others < 5.3  # the others did not wait for it
    # What h03 fetched before the crash was lost with its memory: it took at least the whole patch again.
    assert rows[("h03", 2)].from_seed + rows[("h03", 2)].from_peers >= 20_000_000


def test_hosts_down_at_the_end_and_fresh_rejoins(synthetic: SyntheticRun) -> None:
    events = ((1.0, "h01", False), (30.0, "h01", True), (0.5, "h02", False))
    r = stream(synthetic, churn=Churn(events=events, persist=False), deadline=40.0)
    rows = {(row.host, row.version): row for row in r.rows}
    assert not r.complete
    assert all(rows[("h02", v)].done == math.inf for v in (2, 3))  # never came back
    assert Outage("h02", pytest.approx(0.5), math.inf) in r.outages
    # h01 came back with nothing: the anchor (20 MB) and the three patches.
    assert rows[("h01", 3)].done > 30.0
    assert sum(rows[("h01", v)].from_seed + rows[("h01", v)].from_peers for v in (2, 3)) == 40_000_000


def test_stream_input_errors(synthetic: SyntheticRun, published: Swarm) -> None:
    with pytest.raises(ValueError, match="unknown host"):
        stream(synthetic, churn=Churn(schedule=((1.0, "nobody", 1.0),)))
    with pytest.raises(ValueError, match="publish"):
        stream(SyntheticRun(setup_of(published), synthetic.board, (1,), 1, 1, 1 << 20))
    with pytest.raises(ValueError):
        Churn(rate=-1)


def test_a_version_hosts_already_hold_is_done_when_published(synthetic: SyntheticRun) -> None:
    r = stream(synthetic, n=4, versions=(0, 1), interval=1.0)
    assert r.complete
    assert [row.done for row in r.rows if row.version == 0] == [0.0] * 4
    assert r.versions[0].time_to_all == 0.0 and r.versions[0].seed_egress == 0


def test_news_of_a_rare_chunk_does_not_wait_for_the_announce_tick() -> None:
    """A chunk that few peers hold spreads in hops; with a long tick (0.2 s) each hop would wait for it.
    12 hosts: 0.77 s to all when every announcement waits for the tick, 0.67 s when rare news goes at once
    (0.93 and 0.75 s before the seed kept its line for hosts it was not serving)."""
    run = synthetic_setup(patch_bytes=20_000_000, chunk_bytes=1 << 20, versions=1)
    slow, fast = (stream(run, node_options={"announce_interval": 0.2, "announce_rare": rare}) for rare in (-1, 2))
    assert slow.complete and fast.complete, (slow.errors, fast.errors)
    assert fast.versions[0].time_to_all <= slow.versions[0].time_to_all - 0.05
