"""kill -9 of a rollout daemon 100 times, at points spread over every phase of taking a version.

    python -m benchmarks.crash_loop [--kills 100] [--seed 1]

The same loop as tests/system/test_faults_crash.py (tests/support/faultkit.py: CrashLoop) at full count: each
kill lands while fetching (an external SIGKILL once the API reports fetching), at staging or at a
step of activating (PATCHSWARM_FAULT_AT), or at a random time from process start (recovery
included) to the version landing.  A new version is published for each kill while an engine
thread reads the store through the fence the whole time.  Prints the kills per phase, how each
restart found the store, the engine reads checked and every violation (a torn or unpublished
version shown to the engine, a served version going back, no convergence).  Exit status 1 if any.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from tests.support.faultkit import PHASES, CrashLoop
from tests.support.swarmkit import Swarm


async def main(kills: int, seed: int) -> int:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crash-loop-") as tmp:
        async with CrashLoop(Swarm(Path(tmp)), Path(tmp), seed=seed) as loop:
            for i in range(kills):
                where = await loop.kill_once(PHASES[i % len(PHASES)])
                print(f"kill {i + 1:3d}/{kills}: {where}", flush=True)
            head = await loop.finish()
    r = loop.report
    print(f"\n{kills} kills in {time.monotonic() - start:.0f} s; converged to version {head}")
    print("kills by phase:")
    for where, n in sorted(r.kills.items()):
        print(f"  {where:28s} {n:4d}")
    print("restarts by what recovery found:")
    for what, n in sorted(r.recoveries.items()):
        print(f"  {what:28s} {n:4d}")
    print(f"engine reads checked: {r.engine_reads}; versions the engine served: {len(r.versions_served)}")
    print(f"violations: {len(r.violations)}")
    for v in r.violations:
        print(f"  {v}")
    return 1 if r.violations else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    sys.exit(asyncio.run(main(args.kills, args.seed)))
