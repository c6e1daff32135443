"""Simulator speed: the flow model alone on a swarm-shaped workload, and real nodes in virtual time.

    .venv/bin/python -m benchmarks.sim_bench network --hosts 1000 --chunks 125
    .venv/bin/python -m benchmarks.sim_bench swarm --peers 32
    .venv/bin/python -m benchmarks.sim_bench swarm --hosts 1000 --patch-mb 500 --chunk-mib 4
    .venv/bin/python -m benchmarks.sim_bench swarm --hosts 10000 --patch-mb 500 --chunk-mib 4
    .venv/bin/python -m benchmarks.sim_bench swarm --hosts 300 --down-rate 2.5e9   # downlinks with headroom

``--node FIELD=JSON`` / ``--sched FIELD=JSON`` / ``--member FIELD=JSON`` set NodeConfig, SchedulerConfig and
MembershipConfig fields (repeatable); ``--quantum`` batches network events.  Above 2,000 hosts the
nodes keep a bounded membership view of 128 members (``--member max_members=0``: full membership).

``network``: every host fetches ``chunks`` chunks of ``chunk`` bytes, ``inflight`` at a time,
each from a random other host (no protocol: only the flow model's cost).  ``swarm``: real
SwarmNodes fetching a small published model (tests/support/swarmkit.py's board) in virtual time; with
``--hosts``, real nodes on a synthetic run with placeholder payloads (simulations/synthetic.py).
Prints wall seconds, events and virtual time; the numbers go in docs/simulation.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from patchswarm.protocol.untrusted_json import load_json
from patchswarm.simulations.build import build_label
from patchswarm.simulations.network import Flow, Host, Network, Region

# Placeholder runs above this many hosts use a bounded membership view of this size
# (docs/simulation.md#bounded-membership-views) unless --member max_members=... says otherwise (0: full membership).
BOUNDED_VIEW_ABOVE = 2000
BOUNDED_VIEW = 128


def network_bench(
    hosts: int,
    chunks: int,
    chunk: int,
    inflight: int,
    rate: float,
    latency: float,
    seed: int,
    quantum: float = 0.0,
    check: int = 0,
) -> None:
    """The flow model alone.  ``check`` > 0: every ``check`` event times, recompute the allocation from
    scratch, compare it with the incremental one and time both (the ratio is measured in this run)."""
    rng = random.Random(seed)
    names = [f"h{i}" for i in range(hosts)]
    net = Network([Host(n, "r", up=rate, down=rate) for n in names], [Region("r", latency)], quantum=quantum)
    left = dict.fromkeys(names, chunks)
    events = 0
    full_s = full_cpu = 0.0  # seconds spent in full recomputations (excluded from the figures)
    fulls = 0
    worst = 0.0  # largest relative difference, incremental vs full

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
    c0 = time.process_time()
    while (t := net.next_event_time()) < math.inf:
        done: list[Flow] = net.advance(t)
        events += 1
        for f in done:
            start(t, str(f.tag))
        if check and events % check == 0:
            f0, fc0 = time.perf_counter(), time.process_time()
            full = net.full_allocation()
            full_s += time.perf_counter() - f0
            full_cpu += time.process_time() - fc0
            fulls += 1
            for f in net.active_flows():
                worst = max(worst, abs(f.rate - full[f.id]) / full[f.id] if full[f.id] else abs(f.rate))
    wall = time.perf_counter() - t0 - full_s
    cpu = time.process_time() - c0 - full_cpu
    flows = hosts * chunks
    print(
        f"network: {hosts} hosts x {chunks} chunks of {chunk} B, {inflight} in flight: {flows} flows, "
        f"{events} event times (quantum {quantum:g} s), virtual {net.now:.6f} s: "
        f"wall {wall:.2f} s, cpu {cpu:.2f} s: {flows / wall:.0f} flows/s wall, {flows / cpu:.0f} flows/s cpu, "
        f"{events / cpu:.0f} events/s cpu; {net.sharer.visits / max(events, 1):.1f} resources re-examined per "
        f"event, {net.sharer.restarts} fallbacks to a full recomputation"
    )
    if fulls:
        per_event, per_full = cpu / events, full_cpu / fulls
        print(
            f"  check: {fulls} full recomputations, largest relative difference {worst:.1e}; cpu per full "
            f"recomputation {per_full * 1e3:.2f} ms, per incremental event {per_event * 1e3:.3f} ms "
            f"(x{per_full / per_event:.0f})"
        )


def swarm_bench(peers: int, seed: int) -> None:
    from patchswarm.simulations.runner import SwarmSetup, simulate_swarm
    from tests.support.swarmkit import RUN, SECRET, Swarm

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


class GcTimer:
    """Time spent in the cyclic garbage collector while installed (gc.callbacks): part of a run's CPU
    that grows with the heap (a full collection scans every tracked object), not with the events."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]  # per generation
        self.by_generation = [0.0, 0.0, 0.0]  # seconds
        self.collected = 0  # objects it freed: cyclic garbage (reference counting frees the rest)
        self._t0 = 0.0

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._phase)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._phase)

    def _phase(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.process_time()
        else:
            spent = time.process_time() - self._t0
            self.seconds += spent
            self.by_generation[info["generation"]] += spent
            self.collections[info["generation"]] += 1
            self.collected += info["collected"]

    def __str__(self) -> str:
        runs = "/".join(map(str, self.collections))
        spent = "/".join(f"{s:.1f}" for s in self.by_generation)
        return (
            f"gc {self.seconds:.1f} s ({runs} collections by generation taking {spent} s, "
            f"{self.collected} objects freed)"
        )


def _cpu() -> float:
    """CPU seconds of this process."""
    t = os.times()
    return t.user + t.system


def placeholder_bench(
    hosts: int,
    patch_mb: float,
    chunk_mib: float,
    versions: int,
    interval: float,
    rate: float,
    latency: float,
    seed: int,
    node_options: dict[str, Any] | None = None,
    quantum: float = 0.0,
    membership: dict[str, Any] | None = None,
    cold: bool = False,
    down_rate: float | None = None,
    seed_rate: float | None = None,
) -> None:
    """Real nodes, placeholder payloads: ``hosts`` peers and a seed, at ``rate`` both ways unless
    ``down_rate`` (the peers' downlinks) or ``seed_rate`` (the seed's uplink) say otherwise.
    ``cold``: the first version is published as the nodes join (no warm membership)."""
    from patchswarm.protocol.membership_config import MembershipConfig
    from patchswarm.simulations.placeholder import placeholder_held
    from patchswarm.simulations.runner import simulate_stream
    from patchswarm.simulations.synthetic import synthetic_setup

    run = synthetic_setup(patch_bytes=int(patch_mb * 1e6), chunk_bytes=int(chunk_mib * (1 << 20)), versions=versions)
    down = rate if down_rate is None else down_rate
    peers = [Host(f"h{i:05d}", "r0", up=rate, down=down) for i in range(hosts)]
    cpu0 = _cpu()
    with GcTimer() as gc_time:
        r = simulate_stream(
            run.setup,
            Host("seed", "r0", up=rate if seed_rate is None else seed_rate, down=rate),
            peers,
            versions=run.versions,
            interval=interval,
            regions=[Region("r0", latency)],
            start_from=placeholder_held(0),
            seed=seed,
            node_options=node_options,
            quantum=quantum,
            membership=MembershipConfig(**membership) if membership else None,
            warm_membership=not cold,
        )
    cpu = _cpu() - cpu0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    links = f"{rate * 8 / 1e9:g} Gbit/s"
    if down != rate:
        links += f" up, {down * 8 / 1e9:g} down"
    if seed_rate is not None and seed_rate != rate:
        links += f", seed {seed_rate * 8 / 1e9:g}"
    print(
        f"swarm (placeholders): {hosts} hosts, {versions} x {patch_mb:g} MB in {chunk_mib:g} MiB chunks, "
        f"{links}, {latency * 1e3:g} ms: wall {r.wall_seconds:.1f} s (cpu {cpu:.1f} s), "
        f"{r.events} events ({r.events / r.wall_seconds:.0f}/s wall), "
        f"{r.messages.chunk_requests} chunk requests, {r.messages.gossip_messages} gossip messages, "
        f"peak RSS {rss / 2**20:.2f} GB, {gc_time}, {build_label()}"
    )
    for v in r.versions:
        ratio = v.time_to_all / v.lower_bound if v.lower_bound else math.inf
        print(
            f"  version {v.version}: time to all {v.time_to_all:.3f} s virtual, Kumar-Ross {v.lower_bound:.3f} s "
            f"(x{ratio:.2f}), seed egress {v.seed_egress / v.payload_bytes:.2f} copies, {v.hosts_done}/{hosts} hosts"
        )
        print("    " + phase_breakdown(r.marks, v.version, v.published))


def phase_breakdown(marks: dict[str, tuple[tuple[str, int, float], ...]], version: int, published: float) -> str:
    """Where the hosts' time went: virtual ms after publication at which they passed each step (median / p90 / max)."""
    parts = []
    for step in ("head", "manifest", "chunk", "chunks", "applied"):
        ts = sorted(t - published for m in marks.values() for w, v, t in m if w == step and v == version)
        if ts:
            q = [ts[min(len(ts) - 1, int(f * len(ts)))] * 1e3 for f in (0.5, 0.9)]
            parts.append(f"{step} {q[0]:.0f}/{q[1]:.0f}/{ts[-1] * 1e3:.0f}")
    return "ms after publication (median/p90/max): " + ", ".join(parts)


def _setting(text: str) -> tuple[str, Any]:
    """``FIELD=JSON`` from the command line, the value parsed strictly (one line, not a traceback)."""
    field, sep, value = text.partition("=")
    try:
        if not sep or not field.isidentifier():
            raise ValueError("expected FIELD=JSON")
        return field, load_json(value, max_bytes=4096)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: {e}") from None


def parser() -> argparse.ArgumentParser:
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
    n.add_argument("--check", type=int, default=0, help="compare with a full recomputation every N event times")
    w = sub.add_parser("swarm", help="real nodes; with --hosts: placeholder payloads (--patch-mb, --chunk-mib)")
    w.add_argument("--peers", type=int, default=32, help="real-board mode: peers fetching the small test model")
    w.add_argument("--hosts", type=int, default=0, help="placeholder mode: this many peers")
    w.add_argument("--patch-mb", type=float, default=500.0)
    w.add_argument("--chunk-mib", type=float, default=4.0)
    w.add_argument("--versions", type=int, default=1)
    w.add_argument("--interval", type=float, default=5.0, help="virtual seconds between versions")
    w.add_argument("--rate", type=float, default=10e9 / 8, help="bytes/s, every host's uplink and downlink")
    w.add_argument("--down-rate", type=float, default=None, help="bytes/s, the peers' downlinks (default: --rate)")
    w.add_argument("--seed-rate", type=float, default=None, help="bytes/s, the seed's uplink (default: --rate)")
    w.add_argument("--latency", type=float, default=0.0005)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--node",
        action="append",
        default=[],
        type=_setting,
        metavar="FIELD=JSON",
        help="a NodeConfig field (repeatable)",
    )
    w.add_argument(
        "--member", action="append", default=[], type=_setting, metavar="FIELD=JSON", help="a MembershipConfig field"
    )
    w.add_argument(
        "--sched", action="append", default=[], type=_setting, metavar="FIELD=JSON", help="a SchedulerConfig field"
    )
    w.add_argument("--quantum", type=float, default=0.0, help="network event batching, seconds (0: exact)")
    w.add_argument("--cold", action="store_true", help="publish as the nodes join (membership still spreading)")
    return p


