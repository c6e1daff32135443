"""Sharded trainers across processes: what travels on the process group per version, against the model.

    python -m benchmarks.dist_bench [--params 3.2e7] [--ranks 2] [--patches 3] [--layout rows|tensors]

Spawns ``--ranks`` trainer processes (torch.distributed, gloo, on this host) that publish together
through ``DistPublisher``; rank 0 holds the Publisher (bf16, a temp board).  The model is
``--tensors`` FP32 matrices of ``--cols`` columns (normal(0, 0.02)), as in publish_bench.  Layout
``rows``: every matrix is a DTensor sharded on dim 0 (what FSDP2 holds: each rank has its rows of
every tensor; an odd row count makes the last shard smaller); ``tensors``: each rank holds whole
matrices (tensor-partitioned).  Version 1 is an anchor; each later version follows an Adam-like
step at ``--lr`` (about 0.5% of bf16 values change at 1e-6).  Per version it prints the served
bytes, the bytes the publishing rank received (every rank's part, pickled and, for the small
results, zstd-compressed: ``DistPublisher.last_gathered_bytes``), their ratio, the patch bytes
and the wall time of the collective publish on rank 0.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.publish_bench import adam_like_step, build_state
from patchswarm.daemon.publish_dist import DistPublisher
from patchswarm.daemon.publisher import Publisher
from patchswarm.protocol.keys import SigningKey


def rank_main(rank: int, args: dict[str, Any], root: str) -> None:
    tmp = Path(root)
    world = args["ranks"]
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        full = build_state(args["params"], args["tensors"], args["cols"], seed=0)  # the same on every rank
        g = torch.Generator().manual_seed(1)
        pub = None
        if rank == 0:
            pub = Publisher(tmp / "board", SigningKey.load(tmp / "key"), run_id="bench", anchor_every=1000)
        dp = DistPublisher(pub)
        rows: list[dict[str, Any]] = []
        for v in range(1 + args["patches"]):
            if v:
                adam_like_step(full, args["lr"], 0.12, g)
            if args["layout"] == "rows":
                part: dict[str, torch.Tensor] = {}
                for name, t in full.items():
                    per = -(-t.shape[0] // world)
                    local = t[rank * per : (rank + 1) * per]
                    part[name] = DTensor.from_local(
                        local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride()
                    )
            else:
                names = sorted(full)
                part = {n: full[n] for i, n in enumerate(names) if i % world == rank}
            dist.barrier()
            t0 = time.perf_counter()
            info = dp.publish(part)
            seconds = time.perf_counter() - t0
            rows.append(
                {
                    "version": info.version,
                    "served": info.served_bytes,
                    "gathered": dp.last_gathered_bytes,
                    "patch": info.patch_bytes,
                    "anchor": info.anchor_bytes,
                    "changed": info.changed_fraction,
                    "seconds": seconds,
                }
            )
        if rank == 0:
            (tmp / "rows.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=3.2e7, help="parameters (default 3.2e7: 64 MB served)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--patches", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--layout", choices=("rows", "tensors"), default="rows")
    a = ap.parse_args(argv)
    if not 1 <= a.ranks <= 64 or not 0 < a.params <= 1e10 or a.patches < 0:
        ap.error("--ranks 1..64, --params up to 1e10, --patches >= 0")
    with tempfile.TemporaryDirectory() as d:
        SigningKey.generate().save(Path(d) / "key")
        mp.spawn(rank_main, args=(vars(a), d), nprocs=a.ranks, join=True)
        rows = json.loads((Path(d) / "rows.json").read_text())
    print(f"# {a.ranks} gloo ranks, layout {a.layout}, {a.params:.3g} params, bf16, lr {a.lr:g}")
    print("| version | kind | changed | served MB | on the group MB | / served | patch MB | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        kind = "anchor" if r["anchor"] else "patch"
        print(
            f"| {r['version']} | {kind} | {r['changed']:.2%} | {r['served'] / 1e6:.1f} | {r['gathered'] / 1e6:.2f} "
            f"| {r['gathered'] / r['served']:.3f} | {r['patch'] / 1e6:.2f} | {r['seconds']:.2f} |"
        )


if __name__ == "__main__":
    main()
