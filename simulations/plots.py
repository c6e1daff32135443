"""PNG figures of a study (matplotlib, Agg backend: no display needed).

* ``cdf-<point>.png``: completion-time CDF per strategy, the bound as a vertical line;
* for every swept key K with numeric values: ``time_to_all_vs_<K>.png`` and
  ``seed_egress_vs_<K>.png``, one line per strategy (and per value of the other swept keys).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from patchswarm.simulations.point import Point

STYLE = {"checkpoint": ("tab:red", "full checkpoint, central store"), "central": ("tab:orange", "patch, central seed"),
         "swarm": ("tab:blue", "patch, swarm")}  # fmt: skip


METRICS = {
    "time_to_all_s": "time to all hosts (s)",
    "p50_s": "median completion (s)",
    "p99_s": "99th percentile completion (s)",
    "seed_egress_bytes": "seed/store egress (bytes)",
}


class PlotsUnavailable(Exception):
    """matplotlib is an optional extra: the daemon never needs it, a study's plots do."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable("matplotlib is not installed: install patchswarm[sim] for plots") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def cdf(point: Point, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in point.runs:
        xs = sorted(o.completion for o in r.outcomes)
        n = len(xs)
        finite = [x for x in xs if x < math.inf]
        color, label = STYLE.get(r.strategy, ("black", r.strategy))
        if finite:
            ax.step(finite, [(i + 1) / n for i in range(len(finite))], where="post", color=color, label=label)
    ax.axvline(point.bound, color="black", linestyle=":", label=f"Kumar-Ross bound {point.bound:.3g} s")
    ax.set_xscale("log")
    ax.set_xlabel("seconds from publication to the host holding the version")
    ax.set_ylabel("fraction of (host, version)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{point.scenario.name}: {point.label}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# summary.json fields that hold a scenario key's value for every point, swept or not
_FIELDS = {
    "hosts.count": "hosts",
    "payload.patch_size": "patch_size",
    "payload.checkpoint_size": "checkpoint_size",
    "payload.chunk_size": "chunk_size",
    "versions.count": "versions",
    "churn.crash_rate": "crash_rate",
}


def _x(entry: Mapping[str, Any], key: str) -> Any:
    values = entry.get("values", {})
    if key in values:
        return values[key]
    return entry[_FIELDS[key]] if key in _FIELDS else entry["params"].get(key)


def versus(entries: Sequence[Mapping[str, Any]], key: str, metric: str, path: Path) -> bool:
    """``metric`` (a key of METRICS) against the swept ``key``, from summary.json points
    (of one study or several merged); one line per strategy and per value of the other swept keys (except
    ``run.strategies``).  False (nothing drawn) if ``key`` is not numeric in every point."""
    xs = [_x(e, key) for e in entries]
    if not xs or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    # the other swept keys' values -> x -> (strategy -> metrics, bound); the first study given wins a tie
    groups: dict[str, dict[float, tuple[dict[str, Mapping[str, Any]], float]]] = {}
    varied = {k for e in entries for k, v in e["params"].items() if any(f["params"].get(k) != v for f in entries)}
    for e, x in zip(entries, xs, strict=True):
        rest = ", ".join(f"{k}={v}" for k, v in e["params"].items() if k in varied - {key, "run.strategies"})
        metrics, _ = groups.setdefault(rest, {}).setdefault(float(x), ({}, e["bound_s"]))
        for name, m in e["strategies"].items():
            metrics.setdefault(name, m)
    dashes = ["-", "--", "-.", ":"]
    for gi, (rest, by_x) in enumerate(groups.items()):
        suffix = f" ({rest})" if rest else ""
        names = {n for metrics, _ in by_x.values() for n in metrics}
        for name in [n for n in STYLE if n in names]:
            color, label = STYLE[name]
            pts = sorted((x, ms[name][metric]) for x, (ms, _) in by_x.items() if name in ms)
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), marker="o", color=color, linestyle=dashes[gi % 4], label=label + suffix
                )
        if metric.endswith("_s"):
            bounds = sorted((x, b) for x, (_, b) in by_x.items())
            ax.plot(*zip(*bounds, strict=True), color="black", linestyle=dashes[gi % 4], marker=".", alpha=0.6,
                    label="Kumar-Ross bound" + suffix)  # fmt: skip
    positive = [x for x in xs if x > 0]
    if positive and max(positive) / min(positive) >= 20:
        ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(METRICS[metric])
    ax.grid(True, which="both", alpha=0.3)
    entries_shown = len(ax.get_legend_handles_labels()[1])
    if entries_shown > 4:  # a grid's many series: the legend goes below the axes, not over the lines
        fig.set_size_inches(6.4, 4.0 + 0.17 * entries_shown)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    else:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(points: Sequence[Point], doc: Mapping[str, Any], out: Path) -> list[tuple[str, str]]:
    """Every figure for the study; returns (file name, caption) pairs in report order."""
    figures: list[tuple[str, str]] = []
    for p in points:
        name = f"cdf-{p.index:02d}.png"
        cdf(p, out / name)
        figures.append((name, f"Completion CDF, {p.label}"))
    keys = [k for k, _ in points[0].params] if points else []
    swept = [k for k in keys if len({repr(dict(p.params)[k]) for p in points}) > 1]
    for key in swept:
        for metric, stem in (("time_to_all_s", "time_to_all"), ("seed_egress_bytes", "seed_egress")):
            name = f"{stem}_vs_{_name(key)}.png"
            if versus(doc["points"], key, metric, out / name):
                figures.append((name, f"{stem.replace('_', ' ')} vs {key}"))
    return figures


MAX_SUMMARY_BYTES = 256 << 20


def main(argv: Sequence[str] | None = None) -> int:
    """Draw one ``versus`` figure from several studies' summary.json files (e.g. a swarm sweep up to N = 300
    and a central-only sweep up to N = 10,000): ``python -m simulations.plots KEY METRIC OUT.png SUMMARY...``."""
    import argparse

    from patchswarm.protocol.errors import PatchswarmError
    from patchswarm.protocol.files import read_file
    from patchswarm.protocol.untrusted_json import load_json

    p = argparse.ArgumentParser(prog="python -m simulations.plots")
    p.add_argument("key")
    p.add_argument("metric", choices=list(METRICS))
    p.add_argument("out")
    p.add_argument("summaries", nargs="+")
    args = p.parse_args(argv)
    entries: list[dict[str, Any]] = []
    for path in args.summaries:
        try:
            doc = load_json(read_file(Path(path), MAX_SUMMARY_BYTES), max_bytes=MAX_SUMMARY_BYTES)
        except (OSError, PatchswarmError, ValueError) as e:
            p.error(f"{path}: not a readable summary.json ({e})")
        points = doc.get("points") if isinstance(doc, dict) else None
        if not isinstance(points, list) or not all(isinstance(e, dict) for e in points):
            p.error(f"{path}: not a study's summary.json (no list of points)")
        entries += points
    if not versus(entries, args.key, args.metric, Path(args.out)):
        print(f"{args.key} is not numeric in every point", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
