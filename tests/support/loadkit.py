"""Load generators for the daemon's unix-socket API and the sidecar, shared by the load tests
(correctness only) and benchmarks/api_load.py (the same code at full rate, printing latencies).

Open loop: requests are issued on a fixed schedule whatever the replies do, so a slow server
shows up as latency and as a lower achieved rate instead of being hidden by a waiting client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from patchswarm.daemon.sidecar import HEADER_END, HEADER_START


@dataclass
class LoadResult:
    latencies: dict[str, list[float]] = field(default_factory=dict)  # by kind, seconds
    errors: list[str] = field(default_factory=list)
    sent: int = 0
    skipped: int = 0  # due while max_in_flight requests were outstanding: not sent (the client's limit)
    elapsed: float = 0.0
    versions: set[int] = field(default_factory=set)

    def ok(self, kind: str, seconds: float) -> None:
        self.latencies.setdefault(kind, []).append(seconds)

    @property
    def completed(self) -> int:
        return sum(len(v) for v in self.latencies.values())

    def percentiles(self, kind: str) -> tuple[float, float]:
        xs = sorted(self.latencies.get(kind, []))
        if not xs:
            return float("nan"), float("nan")
        return xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))]


class Monotone:
    """The versions a client sees must never go back: a reply may not be older than any reply that
    had already arrived when its request was sent (concurrent requests may finish in any order)."""

    def __init__(self) -> None:
        self.highest = 0

    def floor(self) -> int:
        return self.highest

    def check(self, floor: int, version: int | None, what: str, result: LoadResult) -> None:
        if version is None:
            return
        result.versions.add(version)
        if version < floor:
            result.errors.append(f"{what}: version {version} after {floor} had been seen")
        self.highest = max(self.highest, version)


async def open_loop(
    rate: float, stop: Callable[[], bool], one: Callable[[int], Coroutine[Any, Any, None]], max_in_flight: int = 512
) -> tuple[int, int, float]:
    """Call ``one(i)`` ``rate`` times a second until ``stop()``; returns (sent, skipped, seconds)."""
    start = time.perf_counter()
    tasks: set[asyncio.Task[None]] = set()
    i = skipped = 0
    while not stop():
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) < max_in_flight:
            t = asyncio.create_task(one(i))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        else:
            skipped += 1
        i += 1
    elapsed = time.perf_counter() - start
    if tasks:
        await asyncio.gather(*tasks)
    return i - skipped, skipped, elapsed


async def api_load(
    socket_path: str, rate: float, stop: Callable[[], bool], paths: tuple[str, ...] = ("/v1/version", "/v1/status")
) -> LoadResult:
    """Version queries on the daemon's unix socket, alternating ``paths``, at ``rate`` per second."""
    result = LoadResult()
    seen = Monotone()
    conn = aiohttp.UnixConnector(path=socket_path, limit=64)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as http:

        async def one(i: int) -> None:
            path = paths[i % len(paths)]
            floor = seen.floor()
            t0 = time.perf_counter()
            try:
                async with http.get(f"http://daemon{path}") as r:
                    body = await r.read()
                    status = r.status
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                result.errors.append(f"{path}: {type(e).__name__}: {e}")
                return
            took = time.perf_counter() - t0
            if status != 200:
                result.errors.append(f"{path}: HTTP {status}")
                return
            try:
                doc = json.loads(body)
                version = doc["version"]
                if not (version is None or (isinstance(version, int) and version >= 1)):
                    raise ValueError(f"version {version!r}")
                if not isinstance(doc["state"], str):
                    raise ValueError("no state")
            except (ValueError, KeyError, TypeError) as e:
                result.errors.append(f"{path}: bad reply ({e}): {body[:200]!r}")
                return
            seen.check(floor, version, path, result)
            result.ok(path, took)

        result.sent, result.skipped, result.elapsed = await open_loop(rate, stop, one)
    return result


# ---------------------------------------------------------------- the sidecar