def run(a: argparse.Namespace) -> None:
    """The benchmark ``parser()``'s arguments ask for."""
    if a.what == "network":
        network_bench(a.hosts, a.chunks, a.chunk, a.inflight, a.rate, a.latency, a.seed, a.quantum, a.check)
    elif a.hosts:
        options: dict[str, Any] = dict(a.node)
        if a.sched:
            from patchswarm.protocol.scheduler_types import SchedulerConfig

            options["scheduler"] = SchedulerConfig(**dict(a.sched))
        member = dict(a.member)
        if a.hosts > BOUNDED_VIEW_ABOVE and "max_members" not in member:
            # One process holds every node's view: full membership is N^2 member records (10^8 at 10,000).
            member["max_members"] = BOUNDED_VIEW
            print(f"(more than {BOUNDED_VIEW_ABOVE} hosts: membership max_members={BOUNDED_VIEW}; --member to change)")
        args = (a.hosts, a.patch_mb, a.chunk_mib, a.versions, a.interval, a.rate, a.latency, a.seed)
        placeholder_bench(*args, options, a.quantum, member, a.cold, a.down_rate, a.seed_rate)
    else:
        swarm_bench(a.peers, a.seed)


def main() -> None:
    run(parser().parse_args())


if __name__ == "__main__":
    main()
