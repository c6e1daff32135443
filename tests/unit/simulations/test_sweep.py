"""simulations.sweep: the calls' results in the order given, wherever they run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from patchswarm.simulations.sweep import SweepError, run_all


def square(x: int) -> int:
    return x * x


def test_in_process_runs_the_calls_in_order_and_reports_each() -> None:
    seen: list[int] = []
    assert run_all(square, [(3,), (1,), (2,)], finished=seen.append) == [9, 1, 4]
    assert seen == [0, 1, 2]


def test_a_process_pool_gives_the_results_in_the_order_of_the_calls() -> None:
    seen: list[int] = []
    assert run_all(square, [(i,) for i in range(5)], workers=2, finished=seen.append) == [0, 1, 4, 9, 16]
    assert sorted(seen) == [0, 1, 2, 3, 4]


def test_no_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="workers"):
        run_all(square, [(1,)], workers=0)


def test_ray_missing_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(SweepError, match=r"pip install 'patchswarm\[ray\]'"):
        run_all(square, [(1,)], ray_address="local")


def test_a_study_without_ray_loads_no_ray() -> None:
    code = "import sys, patchswarm.daemon.simulate_cli, patchswarm.simulations.study; print('ray' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout == "False\n"
