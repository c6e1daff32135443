"""How far below the memoryless position bound a host-side context can take a patch (issue 37).

    python -m benchmarks.codec_contexts [--preset small] [--steps 5] [--from-dir DIR]

For each consecutive pair of a real trajectory (daemon.trajectory; bf16 and fp8 exports), per dtype:

- ``memoryless``: sum over tensors of log2 C(n_t, k_t), the position bits of a coder that knows only
  how many elements of each tensor changed (the reference of benchmarks/codec_bench.py);
- ``(a) exp``: sum over tensors and exponent classes c of log2 C(n_tc, k_tc), the classes being the
  exponent field of the base value (bf16: 8 bits, fp8 e4m3: 4 bits): the ideal two-pass coder under
  context (tensor, exponent of the base word), per-class counts taken as known;
- ``(b) exp x prev``: the same with the classes split by "changed in the previous pair" (history);
- ``rice(a)``: the bits a per-class Rice coder spends on (a), class counts included (what format 2 does);
- the value-delta entropy H(d) pooled per dtype, and H(d | exponent class).

Then where format 2's position bits go (``decompose``): the ideal per exponent and under its
groups, Rice against Golomb codes, the minority sets of dense groups, counts and thresholds.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.bound import entropy_bits, log2_binom_sum
from patchswarm.protocol import context_coding as cc
from patchswarm.protocol import context_pass_torch, ordered
from patchswarm.protocol.codec import apply_patch, encode_patch
from patchswarm.protocol.diffscan import scan
from patchswarm.protocol.position_coding import rice_bits
from patchswarm.protocol.served import ServedModel, TensorSpec, word_view

MANTISSA = {"BF16": 7, "F16": 10, "F32": 23, "F64": 52, "F8_E4M3": 3, "F8_E5M2": 2}


def exponent(words: np.ndarray, name: str) -> np.ndarray:
    m = MANTISSA[name]
    e = 8 * words.dtype.itemsize - 1 - m
    return ((words.astype(np.int64) >> m) & ((1 << e) - 1)).astype(np.int64)


def class_bits(cls: np.ndarray, changed: np.ndarray, nclass: int) -> tuple[float, np.ndarray, np.ndarray]:
    n_c = np.bincount(cls, minlength=nclass)
    k_c = np.bincount(cls[changed], minlength=nclass)
    return log2_binom_sum(n_c, k_c), n_c, k_c


def gamma_bits(x: np.ndarray) -> int:
    """Elias-gamma lengths of the positive integers ``x``."""
    return int(np.sum(2 * np.floor(np.log2(x)).astype(np.int64) + 1)) if x.size else 0


def rice_exact(n: int, pos: np.ndarray) -> int:
    """Bits of the format-1 Rice code of the ascending positions ``pos`` among ``n``."""
    k = pos.size
    if k == 0:
        return 0
    gaps = np.diff(pos, prepend=-1) - 1
    r = rice_bits(n, k)
    return int(k + np.sum(gaps >> r) + k * r)


def rice_cost(cls: np.ndarray, changed: np.ndarray, n_c: np.ndarray, k_c: np.ndarray) -> float:
    """Bits of per-class Rice codes (the gaps within each class's subsequence of positions), class
    counts included (Elias-gamma of k_c + 1 for every class present in the base)."""
    order = np.argsort(cls, kind="stable")
    starts = np.concatenate([[0], np.cumsum(n_c)])
    bits = gamma_bits(k_c[n_c > 0] + 1)
    ch_sorted = changed[order]
    for c in np.flatnonzero(k_c):
        sub = ch_sorted[starts[c] : starts[c + 1]]
        bits += rice_exact(int(n_c[c]), np.flatnonzero(sub))
    return float(bits)


def group_lut(n_c: np.ndarray, k_c: np.ndarray, groups: int) -> np.ndarray:
    """Exponent class -> group: classes sorted by change rate, cut into ``groups`` runs minimizing
    the summed n H(k/n) (dynamic programming over cut points)."""
    order = np.arange(len(n_c))  # contiguous exponent ranges
    n = np.concatenate([[0], np.cumsum(n_c[order])]).astype(np.float64)
    k = np.concatenate([[0], np.cumsum(k_c[order])]).astype(np.float64)
    nn = n[None, :] - n[:, None]
    kk = k[None, :] - k[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(nn > 0, kk / np.where(nn > 0, nn, 1), 0)
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    cost = np.where(np.triu(np.ones_like(nn, dtype=bool), 0), nn * h, np.inf)  # groups i..j-1, empty allowed
    m = len(n_c)
    dp = np.full(m + 1, np.inf)
    dp[0] = 0
    back = []
    for _ in range(groups):
        tot = dp[:, None] + cost
        arg = np.argmin(tot, axis=0)
        back.append(arg)
        dp = tot[arg, np.arange(m + 1)]
    lut = np.zeros(len(n_c), dtype=np.int64)
    j = m
    for g in range(groups - 1, -1, -1):
        i = int(back[g][j])
        lut[order[i:j]] = g
        j = i
    return lut


def pair_row(base: ServedModel, target: ServedModel, prev: dict[str, np.ndarray] | None) -> dict[str, object]:
    acc: dict[str, dict[str, float]] = {}
    dcount: dict[str, Counter[int]] = {}
    dcond: dict[str, dict[int, Counter[int]]] = {}
    changed_now: dict[str, np.ndarray] = {}
    for i, (spec, tdata) in enumerate(target):
        name = spec.dtype
        if name not in MANTISSA:
            continue
        a = word_view(base.data[i], spec)
        ch = scan(a, word_view(tdata, spec))
        n, k = spec.numel, len(ch)
        pos = ch.positions.numpy()
        changed = np.zeros(n, dtype=bool)
        changed[pos] = True
        changed_now[spec.name] = changed
        row = acc.setdefault(
            name, dict.fromkeys(("n", "k", "mem", "a", "b", "rice_a", "rice_1", "mem_b", "g2", "g4", "g8"), 0.0)
        )
        row["n"] += n
        row["k"] += k
        if k == 0:
            continue
        mem = log2_binom_sum(np.array([n]), np.array([k]))
        row["mem"] += mem
        cls = exponent(a.numpy(), name)
        nclass = 1 << (8 * spec.dt.width - 1 - MANTISSA[name])
        bits_a, n_c, k_c = class_bits(cls, changed, nclass)
        row["a"] += bits_a
        row["rice_a"] += min(rice_cost(cls, changed, n_c, k_c), rice_exact(n, pos))
        row["rice_1"] += rice_exact(n, pos)
        for groups in (2, 4, 8):
            lut = group_lut(n_c, k_c, groups)
            g_cls = lut[cls]
            _, gn, gk = class_bits(g_cls, changed, groups)
            lut_bits = (groups - 1) * (8 * spec.dt.width - 1)
            row[f"g{groups}"] += min(rice_cost(g_cls, changed, gn, gk) + lut_bits, rice_exact(n, pos))
        if prev is not None and spec.name in prev:
            cls_b = cls * 2 + prev[spec.name]
            row["b"] += class_bits(cls_b, changed, 2 * nclass)[0]
            row["mem_b"] += mem
        d = (ordered.ordered_key(ch.new, spec.dt.width) - ordered.ordered_key(ch.old, spec.dt.width)).numpy()
        dcount.setdefault(name, Counter()).update(d.tolist())
        per = dcond.setdefault(name, {})
        for c, dv in zip(cls[pos].tolist(), d.tolist(), strict=True):
            per.setdefault(c, Counter())[dv] += 1
    for name, row in acc.items():
        c = dcount.get(name, Counter())
        row["H_d"] = entropy_bits(c)
        tot = sum(c.values())
        hd_a = sum(sum(v.values()) * entropy_bits(v) for v in dcond.get(name, {}).values())
        row["H_d_a"] = hd_a / tot if tot else 0.0
    return {"rows": acc, "changed": changed_now}


# ---------------------------------------------------------------- where format 2's position bits go

DECOMP = ("mem", "exp", "groups", "rice", "golomb_k", "golomb", "counts", "thresholds", "dense_ideal", "dense_rice")


def decompose(spec: TensorSpec, base: np.ndarray, pos: np.ndarray, acc: dict[str, float]) -> None:
    """Adds one tensor's position bits to ``acc`` (tensors the encoder codes with contexts only):
    the memoryless bound; the ideal per exponent class; the ideal under the encoder's groups and
    blocks; the gaps of those groups as Rice codes (format 2 before issue 37's revision), as Golomb
    codes of the changes, as Golomb codes of the minority set (today); the counts; the thresholds;
    and the ideal and Rice bits of the dense groups (more than a third of their elements changed)."""
    th = cc.context_thresholds(spec, base, pos)
    fields = cc.ctx_fields(spec, base, pos, th) if th.size else None
    n, k = spec.numel, pos.size
    if fields is None or cc.field_bits(fields) >= rice_exact(n, pos):
        return
    e = cc.exponent_field(spec)[1]
    cls = exponent(base, spec.dtype)
    changed = np.zeros(n, dtype=bool)
    changed[pos] = True
    acc["mem"] += log2_binom_sum(np.array([n]), np.array([k]))
    acc["exp"] += class_bits(cls, changed, 1 << e)[0]
    acc["thresholds"] += cc.GROUP_BITS + sum(2 * int(d).bit_length() - 1 for d in np.diff(th, prepend=0))
    group = np.searchsorted(th, cls, side="right")
    for start in range(0, n, cc.CTX_BLOCK):
        g = group[start : start + cc.CTX_BLOCK]
        local = pos[(pos >= start) & (pos < start + cc.CTX_BLOCK)] - start
        n_g = np.bincount(g, minlength=th.size + 1)
        k_g = np.bincount(g[local], minlength=th.size + 1)
        acc["groups"] += log2_binom_sum(n_g, k_g)
        acc["counts"] += gamma_bits(k_g[n_g > 0] + 1)
        for gi in np.flatnonzero(k_g).tolist():
            ng, kg = int(n_g[gi]), int(k_g[gi])
            member = g == gi
            ranks = np.cumsum(member)[local[g[local] == gi]] - 1
            rice = rice_exact(ng, ranks)
            acc["rice"] += rice
            acc["golomb_k"] += golomb_bits(ranks, ng)
            acc["golomb"] += golomb_bits(cc._minority(ranks, ng), ng)
            if 3 * kg > ng:
                acc["dense_ideal"] += log2_binom_sum(np.array([ng]), np.array([kg]))
                acc["dense_rice"] += rice


def golomb_bits(ranks: np.ndarray, n: int) -> int:
    """Bits of format 2's Golomb code of the ascending ``ranks`` among ``n``."""
    if ranks.size == 0:
        return 0
    q, rem = cc._golomb(np.diff(ranks, prepend=-1) - 1, cc.golomb_param(n, ranks.size))
    return int(q.sum()) + q.size + cc.field_bits(rem)


def decomposition_table(exports: dict[str, list[ServedModel]]) -> None:
    print("\n### Where format 2's position bits go (tensors it codes with contexts; bits / memoryless bound)\n")
    print(
        "| export | per-exponent ideal | ideal, format 2's groups | Rice | Golomb of changes | **Golomb of minority** "
        "| counts | thresholds | **total** | dense groups: Rice / ideal, share of ideal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, versions in exports.items():
        acc = dict.fromkeys(DECOMP, 0.0)
        for i in range(1, len(versions)):
            for j, (spec, tdata) in enumerate(versions[i]):
                if spec.dtype not in cc.MANTISSA:
                    continue
                a = word_view(versions[i - 1].data[j], spec)
                ch = scan(a, word_view(tdata, spec))
                if len(ch):
                    decompose(spec, a.numpy(), ch.positions.numpy(), acc)
        r = {key: v / acc["mem"] for key, v in acc.items()}
        total = r["golomb"] + r["counts"] + r["thresholds"]
        dense = acc["dense_rice"] / max(acc["dense_ideal"], 1)
        print(
            f"| {kind} | {r['exp']:.4f} | {r['groups']:.4f} | {r['rice']:.4f} | {r['golomb_k']:.4f} "
            f"| **{r['golomb']:.4f}** | {r['counts']:.4f} | {r['thresholds']:.4f} | **{total:.4f}** "
            f"| {dense:.3f}, {acc['dense_ideal'] / max(acc['groups'], 1):.1%} |"
        )


# ---------------------------------------------------------------- used by codec_bench's format-2 tables


def ctx_ideal_bits(spec: TensorSpec, base: np.ndarray, pos: np.ndarray) -> float:
    """Ideal position bits under the contexts format 2 would use for this tensor: sum over blocks
    and groups of log2 C(n_bg, k_bg) (the memoryless log2 C(n, k) where it would use plain gaps)."""
    if spec.dtype not in cc.MANTISSA:
        return log2_binom_sum(np.array([spec.numel]), np.array([pos.size]))
    th = cc.context_thresholds(spec, base, pos)
    m, _ = cc.exponent_field(spec)
    bits = 0.0
    block = cc.CTX_BLOCK
    for start in range(0, spec.numel, block):
        words = base[start : start + block]
        local = pos[(pos >= start) & (pos < start + block)] - start
        mag = words & np.array((1 << (8 * words.dtype.itemsize - 1)) - 1, dtype=words.dtype)
        groups = np.zeros(words.size, dtype=np.int64)
        for t in th.tolist():
            groups += mag >= t << m
        n_g = np.bincount(groups, minlength=th.size + 1)
        k_g = np.bincount(groups[local], minlength=th.size + 1)
        bits += log2_binom_sum(n_g, k_g)
    return min(bits, log2_binom_sum(np.array([spec.numel]), np.array([pos.size])))


def adam_like_synthetic(total_bytes: int, ntensors: int, step: float, seed: int) -> tuple[ServedModel, ServedModel]:
    """Base: an FP32 master normal*0.02 served in bf16; target: the master moved by +-``step``, served
    in bf16 (a change is a rounding boundary crossed: likelier the smaller the value, as in training)."""
    g = torch.Generator().manual_seed(seed)
    n_each = total_bytes // 2 // ntensors
    base: dict[str, torch.Tensor] = {}
    target: dict[str, torch.Tensor] = {}
    for t in range(ntensors):
        master = torch.randn(n_each, generator=g) * 0.02
        base[f"layer{t:02d}.weight"] = master.bfloat16()
        master -= step * torch.sign(torch.randn(n_each, generator=g))
        target[f"layer{t:02d}.weight"] = master.bfloat16()
    return ServedModel.from_tensors(base), ServedModel.from_tensors(target)


def cpu_best_of(n: int, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
    """Best CPU seconds (this process, every thread) of ``n`` calls: steadier than wall time on a
    machine other jobs share."""
    best = float("inf")
    for _ in range(n):
        if setup:
            setup()
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def speed_format2(big_gb: float, ntensors: int, seed: int, reps: int) -> None:
    """Format 1 against format 2 on an AdamW-like synthetic step (changes favour small magnitudes),
    in CPU time with one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base, target = adam_like_synthetic(int(big_gb * (1 << 30)), ntensors, 2e-7, seed)
    nb = base.nbytes
    src = [d.numpy() for d in base.data]
    dst = [np.zeros_like(a) for a in src]
    t_mem = cpu_best_of(5, lambda: [np.copyto(d, a) for d, a in zip(dst, src, strict=True)])
    p1 = encode_patch(base, target, payload_format=1).payload
    p2 = encode_patch(base, target, payload_format=2).payload
    k = sum(int((a != b).sum()) for a, b in zip(base.data, target.data, strict=True))
    t_e1 = cpu_best_of(reps, lambda: encode_patch(base, target, payload_format=1))
    t_e2 = cpu_best_of(reps, lambda: encode_patch(base, target, payload_format=2))
    work = base.clone()

    def reset() -> None:
        for w, b in zip(work.data, base.data, strict=True):
            w.copy_(b)

    t_a1 = cpu_best_of(reps, lambda: apply_patch(work, p1, base.specs), reset)
    t_a2 = cpu_best_of(reps, lambda: apply_patch(work, p2, base.specs), reset)
    t_e2t, t_a2t, exact_torch = torch_pass_times(base, work, p2, target, reps, reset)
    t_read, t_ctx, groups = context_floor(base, target, reps)
    reset()
    exact = apply_patch(work, p2, base.specs).bitwise_equal(target)
    torch.set_num_threads(threads)
    n = nb // 2
    print(
        f"\n### Speed, format 1 against format 2: AdamW-like synthetic bf16 step, {nb / 1e9:.3f} GB in "
        f"{ntensors} tensors, about {k / n:.2%} of the elements changed (CPU time, 1 torch thread)\n"
    )
    print("| | format 1 | format 2 | goal |")
    print("|---|---|---|---|")
    print(f"| payload bytes | {len(p1):,} | {len(p2):,} ({len(p2) / len(p1):.3f}x) | |")
    print(
        f"| encode (memcpy {t_mem * 1e3:.0f} ms) | {t_e1 * 1e3:.0f} ms, memcpy/encode {t_mem / t_e1:.2f} "
        f"| {t_e2 * 1e3:.0f} ms, **memcpy/encode {t_mem / t_e2:.2f}** | >= 0.4 |"
    )
    print(f"| apply in place | {t_a1 * 1e3:.0f} ms | {t_a2 * 1e3:.0f} ms (**{t_a2 / t_a1:.2f}x**) | <= 1.5x |")
    print(
        f"| encode, the context pass in torch (protocol/context_pass_torch.py, CPU twin) | | "
        f"{t_e2t * 1e3:.0f} ms (**{t_e2t / t_e2:.2f}x the numpy pass**), the same bytes: {exact_torch} | |"
    )
    print(
        f"| apply in place, the context pass in torch (CPU twin) | | "
        f"{t_a2t * 1e3:.0f} ms ({t_a2t / t_a1:.2f}x; **{t_a2t / t_a2:.2f}x the numpy pass**), "
        f"bitwise exact: {exact_torch} | |"
    )
    print(
        f"\nformat 2 costs {(t_e2 - t_e1) / n * 1e9:.2f} ns an element more to encode, {(t_a2 - t_a1) / n * 1e9:.2f} "
        f"ns to apply; bitwise exact after apply: {exact}"
    )
    print(
        f"\nfloor of any base-context decoder: one read of the base (exponent extraction, compare, count) "
        f"{t_read * 1e3:.0f} ms = **{t_read / t_a1:.2f}x** format-1 apply; format 2's group bit sets alone "
        f"({groups} groups a tensor on average) {t_ctx * 1e3:.0f} ms = **{t_ctx / t_a1:.2f}x** format-1 apply"
    )
    if not (exact and exact_torch):
        raise SystemExit("format 2 did not reproduce the target")


def torch_pass_times(
    base: ServedModel, work: ServedModel, payload: bytes, target: ServedModel, reps: int, reset: Callable[[], object]
) -> tuple[float, float, bool]:
    """CPU seconds of encoding ``target`` against ``base`` and of applying ``payload`` (format 2) with
    the torch context pass on CPU tensors (what a device store runs, here on the host), side by side
    with the numpy pass; and whether it wrote the same bytes and applied bitwise exact."""
    saved = context_pass_torch.ON_CPU
    context_pass_torch.ON_CPU = True
    try:
        t_enc = cpu_best_of(reps, lambda: encode_patch(base, target, payload_format=2))
        same = encode_patch(base, target, payload_format=2).payload == payload
        t_apply = cpu_best_of(reps, lambda: apply_patch(work, payload, target.specs), reset)
        reset()
        return t_enc, t_apply, same and apply_patch(work, payload, target.specs).bitwise_equal(target)
    finally:
        context_pass_torch.ON_CPU = saved


def context_floor(base: ServedModel, target: ServedModel, reps: int) -> tuple[float, float, float]:
    """CPU seconds of (one read of the base: exponent extraction, one compare and a count over every
    element, block by block; format 2's group bit sets alone, with the thresholds its encoder picks for each tensor)
    and the mean group count."""
    words, cuts = [], []
    for i, (spec, tdata) in enumerate(target):
        a = word_view(base.data[i], spec)
        ch = scan(a, word_view(tdata, spec))
        words.append((a.numpy(), spec))
        cuts.append(cc.context_thresholds(spec, a.numpy(), ch.positions.numpy()) if len(ch) else np.zeros(0, int))

    def read_once() -> None:  # the cheapest pass that sees every exponent (block by block, as decoding)
        for w, spec in words:
            m, e = cc.exponent_field(spec)
            for start in range(0, w.size, cc.CTX_BLOCK):
                np.count_nonzero((w[start : start + cc.CTX_BLOCK] >> m) & ((1 << e) - 1) >= 1 << (e - 1))

    def group_sets() -> None:
        for (w, spec), th in zip(words, cuts, strict=True):
            for start in range(0, w.size, cc.CTX_BLOCK):
                cc.group_words(w[start : start + cc.CTX_BLOCK], cc.exponent_field(spec)[0], th)

    return cpu_best_of(reps, read_once), cpu_best_of(reps, group_sets), float(np.mean([c.size + 1 for c in cuts]))


def load_dir(path: Path, kind: str) -> list[ServedModel]:
    from patchswarm.protocol.safetensors_io import load_safetensors

    return [load_safetensors(p) for p in sorted((path / kind).glob("v*.safetensors"))]


def gs(r: dict[str, float]) -> str:
    return ", ".join(f"{r[f'g{g}'] / r['mem']:.3f}" for g in (2, 4, 8))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.from_dir is not None:
        exports = {kind: load_dir(args.from_dir, kind) for kind in ("bf16", "fp8")}
        print(f"trajectory: versions read from {args.from_dir}")
    else:
        from patchswarm.daemon.trajectory import generate

        traj = generate(args.preset, args.steps, args.lr, args.seed, threads=1)
        exports = {kind: traj.served(kind) for kind in ("bf16", "fp8")}
        print(f"trajectory: preset {args.preset}, {args.steps} steps, lr {args.lr:g}, seed {args.seed}")
    print(
        "\n| export | pair | dtype | changed | memoryless B | (a) exp / mem | rice v1 / mem | min(v1, rice(a)) / mem "
        "| (b) exp x prev / mem | H(d) | H(d given exp) | rice G=2,4,8 groups |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, versions in exports.items():
        prev: dict[str, np.ndarray] | None = None
        tot: dict[str, dict[str, float]] = {}
        for i in range(1, len(versions)):
            out = pair_row(versions[i - 1], versions[i], prev)
            rows = out["rows"]
            assert isinstance(rows, dict)
            for name, r in sorted(rows.items()):
                t = tot.setdefault(name, Counter())
                for key, v in r.items():
                    t[key] += v
                if not r["mem"]:
                    continue
                b = f"{r['b'] / r['mem_b']:.3f}" if r["mem_b"] else "-"
                print(
                    f"| {kind} | v{i - 1}->v{i} | {name} | {100 * r['k'] / r['n']:.3f}% | {r['mem'] / 8:,.0f} "
                    f"| {r['a'] / r['mem']:.3f} | {r['rice_1'] / r['mem']:.3f} | {r['rice_a'] / r['mem']:.3f} | {b} "
                    f"| {r['H_d']:.3f} | {r['H_d_a']:.3f} | {gs(r)} |"
                )
            changed = out["changed"]
            assert isinstance(changed, dict)
            prev = changed
        for name, r in sorted(tot.items()):
            if r["mem"]:
                b = f"{r['b'] / r['mem_b']:.3f}" if r["mem_b"] else "-"
                print(
                    f"| {kind} | all | {name} | {100 * r['k'] / r['n']:.3f}% | {r['mem'] / 8:,.0f} "
                    f"| **{r['a'] / r['mem']:.3f}** | {r['rice_1'] / r['mem']:.3f} | **{r['rice_a'] / r['mem']:.3f}** "
                    f"| **{b}** | | | {gs(r)} |"
                )
    decomposition_table(exports)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
