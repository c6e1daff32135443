"""Optimizers and training regimes of the absorption study, and learning rates matched by update RMS.

Optimizers (weight decay 0.01 wherever it applies):

- ``adamw``: torch.optim.AdamW, betas (0.9, 0.999).
- ``adafactor``: transformers.optimization.Adafactor with a fixed learning rate
  (``scale_parameter=False, relative_step=False``), no first moment (its default).
- ``sgd``: torch.optim.SGD, momentum 0.9.
- ``muon``: torch.optim.Muon (momentum 0.95, Nesterov, 5 Newton-Schulz steps) for the 2-D hidden
  matrices of the decoder layers, AdamW for embeddings, lm_head, norms and MoE routers, as Muon is
  used in practice (https://kellerjordan.github.io/posts/muon/; Moonlight, https://arxiv.org/abs/2502.16982).
  ``adjust_lr_fn="match_rms_adamw"`` (Moonlight's 0.2 * sqrt(max(A, B)) scaling) lets the two
  groups share one learning rate.  torch's Muon takes 2-D parameters only, so transformers 5's
  fused 3-D expert tensors get the same update per expert matrix (``ExpertMuon``).

Regimes and the AdamW learning rate each is compared at: ``rl`` (policy gradient, 1e-6), ``sft``
(answer cross-entropy, 1e-5), ``pretrain`` (next-token cross-entropy on fresh data, 3e-4).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz  # torch's own Newton-Schulz iteration

from benchmarks.absorption_models import Batch, answer_loss, next_token_loss, policy_gradient_loss

OPTIMIZERS = ("adamw", "adafactor", "sgd", "muon")
WEIGHT_DECAY = 0.01


@dataclass(frozen=True, slots=True)
class Regime:
    name: str
    adamw_lr: float
    what: str


REGIMES: dict[str, Regime] = {
    "rl": Regime("rl", 1e-6, "policy gradient on sampled answers, GRPO-style advantage"),
    "sft": Regime("sft", 1e-5, "cross-entropy on the answer tokens"),
    "pretrain": Regime("pretrain", 3e-4, "next-token cross-entropy on fresh data"),
}


def regime_loss(regime: str, model: nn.Module, batch: Batch, g_sample: torch.Generator) -> torch.Tensor:
    if regime == "rl":
        return policy_gradient_loss(model, *batch, g_sample)
    if regime == "sft":
        return answer_loss(model, *batch)
    if regime == "pretrain":
        return next_token_loss(model, *batch)
    raise ValueError(f"unknown regime {regime!r} (one of {', '.join(REGIMES)})")


class ExpertMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update (same momentum, Nesterov, Newton-Schulz, lr adjustment and decoupled
    weight decay) applied to each expert matrix ``p[e]`` of 3-D fused expert tensors."""

    def __init__(self, params: list[nn.Parameter], lr: float, weight_decay: float, momentum: float = 0.95) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom)
                rows, cols = p.shape[1], p.shape[2]
                adjusted = lr * 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw"
                p.mul_(1 - lr * wd)
                for e in range(p.shape[0]):
                    p[e].add_(
                        _zeropower_via_newtonschulz(update[e], (3.4445, -4.775, 2.0315), 5, 1e-7), alpha=-adjusted
                    )


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """Muon's share: matrices inside the decoder layers, MoE routers (``mlp.gate``) excepted."""
    return ".layers." in name and p.dim() >= 2 and not name.endswith("mlp.gate.weight")


