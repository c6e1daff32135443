"""Simulator speed: the flow model alone on a swarm-shaped workload, and real nodes in virtual time.

    .venv/bin/python -m benchmarks.sim_bench network --hosts 1000 --chunks 125
    .venv/bin/python -m benchmarks.sim_bench swarm --peers 32

``network``: every host fetches ``chunks`` chunks of ``chunk`` bytes, ``inflight`` at a time,
each from a random other host (no protocol: only the flow model's cost).  ``swarm``: real
SwarmNodes fetching a small published model (tests/swarmkit.py's board) in virtual time.
Prints wall seconds, events and virtual time; the numbers go in docs/simulation.md.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path

from simulations.network import Flow, Host, Network, Region


def network_bench(
    hosts: int, chunks: int, chunk: int, inflight: int, rate: float, latency: float, seed: int, quantum: float = 0.0
) -> None:
    rng = random.Random(seed)
    names = [f"h{i}" for i in range(hosts)]
    net = Network([Host(n, "r", up=rate, down=rate) for n in names], [Region("r", latency)], quantum=quantum)
    left = dict.fromkeys(names, chunks)
    events = 0

    def start(now: float, dst: str) -> None:
        if left[dst] <= 0:
            return
        left[dst] -= 1
        src = names[rng.randrange(hosts - 1)]
        if src == dst:
            src = names[-1]
        net.add_flow(now, src, dst, chunk, tag=dst)

    for n in names:
        for _ in range(min(inflight, chunks)):
            start(0.0, n)
    t0 = time.perf_counter()
    while (t := net.next_event_time()) < math.inf:
        done: list[Flow] = net.advance(t)
        events += 1
        for f in done:
            start(t, str(f.tag))
    wall = time.perf_counter() - t0
    flows = hosts * chunks
    print(
        f"network: {hosts} hosts x {chunks} chunks of {chunk} B, {inflight} in flight: {flows} flows, "
        f"{events} event times (quantum {quantum:g} s), virtual {net.now:.3f} s, "
        f"wall {wall:.2f} s ({flows / wall:.0f} flows/s)"
    )


def swarm_bench(peers: int, seed: int) -> None:
    from simulations.runner import SwarmSetup, simulate_swarm
    from tests.swarmkit import RUN, SECRET, Swarm

    s = Swarm(Path(tempfile.mkdtemp()))
    v = s.publish()
    hosts = [Host(f"n{i}", "r0", up=1e6, down=4e6) for i in range(peers)]
    t0 = time.perf_counter()
    r = simulate_swarm(
        SwarmSetup(s.board, RUN, SECRET, s.policy),
        Host("seed", "r0", up=2e6),
        hosts,
        v,
        regions=[Region("r0", 0.005)],
        seed=seed,
    )
    wall = time.perf_counter() - t0
    print(
        f"swarm: {peers} peers, {r.payload_bytes} B: time to all {r.time_to_all:.3f} s virtual "
        f"(bound {r.lower_bound:.3f} s), wall {wall:.2f} s, {r.loop_jumps} loop jumps, "
        f"{r.messages.gossip_messages} gossip messages, {r.messages.chunk_requests} chunk requests"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    n = sub.add_parser("network")
    n.add_argument("--hosts", type=int, default=1000)
    n.add_argument("--chunks", type=int, default=125)
    n.add_argument("--chunk", type=int, default=4 << 20)
    n.add_argument("--inflight", type=int, default=8)
    n.add_argument("--rate", type=float, default=10e9 / 8)
    n.add_argument("--latency", type=float, default=0.0005)
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--quantum", type=float, default=0.0)
    w = sub.add_parser("swarm")
    w.add_argument("--peers", type=int, default=32)
    w.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.what == "network":
        network_bench(a.hosts, a.chunks, a.chunk, a.inflight, a.rate, a.latency, a.seed, a.quantum)
    else:
        swarm_bench(a.peers, a.seed)


if __name__ == "__main__":
    main()
