"""The fleet staleness study (simulations/fleet_study.py, simulations/staleness.py) on tiny fleets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from patchswarm.simulations import plots
from patchswarm.simulations.fleet_plots import largest_fleet
from patchswarm.simulations.fleet_study import Fleet, extrapolate, main, merge, row, run_strategy
from patchswarm.simulations.scenario import ChurnEvent, layout
from patchswarm.simulations.staleness import Staleness, staleness, up_intervals
from patchswarm.simulations.strategies import Outcome, swarm

GBIT = 1.25e8
L = 0.5e-3  # one-way latency inside the one region


def _stable(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k not in ("wall_s", "build")}


def test_quantiles_and_fractions_of_a_hand_made_distribution() -> None:
    st = Staleness(((0, 90.0), (1, 9.0), (3, 1.0)))
    assert st.quantile(0.5) == 0
    assert st.quantile(0.9) == 0
    assert st.quantile(0.95) == 1
    assert st.quantile(0.99) == 1
    assert st.quantile(0.995) == 3
    assert st.max == 3
    assert st.fraction_at_most(0) == pytest.approx(0.9)
    assert st.fraction_at_most(2) == pytest.approx(0.99)
    assert st.summary()["mean"] == pytest.approx((9 + 3) / 100)


def test_up_intervals_follow_crashes_and_rejoins() -> None:
    ev = [
        ChurnEvent(5.0, "a", False),
        ChurnEvent(7.0, "a", True),
        ChurnEvent(9.0, "a", False),
        ChurnEvent(1, "b", False),
    ]
    assert up_intervals(ev, "a", 20.0) == [(0.0, 5.0), (7.0, 9.0)]
    assert up_intervals(ev, "c", 20.0) == [(0.0, 20.0)]


def test_a_host_that_skips_versions_is_counted_from_the_newest_it_holds() -> None:
    # versions at 0, 10, 20; the host gets 1 at 4 s, then 3 (skipping 2) at 27 s: "first held v or newer"
    outs = [Outcome("h", 1, 4.0, 0, 0), Outcome("h", 2, 17.0, 0, 0), Outcome("h", 3, 7.0, 0, 0)]
    st = staleness(outs, [], interval=10.0, versions=3)
    # [0,4) s=1; [4,10) 0; [10,20) 1; [20,27) 2; [27,30) 0
    assert dict(st.seconds) == pytest.approx({0: 9.0, 1: 14.0, 2: 7.0})


def test_central_seed_one_region_no_churn_matches_bytes_over_bandwidth() -> None:
    n, patch, t, versions = 10, 100 * 10**6, 10.0, 3
    fleet = Fleet(hosts=n, interval=t, versions=versions, patch_bytes=patch, life=math.inf, single_region=True)
    run, churn, _ = run_strategy(fleet, "central")
    assert churn == ()
    # every host shares the seed's uplink: request leg + reply latency + N F / u, well inside T
    c = 2 * L + n * patch / (10 * GBIT)
    assert [o.completion for o in run.outcomes] == pytest.approx([c] * n * versions, rel=1e-9)
    r = row(fleet, "central", run, churn)
    assert r["staleness"]["le0"] == pytest.approx(1 - c / t, rel=1e-9)
    assert (r["staleness"]["p50"], r["staleness"]["p99"], r["staleness"]["max"]) == (0, 1, 1)


def test_a_saturated_central_seed_falls_behind_as_a_grid_of_requests_sees_it() -> None:
    # each version takes c > T: the host fetches version k from (k-1) c on and holds it at k c
    n, patch, t, versions = 10, 100 * 10**6, 0.5, 8
    fleet = Fleet(hosts=n, interval=t, versions=versions, patch_bytes=patch, life=math.inf, single_region=True)
    run, churn, _ = run_strategy(fleet, "central")
    c = 2 * L + n * patch / (10 * GBIT)
    assert c > t
    steps = 40_000  # requests on a fine grid, an independent count of the same distribution
    seen: dict[int, int] = {}
    for i in range(steps):
        at = (i + 0.5) * versions * t / steps
        s = (math.floor(at / t) + 1) - math.floor(at / c)
        seen[s] = seen.get(s, 0) + 1
    st = staleness(run.outcomes, churn, interval=t, versions=versions)
    for s, _k in seen.items():
        assert st.fraction_at_most(s) == pytest.approx(sum(v for x, v in seen.items() if x <= s) / steps, abs=2e-3)
    assert st.max == max(seen)


def test_a_saturated_central_seed_counts_only_the_bytes_it_sent_inside_the_window() -> None:
    # The swarm stops at the last publication + deadline (here T); the central store goes on serving
    # until every host holds every version, and used to count all of it: 8 versions x 10 hosts x 100 MB.
    n, patch, t, versions, u = 10, 100 * 10**6, 0.5, 8, 10 * GBIT
    fleet = Fleet(hosts=n, interval=t, versions=versions, patch_bytes=patch, life=math.inf, single_region=True)
    run, churn, _ = run_strategy(fleet, "central")
    c = 2 * L + n * patch / u  # one round: request and reply latency, then N F at the seed's uplink
    end = (versions - 1) * t + t  # 4.0 s
    rounds = 4  # done by 3.204 s; the fifth sends from 3.205 s at the full uplink until 4.005 s
    assert rounds * c + 2 * L < end < (rounds + 1) * c
    expected = rounds * n * patch + (end - (rounds * c + 2 * L)) * u  # 4.99375e9 bytes
    assert run.seed_egress == pytest.approx(expected, rel=1e-9)
    assert row(fleet, "central", run, churn)["seed_egress_bytes"] == pytest.approx(expected, rel=1e-9)
    assert math.fsum(o.from_seed for o in run.outcomes) == versions * n * patch  # (all delivered, later)


def test_same_seed_same_numbers_with_churn() -> None:
    fleet = Fleet(hosts=6, interval=4.0, versions=3, patch_bytes=8 << 20, life=20.0, downtime=3.0, single_region=True)
    runs = []
    for _ in range(2):
        run, churn, _ = run_strategy(fleet, "swarm")
        runs.append(_stable(row(fleet, "swarm", run, churn)))
    assert runs[0]["churn_events"] > 0
    assert runs[0] == runs[1]


def test_the_swarm_beats_a_saturated_central_seed() -> None:
    # the seed's 1 Gbit/s carries 12 copies of 50 MB in 4.8 s > T = 3 s; the swarm needs about one copy
    fleet = Fleet(hosts=12, interval=3.0, versions=3, patch_bytes=50 * 10**6, seed_gbps=1.0, life=math.inf)
    rows = {}
    for strat in ("swarm", "central"):
        run, churn, _ = run_strategy(fleet, strat)
        rows[strat] = row(fleet, strat, run, churn)["staleness"]
    assert rows["central"]["p50"] >= 1
    assert rows["swarm"]["p99"] <= rows["central"]["p99"]
    assert rows["swarm"]["mean"] < rows["central"]["mean"]
    assert rows["swarm"]["le0"] > rows["central"]["le0"]


def test_a_host_that_comes_back_catches_up_and_serves_nothing_while_down() -> None:
    fleet = Fleet(hosts=4, interval=3.0, versions=4, patch_bytes=8 << 20, life=math.inf, single_region=True)
    s = fleet.scenario()
    lay = layout(s)
    host = lay.peers[1].id
    churn = (ChurnEvent(1.0, host, False), ChurnEvent(8.0, host, True))  # down over the publications at 3 and 6
    run = swarm(s, lay, churn)
    mine = [o for o in run.outcomes if o.host == host]
    assert mine[0].completion < 1.0  # version 1 before the crash
    for o in mine[1:]:  # versions 2..4: after the rejoin, well before the window ends
        assert math.isfinite(o.completion)
        assert (o.version - 1) * fleet.interval + o.completion >= 8.0 or o.version == 4
    st = staleness([o for o in run.outcomes if o.host == host], churn, interval=3.0, versions=4)
    assert st.total == pytest.approx(12.0 - 7.0)  # up [0, 1) and [8, 12)
    assert st.max >= 2  # it came back two versions behind the head


def test_extrapolating_to_the_same_fleet_changes_nothing_and_largest_fleet_reads_the_grid() -> None:
    fleet = Fleet(hosts=6, interval=4.0, versions=2, patch_bytes=8 << 20, life=30.0, downtime=2.0)
    run, churn, _ = run_strategy(fleet, "swarm")
    real = row(fleet, "swarm", run, churn)
    same = extrapolate(fleet, fleet, run, churn)
    assert same["staleness"] == real["staleness"]
    rows = [
        {"strategy": "central", "fleet": {"hosts": n, "interval": 60.0}, "staleness": {"p99": p}}
        for n, p in ((100, 0), (1000, 1), (5000, 3), (10000, 1))
    ]
    assert largest_fleet(rows, "central", 60.0, 1) == 1000  # 10,000 is within again, but 5,000 was not
    assert largest_fleet(rows, "central", 60.0, 0) == 100
    assert largest_fleet(rows, "swarm", 60.0, 1) is None


def test_the_command_writes_results_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    args = ["run", "--hosts", "3,5", "--interval", "5", "--versions", "2", "--patch-mb", "4", "--life-h", "inf"]
    assert main([*args, "--swarm-max-hosts", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["fleet"]["hosts"], r["strategy"]) for r in rows} == {
        (n, s) for n in (3, 5) for s in ("swarm", "central", "checkpoint")
    }
    assert [r["extrapolated_from"] for r in rows if r["strategy"] == "swarm"] == [None, 3]
    cdf, big = tmp_path / "cdf.png", tmp_path / "largest.png"
    assert main(["plot", str(out), "--hosts", "5", "--interval", "5", "--cdf", str(cdf), "--largest", str(big)]) == 0
    assert cdf.stat().st_size > 1000 and big.stat().st_size > 1000


def test_merging_results_prefers_real_runs_then_larger_sources() -> None:
    f = {"hosts": 300, "interval": 60.0}
    rows = [
        {"fleet": f, "strategy": "swarm", "extrapolated_from": 30, "tag": "a"},
        {"fleet": f, "strategy": "swarm", "extrapolated_from": 100, "tag": "b"},
        {"fleet": f, "strategy": "central", "extrapolated_from": None, "tag": "c"},
    ]
    assert sorted(r["tag"] for r in merge(rows)) == ["b", "c"]
    assert [
        r["tag"] for r in merge([*rows, {"fleet": f, "strategy": "swarm", "extrapolated_from": None, "tag": "d"}])
    ] == [
        "d",
        "c",
    ]


@pytest.mark.parametrize(
    "text",
    [
        '[{"fleet": {}, "strategy": "central", "strategy": "swarm", "extrapolated_from": null}]',  # last won
        "[" * 5000 + "]" * 5000,  # RecursionError: a traceback past the one-line error
        '[{"fleet": {}, "strategy": "\\udc00", "extrapolated_from": null}]',  # a str no file can hold
    ],
)
def test_results_and_summary_files_are_read_strictly(tmp_path: Path, text: str) -> None:
    f = tmp_path / "results.json"
    f.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["plot", str(f)])
    assert e.value.code == 2
    f.write_text('{"points": ' + text + "}")
    with pytest.raises(SystemExit) as e:
        plots.main(["x", "time_to_all_s", str(tmp_path / "out.png"), str(f)])
    assert e.value.code == 2
