"""Activation pause of the weight store: a synthetic bf16 model, a fraction of its values changed.

    python -m benchmarks.activation_bench [--gb 1.0] [--frac 0.005] [--repeat 3] [--gpu-gb 14]
                                          [--device auto|cpu|cuda|engine-cpu] [--json OUT.json]

CPU (host shared-memory store): prints the journal write time, the pause (fence odd -> even:
scatter + gather-compare + version flip), a single-threaded memcpy of the whole model
(np.copyto) and the ratio pause / memcpy.  GPU (``--device cuda``; ``auto`` runs it when CUDA
is present): an engine buffer on the device, ``--gpu-gb`` of bf16; prints its pause (goal <= 50
ms for 14 GB at 0.5% changed), the state root computed on the GPU (no copy of the model to the
host) against the blake3 library on a host copy, and a device-to-device memcpy of the model.
``engine-cpu`` runs the GPU case's code with the buffer in host memory (to check the script
without a GPU).  The two versions live on the store's device, so the diff runs there; in the
daemon the diff runs on its host shadow and the values are staged to the device before the pause.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from patchswarm.daemon.store_format import StoreLayout
from patchswarm.daemon.store_updates import device_sync, diff_updates
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import ServedModel, TensorSpec

COLS = 4096


def synthetic(
    total_bytes: int, frac: float, tensor_mb: int, device: str, seed: int = 0
) -> tuple[ServedModel, ServedModel]:
    """Two bf16 versions: random words, then ``frac`` of them moved by one or two ulps (an Adam-like step)."""
    rows_per = max(1, (tensor_mb << 20) // (COLS * 2))
    n_tensors = max(1, total_bytes // (rows_per * COLS * 2))
    g = torch.Generator(device=device).manual_seed(seed)
    specs, old, new = [], [], []
    for i in range(n_tensors):
        spec = TensorSpec(f"layers.{i:04d}.weight", "BF16", (rows_per, COLS))
        w = torch.randint(-(1 << 14), 1 << 14, (spec.numel,), dtype=torch.int16, generator=g, device=device)
        k = int(spec.numel * frac)
        pos = torch.randint(0, spec.numel, (k,), generator=g, device=device)
        step = torch.randint(1, 3, (k,), dtype=torch.int16, generator=g, device=device)
        v = w.clone()
        v[pos] += step
        specs.append(spec)
        old.append(w.view(torch.uint8))
        new.append(v.view(torch.uint8))
    return ServedModel(specs, old), ServedModel(specs, new)


def memcpy_s(nbytes: int, repeat: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return best


def run(store: WeightStore, a: ServedModel, b: ServedModel, repeat: int, jdir: Path) -> dict[str, float]:
    t = time.perf_counter()
    store.load(a, 1, a.root())
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    fwd, back = diff_updates(a, b), diff_updates(b, a)
    diff_s = (time.perf_counter() - t) / 2
    roots = {0: a.root(), 1: b.root()}
    pauses, journals, jbytes, changed = [], [], 0, 0
    for i in range(2 * repeat + 1):  # the first round warms up; alternate a -> b -> a ...
        ups = fwd if i % 2 == 0 else back
        st = store.activate(i + 2, roots[(i + 1) % 2], ups, jdir)
        if i:
            pauses.append(st.pause_s)
            journals.append(st.journal_s)
        jbytes, changed = st.journal_bytes, st.changed
    store.verify(roots[(2 * repeat + 1) % 2])
    return {"load_s": load_s, "diff_s": diff_s, "journal_s": statistics.median(journals), "journal_bytes": jbytes,
            "changed": changed, "pause_s": statistics.median(pauses), "pause_min_s": min(pauses),
            "pause_max_s": max(pauses)}  # fmt: skip


def gpu_case(device: str, gb: float, frac: float, repeat: int, jdir: Path, name: str) -> dict[str, Any]:
    """An engine-buffer store on ``device`` (the GPU placement): pause, device digest, device memcpy."""
    a, b = synthetic(int(gb * 1e9), frac, 256 if gb >= 2 else 16, device)
    lay = StoreLayout.from_specs(a.specs)
    store = WeightStore.create(name, lay, engine_buffer=True)
    try:
        store.bind_buffer(torch.empty(lay.nbytes, dtype=torch.uint8, device=device), buffer_id=1)
        r: dict[str, Any] = run(store, a, b, repeat, jdir)
        # printed now too: the digests below are slow where the device digest is (a cut run keeps this)
        ms = (r["pause_s"] * 1e3, r["pause_max_s"] * 1e3)
        print(f"  (pause median {ms[0]:.1f} ms, max {ms[1]:.1f} ms; load {r['load_s']:.1f} s)")
        t = time.perf_counter()
        on_dev = store.digests(on_device=True)
        r["device_digest_s"] = time.perf_counter() - t
        t = time.perf_counter()
        on_host = store.digests(on_device=False)  # copies each tensor to the host first
        r["host_copy_digest_s"] = time.perf_counter() - t
        r["digests_equal"] = on_dev == on_host
        data = store._require_data()
        dst = torch.empty_like(data)
        best = float("inf")
        for _ in range(3):
            device_sync(data.device)
            t = time.perf_counter()
            dst.copy_(data)
            device_sync(data.device)
            best = min(best, time.perf_counter() - t)
        r["device_memcpy_s"] = best
        del dst
    finally:
        store.destroy()
    r |= {"model_bytes": a.nbytes, "tensors": len(a), "device": device}
    if device.startswith("cuda"):
        r["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="CPU model size in GB")
    ap.add_argument("--frac", type=float, default=0.005, help="fraction of values changed per version")
    ap.add_argument("--tensor-mb", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="activations each way (after one warm-up)")
    ap.add_argument("--gpu-gb", type=float, default=14.0)
    ap.add_argument("--journal-dir", default=None, help="default: a temporary directory under $TMPDIR")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--write-threads", type=int, default=None, help="WeightStore.write_threads (default: torch's)")
    ap.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "engine-cpu"),
        default="auto",
        help="auto: CPU store, then the GPU case if CUDA is present; engine-cpu: the GPU case on the host",
    )
    ap.add_argument("--json", default=None, help="also write the measurements to this file")
    ap.add_argument("--pause-goal-ms", type=float, default=50.0)
    args = ap.parse_args()
    if args.skip_cpu and args.device == "auto":
        args.device = "cuda"
    results: dict[str, Any] = {"args": vars(args)}
    jdir = Path(args.journal_dir or tempfile.mkdtemp(prefix="psw-journal-"))
    jdir.mkdir(parents=True, exist_ok=True)
    name = f"psw-bench-{os.getpid()}"
    threads = args.write_threads or torch.get_num_threads()
    print(f"torch threads {torch.get_num_threads()}, write threads {threads}, cpus {os.cpu_count()}, journal {jdir}")
    try:
        if args.device in ("auto", "cpu"):
            a, b = synthetic(int(args.gb * 1e9), args.frac, args.tensor_mb, "cpu")
            store = WeightStore.create(name, StoreLayout.from_specs(a.specs))
            store.write_threads = args.write_threads
            try:
                r = run(store, a, b, args.repeat, jdir)
            finally:
                store.destroy()
            mc = memcpy_s(a.nbytes, 3)
            print(f"CPU host store: {a.nbytes / 1e9:.2f} GB bf16 in {len(a)} tensors, {r['changed']:,} values changed")
            print(f"  diff (diffscan)      {r['diff_s'] * 1e3:9.1f} ms   (before the pause; serving continues)")
            print(f"  journal write+fsync  {r['journal_s'] * 1e3:9.1f} ms   ({r['journal_bytes'] / 1e6:.1f} MB)")
            lo, hi = r["pause_min_s"] * 1e3, r["pause_max_s"] * 1e3
            print(f"  pause (odd -> even)  {r['pause_s'] * 1e3:9.1f} ms   median (min {lo:.1f}, max {hi:.1f})")
            print(f"  memcpy of the model  {mc * 1e3:9.1f} ms   (np.copyto, one thread, best of 3)")
            print(
                f"  pause / memcpy       {r['pause_s'] / mc:9.3f}   (best pause / memcpy {r['pause_min_s'] / mc:.3f})"
            )
            print(f"  (journal + pause) / memcpy {(r['journal_s'] + r['pause_s']) / mc:.3f}")
            print(f"  first full load + root verify {r['load_s'] * 1e3:.0f} ms")
            results["cpu"] = r | {"memcpy_s": mc, "model_bytes": a.nbytes, "pause_over_memcpy": r["pause_s"] / mc}
            del a, b
        dev = "cpu" if args.device == "engine-cpu" else "cuda:0"
        if args.device in ("cuda", "engine-cpu") or (args.device == "auto" and torch.cuda.is_available()):
            if dev != "cpu" and not torch.cuda.is_available():
                print("GPU: CUDA not available, skipped")
                results["gpu"] = {"skipped": "CUDA not available"}
            else:
                r = gpu_case(dev, args.gpu_gb, args.frac, args.repeat, jdir, name + "-gpu")
                what = r.get("device_name", "engine buffer in host memory")
                print(f"GPU store ({what}): {r['model_bytes'] / 1e9:.2f} GB bf16 in {r['tensors']} tensors, "
                      f"{r['changed']:,} values changed")  # fmt: skip
                print(f"  diff on device       {r['diff_s'] * 1e3:9.1f} ms")
                print(f"  journal write+fsync  {r['journal_s'] * 1e3:9.1f} ms   ({r['journal_bytes'] / 1e6:.1f} MB)")
                pause, lo, worst = r["pause_s"] * 1e3, r["pause_min_s"] * 1e3, r["pause_max_s"] * 1e3
                verdict = "met" if r["pause_max_s"] * 1e3 <= args.pause_goal_ms else "NOT met"
                print(f"  pause (odd -> even)  {pause:9.1f} ms   median (min {lo:.1f}, max {worst:.1f}); "
                      f"goal <= {args.pause_goal_ms:g} ms: {verdict}")  # fmt: skip
                mc = r["device_memcpy_s"]
                print(f"  device memcpy        {mc * 1e3:9.1f} ms   (pause / memcpy {r['pause_s'] / mc:.3f})")
                host_ms, same = r["host_copy_digest_s"] * 1e3, r["digests_equal"]
                print(f"  state root on device {r['device_digest_s'] * 1e3:9.1f} ms   (torch BLAKE3; "
                      f"host copy + blake3: {host_ms:.0f} ms; equal: {same})")  # fmt: skip
                print(f"  first full load + root verify (on device) {r['load_s'] * 1e3:.0f} ms")
                results["gpu"] = r | {"pause_goal_ms": args.pause_goal_ms, "pause_goal_met": verdict == "met"}
        elif args.device == "auto":
            print("GPU: CUDA not available, skipped")
            results["gpu"] = {"skipped": "CUDA not available"}
    finally:
        if not args.journal_dir:
            shutil.rmtree(jdir, ignore_errors=True)

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
