"""Where a simulated swarm's time goes: goodput per 10 ms, each chunk's spread, refusals.

    .venv/bin/python -m benchmarks.sim_timeline --hosts 300
    .venv/bin/python -m benchmarks.sim_timeline --hosts 300 --rate 2.5e9 --seed-rate 1.25e9

Runs ``sim_bench swarm`` with its flags (``--hosts``, default here 300, ``--patch-mb``,
``--chunk-mib``, ``--rate``, ``--down-rate``, ``--seed-rate``, ``--node``/``--sched``/``--member``, ...)
with every node's chunk scheduler observed: each first delivery of a chunk (time, receiver, sender, seconds from request
to arrival), each request and each failure.  It prints, per 10 ms from the first request:
deliveries against what the hosts' downlinks could take in 10 ms (goodput), how many came from
the seed, and the BUSY/MISSING refusals; then, for chunks in the order the seed sent them, when
half, 90% and all of the hosts held each; then when each host's last chunk left the seed and
arrived.  The numbers behind docs/simulation.md#what-limits-the-time-to-all.

The scheduler's methods are wrapped for the run (instrumentation, restored afterwards), so the
nodes run unchanged.  The figures need one version; with ``--versions`` > 1 they mix them.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from patchswarm.protocol.scheduler import ChunkScheduler

BIN = 0.01  # seconds per row of the timeline


@dataclass
class Trace:
    delivered: list[tuple[float, str, str, int, float]] = field(default_factory=list)  # t, to, from, chunk, took
    requested: list[tuple[float, str, str, int]] = field(default_factory=list)  # t, by, to, chunk
    failed: list[tuple[float, str, str, int, str]] = field(default_factory=list)  # t, by, to, chunk, reason


@contextlib.contextmanager
def observed() -> Iterator[Trace]:
    """Record every scheduler's deliveries, requests and failures while the block runs."""
    trace = Trace()
    success, failure, issue = ChunkScheduler.on_success, ChunkScheduler.on_failure, ChunkScheduler._issue

    def on_success(self: ChunkScheduler, now: float, chunk: int, peer_id: str, nbytes: int, elapsed: float) -> Any:
        if not self.holds(chunk):  # the first copy only (an endgame duplicate may arrive too)
            trace.delivered.append((now, self._me.peer_id, peer_id, chunk, elapsed))
        return success(self, now, chunk, peer_id, nbytes, elapsed)

    def on_failure(self: ChunkScheduler, now: float, chunk: int, peer_id: str, reason: Any, retry: Any = None) -> Any:
        trace.failed.append((now, self._me.peer_id, peer_id, chunk, reason.name))
        return failure(self, now, chunk, peer_id, reason, retry)

    def _issue(self: ChunkScheduler, chunk: int, peer: Any, rnd: Any, *, duplicate: bool) -> Any:
        trace.requested.append((rnd.now, self._me.peer_id, peer.info.peer_id, chunk))
        return issue(self, chunk, peer, rnd, duplicate=duplicate)

    ChunkScheduler.on_success = on_success  # type: ignore[method-assign]
    ChunkScheduler.on_failure = on_failure  # type: ignore[method-assign]
    ChunkScheduler._issue = _issue  # type: ignore[method-assign]
    try:
        yield trace
    finally:
        ChunkScheduler.on_success, ChunkScheduler.on_failure, ChunkScheduler._issue = success, failure, issue  # type: ignore[method-assign]


def report(trace: Trace, chunk_bytes: int, down_rate: float) -> None:
    if not trace.delivered:
        print("no chunk was delivered")
        return
    t0 = min(t for t, *_ in trace.requested)
    hosts = {to for _, to, *_ in trace.delivered}
    capacity = len(hosts) * BIN * down_rate / chunk_bytes  # chunks the downlinks could take per bin
    got: collections.Counter[int] = collections.Counter()
    from_seed: collections.Counter[int] = collections.Counter()
    for t, _to, frm, _c, _took in trace.delivered:
        got[int((t - t0) / BIN)] += 1
        from_seed[int((t - t0) / BIN)] += frm == "seed"
    refused: collections.Counter[tuple[int, str]] = collections.Counter()
    for t, _by, _to, _c, why in trace.failed:
        refused[(int((t - t0) / BIN), why)] += 1
    print(f"{len(hosts)} hosts; per {BIN * 1e3:g} ms from the first request (t0 = {t0 * 1e3:.1f} ms):")
    print("  ms     chunks  from seed  goodput  busy  missing")
    for k in range(max(got) + 1):
        print(
            f"  {k * BIN * 1e3:5.0f}  {got[k]:6d}  {from_seed[k]:9d}  {got[k] / capacity:6.0%}"
            f"  {refused[(k, 'BUSY')]:4d}  {refused[(k, 'MISSING')]:7d}"
        )
    first: dict[int, float] = {}
    arrivals: dict[int, list[float]] = collections.defaultdict(list)
    for t, _to, _frm, c, _took in sorted(trace.delivered):
        first.setdefault(c, t)
        arrivals[c].append(t)
    order = sorted(first, key=first.__getitem__)
    print("chunks in the order the seed sent them (ms from t0): sent, half the hosts hold it, 90%, all")
    for c in order[:: max(1, len(order) // 10)] + order[-3:]:
        ts = arrivals[c]
        print(
            f"  chunk {c:5d}: {(first[c] - t0) * 1e3:7.1f} {(ts[len(ts) // 2] - t0) * 1e3:7.1f}"
            f" {(ts[int(0.9 * len(ts))] - t0) * 1e3:7.1f} {(ts[-1] - t0) * 1e3:7.1f}"
        )
    last: dict[str, tuple[float, int]] = {}
    for t, to, _frm, c, _took in trace.delivered:
        if to not in last or t > last[to][0]:
            last[to] = (t, c)
    sent = statistics.median(first[c] - t0 for _, c in last.values()) * 1e3
    arrived = statistics.median(t - t0 for t, _ in last.values()) * 1e3
    print(f"each host's last chunk: the seed sent it at {sent:.1f} ms (median), it arrived at {arrived:.1f} ms")
    print(
        f"requests {len(trace.requested)}, first deliveries {len(trace.delivered)}, refused {len(trace.failed)}"
        f" ({sum(1 for f in trace.failed if f[4] == 'BUSY')} busy)"
    )


def main() -> None:
    from benchmarks import sim_bench

    a = sim_bench.parser().parse_args(["swarm", *sys.argv[1:]])
    if not a.hosts:
        a.hosts = 300  # placeholder mode: the timeline needs sized chunks, not the small test model
    with observed() as trace:
        sim_bench.run(a)
    report(trace, int(a.chunk_mib * (1 << 20)), a.rate if a.down_rate is None else a.down_rate)


if __name__ == "__main__":
    main()
