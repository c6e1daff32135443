"""Load on a rollout daemon's local interfaces while versions distribute, measured side by side
with the same load on an idle daemon.

    python -m benchmarks.api_load [--rate 1000] [--seconds 10] [--every 1.0]
    python -m benchmarks.api_load --sidecar [--rate 100] [--seconds 10] [--every 1.0]

A trainer (this process, publishing in a thread), a seed process and one daemon process on
loopback.  Default mode: GET /v1/version and GET /v1/status alternately on the daemon's unix
socket at ``--rate`` requests/s (open loop), first for ``--seconds`` on an idle daemon, then for
``--seconds`` while a new version is published every ``--every`` seconds and activated.
``--sidecar``: generation requests (unpinned, min-pinned, exact-pinned) through the daemon's
sidecar to the reference engine reading the daemon's store, idle then across activations.
Prints p50/p99 latency per kind of request, the achieved rate, errors and attribution problems
(tests/support/loadkit.py checks every reply, as the tests do), and the ratio loaded/idle.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from patchswarm.daemon.engine import attach
from patchswarm.daemon.publisher import Publisher
from patchswarm.daemon.ref_sources import StoreViewSource
from patchswarm.daemon.refengine import start_engine
from patchswarm.daemon.trajectory import generate
from patchswarm.protocol.files import write_atomic
from patchswarm.protocol.trust import Certificate
from tests.support.boards import free_port
from tests.support.faultkit import SeedProc, fleet_daemon
from tests.support.loadkit import LoadResult, Pin, api_load, sidecar_load
from tests.support.swarmkit import RUN, Swarm


def client(sidecar: bool, target: str, rate: float, seconds: float, top: int, every: float) -> LoadResult:
    """The load, in a process of its own (so the trainer publishing here cannot stall it)."""
    until = time.monotonic() + seconds
    if not sidecar:
        return asyncio.run(api_load(target, rate, lambda: time.monotonic() > until))
    rng = random.Random(1)
    t0 = time.monotonic()

    def pin(i: int) -> Pin:
        kind = ("free", "min", "exact")[i % 3]
        now = top + int((time.monotonic() - t0) / every)  # about the version the trainer is at
        return Pin(kind, None if kind == "free" else rng.randint(max(1, now - 1), now + 1))

    return asyncio.run(sidecar_load(target, rate, lambda: time.monotonic() > until, pin, prompt=[2, 5, 6, 7, 1]))


def report(label: str, r: LoadResult, base: LoadResult | None = None) -> None:
    rate = r.sent / r.elapsed if r.elapsed else 0.0
    print(
        f"{label}: sent {r.sent} in {r.elapsed:.1f} s = {rate:.0f}/s, answered {r.completed}, "
        f"skipped (client limit) {r.skipped}, errors {len(r.errors)}, versions seen {sorted(r.versions)}"
    )
    for kind in sorted(r.latencies):
        p50, p99 = r.percentiles(kind)
        line = f"    {kind:14s} n={len(r.latencies[kind]):6d}  p50 {p50 * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms"
        if base is not None and kind in base.latencies:
            b50, b99 = base.percentiles(kind)
            line += f"   (x{p50 / b50:.2f} / x{p99 / b99:.2f} of idle)"
        print(line)
    for e in r.errors[:10]:
        print(f"    error: {e}")


class Replay:
    """Versions published beforehand on a trainer's board, then released one by one onto the board
    the seed serves (every new file, the head last), so no trainer work competes with the load."""

    def __init__(self, sw: Swarm, served: Path, sidecar: bool, count: int) -> None:
        self.src, self.dst = sw.board.root, served
        self.releases: list[dict[str, bytes]] = []
        self.known: dict[str, bytes] = {}
        traj = generate("tiny", steps=count) if sidecar else None
        pub = sw.pub
        if traj is not None:
            now = int(time.time() * 1000)
            cert = Certificate(sw.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(sw.root).to_bytes()
            pub = Publisher(sw.board, sw.trainer, run_id=RUN, served_format="as_is", certificate=cert)
        assert pub is not None
        for step in range(count):
            if traj is not None:
                pub.publish(traj.bf16[step])
            else:
                sw.publish(3e-4)
            self._snapshot()
        self.released = 0

    def _snapshot(self) -> None:
        changed = {}
        for p in sorted(self.src.rglob("*")):
            rel = str(p.relative_to(self.src))
            if p.is_file() and not p.name.startswith("."):
                data = p.read_bytes()
                if self.known.get(rel) != data:
                    changed[rel] = self.known[rel] = data
        self.releases.append(changed)

    def release(self) -> int:
        """Put the next version on the served board; returns its number."""
        files = self.releases[self.released]
        for rel in sorted(files, key=lambda r: r.endswith("/head")):  # the head goes last
            (self.dst / rel).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.dst / rel, files[rel], sync_dir=False)
        self.released += 1
        return self.released


async def run(args: argparse.Namespace, tmp: Path) -> int:
    sw = Swarm(tmp / "trainer")
    replay = Replay(sw, tmp / "served", args.sidecar, int(args.seconds / args.every) + 3)
    replay.release()  # version 1
    seed = SeedProc(sw, tmp, board=tmp / "served")
    seed.start()
    engine_port, sidecar_port = free_port(), free_port()
    d = fleet_daemon(sw, seed.url, "bench", tmp)
    if args.sidecar:
        d.env.update(
            PATCHSWARM_SIDECAR_ENABLED="true",
            PATCHSWARM_SIDECAR_LISTEN=f"127.0.0.1:{sidecar_port}",
            PATCHSWARM_SIDECAR_UPSTREAM=f"http://127.0.0.1:{engine_port}",
        )
    d.start()
    engine = view = None
    published = [1]
    try:
        await d.wait_version(1, timeout=120)

        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        target = f"http://127.0.0.1:{sidecar_port}/generate" if args.sidecar else d.socket

        async def load(seconds: float) -> LoadResult:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                pool, client, args.sidecar, target, args.rate, seconds, published[-1], args.every
            )

        if args.sidecar:
            view = attach((await d.get("/v1/layout"))["attach"])
            engine = await start_engine(StoreViewSource(view), port=engine_port)
        idle = await load(args.seconds)

        async def trainer() -> None:
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline and replay.released < len(replay.releases):
                await asyncio.sleep(args.every)
                published.append(replay.release())

        loaded, _ = await asyncio.gather(load(args.seconds), trainer())
        st = await d.get("/v1/status")
        what = "sidecar /generate" if args.sidecar else "unix-socket API"
        print(f"{what} at {args.rate:.0f} requests/s; versions published during the loaded run: {published[1:]}")
        print(f"daemon at version {st['version']} (head {published[-1]}) after the loaded run")
        print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        pool.shutdown()
        report("idle       ", idle)
        report("distributing", loaded, idle)
        return 1 if idle.errors or loaded.errors else 0
    finally:
        if engine is not None:
            await engine.close()
        if view is not None:
            view.close()
        d.cleanup()
        seed.kill()
        await sw.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sidecar", action="store_true", help="load the sidecar instead of the API")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default 1000; 100 with --sidecar)")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each run (idle, then distributing)")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between published versions")
    args = ap.parse_args()
    if args.rate is None:
        args.rate = 100.0 if args.sidecar else 1000.0
    with tempfile.TemporaryDirectory(prefix="api-load-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
