"""A copy engine's apply (daemon/param_sync.py) on CPU against a memcpy of the weights it serves.

One host rank store of ``--mb`` MiB of bf16 tensors (identity plan), the engine's parameters plain
tensors: prints the full copy (a first load), the copy of ``--frac`` of the bytes in 4 KiB regions
spread over every tensor (best of 5), and a memcpy of the whole store (best of 3).  One torch thread.

    .venv/bin/python -m benchmarks.param_sync_bench [--mb 256] [--frac 0.005]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from patchswarm.daemon.engine import attach
from patchswarm.daemon.engine_driver import Region
from patchswarm.daemon.param_sync import ParamSync
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.protocol.layout_plan import PlanBuilder, full_box
from patchswarm.protocol.served import ServedModel, TensorSpec

REGION = 4096


def best(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--frac", type=float, default=0.005)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = max(1, args.mb // 16)
    specs = [TensorSpec(f"t{i:03d}.weight", "BF16", (4096, 2048)) for i in range(n)]  # 16 MiB each
    model = ServedModel.from_tensors({s.name: torch.randn(s.shape).to(torch.bfloat16) for s in specs})
    b = PlanBuilder(1, "identity")
    for s in specs:
        b.param(0, s.name, s.shape, s.dtype)
        b.place(s.name, 0, s.name, full_box(s.shape), full_box(s.shape))
    name = f"psw-bench-sync-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory() as tmp:
        rs = RankStores(name, 1, Path(tmp), engine_kind=False)
        try:
            rs.prepare(b.build(), specs)
            rs.apply(1, model, None)
            store = rs.store(0)
            assert store is not None
            view = attach(store.attach_info())
            sync = ParamSync(view, {s.name: torch.empty(s.shape, dtype=torch.bfloat16) for s in specs})
            full = best(lambda: sync.apply(1, None), 1)
            nb = specs[0].nbytes
            per = max(1, int(nb * args.frac) // REGION)
            regs = [Region(s.name, k * (nb // per), k * (nb // per) + REGION) for s in specs for k in range(per)]
            sparse = best(lambda: sync.apply(1, regs), 5)
            flat = view.data.clone()
            dst = torch.empty_like(flat)
            memcpy = best(lambda: dst.copy_(flat), 3)
            print(
                f"store {view.data.numel() / 2**20:.0f} MiB: full apply {full * 1e3:.1f} ms; "
                f"{args.frac:.2%} in {len(regs)} regions {sparse * 1e3:.2f} ms; memcpy {memcpy * 1e3:.1f} ms"
            )
            view.close()
        finally:
            for s in rs.stores:
                if s is not None:
                    s.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
