"""Activation pause of the weight store: a synthetic bf16 model, a fraction of its values changed.

    python benchmarks/activation_bench.py [--gb 1.0] [--frac 0.005] [--repeat 3] [--gpu-gb 14]

CPU (host shared-memory store): prints the journal write time, the pause (fence odd -> even:
scatter + gather-compare + version flip), a single-threaded memcpy of the whole model
(np.copyto) and the ratio pause / memcpy.  With CUDA it also runs the GPU case (an
engine-style buffer on the device, ``--gpu-gb`` of bf16) and prints its pause.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from daemon.weightstore import StoreLayout, WeightStore, diff_updates
from protocol.served import ServedModel, TensorSpec

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
    args = ap.parse_args()
    jdir = Path(args.journal_dir or tempfile.mkdtemp(prefix="psw-journal-"))
    jdir.mkdir(parents=True, exist_ok=True)
    name = f"psw-bench-{os.getpid()}"
    threads = args.write_threads or torch.get_num_threads()
    print(f"torch threads {torch.get_num_threads()}, write threads {threads}, cpus {os.cpu_count()}, journal {jdir}")
    try:
        if not args.skip_cpu:
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
            del a, b
        if torch.cuda.is_available():
            dev = "cuda:0"
            a, b = synthetic(int(args.gpu_gb * 1e9), args.frac, 256, dev)
            lay = StoreLayout.from_specs(a.specs)
            store = WeightStore.create(name + "-gpu", lay, engine_buffer=True)
            try:
                store.bind_buffer(torch.empty(lay.nbytes, dtype=torch.uint8, device=dev), buffer_id=1)
                r = run(store, a, b, args.repeat, jdir)
            finally:
                store.destroy()
            print(
                f"GPU store ({torch.cuda.get_device_name(0)}): {a.nbytes / 1e9:.2f} GB bf16, {r['changed']:,} changed"
            )
            print(f"  diff on device       {r['diff_s'] * 1e3:9.1f} ms")
            print(f"  journal write+fsync  {r['journal_s'] * 1e3:9.1f} ms   ({r['journal_bytes'] / 1e6:.1f} MB)")
            pause, worst = r["pause_s"] * 1e3, r["pause_max_s"] * 1e3
            print(f"  pause (odd -> even)  {pause:9.1f} ms   (max {worst:.1f} ms; goal <= 50)")
        else:
            print("GPU: CUDA not available, skipped")
    finally:
        if not args.journal_dir:
            shutil.rmtree(jdir, ignore_errors=True)


if __name__ == "__main__":
    main()
