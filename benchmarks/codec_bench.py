"""Codec benchmark: patch size against the entropy reference, speed against memcpy, hash speeds.

    python -m benchmarks.codec_bench [--preset bench] [--steps N] [--big-gb 1.0]

a) Size.  For each consecutive pair of a real training trajectory (daemon.trajectory, bf16 and
   fp8 exports), the patch bytes of ``encode_patch`` against the reference bound

       sum over tensors of log2 C(n_t, k_t)  +  K * H(value deltas)   bits,

   H the empirical entropy of the ordered-line deltas key(new) - key(old) pooled over the pair
   per dtype (new values for non-float dtypes).  Baselines in the same run: varint gaps + new
   values + zstd-3 (PULSE-style), int32 indices + raw values (TRL-style, uncompressed) and dense
   XOR + zstd-3 (Stitch-style).
b) Speed.  On a big synthetic bf16 model (base normal*0.02; target: 0.5% of positions moved along
   the ordered line, mostly by one step): single-thread memcpy, encode, in-place apply, the naive
   ``np.flatnonzero(a != b)`` scan, the bare scatter ``w[pos] = new`` of the patch's changes (the
   floor of any in-place apply), and the peak RSS growth of encode and apply.
c) Hashing: BLAKE3 (all threads, one thread) and SHA-256 on a 256 MB buffer.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import os
import platform
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import numpy as np
import torch
import zstandard

from benchmarks.bound import counter, entropy_bits, log2_binom
from benchmarks.codec_contexts import ctx_ideal_bits, load_dir, speed_format2
from patchswarm.protocol import ordered
from patchswarm.protocol.codec import apply_patch, encode_patch
from patchswarm.protocol.diffscan import scan
from patchswarm.protocol.served import ServedModel, word_view

# ---------------------------------------------------------------- a) size


def varint(values: np.ndarray) -> bytes:
    """LEB128 of non-negative integers, vectorized."""
    v = values.astype(np.uint64)
    out_cols: list[np.ndarray] = []
    more = np.ones(v.shape, dtype=bool)
    while more.any():
        byte = (v & np.uint64(0x7F)).astype(np.uint8)
        v = v >> np.uint64(7)
        cont = v != 0
        out_cols.append(np.where(more, byte | (cont.astype(np.uint8) << 7), 0).astype(np.uint8))
        out_cols.append(more.astype(np.uint8))  # validity flag of the byte just appended
        more = more & cont
    if not out_cols:
        return b""
    data = np.stack(out_cols[0::2], axis=1)
    valid = np.stack(out_cols[1::2], axis=1).astype(bool)
    out: bytes = data[valid].tobytes()
    return out


class PairSizes:
    """Every size measure of one (base, target) pair."""

    def __init__(self, base: ServedModel, target: ServedModel, level: int = 3) -> None:
        self.n = target.nbytes
        self.numel = sum(s.numel for s in target.specs)
        self.k = 0
        self.ours = len(encode_patch(base, target, level=level, payload_format=1).payload)
        self.v2 = len(encode_patch(base, target, level=level, payload_format=2).payload)
        ctx_pos_bits = 0.0
        ref_pos_bits = 0.0
        deltas: dict[str, Counter[int]] = {}
        gaps_parts: list[bytes] = []
        value_parts: list[bytes] = []
        trl = 0
        cz = zstandard.ZstdCompressor(level=level)
        xor_obj = cz.compressobj()
        xor_parts: list[bytes] = []
        for i, (spec, tdata) in enumerate(target):
            bdata = base.data[i]
            a, b = word_view(bdata, spec), word_view(tdata, spec)
            ch = scan(a, b)
            k = len(ch)
            self.k += k
            ref_pos_bits += log2_binom(spec.numel, k)
            if k:
                ctx_pos_bits += ctx_ideal_bits(spec, a.numpy(), ch.positions.numpy())
            xor_parts.append(xor_obj.compress((bdata ^ tdata).numpy().tobytes()))
            gaps_parts.append(varint(np.array([k])))
            if k == 0:
                continue
            if spec.dt.is_float:
                d = (ordered.ordered_key(ch.new, spec.dt.width) - ordered.ordered_key(ch.old, spec.dt.width)).numpy()
            else:
                d = ch.new.numpy().astype(np.int64)
            c = deltas.setdefault(spec.dtype, Counter())
            c.update(counter(d))
            pos = ch.positions.numpy()
            gaps_parts.append(varint(np.diff(pos, prepend=-1) - 1))
            value_parts.append(ch.new.numpy().tobytes())
            trl += k * (4 + spec.dt.width)
        xor_parts.append(xor_obj.flush())
        ref_val_bits = sum(sum(c.values()) * entropy_bits(c) for c in deltas.values())
        self.delta_entropy = {dt: entropy_bits(c) for dt, c in deltas.items()}
        self.reference = (ref_pos_bits + ref_val_bits) / 8
        self.ctx_ideal = (ctx_pos_bits + ref_val_bits) / 8  # the same, positions under format 2's contexts
        self.ref_pos = ref_pos_bits / 8
        self.pulse = len(cz.compress(b"".join(gaps_parts) + b"".join(value_parts)))
        self.trl = trl
        self.xor = sum(len(p) for p in xor_parts)

    def ratio(self, size: int) -> float:
        return size / self.reference if self.reference else float("inf")


def _timed_apply(base: ServedModel, payload: bytes, reps: int) -> float:
    work = base.clone()

    def reset() -> None:
        for w, b in zip(work.data, base.data, strict=True):
            w.copy_(b)

    return best_of(reps, lambda: apply_patch(work, payload, base.specs), reset)


def size_table(kind: str, versions: list[ServedModel], reps: int = 3) -> list[PairSizes]:
    print(f"\n### Size, {kind} ({versions[0].nbytes / 1e6:.1f} MB served, {len(versions) - 1} pairs)\n")
    print(
        "| pair | changed | K | reference B | ours B | ours/ref | PULSE-style/ref | TRL-style/ref "
        "| Stitch XOR/ref | H(delta) bits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows: list[PairSizes] = []
    for i in range(1, len(versions)):
        r = PairSizes(versions[i - 1], versions[i])
        rows.append(r)
        h = ", ".join(f"{dt} {e:.2f}" for dt, e in sorted(r.delta_entropy.items()))
        print(
            f"| v{i - 1}->v{i} | {100 * r.k / r.numel:.4f}% | {r.k:,} | {r.reference:,.0f} | {r.ours:,} "
            f"| **{r.ratio(r.ours):.3f}** | {r.ratio(r.pulse):.2f} | {r.ratio(r.trl):.2f} | {r.ratio(r.xor):.2f} "
            f"| {h} |"
        )
    tot_ref = sum(r.reference for r in rows)
    tot = {name: sum(getattr(r, name) for r in rows) for name in ("ours", "pulse", "trl", "xor")}
    print(
        f"| all | | {sum(r.k for r in rows):,} | {tot_ref:,.0f} | {tot['ours']:,} | **{tot['ours'] / tot_ref:.3f}** "
        f"| {tot['pulse'] / tot_ref:.2f} | {tot['trl'] / tot_ref:.2f} | {tot['xor'] / tot_ref:.2f} | |"
    )
    format2_table(kind, versions, rows, reps)
    return rows


def format2_table(kind: str, versions: list[ServedModel], rows: list[PairSizes], reps: int) -> None:
    """Format 1 against format 2 (SPARSE_CTX, issue 37): bytes, against the memoryless bound and the
    ideal entropy under the contexts format 2 uses, and CPU encode/apply times (best of ``reps``)."""
    print(f"\n### Format 2 (positions under base-value contexts), {kind}\n")
    print(
        "| pair | v1 B | v2 B | v2/v1 | v1/bound | **v2/bound** | ctx ideal/bound | v2/ctx ideal (coder) "
        "| memcpy/encode v1 | **memcpy/encode v2** | apply v1 | apply v2 | **apply v2/v1** |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, start=1):
        base, target = versions[i - 1], versions[i]
        t_mem = min(memcpy_times([d.numpy() for d in base.data], reps))
        t_e1 = best_of(reps, lambda: encode_patch(base, target, payload_format=1))  # noqa: B023
        t_e2 = best_of(reps, lambda: encode_patch(base, target, payload_format=2))  # noqa: B023
        p1 = encode_patch(base, target, payload_format=1).payload
        p2 = encode_patch(base, target, payload_format=2).payload
        t_a1, t_a2 = _timed_apply(base, p1, reps), _timed_apply(base, p2, reps)
        print(
            f"| v{i - 1}->v{i} | {r.ours:,} | {r.v2:,} | {r.v2 / r.ours:.3f} | {r.ratio(r.ours):.3f} "
            f"| **{r.ratio(r.v2):.3f}** | {r.ratio(int(r.ctx_ideal)):.3f} | {r.v2 / r.ctx_ideal:.3f} "
            f"| {t_mem / t_e1:.2f} | **{t_mem / t_e2:.2f}** | {t_a1 * 1e3:.1f} ms | {t_a2 * 1e3:.1f} ms "
            f"| **{t_a2 / t_a1:.2f}** |"
        )
    tot_ref, tot_ctx = sum(r.reference for r in rows), sum(r.ctx_ideal for r in rows)
    v1, v2 = sum(r.ours for r in rows), sum(r.v2 for r in rows)
    print(
        f"| all | {v1:,} | {v2:,} | {v2 / v1:.3f} | {v1 / tot_ref:.3f} | **{v2 / tot_ref:.3f}** "
        f"| {tot_ctx / tot_ref:.3f} | {v2 / tot_ctx:.3f} | | | | | |"
    )


# ---------------------------------------------------------------- b) speed


def _peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so that reusing it shows as RSS growth."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(fn: Callable[[], object], trim: bool) -> tuple[float, int | None]:
    """Seconds and peak RSS growth in bytes (None where the peak cannot be reset) of one call.

    With ``trim``, freed heap memory is first handed back to the OS, so that the growth counts
    every page the call touches for its own data (otherwise reused free memory hides it).
    """
    gc.collect()
    if trim:
        _trim()
    ok = _peak_reset()
    before = _rss_kb()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dt, (max(0, peak - before) * 1024 if ok else None)


def synthetic_pair(total_bytes: int, ntensors: int, frac: float, seed: int) -> tuple[ServedModel, ServedModel]:
    """Base: normal*0.02 in bf16.  Target: ``frac`` of positions moved along the ordered line by
    +-1 (88%), +-2 (10%) or +-3..16 (2%)."""
    g = torch.Generator().manual_seed(seed)
    n_each = total_bytes // 2 // ntensors
    base: dict[str, torch.Tensor] = {}
    target: dict[str, torch.Tensor] = {}
    for t in range(ntensors):
        b = torch.empty(n_each, dtype=torch.bfloat16)
        chunk = 1 << 24
        for s in range(0, n_each, chunk):
            e = min(s + chunk, n_each)
            b[s:e] = (torch.randn(e - s, generator=g) * 0.02).to(torch.bfloat16)
        k = int(n_each * frac)
        pos = torch.randint(0, n_each, (k,), generator=g)
        pos = torch.unique(pos)
        u = torch.rand(pos.numel(), generator=g)
        mag = torch.where(u < 0.88, 1, torch.where(u < 0.98, 2, torch.randint(3, 17, (pos.numel(),), generator=g)))
        sign = torch.randint(0, 2, (pos.numel(),), generator=g) * 2 - 1
        w = b.view(torch.int16)
        key = ordered.ordered_key(w[pos], 2) + mag * sign
        tw = w.clone()
        tw[pos] = ordered.from_ordered_key(key, 2, torch.int16)
        base[f"layer{t:02d}.weight"] = b.reshape(-1, 4096) if n_each % 4096 == 0 else b
        target[f"layer{t:02d}.weight"] = tw.view(torch.bfloat16).reshape(base[f"layer{t:02d}.weight"].shape)
    return ServedModel.from_tensors(base), ServedModel.from_tensors(target)


def memcpy_times(src: list[np.ndarray], reps: int) -> list[float]:
    """Seconds of single-threaded copies of every array into preallocated (pre-faulted) buffers."""
    dst = [np.zeros_like(a) for a in src]
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            np.copyto(d, s)
        runs.append(time.perf_counter() - t0)
    return runs


def best_of(n: int, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
    best = float("inf")
    for _ in range(n):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def speed(big_gb: float, ntensors: int, frac: float, seed: int, reps: int) -> None:
    total = int(big_gb * (1 << 30))
    t0 = time.perf_counter()
    base, target = synthetic_pair(total, ntensors, frac, seed)
    nb = base.nbytes
    print(
        f"\n### Speed: synthetic bf16 model, {nb / 1e9:.3f} GB in {ntensors} tensors, "
        f"{frac:.2%} of positions changed (built in {time.perf_counter() - t0:.1f} s)\n"
    )
    src = [d.numpy() for d in base.data]
    tgt = [d.numpy() for d in target.data]
    memcpy_runs = memcpy_times(src, 3)
    t_mem = min(memcpy_runs)

    def naive() -> None:
        for a, b in zip(src, tgt, strict=True):
            np.flatnonzero(a.view(np.int16) != b.view(np.int16))

    t_naive = best_of(reps, naive)

    # Timed runs with a warm allocator (as in a long-running daemon), best kept; then one run
    # each after handing freed memory back to the OS, for the peak RSS growth (and a cold time).
    patch_holder: list[bytes] = []

    def enc() -> None:
        patch_holder[:] = [encode_patch(base, target).payload]

    enc_times = [measure(enc, trim=False)[0] for _ in range(reps)]
    t_enc = min(enc_times)
    enc_cold, enc_rss = measure(enc, trim=True)
    payload = patch_holder[0]

    work = base.clone()

    def app() -> None:
        apply_patch(work, payload, base.specs)

    def reset() -> None:
        for w, b in zip(work.data, base.data, strict=True):
            w.copy_(b)

    app_times = []
    for _ in range(reps):
        reset()
        app_times.append(measure(app, trim=False)[0])
    t_app = min(app_times)
    reset()
    app_cold, app_rss = measure(app, trim=True)
    exact = work.bitwise_equal(target)

    # The bare scatter floor: numpy fancy assignment of the very positions and new words the
    # patch carries, nothing decoded or computed (one thread; then split over two threads).
    changes = [
        scan(word_view(b, s), word_view(t, s)) for s, b, t in zip(base.specs, base.data, target.data, strict=True)
    ]
    dst = [word_view(w, s).numpy() for s, w in zip(base.specs, work.data, strict=True)]
    pos = [c.positions.numpy() for c in changes]
    new = [c.new.numpy() for c in changes]

    def scatter() -> None:
        for d, p, v in zip(dst, pos, new, strict=True):
            d[p] = v

    pool = ThreadPoolExecutor(2)

    def scatter2() -> None:
        for d, p, v in zip(dst, pos, new, strict=True):
            h = p.size // 2
            list(pool.map(d.__setitem__, (p[:h], p[h:]), (v[:h], v[h:])))

    def gather_scatter() -> None:  # what a ulp patch needs at least: read the old words, write the new
        for d, p in zip(dst, pos, strict=True):
            d[p] = d[p]

    t_gs = best_of(reps, gather_scatter, reset)
    t_scatter = best_of(reps, scatter, reset)
    t_scatter2 = best_of(reps, scatter2, reset)
    pool.shutdown()
    scatter_exact = work.bitwise_equal(target)

    def gbps(t: float) -> str:
        return f"{nb / t / 1e9:.2f} GB/s"

    def mb(x: int | None) -> str:
        return "n/a" if x is None else f"{x / 1e6:.1f} MB ({x / nb:.1%} of model)"

    print("| operation | time | throughput (of served bytes) | ratio | goal | peak RSS growth (cold run) |")
    print("|---|---|---|---|---|---|")
    runs = ", ".join(f"{t * 1e3:.0f}" for t in memcpy_runs)
    print(f"| memcpy, np.copyto 1 thread (best of 3: {runs} ms) | {t_mem * 1e3:.0f} ms | {gbps(t_mem)} | 1 | | |")
    print(
        f"| naive scan `np.flatnonzero(a != b)` | {t_naive * 1e3:.0f} ms | {gbps(t_naive)} "
        f"| memcpy/naive = {t_mem / t_naive:.2f} | | |"
    )
    print(
        f"| diff + encode (`encode_patch`) | {t_enc * 1e3:.0f} ms | {gbps(t_enc)} "
        f"| **memcpy/encode = {t_mem / t_enc:.2f}** | >= 0.5 | {mb(enc_rss)} |"
    )
    print(
        f"| apply in place (`apply_patch`) | {t_app * 1e3:.1f} ms | {gbps(t_app)} "
        f"| **apply/memcpy = {t_app / t_mem:.3f}** | < 0.10 | {mb(app_rss)} |"
    )
    print(
        f"| bare scatter `w[pos] = new`, 1 thread (floor) | {t_scatter * 1e3:.1f} ms | {gbps(t_scatter)} "
        f"| **scatter/memcpy = {t_scatter / t_mem:.3f}** | | |"
    )
    print(
        f"| bare scatter, 2 threads (half the changes each) | {t_scatter2 * 1e3:.1f} ms | {gbps(t_scatter2)} "
        f"| scatter/memcpy = {t_scatter2 / t_mem:.3f} | | |"
    )
    print(
        f"| bare gather + scatter `w[pos] = w[pos]`, 1 thread | {t_gs * 1e3:.1f} ms | {gbps(t_gs)} "
        f"| gather+scatter/memcpy = {t_gs / t_mem:.3f} | | |"
    )
    print(
        f"\npatch {len(payload):,} bytes ({len(payload) / nb:.3%} of the model); bitwise exact after apply: {exact}; "
        f"encode runs {', '.join(f'{t * 1e3:.0f}' for t in enc_times)} ms (cold: {enc_cold * 1e3:.0f} ms); "
        f"apply runs {', '.join(f'{t * 1e3:.1f}' for t in app_times)} ms (cold: {app_cold * 1e3:.1f} ms)"
    )
    if not exact:
        raise SystemExit("apply_patch did not reproduce the target")
    if not scatter_exact:
        raise SystemExit("the bare scatter did not reproduce the target")


# ---------------------------------------------------------------- c) hashing


def hashing(mb: int) -> None:
    buf = np.random.default_rng(0).integers(0, 256, mb << 20, dtype=np.uint8)
    data = memoryview(buf.data)
    nbytes = buf.nbytes

    cases: list[tuple[str, Callable[[], object]]] = [
        ("BLAKE3, max_threads=AUTO", lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()),
        ("BLAKE3, 1 thread", lambda: blake3.blake3(data).digest()),
        ("SHA-256 (hashlib)", lambda: hashlib.sha256(data).digest()),
    ]
    print(f"\n### Hashing {nbytes / 1e6:.0f} MB (best of 3)\n")
    print("| hash | time | GB/s |")
    print("|---|---|---|")
    for name, fn in cases:
        t = best_of(3, fn)
        print(f"| {name} | {t * 1e3:.0f} ms | {nbytes / t / 1e9:.2f} |")


# ---------------------------------------------------------------- main


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / (1 << 20):.0f} GiB RAM"
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {mem}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"numpy {np.__version__}, zstandard {zstandard.__version__}, torch threads {torch.get_num_threads()}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench", help="daemon.trajectory preset (tiny, small, bench)")
    ap.add_argument("--steps", type=int, default=5, help="RL steps of the trajectory (pairs per export)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training (0: torch's default)")
    ap.add_argument("--from-dir", type=Path, default=None, help="read versions written by daemon.trajectory")
    ap.add_argument("--big-gb", type=float, default=1.0, help="GiB of served bytes of the synthetic model")
    ap.add_argument("--big-tensors", type=int, default=8)
    ap.add_argument("--big-frac", type=float, default=0.005)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of encode and apply (best kept)")
    ap.add_argument("--hash-mb", type=int, default=256)
    ap.add_argument("--skip", action="append", default=[], choices=("size", "speed", "hash"))
    args = ap.parse_args(argv)

    print(f"command: `python -m benchmarks.codec_bench {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(f"machine: {machine()}")
    if "size" not in args.skip:
        t0 = time.perf_counter()
        if args.from_dir is not None:
            exports = {kind: load_dir(args.from_dir, kind) for kind in ("bf16", "fp8")}
            print(f"trajectory: versions read from {args.from_dir}")
        else:
            from patchswarm.daemon.trajectory import generate, param_count

            traj = generate(args.preset, args.steps, args.lr, args.seed, threads=args.threads or None)
            exports = {kind: traj.served(kind) for kind in ("bf16", "fp8")}
            print(
                f"trajectory: preset {args.preset} ({param_count(args.preset):,} parameters), {args.steps} RL "
                f"steps at lr {args.lr:g}, seed {args.seed}, {args.threads or 'default'} torch thread(s); "
                f"generated in {time.perf_counter() - t0:.1f} s"
            )
        for kind, versions in exports.items():
            size_table(kind, versions, args.reps)
    if "speed" not in args.skip:
        speed(args.big_gb, args.big_tensors, args.big_frac, args.seed, args.reps)
        speed_format2(args.big_gb, args.big_tensors, args.seed, args.reps)
    if "hash" not in args.skip:
        hashing(args.hash_mb)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
