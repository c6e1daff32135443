"""A real (small) training trajectory, for tests and benchmarks of the patch codec.

A decoder-only transformer, built here in plain ``torch.nn`` (nothing is downloaded), is
trained in FP32 with AdamW on synthetic token tasks (copy, reverse, running sum modulo a small
number) drawn from a seeded ``torch.Generator``: first ``warmup_steps`` at a normal learning
rate (so that the Adam moments are those of a model in training, not of a fresh optimizer),
then ``steps`` RL-like steps at a small learning rate (1e-6 by default).  An RL-like step is a
policy-gradient step: the model samples an answer token at every answer position (teacher
forced, so one forward pass), earns reward 1 where it matches the task's answer, and the loss
is ``-advantage * log p(sample)`` with the advantage ``(reward - mean) / std`` over the batch
(GRPO-style).

Version 0 is the model after warm-up; version ``i`` the model after RL step ``i``.  Each
version is exported the way an inference engine would be served:

- ``bf16``: every parameter cast to bfloat16;
- ``fp8``: every matrix (2-D parameter, embeddings included) as ``float8_e4m3fn`` with a
  per-tensor scale ``amax / 448`` computed once, at version 0, and kept for every later
  version (stored as a 1-element F32 tensor ``<name>.scale``; dequantize as ``q * scale``);
  vectors (norms, biases) stay bfloat16.

Everything is deterministic for a given preset, seed and thread count.

CLI: ``python -m daemon.trajectory --preset tiny --steps 5 --out DIR`` writes
``DIR/bf16/v0000.safetensors ...`` and ``DIR/fp8/v0000.safetensors ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from patchswarm.protocol.safetensors_io import save_safetensors
from patchswarm.protocol.served import ServedModel

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Token ids: 0 padding (unused), 1 separator, 2.. task markers, then the data symbols.
_SEP = 1
_TASKS = ("copy", "reverse", "cumsum")
_FIRST_SYMBOL = 2 + len(_TASKS)


@dataclass(frozen=True, slots=True)
class Preset:
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int  # 1 task marker + n inputs + 1 separator + n answers
    batch: int
    warmup_steps: int
    warmup_lr: float = 1e-3
    modulus: int = 7  # of the running-sum task


PRESETS: dict[str, Preset] = {
    # ~0.15M parameters: a few seconds on a laptop core.
    "tiny": Preset(vocab=32, d_model=64, n_layers=3, n_heads=4, d_ff=256, seq_len=26, batch=32, warmup_steps=120),
    # ~3.3M parameters.
    "small": Preset(vocab=128, d_model=256, n_layers=4, n_heads=4, d_ff=1024, seq_len=34, batch=32, warmup_steps=60),
    # ~25.7M parameters (51 MB served in bf16).
    "bench": Preset(vocab=512, d_model=512, n_layers=8, n_heads=8, d_ff=2048, seq_len=42, batch=16, warmup_steps=40),
}


# ---------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.n_heads = p.n_heads
        self.ln1 = nn.LayerNorm(p.d_model)
        self.qkv = nn.Linear(p.d_model, 3 * p.d_model)
        self.proj = nn.Linear(p.d_model, p.d_model)
        self.ln2 = nn.LayerNorm(p.d_model)
        self.fc1 = nn.Linear(p.d_model, p.d_ff)
        self.fc2 = nn.Linear(p.d_ff, p.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class TinyLM(nn.Module):
    """GPT-style decoder: token + learned position embeddings, pre-norm blocks, untied head."""

    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.tok = nn.Embedding(p.vocab, p.d_model)
        self.pos = nn.Embedding(p.seq_len, p.d_model)
        self.blocks = nn.ModuleList(Block(p) for _ in range(p.n_layers))
        self.ln_f = nn.LayerNorm(p.d_model)
        self.head = nn.Linear(p.d_model, p.vocab, bias=False)

    def init_weights(self, g: torch.Generator) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.dim() >= 2:
                    std = 0.02
                    if name.endswith(("proj.weight", "fc2.weight")):  # GPT-2 residual scaling
                        std /= math.sqrt(2 * len(self.blocks))
                    param.normal_(0.0, std, generator=g)
                elif name.endswith("weight"):
                    param.fill_(1.0)
                else:
                    param.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def param_count(preset: str | Preset) -> int:
    p = PRESETS[preset] if isinstance(preset, str) else preset
    return sum(x.numel() for x in TinyLM(p).parameters())


# ---------------------------------------------------------------- data


def make_batch(p: Preset, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of task sequences and the mask of answer positions (whose next token is scored)."""
    n = (p.seq_len - 2) // 2
    nsym = p.vocab - _FIRST_SYMBOL
    task = torch.randint(0, len(_TASKS), (p.batch,), generator=g)
    x = torch.randint(0, nsym, (p.batch, n), generator=g)
    copy = x
    rev = x.flip(1)
    csum = (x % p.modulus).cumsum(1) % p.modulus
    y = torch.where((task == 0)[:, None], copy, torch.where((task == 1)[:, None], rev, csum))
    seq = torch.cat(
        [
            (2 + task)[:, None],
            x + _FIRST_SYMBOL,
            torch.full((p.batch, 1), _SEP),
            y + _FIRST_SYMBOL,
        ],
        dim=1,
    )
    seq = torch.cat([seq, torch.zeros(p.batch, p.seq_len - seq.shape[1], dtype=seq.dtype)], dim=1)
    mask = torch.zeros(p.batch, p.seq_len - 1, dtype=torch.bool)
    mask[:, n + 1 : 2 * n + 1] = True  # predicting token i+1 from prefix [..i]: the answers
    return seq, mask


