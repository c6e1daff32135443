"""Figures and tables of the fleet staleness study (simulations/fleet_study.py results JSON), and reading them.

* ``cdf``: fraction of requests with staleness <= s, one line per strategy, at one (N, T);
* ``largest``: the largest fleet (of the N run) whose p99 staleness stays <= 1 and <= 2 versions, vs T;
* ``tables``: the same numbers as Markdown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from patchswarm.simulations.plots import STYLE, _pyplot

BOUNDS = (1, 2)
STRATEGY_ORDER = ("swarm", "central", "checkpoint")


def largest_fleet(rows: Sequence[dict[str, Any]], strategy: str, interval: float, bound: int) -> int | None:
    """The largest N among the points run for (strategy, interval) whose p99 staleness is <= bound, with every
    smaller N of the grid within it too; None if even the smallest is not."""
    pts = sorted(
        (r["fleet"]["hosts"], r["staleness"]["p99"])
        for r in rows
        if r["strategy"] == strategy and r["fleet"]["interval"] == interval
    )
    best = None
    for n, p99 in pts:
        if p99 > bound:
            break
        best = n
    return best


def _point(rows: Sequence[dict[str, Any]], hosts: int, interval: float) -> list[dict[str, Any]]:
    pts = [r for r in rows if r["fleet"]["hosts"] == hosts and r["fleet"]["interval"] == interval]
    return sorted(pts, key=lambda r: STRATEGY_ORDER.index(r["strategy"]))


def cdf(rows: Sequence[dict[str, Any]], hosts: int, interval: float, path: Path) -> None:
    plt = _pyplot()
    pts = _point(rows, hosts, interval)
    if not pts:
        raise ValueError(f"no results at N={hosts}, T={interval:g}")
    fig, (ax, tail) = plt.subplots(1, 2, figsize=(11, 4.2))
    top = max(max(k for k, _ in r["histogram"]) for r in pts)
    xs = list(range(0, top + 2))
    for r in pts:
        hist = {int(k): float(w) for k, w in r["histogram"]}
        total = math.fsum(hist.values())
        ys = [math.fsum(w for k, w in hist.items() if k <= x) / total for x in xs]
        color, label = STYLE[r["strategy"]]
        note = f" (extrapolated from N={r['extrapolated_from']:,})" if r["extrapolated_from"] else ""
        ax.step(xs, ys, where="post", color=color, label=f"{label}{note}")
        tail.step(xs, [max(1 - y, 1e-6) for y in ys], where="post", color=color)
    ticks = [x for x in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if x <= top + 1]
    for a in (ax, tail):
        a.set_xscale("symlog", linthresh=4)
        a.set_xticks(ticks, [str(x) for x in ticks])
        a.set_xlabel("staleness a request sees (versions behind the head)")
        a.grid(alpha=0.3)
    ax.set_ylabel("fraction of requests with staleness <= s")
    ax.set_ylim(0, 1.02)
    tail.set_yscale("log")
    tail.set_ylim(1e-5, 1.5)
    tail.set_ylabel("fraction of requests with staleness > s")
    f = pts[0]["fleet"]
    fig.suptitle(f"N = {hosts:,} hosts, a version every {interval:g} s, {f['patch_bytes'] / 1e6:.1f} MB patch")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def largest(rows: Sequence[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    intervals = sorted({r["fleet"]["interval"] for r in rows})
    fig, axes = plt.subplots(1, len(BOUNDS), figsize=(10, 4), sharey=True)
    floor = 0.5  # "not even the smallest fleet run": drawn below the axis' first decade
    for ax, bound in zip(axes, BOUNDS, strict=True):
        for strat in STRATEGY_ORDER:
            ys = [largest_fleet(rows, strat, t, bound) for t in intervals]
            if all(y is None for y in ys):
                continue
            color, label = STYLE[strat]
            extrapolated = any(r["extrapolated_from"] for r in rows if r["strategy"] == strat)
            style = "--" if extrapolated else "-"
            note = " (extrapolated above the real runs)" if extrapolated else ""
            ax.plot(
                intervals, [y if y is not None else floor for y in ys], "o" + style, color=color, label=label + note
            )
            for t, y in zip(intervals, ys, strict=True):
                top = max(r["fleet"]["hosts"] for r in rows if r["strategy"] == strat and r["fleet"]["interval"] == t)
                if y == top:  # within the bound at every N run: the real limit is higher
                    ax.annotate("^ largest N run", (t, y), textcoords="offset points", xytext=(-20, 6), fontsize=7)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_ylim(0.4, 4e4)
        ax.set_yscale("log")
        ax.set_xticks(intervals, [f"{t:g}" for t in intervals])
        ax.set_xlabel("seconds between versions (T)")
        ax.set_title(f"p99 staleness <= {bound}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("largest fleet run that stays within (hosts)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tables(rows: Sequence[dict[str, Any]]) -> str:
    out = [
        "| T (s) | N | strategy | p50 | p90 | p99 | max | mean | <=0 | <=1 | <=2 | <=4 "
        "| delivery p99 (s) | seed egress (GB) | run |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    key = sorted(rows, key=lambda r: (r["fleet"]["interval"], r["fleet"]["hosts"], STRATEGY_ORDER.index(r["strategy"])))
    for r in key:
        s, f = r["staleness"], r["fleet"]
        how = f"extrapolated from {r['extrapolated_from']}" if r["extrapolated_from"] else f"{r['wall_s']:.0f} s wall"
        out.append(
            f"| {f['interval']:g} | {f['hosts']:,} | {STYLE[r['strategy']][1]} | {s['p50']:g} | {s['p90']:g} | "
            f"{s['p99']:g} | {s['max']:g} | {s['mean']:.3f} | {s['le0']:.4f} | {s['le1']:.4f} | {s['le2']:.4f} | "
            f"{s['le4']:.4f} | {r['delivery_p99_s']:.3g} | {r['seed_egress_bytes'] / 1e9:.3g} | {how} |"
        )
    intervals = sorted({r["fleet"]["interval"] for r in rows})
    out += ["", "| strategy | " + " | ".join(f"T = {t:g} s, p99 <= {b}" for b in BOUNDS for t in intervals) + " |"]
    out.append("| --- |" + " ---: |" * (len(BOUNDS) * len(intervals)))
    for strat in [x for x in STRATEGY_ORDER if any(r["strategy"] == x for r in rows)]:
        cells = []
        for b in BOUNDS:
            for t in intervals:
                n = largest_fleet(rows, strat, t, b)
                biggest = max(
                    (r["fleet"]["hosts"] for r in rows if r["fleet"]["interval"] == t and r["strategy"] == strat),
                    default=0,
                )
                cells.append("none" if n is None else (f">= {n:,}" if n == biggest else f"{n:,}"))
        out.append(f"| {STYLE[strat][1]} | " + " | ".join(cells) + " |")
    return "\n".join(out)
