"""The absorption study's markdown tables and PNG figures, from its JSON result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FORMATS = ("bf16", "fp8", "int4")
LABEL = {"rl": "RL-like", "sft": "SFT-like", "pretrain": "pre-training-like"}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _t(x: int | None, steps: int) -> str:
    return str(x) if x is not None else f">{steps}"


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    steps = cfg["steps"]
    lines = [
        f"Command: `{result.get('command', '')}`; preset {cfg['preset']}, {steps} measured steps after "
        f"{cfg['state_steps']} optimizer-state steps, seed {cfg['seed']}, {cfg['threads']} torch thread(s), "
        f"torch {result['versions']['torch']}, transformers {result['versions']['transformers']}.",
        "",
    ]
    for arch, m in result["models"].items():
        line = f"- {arch}: {m['parameters']:,} parameters"
        if "active_parameters" in m:
            line += f" ({m['active_parameters']:,} active per token)"
        last = m.get("warmup_loss_tail", m["warmup_loss_last"])
        line += f", warm-up loss {m['warmup_loss_first']:.3f} -> {last:.3f}"
        if "answer_loss_init" in m:
            line += f", held-out answer-token loss {m['answer_loss_init']:.3f} -> {m['answer_loss_warm']:.3f}"
        lines.append(line)
    lines += [
        "",
        "lr: the mean over the measured steps of the lr schedule that matches each step's update RMS to "
        "AdamW's at that step; RMS / AdamW's: the achieved ratio over the measured steps. "
        "Changed: mean fraction of served values changed per step. Patch: mean chain patch per step as a "
        "fraction of the full served model (codec bytes for bf16/fp8, the bound for int4). "
        "Codec/bound: codec bytes over the memoryless bound. Union@N: positions changed at least once "
        f"in v0..v{steps}. Anchor@t: first step whose summed chain patches exceed one full anchor "
        f"(>{steps}: not within the run).",
        "",
        "| arch | regime | optimizer | lr | update RMS | RMS / AdamW's (mean, range) "
        "| bf16 changed | fp8 changed | int4 changed "
        "| bf16 patch | fp8 patch | int4 patch (bound) | bf16 codec/bound | fp8 codec/bound "
        f"| bf16 union@{steps} | fp8 union@{steps} | int4 union@{steps} "
        "| bf16 anchor@t | fp8 anchor@t | int4 anchor@t |",
        "|---" * 20 + "|",
    ]
    for r in result["runs"]:
        f = r["formats"]
        q = r["rms_ratio"]
        cells = [r["arch"], LABEL[r["regime"]], r["optimizer"], f"{r['lr']:.3g}", f"{_mean(r['step_rms']):.3g}"]
        cells.append(f"{q['mean']:.4f} ({q['min']:.4f}-{q['max']:.4f})")
        cells += [_pct(_mean(f[k]["changed"])) for k in FORMATS]
        for k in FORMATS:
            sizes = f[k]["patch"] or f[k]["bound"]
            cells.append(_pct(_mean(sizes) / f[k]["full_bytes"]))
        for k in ("bf16", "fp8"):
            b = sum(f[k]["bound"])
            cells.append(f"{sum(f[k]['patch']) / b:.2f}" if b else "-")
        cells += [_pct(f[k]["union"][-1]) for k in FORMATS]
        cells += [_t(f[k]["crossover"]["anchor_beats_chain"], steps) for k in FORMATS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Catch-up patch v0->v{steps} against the {steps} chain patches summed and against an anchor "
        "(bytes as a fraction of the full served model; codec for bf16/fp8, bound for int4):",
        "",
        "| arch | regime | optimizer | format | chain sum | catch-up | anchor | catch-up < chain from t | "
        "catch-up > anchor from t |",
        "|---" * 9 + "|",
    ]
    for r in result["runs"]:
        for k in FORMATS:
            f = r["formats"][k]
            chain = f["patch"] or f["bound"]
            catch = f["catchup_patch"] or f["catchup_bound"]
            full = f["full_bytes"]
            lines.append(
                f"| {r['arch']} | {LABEL[r['regime']]} | {r['optimizer']} | {k} | {_pct(sum(chain) / full)} "
                f"| {_pct(catch[-1] / full)} | {_pct(f['anchor_bytes'] / full)} "
                f"| {_t(f['crossover']['catchup_beats_chain'], steps)} "
                f"| {_t(f['crossover']['anchor_beats_catchup'], steps)} |"
            )
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    """Per architecture: changed fraction per step, and union growth along the chain (regimes x formats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    regimes = list(result["config"]["regimes"])
    preset = result["config"]["preset"]
    tag = "" if preset == "small" else f"{preset}-"  # the docs' small-preset figures keep their names
    written: list[Path] = []
    for arch in result["models"]:
        runs = [r for r in result["runs"] if r["arch"] == arch]
        for key, title, fname in (
            ("changed", "fraction of served values changed per step", "changed"),
            ("union", "union of changed positions v0..vt", "union"),
            ("catchup_changed", "catch-up v0->vt: fraction of values that differ", "catchup"),
        ):
            fig, axes = plt.subplots(
                len(regimes), len(FORMATS), figsize=(4 * len(FORMATS), 3 * len(regimes)), squeeze=False
            )
            for i, reg in enumerate(regimes):
                for j, fmt in enumerate(FORMATS):
                    ax = axes[i][j]
                    for r in runs:
                        if r["regime"] == reg:
                            ys = r["formats"][fmt][key]
                            ax.plot(range(1, len(ys) + 1), [100 * y for y in ys], label=r["optimizer"])
                    ax.set_yscale("log")
                    ax.set_title(f"{LABEL[reg]}, {fmt}", fontsize=9)
                    ax.set_xlabel("step t", fontsize=8)
                    ax.set_ylabel("% of values", fontsize=8)
                    ax.grid(True, alpha=0.3)
            axes[0][0].legend(fontsize=8)
            fig.suptitle(f"{arch}: {title}")
            fig.tight_layout()
            path = out / f"absorption-{tag}{arch}-{fname}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written
