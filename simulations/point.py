"""``Point``: one point of a study's sweep, with the runs of its strategies (what study.py computes
and plots.py draws)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from patchswarm.simulations.scenario import Layout, Scenario
from patchswarm.simulations.strategies import StrategyRun


@dataclass(frozen=True)
class Point:
    index: int
    params: tuple[tuple[str, Any], ...]  # the sweep values of this point (empty: no sweep)
    scenario: Scenario
    layout: Layout
    bound: float  # seconds, per version (the patch to every receiver)
    runs: tuple[StrategyRun, ...]

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={_fmt_value(v)}" for k, v in self.params) or "base"


def _fmt_value(v: Any) -> str:
    return repr(v) if not isinstance(v, str) else v
