"""A placeholder stream (simulations/runner.py: simulate_stream) over a small LAN: one seed and n
peers in one region, versions two seconds apart.  Shared by the simulator tests (tests/unit/simulations/)
and tests/unit/swarm/test_swarm_objects.py."""

from __future__ import annotations

from typing import Any

from patchswarm.simulations.network import Host, Region
from patchswarm.simulations.placeholder import placeholder_held
from patchswarm.simulations.runner import StreamResult, simulate_stream

MB = 1e6


def placeholder_peers(n: int, up: float = 50 * MB) -> tuple[Host, list[Host]]:
    return Host("seed", "r0", up=100 * MB, down=100 * MB), [Host(f"h{i:02d}", "r0", up=up, down=up) for i in range(n)]


def stream(run: Any, n: int = 12, **kw: Any) -> StreamResult:
    seed, peers = placeholder_peers(n)
    args: dict[str, Any] = {
        "versions": run.versions,
        "interval": 2.0,
        "regions": [Region("r0", 0.001)],
        "start_from": placeholder_held(0),
        "deadline": 60.0,
        "seed": 4,
    }
    return simulate_stream(run.setup, seed, peers, **{**args, **kw})
