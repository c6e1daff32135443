"""Clock skew between hosts: one daemon's wall clock is moved (libfaketime, rereading an offset file
while the daemon runs; its monotonic timers stay real) against the trainer's and the seed's.

Within trust.clock_skew (5 minutes by default) the daemon keeps converging, even where a strict
clock would refuse: 90 s behind, the trainer's certificate (valid from 60 s before the run began)
is not yet valid by the host's clock.  Beyond it, the head is refused with a clear reason in the
status (certificate not valid now; head expired: the board may be frozen), the engine keeps the
version it had, and the daemon catches up once its clock is right again."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchswarm.daemon.engine import attach
from tests.support.faultkit import SkewedClock, engine_sees, fleet_daemon, wait_status
from tests.support.swarmkit import Swarm

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


async def test_bounded_skew_is_tolerated_and_beyond_it_the_head_is_refused_clearly(tmp_path: Path) -> None:
    clock = SkewedClock(tmp_path)
    sw = Swarm(tmp_path)
    sw.publish()
    seed = await sw.start_seed()
    d = fleet_daemon(sw, seed.url, "skewed", tmp_path, env=clock.env)
    d.start()
    view = None
    try:
        await d.wait_version(1)
        view = attach((await d.get("/v1/layout"))["attach"])
        clock.set(-90)  # behind the trainer, within the bound
        v2 = sw.publish(scale=3e-4)
        await d.wait_version(v2)
        assert engine_sees(view, sw.served) == v2

        clock.set(-600)  # 10 minutes behind: the certificate has not started yet, even with the skew
        v3 = sw.publish(scale=3e-4)
        st = await wait_status(d, lambda s: "not valid now" in (s["reason"] or ""))
        assert st["version"] == v2 and engine_sees(view, sw.served) == v2, st

        clock.set(600)  # 10 minutes ahead: the head (120 s lifetime) expired beyond the skew
        st = await wait_status(d, lambda s: "expired" in (s["reason"] or ""))
        assert st["version"] == v2 and engine_sees(view, sw.served) == v2, st

        clock.set(0)
        st = await d.wait_version(v3)
        assert st["reason"] is None and engine_sees(view, sw.served) == v3
        assert await d.stop() == 0
    finally:
        if view is not None:
            view.close()
        d.cleanup()
        await sw.close()
