"""Absorption study (issue 36, part 1): does the sparsity of served updates hold for other
optimizers, served formats and training regimes?

    python -m benchmarks.absorption_study --preset small --steps 50 --out docs/research-data

For each architecture (Llama, Qwen3-MoE; benchmarks/absorption_models.py), regime (RL-like, SFT-like,
pre-training-like) and optimizer (AdamW, Adafactor, SGD+momentum, Muon; absorption_optim.py):

1. Warm-up (once per architecture): AdamW at 1e-3 on next-token cross-entropy of synthetic tasks.
2. Learning rates matched by update RMS, step by step: AdamW runs first at the regime's lr and its
   update RMS at every step is recorded; every other optimizer then takes each step at the lr that
   gives AdamW's update RMS at that step (an lr schedule; absorption_optim.Optim.step), so the
   optimizers move the weights equally far at every step, which is what a changed fraction per step
   depends on most.  The same batches for every optimizer (RL samples follow each model).  The
   achieved ratio to AdamW's RMS (mean, min, max over the measured steps) is reported per run.
3. Run: from the warm-up weights, a fresh optimizer takes ``--state-steps`` steps (its state warms
   up: moments, momentum, factored second moments), then version 0 is exported, then ``--steps``
   measured steps, each exported in every format (absorption_formats.py) and compared with the
   previous version (a chain patch) and with version 0 (a catch-up patch).

Outputs: ``OUT/absorption.json`` (every number, the config, seed, versions, threads),
``OUT/absorption.md`` (tables) and, with ``--plots DIR``, PNG figures.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.absorption_formats import FORMATS, PAYLOAD_FORMAT, Exporter, changed_masks, pair_cost
from benchmarks.absorption_models import (
    ARCHS,
    PRESETS,
    active_count,
    answer_loss,
    batches,
    build,
    canonical,
    param_count,
    warm_up,
)
from benchmarks.absorption_optim import OPTIMIZERS, REGIMES, Optim, run
from patchswarm.daemon.trajectory import deterministic
from patchswarm.protocol.files import write_atomic

SGD_GUESS = 1000.0  # SGD's provisional lr, times AdamW's: plain gradients are ~1e-3 of Adam's unit steps


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def first(pred: list[bool]) -> int | None:
    """1-based index of the first true entry (the step t), None if none."""
    return next((i + 1 for i, x in enumerate(pred) if x), None)


def crossovers(chain: list[float], catchup: list[float], anchor: float) -> dict[str, int | None]:
    """Steps t where: a catch-up v0->vt is smaller than the t chain patches summed; the chain sum
    exceeds one full anchor; a catch-up exceeds an anchor (re-anchor from then on)."""
    sums = [sum(chain[: t + 1]) for t in range(len(chain))]
    return {
        "catchup_beats_chain": first([c < s for c, s in zip(catchup, sums, strict=True)]),
        "anchor_beats_chain": first([s > anchor for s in sums]),
        "anchor_beats_catchup": first([c > anchor for c in catchup]),
    }


def one_run(
    arch: str,
    regime: str,
    opt_name: str,
    warm: dict[str, torch.Tensor],
    args: argparse.Namespace,
    ref_rms: list[float] | None,
) -> dict[str, Any]:
    p = PRESETS[args.preset]
    reg = REGIMES[regime]
    data_seed = args.seed * 1000 + 10 + list(REGIMES).index(regime)

    def fresh(lr: float) -> tuple[torch.nn.Module, Optim, Any, torch.Generator]:
        model = build(arch, p, args.seed)
        model.load_state_dict(warm)
        return model, Optim(opt_name, model, lr), batches(p, data_seed), torch.Generator().manual_seed(data_seed + 7)

    # AdamW steps at the regime's lr; every other optimizer at the lr schedule whose update RMS is
    # AdamW's at the same step (absorption_optim.Optim.step), over the state steps and the measured ones.
    total = args.state_steps + args.steps
    targets = None if opt_name == "adamw" else ref_rms
    if targets is not None and len(targets) != total:
        raise ValueError(f"AdamW's reference has {len(targets)} steps, not {total}")
    model, opt, data, gs = fresh(reg.adamw_lr * (SGD_GUESS if opt_name == "sgd" else 1.0))
    warm_rms = run(regime, model, opt, data, gs, args.state_steps, targets=targets)
    exporter = Exporter()
    v0 = exporter.export(canonical(model))
    anchor = exporter.anchor_bytes(v0)
    full = {"bf16": v0.bf16.nbytes, "fp8": v0.fp8.nbytes, "int4": exporter.int4_full_bytes(v0)}
    series: dict[str, dict[str, list[float]]] = {
        f: {k: [] for k in ("changed", "patch", "bound", "union", "catchup_changed", "catchup_patch", "catchup_bound")}
        for f in FORMATS
    }
    union: dict[str, list[torch.Tensor] | None] = dict.fromkeys(FORMATS)
    numel: dict[str, int] = {}
    dump = Path(args.dump) / f"{arch}-{regime}-{opt_name}" if args.dump else None
    if dump is not None:
        _dump(dump, 0, model, v0)
    step_rms: list[float] = []
    losses: list[float] = []
    prev = v0
    for t in range(1, args.steps + 1):
        step_rms += run(
            regime, model, opt, data, gs, 1, losses, None if targets is None else targets[len(warm_rms) + t - 1 :]
        )
        cur = exporter.export(canonical(model))
        if dump is not None:
            _dump(dump, t, model, cur)
        for f in FORMATS:
            s = series[f]
            c = pair_cost(f, prev, cur)
            cu = pair_cost(f, v0, cur)
            numel[f] = c.numel
            s["changed"].append(c.changed / c.numel)
            s["bound"].append(c.bound)
            s["catchup_changed"].append(cu.changed / cu.numel)
            s["catchup_bound"].append(cu.bound)
            if c.codec is not None and cu.codec is not None:
                s["patch"].append(c.codec)
                s["catchup_patch"].append(cu.codec)
            masks = changed_masks(f, prev, cur)
            u = union[f]
            union[f] = masks if u is None else [a | b for a, b in zip(u, masks, strict=True)]
            s["union"].append(sum(int(m.sum()) for m in union[f] or []) / c.numel)
        prev = cur
        if args.verbose:
            log(
                f"  {arch} {regime} {opt_name} step {t}: "
                + ", ".join(f"{f} {100 * series[f]['changed'][-1]:.3f}%" for f in FORMATS)
            )
    formats: dict[str, Any] = {}
    for f in FORMATS:
        s = series[f]
        chain = s["patch"] or s["bound"]
        catchup = s["catchup_patch"] or s["catchup_bound"]
        formats[f] = {
            "numel": numel[f],
            "full_bytes": full[f],
            "anchor_bytes": anchor[f],
            "sizes_from": "codec" if s["patch"] else "bound",
            **s,
            "crossover": crossovers(chain, catchup, anchor[f]),
        }
    reference = warm_rms + step_rms if targets is None else targets
    ratio = [r / ref for r, ref in zip(step_rms, reference[args.state_steps :], strict=True)]
    return {
        "arch": arch,
        "regime": regime,
        "optimizer": opt_name,
        "lr": _mean(opt.lrs[args.state_steps :]),
        "lr_schedule": opt.lrs,
        "reference_rms": reference,
        "rms_ratio": {"mean": _mean(ratio), "min": min(ratio), "max": max(ratio)},
        "state_rms": warm_rms,
        "step_rms": step_rms,
        "losses": losses,
        "formats": formats,
    }


def _dump(root: Path, t: int, model: torch.nn.Module, v: Any) -> None:
    """The versions as files, for checks against `patchswarm diff` / `inspect` (tests)."""
    from patchswarm.protocol.safetensors_io import save_safetensors
    from patchswarm.protocol.served import ServedModel

    fp32 = ServedModel.from_tensors({n: w.contiguous() for n, w in canonical(model).items()})
    for kind, served in (("bf16", v.bf16), ("fp8", v.fp8), ("fp32", fp32)):
        d = root / kind
        d.mkdir(parents=True, exist_ok=True)
        save_safetensors(served, d / f"v{t:04d}.safetensors")


def study(args: argparse.Namespace) -> dict[str, Any]:
    p = PRESETS[args.preset]
    out: dict[str, Any] = {
        "config": {
            "preset": args.preset,
            "model": asdict(p),
            "archs": args.archs,
            "regimes": {r: asdict(REGIMES[r]) for r in args.regimes},
            "optimizers": args.optimizers,
            "steps": args.steps,
            "state_steps": args.state_steps,
            "seed": args.seed,
            "threads": args.threads,
            "payload_format": PAYLOAD_FORMAT,
        },
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "transformers": _tf_version()},
        "models": {},
        "runs": [],
    }
    with deterministic(args.threads):
        for arch in args.archs:
            t0 = time.perf_counter()
            warm, out["models"][arch] = warmed(arch, args)
            m = out["models"][arch]
            log(
                f"{arch}: {m['parameters']:,} parameters ({m['active_parameters']:,} active), warm-up loss "
                f"{m['warmup_loss_first']:.3f} -> {m['warmup_loss_tail']:.3f}, answer-token loss "
                f"{m['answer_loss_init']:.3f} -> {m['answer_loss_warm']:.3f}"
            )
            for regime in args.regimes:
                ref: list[float] | None = None
                for opt_name in ["adamw", *[o for o in args.optimizers if o != "adamw"]]:
                    t1 = time.perf_counter()
                    r = one_run(arch, regime, opt_name, warm, args, ref)
                    ref = r["reference_rms"]
                    if opt_name in args.optimizers:
                        out["runs"].append(r)
                    log(
                        f"{arch} {regime} {opt_name}: lr {r['lr']:.3g}, "
                        + ", ".join(f"{f} {100 * _mean(r['formats'][f]['changed']):.3f}%" for f in FORMATS)
                        + f" ({time.perf_counter() - t1:.0f} s)"
                    )
            log(f"{arch} done in {time.perf_counter() - t0:.0f} s")
    return out


def warmed(arch: str, args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The warm-up weights of ``arch`` and what the warm-up reached; with ``--warm-cache`` read from
    (or written to) a file named for the preset's fields and the seed, so that runs of other regimes
    share one warm-up (deterministic: a cached warm-up equals a recomputed one)."""
    p = PRESETS[args.preset]
    model = build(arch, p, args.seed)
    path = None
    if args.warm_cache is not None:
        key = hashlib.sha256(json.dumps([arch, asdict(p), args.seed, args.threads]).encode()).hexdigest()[:12]
        path = args.warm_cache / f"warm-{args.preset}-{arch}-{key}.pt"
        if path.exists():
            saved = torch.load(path, weights_only=True)
            shapes = {k: v.shape for k, v in model.state_dict().items()}
            if not isinstance(saved, dict) or {k: v.shape for k, v in saved.get("state", {}).items()} != shapes:
                raise SystemExit(f"{path}: not a warm-up of this model; delete it to recompute")
            return saved["state"], saved["info"]
    probe = next(batches(p, args.seed * 1000 + 2))  # held out: the answer-token loss before and after
    answer_init = _answer_loss(model, probe)
    losses = warm_up(model, p, args.seed * 1000 + 1, log if args.verbose else None)
    tail = losses[-max(1, len(losses) // 10) :]
    info = {
        "parameters": param_count(model),
        "active_parameters": active_count(model, p),
        "warmup_loss_first": losses[0],
        "warmup_loss_last": losses[-1],
        "warmup_loss_tail": sum(tail) / len(tail),  # mean over the last tenth: one batch is noisy
        "answer_loss_init": answer_init,
        "answer_loss_warm": _answer_loss(model, probe),
    }
    warm = {k: v.clone() for k, v in model.state_dict().items()}
    if path is not None:
        buf = io.BytesIO()
        torch.save({"state": warm, "info": info}, buf)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, buf.getvalue())
    return warm, info


def _answer_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(answer_loss(model, *batch))


def _tf_version() -> str:
    import transformers

    return str(transformers.__version__)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _rounded(x: Any) -> Any:
    """Floats to 6 significant digits (the JSON stays small; no measure here is finer)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.absorption_study", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    ap.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(REGIMES))
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    ap.add_argument("--steps", type=int, default=50, help="measured steps per run (versions 1..N)")
    ap.add_argument("--state-steps", type=int, default=8, help="optimizer-state warm-up steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (fixed: results depend on it)")
    ap.add_argument("--out", type=Path, required=True, help="directory for absorption.json and absorption.md")
    ap.add_argument("--plots", type=Path, default=None, help="directory for the PNG figures")
    ap.add_argument("--warm-cache", type=Path, default=None, help="directory to keep warm-up weights in, per model")
    ap.add_argument("--dump", type=Path, default=None, help="also write every version's files here (tests)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    for name in ("steps", "state_steps", "threads"):
        if not 1 <= getattr(args, name) <= 100_000:
            ap.error(f"--{name.replace('_', '-')} must be between 1 and 100000")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.absorption_report import markdown, plots

    args = parse_args(argv)
    t0 = time.perf_counter()
    result = study(args)
    result["command"] = "python -m benchmarks.absorption_study " + " ".join(argv if argv is not None else sys.argv[1:])
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_rounded(result), sort_keys=True, separators=(",", ":"))
    write_atomic(args.out / "absorption.json", (text + "\n").encode())
    write_atomic(args.out / "absorption.md", markdown(result).encode())
    if args.plots is not None:
        for path in plots(result, args.plots):
            log(f"wrote {path}")
    log(f"wrote {args.out / 'absorption.json'} and absorption.md in {result['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