class Optim:
    """One or more torch optimizers stepped together, sharing one learning rate."""

    def __init__(self, name: str, model: nn.Module, lr: float) -> None:
        self.name = name
        params = list(model.named_parameters())
        self.parts: list[torch.optim.Optimizer]
        if name == "adamw":
            self.parts = [torch.optim.AdamW([p for _, p in params], lr=lr, weight_decay=WEIGHT_DECAY, foreach=False)]
        elif name == "adafactor":
            from transformers.optimization import Adafactor

            self.parts = [
                Adafactor(
                    [p for _, p in params],
                    lr=lr,
                    scale_parameter=False,
                    relative_step=False,
                    warmup_init=False,
                    weight_decay=WEIGHT_DECAY,
                )
            ]
        elif name == "sgd":
            self.parts = [
                torch.optim.SGD([p for _, p in params], lr=lr, momentum=0.9, weight_decay=WEIGHT_DECAY, foreach=False)
            ]
        elif name == "muon":
            hidden = [p for n, p in params if is_hidden_matrix(n, p) and p.dim() == 2]
            experts = [p for n, p in params if is_hidden_matrix(n, p) and p.dim() == 3]
            rest = [p for n, p in params if not is_hidden_matrix(n, p)]
            self.parts = [
                torch.optim.Muon(hidden, lr=lr, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=lr, weight_decay=WEIGHT_DECAY, foreach=False),
            ]
            if experts:
                self.parts.append(ExpertMuon(experts, lr=lr, weight_decay=WEIGHT_DECAY))
        else:
            raise ValueError(f"unknown optimizer {name!r} (one of {', '.join(OPTIMIZERS)})")
        self.params = [p for _, p in params]
        self.lr = lr
        self.lrs: list[float] = []  # the lr of every step taken

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for part in self.parts:
            for group in part.param_groups:
                group["lr"] = lr

    def step(self, loss: torch.Tensor, target_rms: float | None = None) -> float:
        """One step; returns its update RMS over all parameters, sqrt(sum dw^2 / n), and appends the
        learning rate the step was taken at to ``self.lrs``.

        With ``target_rms`` the step's learning rate is chosen so that its update RMS is
        ``target_rms``: every optimizer here moves the weights linearly in the lr from a given state
        (weight decay included; test_an_update_scales_linearly_with_the_learning_rate) and none keeps
        lr-dependent state, so the update taken at ``lr`` and scaled by ``k`` is the step at ``lr * k``
        (to within one FP32 rounding of each weight: far below the bf16/fp8/int4 grids measured).
        The next step starts from the lr found, so ``k`` stays near 1 and the rounding small.  The
        lr used is thus known only after the step (an oracle schedule); it costs no extra pass."""
        before = [p.detach().clone() for p in self.params]
        for part in self.parts:
            part.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        for part in self.parts:
            part.step()
        rms = self._rms(before)
        # A step that moved nothing (a zero gradient, e.g. an RL batch of equal rewards, and no
        # momentum) has no lr that matches: it keeps its lr, and the reported ratio shows it.
        if target_rms is not None and rms > 0:
            k = target_rms / rms
            with torch.no_grad():
                for p, b in zip(self.params, before, strict=True):
                    p.copy_(b.add(p - b, alpha=k))
            self.lrs.append(self.lr * k)
            self.set_lr(self.lr * k)
            return self._rms(before)
        self.lrs.append(self.lr)
        return rms

    def _rms(self, before: list[torch.Tensor]) -> float:
        sq = sum(float((p.detach() - b).double().pow(2).sum()) for p, b in zip(self.params, before, strict=True))
        n = sum(p.numel() for p in self.params)
        return math.sqrt(sq / n)


def run(
    regime: str,
    model: nn.Module,
    opt: Optim,
    data: Iterator[Batch],
    g_sample: torch.Generator,
    steps: int,
    losses: list[float] | None = None,
    targets: list[float] | None = None,
) -> list[float]:
    """``steps`` regime steps; the update RMS of each (and their losses appended to ``losses``).
    With ``targets``: step i's lr is matched to update RMS ``targets[i]`` (Optim.step)."""
    if targets is not None and len(targets) < steps:
        raise ValueError(f"{len(targets)} target update RMS for {steps} steps")
    out: list[float] = []
    for i in range(steps):
        loss = regime_loss(regime, model, next(data), g_sample)
        if losses is not None:
            losses.append(loss.item())
        out.append(opt.step(loss, None if targets is None else targets[i]))
    return out