@dataclass(frozen=True)
class Pin:
    kind: str  # "free", "min" or "exact"
    version: int | None = None

    def body(self) -> dict[str, Any]:
        if self.kind == "min":
            return {"min_version": self.version}
        if self.kind == "exact":
            return {"exact_version": self.version}
        return {}


async def sidecar_load(
    url: str,
    rate: float,
    stop: Callable[[], bool],
    pin: Callable[[int], Pin],
    prompt: list[int],
    max_tokens: int = 3,
    single_version: bool = True,
) -> LoadResult:
    """Generation requests through the sidecar at ``rate`` per second, each pinned by ``pin(i)``.

    Every 200 is checked for attribution: the sidecar's start/end headers and body agree, the
    engine's own before/after version of every token lies within [start, end], an exact pin ran on
    exactly its version and a min pin on a version at least its minimum.  A 409 must say why
    (not ready yet, or superseded) and be consistent with the applied version it reports.
    """
    result = LoadResult()
    seen = Monotone()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def one(i: int) -> None:
            p = pin(i)
            body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens}
            if p.kind != "free":
                body["weight_version"] = p.body()
            floor = seen.floor()
            t0 = time.perf_counter()
            try:
                async with http.post(url, json=body) as r:
                    status, headers, doc = r.status, r.headers, await r.json()
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
                result.errors.append(f"{p}: {type(e).__name__}: {e}")
                return
            took = time.perf_counter() - t0
            problem = attribution_problem(p, status, headers, doc, single_version)
            if problem:
                result.errors.append(f"{p}: {problem}")
                return
            if status == 200:
                seen.check(floor, int(headers[HEADER_START]), "sidecar", result)
            result.ok(f"{p.kind}:{status}", took)

        result.sent, result.skipped, result.elapsed = await open_loop(rate, stop, one, max_in_flight=128)
    return result


def attribution_problem(p: Pin, status: int, headers: Any, doc: Any, single_version: bool = True) -> str | None:
    """Why a sidecar reply is wrongly attributed, or None when it is right.  ``single_version``: the
    daemon commits in quiesce mode, so every request runs on one version (start == end)."""
    if status == 409:
        err, applied = doc.get("error"), doc.get("applied_version")
        if p.kind == "free" or not isinstance(applied, int):
            return f"409 without a pin or an applied version: {doc}"
        if err == "WeightVersionNotReady" and applied >= (p.version or 0) and p.kind == "min":
            return f"min {p.version} refused although {applied} is applied"
        if err == "WeightVersionNotReady" and p.kind == "exact" and applied >= (p.version or 0):
            return f"exact {p.version} 'not ready' although {applied} is applied"
        if err == "WeightVersionUnavailable" and not (p.kind == "exact" and applied > (p.version or 0)):
            return f"'unavailable' for {p} while {applied} is applied"
        if err not in ("WeightVersionNotReady", "WeightVersionUnavailable"):
            return f"409 {err}"
        return None
    if status != 200:
        return f"HTTP {status}: {str(doc)[:200]}"
    start, end = int(headers[HEADER_START]), int(headers[HEADER_END])
    if doc.get("weight_version") != {"start": start, "end": end} or start > end:
        return f"headers [{start}, {end}] and body {doc.get('weight_version')} disagree"
    used = {v for pair in doc["token_versions"] for v in pair}
    engine = doc.get("engine_version", {})
    used |= {engine.get("before"), engine.get("after")}
    if not used <= set(range(start, end + 1)):
        return f"the engine ran on {sorted(used, key=str)}, the sidecar says [{start}, {end}]"
    if single_version and start != end:
        return f"ran across a switch [{start}, {end}] although the daemon quiesces"
    if p.kind == "exact" and not start == end == p.version:
        return f"pinned to {p.version}, ran on [{start}, {end}]"
    if p.kind == "min" and start < (p.version or 0):
        return f"min {p.version}, ran on [{start}, {end}]"
    return None
