"""Fleet staleness study: how far fully asynchronous RL scales with a global rollout fleet.

A trainer publishes a new version every ``interval`` seconds; N rollout hosts in three regions serve
requests with whatever version they hold; spot hosts leave (mean life ``life``) and come back after a
mean ``downtime`` holding the version they last had (their disk keeps the anchor and the chain), then
catch up.  Each point runs the three strategies of simulations/strategies.py on the same hosts,
network and churn, and turns their per-host, per-version completions into the staleness requests see
(simulations/staleness.py).

    python -m patchswarm.simulations.fleet_study run --hosts 100,300 --interval 30,60,120 --out DIR

The patch size defaults to what the codec measured (docs/benchmarks.md a): 1.3467 bytes per changed
bf16 value, 0.6% of an 8B model's values changed per version: 64.6 MB; ``--patch-mb`` takes part 1's
measured sizes instead.  The full checkpoint is the bf16 model (2 bytes per parameter).

The swarm runs the real nodes (placeholder payloads) only up to ``--swarm-max-hosts``; above it the
swarm's row is *extrapolated* (``"extrapolated_from"`` in the JSON): every host of the large fleet
takes the completions and churn of the host of the largest real run at the same position in its region
(flat in N), which docs/research.md validates against real runs at smaller N.  The central strategies
always run in full: they are flow schedules, cheap at 10,000 hosts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.files import read_file, write_atomic
from patchswarm.protocol.untrusted_json import load_json
from patchswarm.simulations import fleet_plots
from patchswarm.simulations.build import build_label
from patchswarm.simulations.fleet_plots import STRATEGY_ORDER
from patchswarm.simulations.scenario import ChurnEvent, Layout, Scenario, churn_schedule, from_dict, layout
from patchswarm.simulations.staleness import staleness
from patchswarm.simulations.strategies import StrategyRun, central, swarm

BYTES_PER_CHANGE = 999_901 / 742_476  # docs/benchmarks.md a), bf16, "all" row: ours B / K
GBIT = 1.25e8  # bytes/s
REGIONS = (("us", 0.5), ("eu", 0.3), ("asia", 0.2))  # bandwidth-study regions3: seed in us
MAX_RESULTS_BYTES = 256 << 20
BACKBONES = (("us", "eu", 0.040), ("us", "asia", 0.060), ("eu", "asia", 0.080))  # one-way latency, s


def default_patch_bytes(params: float, changed: float) -> int:
    return round(params * changed * BYTES_PER_CHANGE)


@dataclass(frozen=True)
class Fleet:
    """One point of the study."""

    hosts: int
    interval: float  # s between publications (T)
    versions: int = 10
    patch_bytes: int = default_patch_bytes(8e9, 0.006)
    model_bytes: int = 16 * 10**9  # the full bf16 checkpoint
    host_gbps: float = 10.0
    seed_gbps: float = 10.0
    backbone_gbps: float = 100.0
    life: float = 2 * 3600.0  # mean seconds a spot host lives; inf: no churn
    downtime: float = 300.0  # mean seconds until the replacement serves again
    seed: int = 1
    window_mib: float = 4.0  # TCP window per flow (a flow moves at most window / RTT); 0: no cap
    single_region: bool = False  # one region, no backbones (the hand-computable case)

    def scenario(self, strategies: Sequence[str] = STRATEGY_ORDER) -> Scenario:
        crash = 0.0 if math.isinf(self.life) else -math.expm1(-self.interval / self.life)
        raw: dict[str, Any] = {
            "name": "fleet",
            "hosts": {"count": self.hosts, "uplink": self.host_gbps * GBIT, "downlink": self.host_gbps * GBIT},
            "seed": {"uplink": self.seed_gbps * GBIT},
            "payload": {
                "patch_size": self.patch_bytes,
                "checkpoint_size": self.model_bytes,
                "chunk_size": min(4 << 20, max(1024, self.patch_bytes)),
            },
            "versions": {"count": self.versions, "interval": self.interval},
            "network": {"window": round(self.window_mib * 2**20)},
            "churn": {"crash_rate": crash, "rejoin_after": self.downtime, "window": self.interval},
            # the swarm stops at the end of the window; the central strategies have no deadline
            "run": {"seed": self.seed, "deadline": self.interval, "strategies": list(strategies)},
        }
        if not self.single_region:
            raw["seed"]["region"] = REGIONS[0][0]
            raw["regions"] = [{"name": n, "share": s, "latency": 0.5e-3} for n, s in REGIONS]
            raw["backbones"] = [
                {"a": a, "b": b, "capacity": self.backbone_gbps * GBIT, "latency": lat} for a, b, lat in BACKBONES
            ]
        if self.hosts > 2000:
            raw["swarm"] = {"max_members": 128}  # docs/simulation.md#bounded-membership-views
        return from_dict(raw)


def _churned(s: Scenario, lay: Layout) -> tuple[ChurnEvent, ...]:
    return churn_schedule(s, lay.peers)


def run_strategy(fleet: Fleet, strategy: str) -> tuple[StrategyRun, tuple[ChurnEvent, ...], Layout]:
    s = fleet.scenario()
    lay = layout(s)
    churn = _churned(s, lay)
    if strategy == "swarm":
        return swarm(s, lay, churn), churn, lay
    return central(s, lay, churn, strategy), churn, lay


def row(fleet: Fleet, strategy: str, run: StrategyRun, churn: Sequence[ChurnEvent]) -> dict[str, Any]:
    st = staleness(run.outcomes, churn, interval=fleet.interval, versions=fleet.versions)
    lat = sorted(o.completion for o in run.outcomes)
    finite = [x for x in lat if math.isfinite(x)]
    return {
        "fleet": asdict(fleet),
        "strategy": strategy,
        "staleness": st.summary(),
        "histogram": [[k, w] for k, w in st.seconds],
        "delivery_p50_s": finite[len(finite) // 2] if finite else math.inf,
        "delivery_p99_s": finite[min(len(finite) - 1, int(0.99 * len(finite)))] if finite else math.inf,
        "undelivered": len(lat) - len(finite),
        "seed_egress_bytes": run.seed_egress,
        "churn_events": len(churn),
        "events": run.events,
        "wall_s": run.wall,
        "build": build_label(),
        "extrapolated_from": None,
    }


def extrapolate(fleet: Fleet, small: Fleet, run: StrategyRun, churn: Sequence[ChurnEvent]) -> dict[str, Any]:
    """The swarm at ``fleet.hosts`` from a real run at ``small.hosts``: each large-fleet host takes the
    completions (and churn) of the small run's host at the same relative position in its region."""
    big_lay = layout(fleet.scenario())
    small_lay = layout(small.scenario())
    by_region: dict[str, list[str]] = {}
    for p in small_lay.peers:
        by_region.setdefault(p.region, []).append(p.id)
    counts: dict[str, int] = {}
    for p in big_lay.peers:
        counts[p.region] = counts.get(p.region, 0) + 1
    seen: dict[str, int] = {}
    source: dict[str, str] = {}
    for p in big_lay.peers:
        i = seen.get(p.region, 0)
        seen[p.region] = i + 1
        pool = by_region[p.region]
        source[p.id] = pool[i * len(pool) // counts[p.region]]
    outs = {(o.host, o.version): o for o in run.outcomes}
    outcomes = tuple(
        replace(outs[(source[p.id], v)], host=p.id) for p in big_lay.peers for v in range(1, fleet.versions + 1)
    )
    events_of: dict[str, list[ChurnEvent]] = {}
    for e in churn:
        events_of.setdefault(e.host, []).append(e)
    big_churn = tuple(sorted(replace(e, host=p.id) for p in big_lay.peers for e in events_of.get(source[p.id], ())))
    scaled = StrategyRun("swarm", outcomes, run.seed_egress, 0, 0.0)
    out = row(fleet, "swarm", scaled, big_churn)
    out["extrapolated_from"] = small.hosts
    return out


# ---------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or len(vals) > 32 or any(not (0 < v < 1e7) for v in vals):
        raise argparse.ArgumentTypeError(f"expected 1-32 positive numbers, got {text!r}")
    return vals


def _ints(text: str) -> list[int]:
    vals = _floats(text)
    if any(not v.is_integer() or v > 10_000 for v in vals):
        raise argparse.ArgumentTypeError(f"expected whole numbers in [1, 10000], got {text!r}")
    return [int(v) for v in vals]


def merge(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (point, strategy) from several results files: a real run over an extrapolation, and an
    extrapolation from a larger real run over one from a smaller."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = json.dumps([r["fleet"], r["strategy"]], sort_keys=True)
        rank = math.inf if r["extrapolated_from"] is None else r["extrapolated_from"]
        old = best.get(key)
        if old is None or rank > (math.inf if old["extrapolated_from"] is None else old["extrapolated_from"]):
            best[key] = r
    return list(best.values())


def _read_rows(ap: argparse.ArgumentParser, path: Path) -> list[dict[str, Any]]:
    """A results file this module wrote: bounded, a JSON list of objects, or one clear line (parsed
    strictly, but for the Infinity json.dumps writes for a delivery that never happened)."""
    try:
        rows = load_json(read_file(path, MAX_RESULTS_BYTES), max_bytes=MAX_RESULTS_BYTES, allow_nan=True)
    except (OSError, PatchswarmError, ValueError) as e:
        ap.error(f"{path}: not a readable results file ({e})")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"fleet", "strategy"} <= r.keys() for r in rows):
        ap.error(f"{path}: not a fleet study results file")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m patchswarm.simulations.fleet_study", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate points and write results JSON")
    r.add_argument("--hosts", type=_ints, default=[100])
    r.add_argument("--interval", type=_floats, default=[60.0], help="seconds between versions (T)")
    r.add_argument("--versions", type=int, default=10)
    r.add_argument("--params", type=float, default=8e9, help="model parameters (bf16)")
    r.add_argument("--changed", type=float, default=0.006, help="fraction of values a version changes")
    r.add_argument("--patch-mb", type=float, default=None, help="patch size in MB (10^6), overrides --changed")
    r.add_argument("--host-gbps", type=float, default=10.0)
    r.add_argument("--seed-gbps", type=float, default=10.0)
    r.add_argument("--backbone-gbps", type=float, default=100.0)
    r.add_argument("--life-h", type=float, default=2.0, help="mean spot host life, hours (inf: no churn)")
    r.add_argument("--downtime", type=float, default=300.0, help="mean seconds until a replacement serves")
    r.add_argument("--strategies", default=",".join(STRATEGY_ORDER))
    r.add_argument("--swarm-max-hosts", type=int, default=1000, help="above: swarm extrapolated from the largest")
    r.add_argument("--window-mib", type=float, default=4.0, help="TCP window per flow, MiB (0: no window cap)")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--out", type=Path, required=True, help="results JSON (appended to if it exists)")
    p = sub.add_parser("plot", help="figures from results JSON")
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--cdf", type=Path, help="staleness CDF per strategy PNG (one point: --hosts, --interval)")
    p.add_argument("--largest", type=Path, help="largest fleet under the bound vs T PNG")
    p.add_argument("--hosts", type=int, default=1000)
    p.add_argument("--interval", type=float, default=60.0)
    p.add_argument("--table", action="store_true", help="print Markdown tables")
    a = ap.parse_args(argv)
    if a.cmd == "plot":
        rows = merge([x for f in a.results for x in _read_rows(ap, f)])
        if a.cdf:
            fleet_plots.cdf(rows, a.hosts, a.interval, a.cdf)
        if a.largest:
            fleet_plots.largest(rows, a.largest)
        if a.table:
            print(fleet_plots.tables(rows))
        return 0
    strategies = [x.strip() for x in a.strategies.split(",")]
    if any(x not in STRATEGY_ORDER for x in strategies) or not 1 <= a.versions <= 1000:
        ap.error(f"--strategies from {STRATEGY_ORDER}; --versions in [1, 1000]")
    if (a.patch_mb is not None and not 0.001 <= a.patch_mb <= 1e7) or not 1e6 <= a.params <= 1e13:
        ap.error("--patch-mb in [0.001, 1e7]; --params in [1e6, 1e13]")
    if not 0 <= a.window_mib <= 4096:
        ap.error("--window-mib in [0, 4096]")
    if not 0 < a.changed <= 1 or not a.life_h > 0 or not 0 <= a.downtime < 1e7:
        ap.error("--changed in (0, 1]; --life-h > 0 (inf: no churn); --downtime in [0, 1e7)")
    patch = round(a.patch_mb * 1e6) if a.patch_mb else default_patch_bytes(a.params, a.changed)
    rows = _read_rows(ap, a.out) if a.out.exists() else []
    for t in a.interval:
        real_swarm: tuple[Fleet, StrategyRun, tuple[ChurnEvent, ...]] | None = None
        for n in sorted(a.hosts):
            fleet = Fleet(
                hosts=n,
                interval=t,
                versions=a.versions,
                patch_bytes=patch,
                model_bytes=round(2 * a.params),
                host_gbps=a.host_gbps,
                seed_gbps=a.seed_gbps,
                backbone_gbps=a.backbone_gbps,
                life=a.life_h * 3600.0,
                downtime=a.downtime,
                seed=a.seed,
                window_mib=a.window_mib,
            )
            for strat in strategies:
                t0 = time.perf_counter()
                if strat == "swarm" and n > a.swarm_max_hosts:
                    if real_swarm is None:
                        print(f"N={n}: no real swarm run at or below {a.swarm_max_hosts} hosts", file=sys.stderr)
                        continue
                    out = extrapolate(fleet, real_swarm[0], real_swarm[1], real_swarm[2])
                else:
                    run, churn, _ = run_strategy(fleet, strat)
                    out = row(fleet, strat, run, churn)
                    if strat == "swarm":
                        real_swarm = (fleet, run, churn)
                rows = [x for x in rows if not (x["fleet"] == out["fleet"] and x["strategy"] == strat)] + [out]
                write_atomic(a.out, json.dumps(rows, indent=1, sort_keys=True).encode())
                st = out["staleness"]
                print(
                    f"T={t:g} N={n} {strat:10s} p50={st['p50']} p99={st['p99']} max={st['max']} "
                    f"<=0:{st['le0']:.4f} deliv p99={out['delivery_p99_s']:.3g}s "
                    f"wall={time.perf_counter() - t0:.1f}s{' (extrapolated)' if out['extrapolated_from'] else ''}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
