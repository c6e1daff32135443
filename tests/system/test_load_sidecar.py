"""The sidecar of a real daemon, in front of the reference engine reading the daemon's store, under
concurrent unpinned, min-pinned and exact-pinned requests while new versions activate.

Every answer is checked against what actually ran: the sidecar's X-Weight-Version-Start/End
headers, its body attribution and the engine's own before/after fence reading of every token
agree; in the default quiesce mode each request ran on one version; an exact pin ran on exactly
its version or got a 409 that says why (not ready yet, or superseded), a min pin ran on a version
at least its minimum.  No timing is asserted (benchmarks/api_load.py --sidecar measures it)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from patchswarm.daemon.engine import attach
from patchswarm.daemon.publisher import Publisher
from patchswarm.daemon.ref_sources import StoreViewSource
from patchswarm.daemon.refengine import start_engine
from patchswarm.daemon.trajectory import generate
from patchswarm.protocol.trust import Certificate
from tests.support.boards import free_port
from tests.support.daemonkit import make_daemon
from tests.support.loadkit import Pin, sidecar_load
from tests.support.swarmkit import RUN, Swarm

RATE = 60.0
VERSIONS = 3


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["quiesce", "in_place"])
async def test_no_request_is_attributed_to_the_wrong_version_across_activations(tmp_path: Path, mode: str) -> None:
    """quiesce: every request runs on one version.  in_place: unpinned requests may span the switch
    (the daemon pauses the engine through /pause_generation while it writes), but every token's
    version still lies in the reported [start, end] and exact pins run on their version."""
    traj = generate("tiny", steps=VERSIONS)
    sw = Swarm(tmp_path)
    now = int(time.time() * 1000)
    cert = Certificate(sw.trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(sw.root).to_bytes()
    pub = Publisher(sw.board, sw.trainer, run_id=RUN, served_format="as_is", certificate=cert, chunk_size=16 << 10)
    pub.publish(traj.bf16[0])
    await sw.start_seed()
    engine_port, sidecar_port = free_port(), free_port()
    extra = (
        f'[sidecar]\nenabled = true\nlisten = "127.0.0.1:{sidecar_port}"\nupstream = "http://127.0.0.1:{engine_port}"\n'
        f'commit_mode = "{mode}"\n'
    )
    d = make_daemon(sw, "d1", tmp_path, extra=extra)
    d.start()
    engine = view = None
    rng = random.Random(7)

    def pin(i: int) -> Pin:
        kind = ("free", "min", "exact")[i % 3]
        return Pin(kind, None if kind == "free" else rng.randint(1, VERSIONS))

    try:
        await d.wait_version(1)
        view = attach((await d.get("/v1/layout"))["attach"])
        engine = await start_engine(StoreViewSource(view), port=engine_port)
        done = asyncio.Event()
        url = f"http://127.0.0.1:{sidecar_port}/generate"
        load = asyncio.create_task(
            sidecar_load(url, RATE, done.is_set, pin, prompt=[2, 5, 6, 7, 1], single_version=mode == "quiesce")
        )
        for step in range(1, VERSIONS):
            await asyncio.sleep(0.5)
            await asyncio.to_thread(pub.publish, traj.bf16[step])
            await d.wait_version(step + 1)
        await asyncio.sleep(0.5)
        done.set()
        result = await asyncio.wait_for(load, 120)
        kinds = Counter({k: len(v) for k, v in result.latencies.items()})
        print(f"{result.sent} requests: {dict(kinds)}; versions served {sorted(result.versions)}")
        assert not result.errors, result.errors[:5]
        assert result.completed == result.sent
        assert set(range(1, VERSIONS + 1)) <= result.versions  # the load spanned every activation
        assert kinds["free:200"] and kinds["min:200"] and kinds["exact:200"] and kinds["exact:409"], kinds
        paused = d.log.read_text().count("engine paused for activation")
        assert paused == (VERSIONS - 1 if mode == "in_place" else 0), paused
    finally:
        if engine is not None:
            await engine.close()
        if view is not None:
            view.close()
        d.cleanup()
        await sw.close()
