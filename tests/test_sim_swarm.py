"""Real SwarmNodes in virtual time: a seed and eight peers on a simulated network with rate limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.pull import Held
from protocol.served import state_root
from simulations.network import Backbone, Host, Region
from simulations.runner import SwarmResult, SwarmSetup, simulate_swarm
from tests.swarmkit import RUN, SECRET, Swarm

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
