"""Decode once for N ranks: applying one version to TP=1, 2, 4, 8 rank stores (issue 33).

    python -m benchmarks.rank_bench [--hidden 1024] [--inter 2816] [--layers 4] [--vocab 4096]
                                    [--heads 16] [--kv-heads 4] [--frac 0.005] [--repeat 5]
                                    [--tp 1,2,4,8] [--threads N] [--profile OUT.prof] [--json OUT.json]
                                    [--phase-clock wall|cpu]

Builds a Llama-shaped canonical bf16 model (the defaults: ~107 MB), a version with ``--frac`` of
its values moved by an ulp or two, and for each TP host shared-memory rank stores with the built-in
Llama plan (``RankStores``, the code the daemon runs; store names unique, segments and the journal
directory removed afterwards).  Versions alternate a -> b -> a; per TP it prints, median and min
over ``--repeat`` applies (after one warm-up): the apply time (``RankStores.apply``: routing, rank
roots, staging, journal, the fenced writes) and its ratio to TP=1 (of the medians, of the minima,
and the median of each round's ratio: the TPs apply each version in turn), the longest single
rank's pause (fence odd -> even) against a torch copy of that rank's bytes timed in the same run,
and first fence odd -> last fence even; then the apply's CPU time (every thread of the process)
and the median of each phase of the apply (``RankStores.phases``: route, digests, stage, journal,
write: the fenced writes, remove: the journal's removal; other: the rest).  ``--threads`` sets
torch's intra-op threads (on a busy host one thread is steadier: OpenMP's fork/join around small
operations waits for a descheduled thread).
``--profile`` writes a cProfile of the largest TP's applies.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

from patchswarm.daemon import rank_activation, rank_stores
from patchswarm.daemon.engine import SHM_DIR, SharedSegment
from patchswarm.daemon.rank_stores import RankStores, rank_store_names
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.served import ServedModel, TensorSpec, state_root


def llama_specs(hidden: int, inter: int, layers: int, vocab: int, heads: int, kv_heads: int) -> list[TensorSpec]:
    """A LlamaForCausalLM's checkpoint tensors (untied lm_head), sorted by name, bf16."""
    hd = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    return [TensorSpec(n, "BF16", shapes[n]) for n in sorted(shapes)]


def two_versions(specs: list[TensorSpec], frac: float, seed: int = 0) -> tuple[ServedModel, ServedModel]:
    """Random bf16 words, then ``frac`` of them moved by one or two ulps (an Adam-like step)."""
    g = torch.Generator().manual_seed(seed)
    old, new = [], []
    for s in specs:
        w = torch.randint(-(1 << 14), 1 << 14, (s.numel,), dtype=torch.int16, generator=g)
        k = max(1, int(s.numel * frac))
        pos = torch.randint(0, s.numel, (k,), generator=g)
        v = w.clone()
        v[pos] += torch.randint(1, 3, (k,), dtype=torch.int16, generator=g)
        old.append(w.view(torch.uint8))
        new.append(v.view(torch.uint8))
    return ServedModel(specs, old), ServedModel(specs, new)


