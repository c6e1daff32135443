"""A bandwidth study: one scenario (and its sweep points), every strategy on the same hosts and churn.

``run_study`` expands the sweep (several ``--sweep`` keys form a grid: every combination), checks
every point before running any, runs each point's strategies and the bound (the points here, on
local processes or on a Ray cluster: simulations/sweep.py), and writes into
``out``: results.csv (one row per point, strategy, version and host), summary.json, the plots
(simulations.plots) and report.md.  Nothing in results.csv depends on the wall clock, so the same
scenario and seed give a byte-identical file; wall seconds live in summary.json only.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from patchswarm.simulations.build import build_label
from patchswarm.simulations.point import Point
from patchswarm.simulations.scenario import (
    Scenario,
    ScenarioError,
    churn_schedule,
    layout,
    parse_override_value,
    value_of,
    with_overrides,
)
from patchswarm.simulations.scenario import load as load_scenario
from patchswarm.simulations.strategies import StrategyRun, bound, central, swarm
from patchswarm.simulations.sweep import run_all

# (point index, strategy, fraction of that strategy done) -> None
Progress = Callable[[int, str, float], None]


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``key=v1,v2,...`` -> (key, values); values are TOML scalars or strings with units ("500MB")."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ScenarioError("--sweep", f"expected KEY=V1,V2,..., got {text!r}")
    items = [v.strip() for v in _split_top_level(values)]
    if not values.strip() or any(not v for v in items):
        raise ScenarioError(key, f"sweep needs comma-separated values, got {values!r}")
    if len(items) > 64:
        raise ScenarioError(key, "at most 64 values per sweep key")
    return key, [parse_override_value(v) for v in items]


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside brackets and quotes (a value may be a TOML list: "['central','swarm']")."""
    parts, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def expand(
    raw: Mapping[str, Any], sweeps: Sequence[tuple[str, list[Any]]], seed: int | None
) -> list[tuple[tuple[tuple[str, Any], ...], Scenario]]:
    """Every point of the grid as (params, scenario), validated before anything runs."""
    keys = [k for k, _ in sweeps]
    if len(set(keys)) != len(keys):
        raise ScenarioError("--sweep", f"a key is swept twice: {keys}")
    base: dict[str, Any] = {} if seed is None else {"run.seed": seed}
    combos = list(itertools.product(*(values for _, values in sweeps)))
    if len(combos) > 256:
        raise ScenarioError("--sweep", f"{len(combos)} points; at most 256")
    points = []
    for combo in combos:
        params = tuple(zip(keys, combo, strict=True))
        points.append((params, with_overrides(raw, {**base, **dict(params)})))
    return points


def run_point(index: int, params: tuple[tuple[str, Any], ...], s: Scenario, progress: Progress | None) -> Point:
    lay = layout(s)
    churn = churn_schedule(s, lay.peers)
    runs = []
    for name in s.strategies:
        if progress is not None:
            progress(index, name, 0.0)
        if name == "swarm":

            def tick(now: float, done: int, total: int, name: str = name) -> None:
                if progress is not None and total:
                    progress(index, name, done / total)

            runs.append(swarm(s, lay, churn, tick))
        else:
            runs.append(central(s, lay, churn, name))
        if progress is not None:
            progress(index, name, 1.0)
    return Point(index, params, s, lay, bound(s, lay), tuple(runs))


