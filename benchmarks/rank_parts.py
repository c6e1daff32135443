"""What TP=N adds to a rank-store apply, part by part: each part of ``RankStores.apply``'s CPU work
measured alone, on one thread (issue 33; docs/benchmarks.md "Rank stores").

    python -m benchmarks.rank_parts [--hidden 1024] [--inter 2816] [--vocab 4096] [--tp 1,8] [--repeat 7]

The same Llama-shaped model and version as benchmarks/rank_bench.py.  Per TP, the fastest of
``--repeat`` runs of process CPU time (ms): ``route`` (``FlatRouter.route``, or ``Router.route``
where the plan needs it), ``hash in place`` (the parameters hashed where their bytes lie),
``assemble`` (copying the column-split and padded parameters into the scratch buffer) and ``hash
assembled`` (assembling and hashing them, minus ``assemble``), each over every parameter the version
changes (all of them, at 0.5%).  Staging, the journal and the fenced writes are rank_bench's phases.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.rank_bench import llama_specs, two_versions
from patchswarm.daemon.store_format import StoreLayout
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.layout_digest import RankDigests
from patchswarm.protocol.layout_flat import FlatRouter
from patchswarm.protocol.layout_route import Router, SlotChange
from patchswarm.protocol.served import ServedModel


def cpu_ms(f: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        c = time.process_time()
        f()
        best = min(best, time.process_time() - c)
    return best * 1e3


def parts(
    config: dict[str, Any], a: ServedModel, b: ServedModel, changes: list[SlotChange], tp: int, repeat: int
) -> tuple[float, float, float, float]:
    plan = builtin_plan(config, a.specs, tp)
    router = Router(plan, a.specs)
    bases = [StoreLayout.from_specs(plan.rank_specs(k)).word_bases() for k in range(tp)]
    flat = FlatRouter.compile(router, [x for x in bases if x is not None]) if None not in bases else None
    d = RankDigests(plan, a.specs)
    jobs = [(k, i) for k in range(tp) for i in range(len(d.params[k]))]
    here = [j for j in jobs if d.in_place(b, *j)]
    built = [j for j in jobs if not d.in_place(b, *j)]
    route = cpu_ms(lambda: flat.route(changes) if flat is not None else router.route(changes), repeat)
    in_place = cpu_ms(lambda: [d.digest(b, *j) for j in here], repeat)
    assemble = cpu_ms(lambda: [d._assemble(b, d.params[k][i], 0) for k, i in built], repeat)
    assembled = cpu_ms(lambda: [d.digest(b, *j) for j in built], repeat) - assemble
    return route, in_place, assemble, assembled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tp", default="1,8")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    specs = llama_specs(args.hidden, args.inter, 4, args.vocab, 16, 4)
    a, b = two_versions(specs, 0.005)
    changes = [SlotChange(u.slot, u.positions, u.new, u.old) for u in diff_updates(a, b)]
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": args.hidden,
        "intermediate_size": args.inter, "num_hidden_layers": 4, "vocab_size": args.vocab,
        "num_attention_heads": 16, "num_key_value_heads": 4, "tie_word_embeddings": False,
    }  # fmt: skip
    print(f"model {b.nbytes / 1e6:.1f} MB bf16, 0.50% of values changed; CPU ms, fastest of {args.repeat}, one thread")
    print(f"{'TP':>3} {'route':>8} {'hash in place':>14} {'assemble':>9} {'hash assembled':>15} {'sum':>8}")
    for tp in sorted({int(x) for x in args.tp.split(",")}):
        route, in_place, assemble, assembled = parts(config, a, b, changes, tp, args.repeat)
        total = route + in_place + assemble + assembled
        print(f"{tp:>3} {route:>8.1f} {in_place:>14.1f} {assemble:>9.1f} {assembled:>15.1f} {total:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