def copy_s(nbytes: int, repeat: int) -> float:
    """The fastest torch copy of ``nbytes`` host bytes (what one rank's whole bytes cost to move)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best


class Case:
    """One TP's rank stores (the daemon's ``RankStores``), loaded with version 1."""

    def __init__(self, tp: int, config: dict[str, Any], a: ServedModel, work: Path) -> None:
        self.tp = tp
        jdir = work / f"journal{tp}"
        jdir.mkdir()
        self.base = f"psbench{os.getpid()}x{secrets.token_hex(3)}tp{tp}"
        self.rs = RankStores(self.base, tp, jdir, engine_kind=False)
        self.applies: list[float] = []
        self.cpu: list[float] = []
        self.longest: list[float] = []
        self.total: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.changed = 0
        self.rs.prepare(builtin_plan(config, a.specs, tp), a.specs)
        self.rs.apply(1, a, None)

    def apply(
        self, version: int, model: ServedModel, ups: list[Any], keep: bool, prof: cProfile.Profile | None
    ) -> None:
        if prof is not None:
            prof.enable()
        t, c = time.perf_counter(), time.process_time()
        st = self.rs.apply(version, model, ups)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        if prof is not None:
            prof.disable()
        assert st is not None
        if keep:
            self.applies.append(dt)
            self.cpu.append(dc)
            self.longest.append(st.pause_s)
            self.total.append(st.total_pause_s)
            phases = getattr(self.rs, "phases", {})  # (a tree before the phases were kept: none)
            spent = dc if rank_stores.time is not time else dt  # (--phase-clock cpu: of the CPU time)
            self.phases.append(phases | {"other": spent - sum(phases.values())})
        self.changed = st.changed

    def result(self, version: int) -> dict[str, Any]:
        rs = self.rs
        for k, s in enumerate(rs.stores):  # every rank holds the version, computed where its bytes live
            assert s is not None
            assert rs.roots[k] == state_root(s.layout.specs, s.digests()) == s.header().root, f"rank {k}"
        assert rs.common_version() == version
        rank_bytes = max(s.layout.nbytes for s in rs.stores if s is not None)
        host = sum(s.layout.nbytes for s in rs.stores if s is not None)
        return {
            "tp": self.tp, "apply_s": statistics.median(self.applies), "apply_min_s": min(self.applies),
            "pause_s": statistics.median(self.longest), "pause_min_s": min(self.longest),
            "total_pause_s": statistics.median(self.total), "total_pause_min_s": min(self.total),
            "rank_bytes": rank_bytes, "host_bytes": host, "copy_s": copy_s(rank_bytes, 5), "changed": self.changed,
            "applies_s": self.applies, "cpu_s": statistics.median(self.cpu), "cpu_min_s": min(self.cpu),
            "phases_s": {k: statistics.median(p[k] for p in self.phases) for k in self.phases[0]},
        }  # fmt: skip

    def close(self) -> None:
        self.rs.close()
        for n in rank_store_names(self.base, self.tp):
            SharedSegment.path_for(n, SHM_DIR).unlink(missing_ok=True)


def run(
    tps: list[int], config: dict[str, Any], a: ServedModel, b: ServedModel, repeat: int, work: Path,
    prof: cProfile.Profile | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every TP applies each version in turn (the TPs interleaved, so that a busy host's drift
    reaches them alike); the first round warms up."""
    fwd, back = diff_updates(a, b), diff_updates(b, a)
    cases: list[Case] = []
    try:
        for tp in tps:
            cases.append(Case(tp, config, a, work))
        for i in range(repeat + 1):
            model, ups = (b, fwd) if i % 2 == 0 else (a, back)
            for c in cases:
                c.apply(i + 2, model, ups, i > 0, prof if c is cases[-1] and i else None)
        return [c.result(repeat + 2) for c in cases]
    finally:
        for c in cases:
            c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--frac", type=float, default=0.005)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tp", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--profile", type=Path, help="write a cProfile of the largest TP's applies here")
    ap.add_argument(
        "--phase-clock", choices=["wall", "cpu"], default="wall",
        help="cpu: RankStores' phases in process CPU time (every thread: the route phase then holds the "
        "digests hashed beside it)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    tps = sorted({int(x) for x in args.tp.split(",")})
    if not tps or tps[0] < 1 or args.repeat < 1 or not 0 < args.frac < 1:
        ap.error("--tp takes positive integers, --repeat >= 1, 0 < --frac < 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.phase_clock == "cpu":  # (rank_stores' own clock only; the apply columns stay wall-clock)
        for mod in (rank_stores, rank_activation):
            mod.time = types.SimpleNamespace(perf_counter=time.process_time)  # type: ignore[assignment]
    print("command:", "python -m benchmarks.rank_bench", *(argv if argv is not None else sys.argv[1:]))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": args.hidden,
        "intermediate_size": args.inter, "num_hidden_layers": args.layers, "vocab_size": args.vocab,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "tie_word_embeddings": False,
    }  # fmt: skip
    specs = llama_specs(args.hidden, args.inter, args.layers, args.vocab, args.heads, args.kv_heads)
    a, b = two_versions(specs, args.frac)
    model_bytes = a.nbytes
    print(
        f"model: {len(specs)} tensors, {model_bytes / 1e6:.1f} MB bf16, {args.frac:.2%} of values changed; "
        f"torch threads {torch.get_num_threads()}"
    )
    work = Path(tempfile.mkdtemp(prefix="rank_bench"))
    prof = cProfile.Profile() if args.profile else None
    try:
        rows = run(tps, config, a, b, args.repeat, work, prof)
        if prof is not None:
            prof.dump_stats(args.profile)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base, base_min = rows[0]["apply_s"], rows[0]["apply_min_s"]
    for r in rows:  # the ratio within each round, then its median (the rounds ran the TPs back to back)
        r["ratio_rounds"] = statistics.median(x / y for x, y in zip(r["applies_s"], rows[0]["applies_s"], strict=True))
    hdr = (
        f"{'TP':>3} {'apply ms':>9} {'min':>7} {'x TP=1':>7} {'min x':>6} {'round x':>7} "
        f"{'host/model':>10} {'rank MB':>8} {'pause ms':>9} {'min':>7} {'copy ms':>8} {'pause/copy':>10} "
        f"{'odd..even ms':>12} {'min':>7}"
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['tp']:>3} {r['apply_s'] * 1e3:>9.1f} {r['apply_min_s'] * 1e3:>7.1f} {r['apply_s'] / base:>7.2f} "
            f"{r['apply_min_s'] / base_min:>6.2f} {r['ratio_rounds']:>7.2f} "
            f"{r['host_bytes'] / model_bytes:>10.3f} {r['rank_bytes'] / 1e6:>8.1f} {r['pause_s'] * 1e3:>9.2f} "
            f"{r['pause_min_s'] * 1e3:>7.2f} {r['copy_s'] * 1e3:>8.2f} {r['pause_s'] / r['copy_s']:>10.2f} "
            f"{r['total_pause_s'] * 1e3:>12.2f} {r['total_pause_min_s'] * 1e3:>7.2f}"
        )
    print("\nCPU time of the apply (every thread of the process; steadier than the wall clock on a busy host)")
    print(f"{'TP':>3} {'cpu ms':>9} {'min':>7} {'x TP=1':>7} {'min x':>6}")
    for r in rows:
        print(
            f"{r['tp']:>3} {r['cpu_s'] * 1e3:>9.1f} {r['cpu_min_s'] * 1e3:>7.1f} {r['cpu_s'] / rows[0]['cpu_s']:>7.2f} "
            f"{r['cpu_min_s'] / rows[0]['cpu_min_s']:>6.2f}"
        )
    names = list(rows[0]["phases_s"])
    print("\nphases of the apply, median ms (RankStores.phases; other: the rest of apply)")
    print(f"{'TP':>3} " + " ".join(f"{n:>8}" for n in names))
    for r in rows:
        print(f"{r['tp']:>3} " + " ".join(f"{r['phases_s'][n] * 1e3:>8.2f}" for n in names))
    if args.json:
        args.json.write_text(json.dumps({"model_bytes": model_bytes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
