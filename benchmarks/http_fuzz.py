"""HTTP-level fuzzing of the four servers as real processes: 100k raw requests by default.

    .venv/bin/python -m benchmarks.http_fuzz [--requests 100000] [--seed 0] [--concurrency 32]

The servers (a seed node's peer endpoints, the plain board server, the sidecar, the unix-socket API)
are those of tests/support/serverkit.py, with its small limits; the requests come from the grammar of
tests/support/http_requests.py (tests/system/test_http_fuzz.py sends the same at CI size), drawn from a seeded RNG
and spread evenly over the servers, ``--concurrency`` connections at a time on each.

Prints the count of replies by status for each server ("none": closed or silent, waiting for the
rest of a request), then sends each server an honest request.  Exits 1 if a server answered 5xx
(other than a 503 with Retry-After: busy, or the connection cap), died, logged a traceback, or
does not answer the honest request.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.support.http_requests import RandomPick, raw_request
from tests.support.serverkit import FAST_LIMITS, Server, running_servers, status_of

SILENCE_S = 0.3


async def one(server: Server, data: bytes) -> bytes:
    try:
        reader, writer = await asyncio.wait_for(server.open(), 10)
    except (OSError, TimeoutError):
        return b"connect failed"
    reply = b""
    try:
        writer.write(data)
        while b"\r\n\r\n" not in reply:
            piece = await asyncio.wait_for(reader.read(1 << 16), SILENCE_S)
            if not piece:
                break
            reply += piece
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()
    return reply


async def fuzz(server: Server, requests: list[bytes], concurrency: int, bad: list[str]) -> Counter[str]:
    counts: Counter[str] = Counter()
    queue = iter(requests)

    async def worker() -> None:
        for data in queue:
            reply = await one(server, data)
            status = status_of(reply)
            if reply == b"connect failed":
                counts["connect failed"] += 1
                continue
            counts[str(status) if status else "none"] += 1
            if status >= 500 and not (status == 503 and b"\r\nretry-after:" in reply.lower()):
                bad.append(f"{server.name}: {status} for {data[:200]!r}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


async def run(servers: list[Server], total: int, seed: int, concurrency: int) -> int:
    pick = RandomPick(random.Random(seed))
    per = total // len(servers)
    bad: list[str] = []
    start = time.monotonic()
    results = await asyncio.gather(
        *(fuzz(s, [raw_request(pick) for _ in range(per)], concurrency, bad) for s in servers)
    )
    elapsed = time.monotonic() - start
    failed = 0
    for server, counts in zip(servers, results, strict=True):
        shown = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        print(f"{server.name:8} {sum(counts.values()):>7} requests  {shown}")
    print(f"{per * len(servers)} requests in {elapsed:.1f} s")
    for line in bad[:20]:
        print("  5xx:", line)
    failed += len(bad)
    for server in servers:
        alive = server.alive()
        traceback = "Traceback" in server.log_text()
        try:
            honest = await asyncio.to_thread(server.honest, 30.0) if alive else 0
        except AssertionError:
            honest = 0
        print(f"{server.name:8} alive: {alive}, traceback in log: {traceback}, honest request: {honest or 'no answer'}")
        failed += (not alive) + traceback + (honest != 200)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=32, help="connections at a time on each server")
    args = p.parse_args()
    env = {**FAST_LIMITS, "PATCHSWARM_HTTP_MAX_CONNECTIONS": str(max(64, 4 * args.concurrency))}
    with tempfile.TemporaryDirectory() as tmp, running_servers(Path(tmp), env) as servers:
        return asyncio.run(run(servers, args.requests, args.seed, args.concurrency))


if __name__ == "__main__":
    sys.exit(main())
