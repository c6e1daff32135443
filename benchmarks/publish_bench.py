"""Publish latency: one version of a ~1B-parameter FP32 model, against one memcpy of its served bytes.

    python -m benchmarks.publish_bench [--params 1.07e9] [--patches 4] [--board DIR]

Builds an FP32 state dict (``--tensors`` matrices of ``--cols`` columns; normal(0, 0.02) values),
publishes version 1 (an anchor, reported separately), then for each of ``--patches`` versions
applies an Adam-like tiny update (``w -= lr * u``, u ~ normal(0, 0.12**2), ``--lr`` 1e-6: about
0.5% of bf16 values change) and times ``Publisher.publish`` (bf16 served format, default settings):
total wall time and the stages the publisher reports (``PublishInfo.stages``).  The reference is
one single-threaded ``np.copyto`` of every served tensor (the publisher's copy of the version
before) into its own pre-faulted buffer (best of 3), measured right before each publish; the
goal is publish <= 3x memcpy.  Side by side, each patch also reports the process CPU seconds of
the publish and the "floor": the part of the work no publisher can skip, timed on the publisher's
own worker pool in its block size (cast each block of the new weights into a served buffer,
BLAKE3 it, and compare it as 64-bit words with the previous version's block; no positions, no
coding, no encode, no write); publish - floor is what finding and coding the changes, the encode
and the writes add.  Peak RSS is printed too (the model itself is 4 bytes per parameter; the
publisher holds two served copies, the memcpy reference one more).  The first
patch is reported apart: its served buffers are new (page faults); later versions reuse the
buffers of the version before last.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from benchmarks.gpu_check import device_copy_s
from patchswarm.daemon import publish_work
from patchswarm.daemon.publisher import STAGES, Publisher
from patchswarm.protocol.keys import SigningKey


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def build_state(params: float, tensors: int, cols: int, seed: int) -> dict[str, torch.Tensor]:
    rows = max(1, round(params / tensors / cols))
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for i in range(tensors):
        t = torch.empty(rows, cols)
        t.normal_(0.0, 0.02, generator=g)
        state[f"layers.{i:02d}.weight"] = t
    return state


def adam_like_step(state: dict[str, torch.Tensor], lr: float, scale: float, g: torch.Generator) -> None:
    """w -= lr * u, u ~ N(0, scale**2): an Adam step m / sqrt(v) on gradients that are mostly noise
    (RL), whose size is well below 1; scale 0.12 at lr 1e-6 changes about 0.5% of bf16 values."""
    for t in state.values():
        flat = t.view(-1)
        for s in range(0, flat.numel(), 1 << 24):
            part = flat[s : s + (1 << 24)]
            part.add_(torch.randn(part.shape, generator=g, device=part.device), alpha=-lr * scale)


def memcpy_seconds(src: list[np.ndarray], dst: list[np.ndarray], reps: int = 3) -> float:
    """Best of ``reps``: single-thread np.copyto of every served tensor into its own pre-faulted buffer."""
    runs: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for a, b in zip(src, dst, strict=True):
            np.copyto(b, a)
        runs.append(time.perf_counter() - t0)
    return min(runs)


def floor_seconds(state: dict[str, torch.Tensor], prev: list[np.ndarray], dst: list[np.ndarray]) -> float:
    """Wall time of the unavoidable work on the publisher's worker pool: cast every block into ``dst``
    (the memcpy buffers, reused), hash it and compare it with ``prev``'s block as 64-bit words."""
    step = publish_work.BLOCK_BYTES // 2  # bf16 elements per block, as the publisher walks them

    def one(src: torch.Tensor, old: np.ndarray, out: np.ndarray) -> bytes:
        whole = old.size // 8 * 8  # bytes in whole 64-bit words
        s32, o64, d64 = src.view(-1), old[:whole].view(np.int64), out[:whole].view(np.int64)
        d16 = torch.from_numpy(out).view(torch.bfloat16)
        mask = np.empty(step // 4, dtype=np.bool_)
        h = blake3.blake3()
        for s in range(0, s32.numel(), step):
            e = min(s + step, s32.numel())
            d16[s:e].copy_(s32[s:e])
            h.update(out[2 * s : 2 * e].data)
            w = o64[s // 4 : e // 4]
            np.not_equal(w, d64[s // 4 : e // 4], out=mask[: w.size])
        return h.digest()

    pool = publish_work.work_pool()
    t = time.perf_counter()
    jobs = [pool.submit(one, src, old, out) for src, old, out in zip(state.values(), prev, dst, strict=True)]
    for j in jobs:
        j.result()
    return time.perf_counter() - t


def fmt_stages(stages: dict[str, float]) -> str:
    return "  ".join(f"{k} {stages[k]:.3f}" for k in STAGES if k in stages)


def main(argv: list[str] | None = None, publisher_cls: type[Publisher] = Publisher) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=16 * 8192 * 8192, help="parameters (default 1.07e9)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--patches", type=int, default=4, help="patch versions to time after the anchor")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--adam-scale", type=float, default=0.12, help="std of the Adam ratio m / sqrt(v)")
    ap.add_argument("--board", type=Path, default=None, help="board directory (default: a temp dir on disk)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the FP32 master weights live (cuda: cast and diff on the GPU; the memcpy reference "
        "stays the host copy of the served bytes, and a device copy is printed beside it)",
    )
    ap.add_argument(
        "--served-on-device",
        action="store_true",
        help="keep the served copy on the weights' device and diff there (Publisher.served_on_host = False)",
    )
    args = ap.parse_args(argv)
    on_gpu = torch.device(args.device).type == "cuda"
    ref = "device copy" if on_gpu else "floor"

    print(
        f"# publish_bench: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}; "
        f"weights on {args.device}, served copy on {'the device' if args.served_on_device else 'the host'}"
    )
    t0 = time.perf_counter()
    state = build_state(args.params, args.tensors, args.cols, args.seed)
    if on_gpu:
        state = {k: t.to(args.device) for k, t in state.items()}
    nparams = sum(t.numel() for t in state.values())
    served_bytes = nparams * 2
    print(
        f"model: {len(state)} x {tuple(next(iter(state.values())).shape)} = {nparams / 1e9:.3f}B params, "
        f"{nparams * 4 / 1e9:.2f} GB fp32, {served_bytes / 1e9:.2f} GB bf16 served "
        f"(built in {time.perf_counter() - t0:.1f} s)"
    )
    g = torch.Generator(device=args.device).manual_seed(args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="publish-bench-", dir=args.board) as tmp:
        pub = publisher_cls(Path(tmp) / "board", SigningKey.generate(), run_id="bench", anchor_every=1000)
        pub.served_on_host = not args.served_on_device
        t = time.perf_counter()
        info: Any = pub.publish(state)  # PublishInfo (no background mode here)
        wall = time.perf_counter() - t
        stages = getattr(info, "stages", {})
        print(
            f"anchor v1: {wall:.2f} s, {info.anchor_bytes / 1e9:.2f} GB payload "
            f"({info.anchor_bytes / served_bytes:.1%} of served), peak RSS {rss_gb():.1f} GB  [{fmt_stages(stages)}]"
        )
        # The served bytes: the publisher's copy of the version just published (read only).
        assert pub._prev is not None
        served = [d.cpu().numpy() for d in pub._prev.data]  # a host copy when the version is on the GPU
        dst = [np.ones_like(a) for a in served]  # pre-faulted, reused
        rows: list[tuple[float, float, float]] = []
        for n in range(args.patches):
            adam_like_step(state, args.lr, args.adam_scale, g)
            gc.collect()
            mem = memcpy_seconds(served, dst)
            t, cpu = time.perf_counter(), time.process_time()
            info = pub.publish(state)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            stages = getattr(info, "stages", {})
            if on_gpu:  # the floor is the host pipeline's; on the GPU print a device copy instead
                floor = device_copy_s(torch.device(args.device), pub._prev.data if pub._prev is not None else [])
            else:
                floor = min(floor_seconds(state, served, dst) for _ in range(2))  # against the version before
            assert pub._prev is not None
            served = [d.cpu().numpy() for d in pub._prev.data]
            if n or args.patches == 1:  # the first patch also allocates (page-faults) its buffers
                rows.append((wall, mem, floor))
            first = " (first: fresh buffers)" if n == 0 else ""
            print(
                f"patch v{info.version}{first}: publish {wall:.3f} s | memcpy {mem:.3f} s "
                f"({served_bytes / mem / 1e9:.1f} GB/s) | ratio {wall / mem:.2f} | {ref} "
                f"{floor:.3f} s ({floor / mem:.2f}x memcpy) | CPU {cpu:.3f} s ({cpu / served_bytes * 1e9:.3f} s/GB) | "
                f"changed {info.changed_fraction:.3%}, patch {info.patch_bytes / 1e6:.2f} MB | [{fmt_stages(stages)}]"
            )
        ratios = [w / m for w, m, _ in rows]
        best = min(range(len(rows)), key=lambda i: ratios[i])
        print(
            f"RESULT publish/memcpy over {len(rows)} patch(es) after the first: best {ratios[best]:.2f} "
            f"(publish {rows[best][0]:.3f} s, memcpy {rows[best][1]:.3f} s), median {statistics.median(ratios):.2f}; "
            f"goal <= 3; {ref}/memcpy median {statistics.median(f / m for _, m, f in rows):.2f}; "
            f"peak RSS {rss_gb():.1f} GB"
        )


if __name__ == "__main__":
    main()
