"""Absorption study (issue 36, part 1): does the sparsity of served updates hold for other
optimizers, served formats and training regimes?

    python -m benchmarks.absorption_study --preset small --steps 50 --out docs/research-data

For each architecture (Llama, Qwen3-MoE; benchmarks/absorption_models.py), regime (RL-like, SFT-like,
pre-training-like) and optimizer (AdamW, Adafactor, SGD+momentum, Muon; absorption_optim.py):

1. Warm-up (once per architecture): AdamW at 1e-3 on next-token cross-entropy of synthetic tasks.
2. Calibration: from the warm-up weights, a fresh optimizer at a provisional lr takes ``--state-steps``
   regime steps; the lr is scaled so that the mean update RMS of the second half of them equals
   AdamW's at the regime's lr (AdamW itself: its lr as is); repeated from the same state (up to 4
   rounds) until within 1%.  The same batches and samples in every round and for every optimizer.
3. Measured run: again from the warm-up weights, a fresh optimizer at the calibrated lr takes the
   ``--state-steps`` steps (its state warms up: moments, momentum, factored second moments), then
   version 0 is exported, then ``--steps`` measured steps, each exported in every format
   (absorption_formats.py) and compared with the previous version (a chain patch) and with version 0
   (a catch-up patch).

Outputs: ``OUT/absorption.json`` (every number, the config, seed, versions, threads),
``OUT/absorption.md`` (tables) and, with ``--plots DIR``, PNG figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.absorption_formats import FORMATS, Exporter, changed_masks, pair_cost
from benchmarks.absorption_models import ARCHS, PRESETS, batches, build, canonical, param_count, warm_up
from benchmarks.absorption_optim import OPTIMIZERS, REGIMES, Optim, calibrated_lr, run
from patchswarm.daemon.trajectory import deterministic

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
    ref_rms: float | None,
) -> dict[str, Any]:
    p = PRESETS[args.preset]
    reg = REGIMES[regime]
    data_seed = args.seed * 1000 + 10 + list(REGIMES).index(regime)

    def fresh(lr: float) -> tuple[torch.nn.Module, Optim, Any, torch.Generator]:
        model = build(arch, p, args.seed)
        model.load_state_dict(warm)
        return model, Optim(opt_name, model, lr), batches(p, data_seed), torch.Generator().manual_seed(data_seed + 7)

    half = max(1, args.state_steps // 2)
    lr = reg.adamw_lr * (SGD_GUESS if opt_name == "sgd" else 1.0)
    rounds: list[dict[str, float]] = []
    for _ in range(4):
        model, opt, data, gs = fresh(lr)
        rms = run(regime, model, opt, data, gs, args.state_steps)
        mean = sum(rms[-half:]) / half
        rounds.append({"lr": lr, "rms": mean})
        if opt_name == "adamw":
            ref_rms = mean
            break
        assert ref_rms is not None
        if abs(mean / ref_rms - 1) < 0.01:
            break
        lr = calibrated_lr(lr, rms[-half:], ref_rms)
    assert ref_rms is not None

    model, opt, data, gs = fresh(lr)
    warm_rms = run(regime, model, opt, data, gs, args.state_steps)
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
        step_rms += run(regime, model, opt, data, gs, 1, losses)
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
    return {
        "arch": arch,
        "regime": regime,
        "optimizer": opt_name,
        "lr": lr,
        "calibration": rounds,
        "reference_rms": ref_rms,
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
        },
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "transformers": _tf_version()},
        "models": {},
        "runs": [],
    }
    with deterministic(args.threads):
        for arch in args.archs:
            t0 = time.perf_counter()
            model = build(arch, p, args.seed)
            losses = warm_up(model, p, args.seed * 1000 + 1, log if args.verbose else None)
            warm = {k: v.clone() for k, v in model.state_dict().items()}
            out["models"][arch] = {
                "parameters": param_count(model),
                "warmup_loss_first": losses[0] if losses else None,
                "warmup_loss_last": losses[-1] if losses else None,
            }
            log(f"{arch}: {param_count(model):,} parameters, warm-up loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            for regime in args.regimes:
                ref: float | None = None
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
    ap.add_argument("--state-steps", type=int, default=8, help="optimizer-state warm-up (and calibration) steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (fixed: results depend on it)")
    ap.add_argument("--out", type=Path, required=True, help="directory for absorption.json and absorption.md")
    ap.add_argument("--plots", type=Path, default=None, help="directory for the PNG figures")
    ap.add_argument("--dump", type=Path, default=None, help="also write every version's files here (tests)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    for name in ("steps", "state_steps", "threads"):
        if not 1 <= getattr(args, name) <= 100_000:
            ap.error(f"--{name.replace('_', '-')} must be between 1 and 100000")
    if args.state_steps < 2:
        ap.error("--state-steps must be at least 2 (calibration uses the second half)")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.absorption_report import markdown, plots
    from patchswarm.protocol.files import write_atomic

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
