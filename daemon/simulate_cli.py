"""``patchswarm simulate SCENARIO.toml --out DIR [--seed S] [--workers N | --ray ADDRESS] [--sweep key=v1,v2,...]``.

Runs every strategy of the scenario (full checkpoint from a central store, patch from a central
seed, patch over the swarm) on the same hosts, with the Kumar-Ross bound beside them, and
writes results.csv, summary.json, PNG plots and report.md into DIR (simulations/study.py).
Several ``--sweep`` flags form a grid (every combination of their values); ``--workers N`` runs
its points on N local processes, ``--ray ADDRESS`` on a Ray cluster (simulations/sweep.py).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from typing import Any

from patchswarm.daemon import cli_args


def scenario_value(key: str) -> Callable[[str], int]:
    """An integer override of a scenario key (``run.seed``), by the scenario's own rule for it."""

    def parse(text: str) -> int:
        from patchswarm.simulations.scenario import ScenarioError, with_overrides

        value = cli_args.bounded(int, "a whole number", -(1 << 64), 1 << 64)(text)
        try:
            with_overrides({}, {key: value})
        except ScenarioError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return parse


def add_simulate_parser(sub: Any) -> None:
    sm = sub.add_parser(
        "simulate", help="bandwidth study: swarm vs central seed vs full checkpoint on a simulated network"
    )
    sm.add_argument(
        "scenario",
        type=cli_args.path,
        metavar="SCENARIO.toml",
        help="see simulations/scenarios/ and docs/bandwidth-study.md",
    )
    sm.add_argument(
        "--out",
        type=cli_args.path,
        required=True,
        metavar="DIR",
        help="results.csv, summary.json, *.png, report.md go here",
    )
    sm.add_argument("--seed", type=scenario_value("run.seed"), metavar="S", help="RNG seed (overrides run.seed)")
    where = sm.add_mutually_exclusive_group()
    where.add_argument(
        "--workers",
        type=cli_args.workers,
        default=1,
        metavar="N",
        help="run the sweep points on N local processes (default 1: in this one); the results are the same",
    )
    where.add_argument(
        "--ray",
        type=cli_args.ray_address,
        metavar="ADDRESS",
        help="run the sweep points on a Ray cluster: HOST:PORT of its head, auto, or local (needs patchswarm[ray])",
    )
    sm.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="vary a dotted scenario key (e.g. hosts.count=10,100,1000); several form a grid",
    )
    sm.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from patchswarm.daemon.user_error import UserError
    from patchswarm.simulations.plots import PlotsUnavailable
    from patchswarm.simulations.study import run_study  # the simulator loads only for this command
    from patchswarm.simulations.sweep import SweepError

    err = Console(stderr=True, soft_wrap=True, emoji=False)
    out = Console(soft_wrap=True, emoji=False)

    words = ["patchswarm", "simulate", args.scenario, "--out", args.out]
    words += ["--seed", str(args.seed)] if args.seed is not None else []
    words += ["--workers", str(args.workers)] if args.workers != 1 else []
    words += ["--ray", args.ray] if args.ray is not None else []
    for sweep in args.sweep:
        words += ["--sweep", sweep]
    command = shlex.join(words)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task: TaskID | None = None
        finished = 0

        def on_points(units: int) -> None:
            nonlocal task
            task = bar.add_task("simulating", total=float(units))

        def progress(index: int, strategy: str, fraction: float) -> None:
            nonlocal finished
            if task is None:
                return
            if fraction >= 1.0:
                finished += 1
                bar.update(task, completed=float(finished), description=f"point {index}: {strategy} done")
            else:
                bar.update(task, completed=finished + fraction, description=f"point {index}: {strategy}")

        try:
            points = run_study(
                args.scenario, args.out, seed=args.seed, sweeps=args.sweep, command=command, progress=progress,
                on_points=on_points, workers=args.workers, ray_address=args.ray,
            )  # fmt: skip
        except SweepError as e:
            raise UserError(str(e)) from None
        except PlotsUnavailable as e:
            raise UserError(f"wrote {args.out}/results.csv, summary.json and report.md, but no plots: {e}") from None
    for p in points:
        best = {r.strategy: max((o.completion for o in r.outcomes), default=0.0) for r in p.runs}
        parts = ", ".join(f"{k} {v:.4g} s" for k, v in best.items())
        out.print(f"{p.label}: {parts}; bound {p.bound:.4g} s", markup=False, highlight=False)
    out.print(f"wrote {args.out}/results.csv, summary.json, report.md and plots", markup=False, highlight=False)
    return 0