# ---------------------------------------------------------------- summaries


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: a time some host really had)."""
    if not xs:
        return math.nan
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(p: Point, r: StrategyRun) -> dict[str, Any]:
    """Time-to-all is over the hosts that got the version (a host that crashed for good never does; those
    rows count in ``incomplete``); the ratio to the bound uses the worst version."""
    s = p.scenario
    done = [o.completion for o in r.outcomes if o.completion < math.inf]
    per_version = [
        max((o.completion for o in r.outcomes if o.version == v and o.completion < math.inf), default=0.0)
        for v in range(1, s.versions + 1)
    ]
    tta = max(per_version, default=math.nan) if done else math.nan
    return {
        "time_to_all_s": _num(tta),
        "time_to_all_by_version_s": [_num(x) for x in per_version],
        "p50_s": _num(percentile(done, 50)),
        "p99_s": _num(percentile(done, 99)),
        "incomplete": sum(1 for o in r.outcomes if o.completion == math.inf),
        "seed_egress_bytes": r.seed_egress,
        "seed_egress_patches": r.seed_egress / (s.patch_size * s.versions),
        "bound_s": p.bound,
        "ratio_to_bound": _num(tta / p.bound) if p.bound > 0 else None,
        "wall_s": round(r.wall, 3),
        "events": r.events,
        "note": r.note,
    }


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def write_results(points: Sequence[Point], path: Path) -> None:
    regions = {}
    with path.open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["point", "params", "strategy", "version", "host", "region", "slow", "completion_s",
                    "from_seed_bytes", "from_peers_bytes"])  # fmt: skip
        for p in points:
            regions = {h.id: h.region for h in p.layout.peers}
            for r in p.runs:
                for o in r.outcomes:
                    w.writerow([p.index, p.label, r.strategy, o.version, o.host, regions[o.host],
                                int(o.host in p.layout.slow), repr(o.completion), repr(o.from_seed),
                                repr(o.from_peers)])  # fmt: skip


def summary_doc(points: Sequence[Point], meta: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **meta,
        "points": [
            {
                "index": p.index,
                "params": dict(p.params),
                "values": {k: _jsonable(value_of(p.scenario, k)) for k, _ in p.params},  # units applied
                "label": p.label,
                "hosts": p.scenario.hosts,
                "regions": [r.name for r in p.scenario.regions],
                "patch_size": p.scenario.patch_size,
                "checkpoint_size": p.scenario.checkpoint_size,
                "chunk_size": p.scenario.chunk_size,
                "versions": p.scenario.versions,
                "crash_rate": p.scenario.crash_rate,
                "seed": p.scenario.rng_seed,
                "bound_s": p.bound,
                "strategies": {r.strategy: summarize(p, r) for r in p.runs},
            }
            for p in points
        ],
    }


def run_study(
    scenario_path: str | Path,
    out: str | Path,
    *,
    seed: int | None = None,
    sweeps: Sequence[str] = (),
    command: str = "",
    workers: int = 1,
    ray_address: str | None = None,
    progress: Progress | None = None,
    on_points: Callable[[int], None] | None = None,
) -> list[Point]:
    """Run the study and write its outputs into ``out`` (created if needed); returns the points.

    ``workers`` > 1: the sweep points run on that many local processes; ``ray_address``: on that Ray
    cluster ("local": one started for the study), simulations.sweep.  The outputs are the same, but
    for wall seconds; ``progress`` then hears of each point when it is done, not during it."""
    from patchswarm.simulations import plots  # matplotlib only when writing

    base = load_scenario(scenario_path)
    grid = expand(base.raw, [parse_sweep(t) for t in sweeps], seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if on_points is not None:
        on_points(sum(len(s.strategies) for _, s in grid))  # units of progress: strategy runs
    if workers == 1 and ray_address is None:
        points = [run_point(i, params, s, progress) for i, (params, s) in enumerate(grid)]
    else:

        def finished(i: int) -> None:
            if progress is not None:
                for name in grid[i][1].strategies:
                    progress(i, name, 1.0)

        calls = [(i, params, s, None) for i, (params, s) in enumerate(grid)]
        points = run_all(run_point, calls, workers=workers, ray_address=ray_address, finished=finished)
    write_results(points, out / "results.csv")
    meta = {"scenario": base.name, "scenario_file": str(scenario_path), "command": command,
            "sweep": [parse_sweep(t)[0] for t in sweeps], "build": build_label()}  # fmt: skip
    doc = summary_doc(points, meta)
    (out / "summary.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    try:
        figures = plots.write_all(points, doc, out)
    except plots.PlotsUnavailable:
        (out / "report.md").write_text(render_report(base, points, doc, []))  # the numbers are kept
        raise
    (out / "report.md").write_text(render_report(base, points, doc, figures))
    return points


# ---------------------------------------------------------------- report.md

_NAMES = {"checkpoint": "full checkpoint, central store", "central": "patch, central seed", "swarm": "patch, swarm"}


def _g(x: float) -> str:
    """Three significant digits, without exponents for the magnitudes a study meets."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _gb(n: float) -> str:
    return f"{_g(n / 1e9)} GB"


def _s(x: float | None) -> str:
    return "never" if x is None else f"{_g(x)} s"


def render_report(
    base: Scenario, points: Sequence[Point], doc: Mapping[str, Any], figures: Sequence[tuple[str, str]]
) -> str:
    lines = [f"# Simulation report: {base.name}", ""]
    if base.description:
        lines += [base.description, ""]
    if doc.get("command"):
        lines += ["```sh", str(doc["command"]), "```", ""]
    s = base
    lines += [
        f"{s.hosts} receiving hosts in {len(s.regions)} region(s) ({', '.join(r.name for r in s.regions)}); "
        f"patch {_gb(s.patch_size)}, full checkpoint {_gb(s.checkpoint_size)}, chunks {s.chunk_size:,} B; "
        f"{s.versions} version(s) every {s.interval:g} s; crash rate {s.crash_rate:g} per window; "
        f"seed/store uplink {s.seed_uplink * 8 / 1e9:g} Gbit/s (base scenario, before sweeps).",
        "",
        "Times are seconds from a version's publication; *time to all* is the worst version's last host "
        "(hosts that never got it are counted under *never*); *x bound* is time to all over the Kumar-Ross "
        "bound for the patch; *seed egress* counts every byte the seed/store sent until the last publication "
        "plus `run.deadline` (where the swarm's run stops); *wall* is the simulator's "
        f"own run time ({doc['build']} build).",
        "",
    ]
    for p, entry in zip(points, doc["points"], strict=True):
        lines += [f"## {p.label}", "", f"Bound: {_s(p.bound)}.", ""]
        lines += ["| strategy | time to all | p50 | p99 | never | x bound | seed egress | events | wall |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for name, m in entry["strategies"].items():
            ratio = "-" if m["ratio_to_bound"] is None else f"{_g(m['ratio_to_bound'])}x"
            egress = f"{_gb(m['seed_egress_bytes'])} ({_g(m['seed_egress_patches'])} patches)"
            lines.append(
                f"| {_NAMES.get(name, name)} | {_s(m['time_to_all_s'])} | {_s(m['p50_s'])} | {_s(m['p99_s'])} "
                f"| {m['incomplete']} | {ratio} | {egress} | {m['events']:,} | {m['wall_s']:.3g} s |"
            )
            if m["note"]:
                lines.append(f"| | errors: {m['note'][:200]} | | | | | | | |")
        lines.append("")
    lines += ["## Figures", ""]
    for name, caption in figures:
        lines += [f"![{caption}]({name})", ""]
    return "\n".join(lines)