def supervised_loss(model: TinyLM, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits[mask], seq[:, 1:][mask])


def policy_gradient_loss(
    model: TinyLM, seq: torch.Tensor, mask: torch.Tensor, g: torch.Generator
) -> tuple[torch.Tensor, float]:
    """REINFORCE over teacher-forced per-position samples, advantages normalized over the batch
    (mean baseline, divided by the standard deviation, as GRPO does); returns (loss, mean reward)."""
    logits = model(seq[:, :-1])[mask]
    logp = F.log_softmax(logits, dim=-1)
    sample = torch.multinomial(logp.detach().exp(), 1, generator=g).squeeze(1)
    reward = (sample == seq[:, 1:][mask]).float()
    advantage = (reward - reward.mean()) / (reward.std() + 1e-4)  # GRPO-style normalized advantage
    loss = -(advantage * logp.gather(1, sample[:, None]).squeeze(1)).mean()
    return loss, float(reward.mean())


# ---------------------------------------------------------------- export


def export_bf16(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


def fp8_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per-tensor scales ``amax / 448`` of every matrix (fixed once, then reused)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            amax = p.detach().abs().max().clamp_min(1e-12)
            out[name] = (amax / FP8_MAX).reshape(1).to(torch.float32)
    return out


def export_fp8(model: nn.Module, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        w = p.detach()
        if name in scales:
            s = scales[name]
            out[name] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[f"{name}.scale"] = s.clone()
        else:
            out[name] = w.to(torch.bfloat16).clone()
    return out


# ---------------------------------------------------------------- trajectory


@dataclass(slots=True)
class Trajectory:
    """Served versions 0..steps (version 0: after warm-up), as typed tensors by name."""

    preset: str
    seed: int
    lr: float
    bf16: list[dict[str, torch.Tensor]] = field(default_factory=list)
    fp8: list[dict[str, torch.Tensor]] = field(default_factory=list)
    warmup_losses: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # mean reward of each RL step

    @property
    def steps(self) -> int:
        return len(self.bf16) - 1

    def versions(self, kind: str) -> list[dict[str, torch.Tensor]]:
        if kind not in ("bf16", "fp8"):
            raise ValueError(f"unknown export kind {kind!r} (bf16 or fp8)")
        out: list[dict[str, torch.Tensor]] = self.bf16 if kind == "bf16" else self.fp8
        return out

    def served(self, kind: str) -> list[ServedModel]:
        """The versions of one export as ServedModels (sharing the tensors' memory)."""
        return [ServedModel.from_tensors(v, _metadata(self, kind, i)) for i, v in enumerate(self.versions(kind))]


def _metadata(traj: Trajectory, kind: str, version: int) -> dict[str, str]:
    return {
        "trajectory.preset": traj.preset,
        "trajectory.seed": str(traj.seed),
        "trajectory.lr": repr(traj.lr),
        "trajectory.export": kind,
        "trajectory.version": str(version),
    }


@contextlib.contextmanager
def deterministic(threads: int | None) -> Iterator[None]:
    """Deterministic kernels and thread count; the caller's RNG state and settings left as they were."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(prev)
        torch.set_num_threads(prev_threads)


def generate(
    preset: str = "tiny",
    steps: int = 5,
    lr: float = 1e-6,
    seed: int = 0,
    *,
    warmup_steps: int | None = None,
    warmup_lr: float | None = None,
    rl: str = "pg",
    threads: int | None = 1,
    log: bool = False,
    on_version: Callable[[int, dict[str, torch.Tensor], dict[str, torch.Tensor]], None] | None = None,
) -> Trajectory:
    """Warm up, then take ``steps`` RL-like steps at ``lr``; export versions 0..steps.

    ``rl="pg"`` takes policy-gradient steps, ``rl="sft"`` plain supervised steps on fresh batches.
    ``on_version(i, bf16, fp8)`` is called as each version is exported, so a trainer can publish it
    while training goes on.
    ``threads``: torch intra-op threads while training.  The default, one, makes the result the
    same on every machine (reductions split over threads round differently) and keeps a busy
    machine from slowing to a crawl; ``None`` keeps torch's setting (faster for "bench").
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    if rl not in ("pg", "sft"):
        raise ValueError("rl must be 'pg' or 'sft'")
    p = PRESETS[preset]
    if warmup_steps is not None:
        p = replace(p, warmup_steps=warmup_steps)
    if warmup_lr is not None:
        p = replace(p, warmup_lr=warmup_lr)
    traj = Trajectory(preset, seed, lr)
    with deterministic(threads):
        g_init = torch.Generator().manual_seed(seed)
        g_data = torch.Generator().manual_seed(seed + 1)
        g_sample = torch.Generator().manual_seed(seed + 2)
        model = TinyLM(p)
        model.init_weights(g_init)
        opt = torch.optim.AdamW(model.parameters(), lr=p.warmup_lr, weight_decay=0.01, foreach=False)
        t0 = time.perf_counter()
        for i in range(p.warmup_steps):
            # Linear warm-up of the learning rate over the first tenth, as usual.
            for group in opt.param_groups:
                group["lr"] = p.warmup_lr * min(1.0, (i + 1) / max(1, p.warmup_steps // 10))
            loss = supervised_loss(model, *make_batch(p, g_data))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            traj.warmup_losses.append(loss.item())
            if log and (i % 10 == 0 or i == p.warmup_steps - 1):
                print(f"warm-up {i:4d}  loss {traj.warmup_losses[-1]:.4f}  {time.perf_counter() - t0:.1f}s", flush=True)
        for group in opt.param_groups:
            group["lr"] = lr
        scales = fp8_scales(model)
        traj.bf16.append(export_bf16(model))
        traj.fp8.append(export_fp8(model, scales))
        if on_version is not None:
            on_version(0, traj.bf16[-1], traj.fp8[-1])
        for i in range(steps):
            seq, mask = make_batch(p, g_data)
            if rl == "pg":
                loss, reward = policy_gradient_loss(model, seq, mask, g_sample)
            else:
                loss = supervised_loss(model, seq, mask)
                with torch.no_grad():
                    reward = math.exp(-loss.item())
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            traj.rewards.append(reward)
            traj.bf16.append(export_bf16(model))
            traj.fp8.append(export_fp8(model, scales))
            if on_version is not None:
                on_version(i + 1, traj.bf16[-1], traj.fp8[-1])
            if log:
                print(f"rl step {i + 1:4d}  reward {reward:.4f}", flush=True)
    return traj


def changed_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, fp8_only: bool = False) -> float:
    """Fraction of elements whose bits differ between two exports (optionally fp8 tensors only)."""
    changed = total = 0
    for name, x in a.items():
        if fp8_only and x.dtype != torch.float8_e4m3fn:
            continue
        y = b[name]
        xv = x.reshape(-1).view(
            torch.uint8 if x.element_size() == 1 else torch.int16 if x.element_size() == 2 else torch.int32
        )
        yv = y.reshape(-1).view(xv.dtype)
        changed += int((xv != yv).sum())
        total += x.numel()
    return changed / total if total else 0.0


def write_versions(traj: Trajectory, out_dir: str | Path, kinds: tuple[str, ...] = ("bf16", "fp8")) -> list[Path]:
    """Write every version as ``out_dir/<kind>/v<NNNN>.safetensors``; returns the paths written."""
    paths: list[Path] = []
    for kind in kinds:
        d = Path(out_dir) / kind
        d.mkdir(parents=True, exist_ok=True)
        for i, model in enumerate(traj.served(kind)):
            path = d / f"v{i:04d}.safetensors"
            save_safetensors(model, path)
            paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m daemon.trajectory", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-steps", type=int, default=None)
    ap.add_argument("--rl", choices=("pg", "sft"), default="pg")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    print(f"preset {args.preset}: {param_count(args.preset):,} parameters")
    traj = generate(
        args.preset,
        args.steps,
        args.lr,
        args.seed,
        warmup_steps=args.warmup_steps,
        rl=args.rl,
        threads=args.threads or None,
        log=True,
    )
    for i in range(1, len(traj.bf16)):
        print(
            f"v{i - 1} -> v{i}: bf16 {100 * changed_fraction(traj.bf16[i - 1], traj.bf16[i]):.3f}% changed, "
            f"fp8 {100 * changed_fraction(traj.fp8[i - 1], traj.fp8[i], fp8_only=True):.4f}% of fp8 values"
        )
    paths = write_versions(traj, args.out)
    print(f"wrote {len(paths)} files under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
