"""Policy staleness that rollout requests see: versions behind the trainer's head, from a strategy run.

A request arriving at time t on a host that holds version v sees staleness ``head(t) - v``, where
``head(t)`` is the newest version published by t.  Requests arrive uniformly in time on every host
that is up (a down host serves none), so the staleness distribution the requests see is the
host-time-weighted distribution of ``head(t) - held(h, t)`` over the up hosts: computed here exactly
(piecewise constant between publications, completions and churn events), no sampled requests.

``held(h, t)`` is the newest version v with ``publication(v) + completion(h, v) <= t`` (``Outcome``'s
completion is when the host first held v *or a newer one*), 0 (the anchor every host starts with)
before the first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from patchswarm.simulations.scenario import ChurnEvent
from patchswarm.simulations.strategies import Outcome

LEVELS = (0, 1, 2, 4)  # the s of "fraction of requests with staleness <= s"


@dataclass(frozen=True)
class Staleness:
    """Host-seconds spent at each staleness (up hosts only) over the measured window."""

    seconds: tuple[tuple[int, float], ...]  # (staleness, host-seconds), staleness ascending

    @property
    def total(self) -> float:
        return math.fsum(w for _, w in self.seconds)

    def quantile(self, q: float) -> int:
        """The smallest s with at least a fraction q of the requests at staleness <= s."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be in [0, 1]")
        total = self.total
        if total <= 0:
            raise ValueError("no host was up in the window")
        acc = 0.0
        for s, w in self.seconds:
            acc += w
            if acc >= q * total * (1 - 1e-12):
                return s
        return self.seconds[-1][0]

    def fraction_at_most(self, s: int) -> float:
        total = self.total
        return math.fsum(w for k, w in self.seconds if k <= s) / total if total > 0 else math.nan

    @property
    def max(self) -> int:
        return max((s for s, w in self.seconds if w > 0), default=0)

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "max": self.max,
            "mean": math.fsum(s * w for s, w in self.seconds) / self.total,
        }
        for s in LEVELS:
            out[f"le{s}"] = self.fraction_at_most(s)
        return out


def up_intervals(churn: Iterable[ChurnEvent], host: str, end: float) -> list[tuple[float, float]]:
    """The [start, stop) intervals in [0, end) when ``host`` is up; every host starts up."""
    spans: list[tuple[float, float]] = []
    up_since: float | None = 0.0
    for e in sorted(e for e in churn if e.host == host):
        if not e.up and up_since is not None:
            spans.append((up_since, min(e.time, end)))
            up_since = None
        elif e.up and up_since is None:
            up_since = e.time
    if up_since is not None:
        spans.append((up_since, end))
    return [(a, b) for a, b in spans if b > a and a < end]


def staleness(
    outcomes: Sequence[Outcome],
    churn: Sequence[ChurnEvent],
    *,
    interval: float,
    versions: int,
    start: float = 0.0,
) -> Staleness:
    """The distribution over [start, versions * interval): version v (1-based) is published at
    ``(v - 1) * interval``; every host in ``outcomes`` holds version 0 at time 0."""
    end = versions * interval
    if not 0.0 <= start < end:
        raise ValueError("start must be in [0, versions * interval)")
    by_host: dict[str, dict[int, float]] = {}
    for o in outcomes:
        by_host.setdefault(o.host, {})[o.version] = (o.version - 1) * interval + o.completion
    churn_by_host: dict[str, list[ChurnEvent]] = {}
    for e in churn:
        churn_by_host.setdefault(e.host, []).append(e)
    acc: dict[int, float] = {}
    for host, reached in by_host.items():
        _host_staleness(reached, up_intervals(churn_by_host.get(host, ()), host, end), interval, versions, start, acc)
    return Staleness(tuple(sorted(acc.items())))


def _host_staleness(
    reached: Mapping[int, float],
    up: Sequence[tuple[float, float]],
    interval: float,
    versions: int,
    start: float,
    acc: dict[int, float],
) -> None:
    end = versions * interval
    # held(t) as steps: (time, newest version reached by then), nondecreasing in both
    steps: list[tuple[float, int]] = []
    best = 0
    for t, v in sorted((t, v) for v, t in reached.items() if t < end):
        if v > best:
            best = v
            steps.append((t, v))
    marks = {start, end}
    marks.update(v * interval for v in range(versions) if start < v * interval < end)
    marks.update(t for t, _ in steps if start < t < end)
    for a, b in up:
        marks.update(x for x in (a, b) if start < x < end)
    cuts = sorted(marks)
    si = 0
    held = 0
    ui = 0
    for a, b in itertools.pairwise(cuts):
        while si < len(steps) and steps[si][0] <= a:
            held = steps[si][1]
            si += 1
        while ui < len(up) and up[ui][1] <= a:
            ui += 1
        if ui >= len(up) or not up[ui][0] <= a:
            continue
        head = min(versions, math.floor(a / interval + 1e-9) + 1)
        s = head - held
        acc[s] = acc.get(s, 0.0) + (b - a)
