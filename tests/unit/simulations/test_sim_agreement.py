"""The simulator against real nodes: the same swarm, the same upload limits, the same time to all.

A seed (0.5 MB/s up) and eight peers (0.5 and 0.3 MB/s up, alternating) fetch one ~3 MB
version.  Real: in-process SwarmNodes over real HTTP on loopback.  Simulated: the same nodes in
virtual time on the flow model.  Same bootstrap pattern (the seed and the two previous peers),
gossip only (no board polling), same node settings; time to all must agree within 15% (the
simulated figure is the mean of eight seeds: one run's random choices move it by up to 7%).

Where the limits live matters, and is the same on both sides: on loopback the only thing that
can hold a host's uplink is the node's own token bucket, so the simulated nodes get the same
buckets (``host_options``) on unconstrained simulated links.  Modelling the limit as the host's
uplink instead is a different regime, not a wrong one: a node's bucket waits *inside* the upload
handler (FIFO, holding an upload slot), whereas a NIC-limited host returns from the handler at
once and its transfers share the link max-min afterwards (slots then count handlers, not bytes on
the wire).  Measured here with the limits as uplinks: 13.6 s simulated against 9.1 s real on a
quiet machine; the sharing model itself is checked against the golden case in
tests/unit/simulations/test_sim_network.py.

Also: the seed hands each chunk out once (a 30 s copy window), so its egress, which sets the time
here, does not hinge on when retries land; slow links and announcements every 0.2 s keep the
real run's CPU cost on this shared machine small next to the transfer time.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.held import Held
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.scheduler_types import SchedulerConfig
from patchswarm.protocol.trust import Certificate
from patchswarm.simulations.bounds import kumar_ross
from patchswarm.simulations.network import Host, Region
from patchswarm.simulations.runner import SwarmResult, SwarmSetup, payload_bytes, simulate_swarm
from patchswarm.swarm.server import RunningNode, start_http_node
from tests.support.swarmkit import FAST_MEMBERSHIP, RUN, SECRET, Swarm

MB = 1e6
SEED_UP = 0.5 * MB
PEER_UP = [0.5 * MB, 0.3 * MB] * 4  # per-host upload limits: fast and slow hosts alternate
CHUNK = 64 << 10
# The same node settings on both sides (see the module docstring); deadlines sized for slow uplinks.
OPTIONS: dict[str, Any] = {
    "membership": FAST_MEMBERSHIP,
    "seed_copy_window": 30.0,
    "announce_interval": 0.2,
    "scheduler": SchedulerConfig(deadline_rate=10e3),
}


def publish_model(tmp: Path) -> tuple[Swarm, int, int]:
    """A board holding one ~3 MB version in 64 KiB chunks."""
    s = Swarm(tmp)
    now = int(time.time() * 1000)
    cert = Certificate(s.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(s.root).to_bytes()
    s.pub = Publisher(s.board, s.trainer, run_id=RUN, certificate=cert, chunk_size=CHUNK)
    gen = torch.Generator().manual_seed(1)
    s.weights = {f"layer{i}.weight": torch.randn(1024, 512, generator=gen) * 0.02 for i in range(4)}
    version = s.publish()
    return s, version, payload_bytes(s.board, RUN, version)


async def real_time_to_all(s: Swarm, version: int) -> float:
    loop = asyncio.get_running_loop()
    reached: dict[str, float] = {}
    everyone = asyncio.Event()
    running: list[RunningNode] = []

    def on_version(name: str) -> Callable[[Held], None]:
        def record(held: Held) -> None:
            reached.setdefault(name, loop.time() - t0)
            if len(reached) == len(PEER_UP):
                everyone.set()

        return record

    t0 = loop.time()
    try:
        seed_cfg = NodeConfig("seed", RUN, SECRET, region="r0", is_seed=True, upload_rate=SEED_UP, **OPTIONS)
        running.append(await start_http_node(seed_cfg, s.policy(), board=s.board, rng=random.Random(0)))
        peers: list[RunningNode] = []
        for i, rate in enumerate(PEER_UP):
            name = f"n{i}"
            bootstrap = [running[0].url, *(p.url for p in peers[max(0, i - 2) : i])]
            cfg = NodeConfig(name, RUN, SECRET, region="r0", bootstrap=bootstrap, upload_rate=rate, **OPTIONS)
            node = await start_http_node(cfg, s.policy(), rng=random.Random(i + 1), on_version=on_version(name))
            peers.append(node)
            running.append(node)
        async with asyncio.timeout(120):
            await everyone.wait()
        for p in peers:
            assert p.node.held is not None and p.node.held.version == version
            assert p.node.held.model.bitwise_equal(s.served[version])
        return max(reached.values())
    finally:
        for r in reversed(running):
            await r.stop()


@pytest.mark.asyncio
async def test_simulated_time_to_all_agrees_with_real_loopback_nodes(tmp_path: Path) -> None:
    s, version, size = publish_model(tmp_path)
    assert size > 2.5 * MB  # the transfer, not the protocol's fixed delays, sets the time
    real = await real_time_to_all(s, version)
    # The limits where the loopback nodes have them: in each node's token bucket (see the docstring).
    seed = Host("seed", "r0")
    peers = [Host(f"n{i}", "r0") for i in range(len(PEER_UP))]
    limits = {"seed": {"upload_rate": SEED_UP}} | {f"n{i}": {"upload_rate": r} for i, r in enumerate(PEER_UP)}
    setup = SwarmSetup(s.board, RUN, SECRET, s.policy, epoch=time.time())
    options = {k: v for k, v in OPTIONS.items() if k != "membership"}

    def simulate(seed_: int) -> SwarmResult:
        return simulate_swarm(
            setup,
            seed,
            peers,
            version,
            regions=[Region("r0", 0.0001)],
            membership=FAST_MEMBERSHIP,
            node_options=options,
            host_options=limits,
            seed=seed_,
        )

    # The protocol's random choices move one run's time to all by up to +-7% here (seeds 0-7:
    # 8.0-9.1 s, mean 8.44 s; the loopback run 8.3-9.4 s): average eight.  Until the seed kept its
    # line for hosts it was not serving (docs/swarm.md "Seed"), one slow host could take half the
    # seed's copy and sit on it: 8.8-11.3 s simulated, 8.3-10.6 s real, and this check failed often.
    # simulate_swarm runs its own loop: keep it off this test's loop (a thread has none).
    sims = [await asyncio.to_thread(simulate, k) for k in range(8)]
    bound = kumar_ross(size, SEED_UP, PEER_UP, [math.inf] * len(PEER_UP))
    for sim in sims:
        assert sim.complete and sim.errors == {}
        assert sim.time_to_all >= bound
        # One copy from the seed, plus at most a few chunks it serves requesters finishing (their
        # last chunks, docs/swarm.md "Seed"): its egress sets the time here.
        assert sim.payload_bytes <= sim.seed_uploaded <= 1.1 * sim.payload_bytes
    simulated = sum(sim.time_to_all for sim in sims) / len(sims)
    print(f"time to all: real {real:.2f} s, simulated {simulated:.2f} s (mean of {len(sims)}), bound {bound:.2f} s")
    assert abs(simulated - real) <= 0.15 * real
