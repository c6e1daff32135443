"""A seed keeps a chunk it handed out from being served again while peers announce holding it
(protocol/seeding.py ``SeedPolicy.refusal``), even once ``seed_copy_window`` has passed: on a slow or loaded
swarm the window passes before the peers have passed the chunks round."""

from __future__ import annotations

import pytest

import patchswarm.protocol.seeding
from patchswarm.simulations.network import Host, Region
from patchswarm.simulations.placeholder import placeholder_held
from patchswarm.simulations.runner import StreamResult, simulate_stream
from patchswarm.simulations.synthetic import synthetic_setup


def run(window: float, seed: int) -> StreamResult:
    synthetic = synthetic_setup(patch_bytes=20_000_000, chunk_bytes=1 << 20, versions=1)
    rate = 1.25e8  # 1 Gbit/s: the transfer (about 0.3 s) outlasts the short copy windows below
    return simulate_stream(
        synthetic.setup,
        Host("seed", "r0", up=rate, down=rate),
        [Host(f"h{i:02d}", "r0", up=rate, down=rate) for i in range(16)],
        versions=synthetic.versions,
        interval=1.0,
        regions=[Region("r0", 0.0005)],
        start_from=placeholder_held(0),
        node_options={"seed_copy_window": window},
        seed=seed,
    )


WINDOWS = (0.01, 0.02, 0.05)
SEEDS = range(8)  # one run's saving depends on how the window falls against the chunks' spread


def egress(window: float) -> float:
    """The seed's egress in patches, summed over SEEDS."""
    return sum(_egress(run(window, seed)) for seed in SEEDS)


def _egress(r: StreamResult) -> float:
    assert r.complete, r.errors
    (v,) = r.versions
    return v.seed_egress / v.payload_bytes


@pytest.mark.slow
def test_a_short_copy_window_does_not_make_the_seed_serve_chunks_peers_announce(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = [egress(w) for w in WINDOWS]
    monkeypatch.setattr(patchswarm.protocol.seeding, "SEED_HOLD_WINDOWS", 1)  # the window alone decides again
    window_only = [egress(w) for w in WINDOWS]
    for w, a, b in zip(WINDOWS, held, window_only, strict=True):
        print(
            f"window {w * 1e3:.0f} ms: seed egress over {len(SEEDS)} runs {a:.2f} patches withheld, {b:.2f} window only"
        )
    # Measured (mean patches per run over 8 seeds): 10 ms 1.79 against 1.83, 20 ms 1.63 against 1.68,
    # 50 ms 1.37 against 1.55.  It saves most where the window is short against the chunks' spread
    # (50 ms: the window alone lets the seed serve a chunk again while it spreads); at 10-20 ms one
    # code change to another moves the balance by several percent either way (one ordering of events
    # measured 1.75 against 1.63 at 20 ms: held back, more hosts come to the seed with their last 3
    # chunks, which it serves whatever the window, docs/swarm.md "Seed").
    assert sum(held) < 0.99 * sum(window_only)
    assert held[-1] < 0.92 * window_only[-1]
    assert all(a <= 1.1 * b for a, b in zip(held, window_only, strict=True))
