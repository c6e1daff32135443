"""Where a study's sweep points run: in this process, a local process pool, or a Ray cluster.

Each point is independent and seeded (its scenario carries ``run.seed``), so it gives the same result
wherever it runs; the results come back in the order the calls were given, whichever finished first.
A study that outgrows one process runs its points on ``workers`` local processes
(``concurrent.futures``, started by spawning: the caller may hold threads, a progress bar's, that a
fork would copy half-way) and one that outgrows one machine on a Ray cluster (``ray`` is an optional
extra, imported only when asked for).  A single point is never split: its nodes share one event loop.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class SweepError(RuntimeError):
    """The points cannot run where they were sent (Ray is not installed)."""


def run_all(
    fn: Callable[..., T],
    calls: Sequence[tuple[Any, ...]],
    *,
    workers: int = 1,
    ray_address: str | None = None,
    finished: Callable[[int], None] | None = None,
) -> list[T]:
    """``[fn(*call) for call in calls]``: here (``workers`` 1), on ``workers`` local processes, or on the Ray
    cluster at ``ray_address`` ("local": a Ray instance started for this call).  ``fn`` must be a module-level
    function and the calls picklable.  ``finished(i)``: call ``i`` is done (in the order they finish)."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if ray_address is not None:
        return _on_ray(fn, calls, ray_address, finished)
    if workers == 1 or len(calls) <= 1:
        results = []
        for i, call in enumerate(calls):
            results.append(fn(*call))
            if finished is not None:
                finished(i)
        return results
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(calls)), mp_context=context) as pool:
        futures = [pool.submit(fn, *call) for call in calls]
        index = {f: i for i, f in enumerate(futures)}
        for f in concurrent.futures.as_completed(futures):
            f.result()  # a failed point fails the study here, the others cancelled on the way out
            if finished is not None:
                finished(index[f])
        return [f.result() for f in futures]


def _on_ray(
    fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], address: str, finished: Callable[[int], None] | None
) -> list[T]:
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs the ray package: pip install 'patchswarm[ray]'") from None
    started = not ray.is_initialized()
    if started:
        # "local": a Ray instance of this machine's cores, stopped again below; else a running cluster's head.
        ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(fn)
        refs = [remote.remote(*call) for call in calls]
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                ray.get(ref)  # a failed point fails the study here
                if finished is not None:
                    finished(index[ref])
        return list(ray.get(refs))
    finally:
        if started:
            ray.shutdown()
