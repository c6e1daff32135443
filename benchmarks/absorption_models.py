"""Models and data of the absorption study: Hugging Face causal LMs built from a config (nothing
downloaded), FP32 master weights, trained on daemon/trajectory.py's synthetic token tasks.

Two architectures: ``llama`` (LlamaConfig: dense SwiGLU MLP, GQA, RMSNorm, RoPE) and ``qwen3moe``
(Qwen3MoeConfig: every layer a top-k routed mixture of experts, q/k norms).  Presets: ``tiny`` for
the tests (< 1M parameters, seconds), ``small`` (a few M: the docs run on 2 shared cores) and
``paper`` (tens of millions, as issue 36 asks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from patchswarm.daemon.trajectory import Preset as TaskPreset
from patchswarm.daemon.trajectory import make_batch

ARCHS = ("llama", "qwen3moe")


@dataclass(frozen=True, slots=True)
class ModelPreset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int  # dense MLP (llama)
    experts: int  # qwen3moe
    moe_intermediate: int
    top_k: int
    vocab: int
    seq_len: int
    batch: int
    warmup_steps: int
    warmup_lr: float = 1e-3
    warmup_decay: bool = False  # cosine decay of the warm-up lr to a tenth after its linear ramp


PRESETS: dict[str, ModelPreset] = {
    # < 0.2M parameters: the tests.
    "tiny": ModelPreset(64, 2, 4, 2, 128, 4, 32, 2, vocab=64, seq_len=18, batch=16, warmup_steps=30),
    # ~1-2M parameters: the docs run (24 runs of 50 steps in ~30 min on 2 shared cores).
    "small": ModelPreset(160, 4, 4, 2, 448, 8, 112, 2, vocab=256, seq_len=26, batch=16, warmup_steps=300),
    # >= 10M parameters per model (llama 10.2M; qwen3moe 20.9M total, 6.7M active with top-2 of 8
    # experts): the tens-of-millions run that fits a session on one shared core.
    "mid": ModelPreset(
        384,
        4,
        6,
        2,
        1792,
        8,
        512,
        2,
        vocab=512,
        seq_len=26,
        batch=16,
        warmup_steps=600,
        warmup_lr=3e-4,
        warmup_decay=True,
    ),
    # tens of millions of parameters, as issue 36 asks (hours on a CPU).
    "paper": ModelPreset(512, 8, 8, 4, 1536, 16, 384, 4, vocab=4096, seq_len=66, batch=32, warmup_steps=1000),
}


def task_preset(p: ModelPreset) -> TaskPreset:
    """The synthetic tasks of daemon/trajectory.py (copy, reverse, running sum) at this vocabulary."""
    return TaskPreset(
        vocab=p.vocab, d_model=p.hidden, n_layers=p.layers, n_heads=p.heads, d_ff=p.intermediate,
        seq_len=p.seq_len, batch=p.batch, warmup_steps=p.warmup_steps, warmup_lr=p.warmup_lr,
    )  # fmt: skip


def build(arch: str, p: ModelPreset, seed: int) -> nn.Module:
    """A freshly initialized model; its init draws from torch's global RNG, seeded here and restored after."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = {
        "vocab_size": p.vocab,
        "hidden_size": p.hidden,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "max_position_embeddings": max(64, p.seq_len),
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module
        if arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(intermediate_size=p.intermediate, **common))
        elif arch == "qwen3moe":
            cfg = Qwen3MoeConfig(
                intermediate_size=p.intermediate,
                moe_intermediate_size=p.moe_intermediate,
                num_experts=p.experts,
                num_experts_per_tok=p.top_k,
                head_dim=p.hidden // p.heads,
                **common,
            )
            model = Qwen3MoeForCausalLM(cfg)
        else:
            raise ValueError(f"unknown architecture {arch!r} (one of {', '.join(ARCHS)})")
    return model.float().train()


def param_count(model: nn.Module) -> int:
    return sum(x.numel() for x in model.parameters())


def active_count(model: nn.Module, p: ModelPreset) -> int:
    """Parameters a token passes through: of the routed experts only ``top_k`` of ``experts``."""
    experts = sum(x.numel() for n, x in model.named_parameters() if ".experts." in n)
    return param_count(model) - experts + experts * p.top_k // p.experts


def logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(input_ids=idx).logits
    return out


def canonical(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP32 weights under their Hugging Face checkpoint names: the fused expert tensors of
    transformers 5 (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) split into the
    per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` matrices that checkpoints and engines use
    (gate rows first: Qwen3MoeExperts.forward chunks the fused product in that order)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        w = p.detach()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            half = w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = w[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = w[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(w.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = w[e]
        else:
            out[name] = w
    return out


# ---------------------------------------------------------------- losses


Batch = tuple[torch.Tensor, torch.Tensor]


def next_token_loss(model: nn.Module, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pre-training-like: cross-entropy of every next token of the (unpadded) sequence."""
    lg = logits(model, seq[:, :-1])
    target = seq[:, 1:]
    keep = target != 0  # padding
    return F.cross_entropy(lg[keep], target[keep])


def answer_loss(model: nn.Module, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SFT-like: cross-entropy of the answer tokens only (the prompt is given)."""
    lg = logits(model, seq[:, :-1])
    return F.cross_entropy(lg[mask], seq[:, 1:][mask])


def policy_gradient_loss(model: nn.Module, seq: torch.Tensor, mask: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """RL-like, as daemon/trajectory.py: one sampled token per answer position (teacher forced: one
    forward pass), reward 1 where it is the task's answer, loss ``-advantage * log p(sample)`` with the
    advantage normalized over the batch (GRPO-style)."""
    lg = logits(model, seq[:, :-1])[mask]
    logp = F.log_softmax(lg, dim=-1)
    sample = torch.multinomial(logp.detach().exp(), 1, generator=g).squeeze(1)
    reward = (sample == seq[:, 1:][mask]).float()
    advantage = (reward - reward.mean()) / (reward.std() + 1e-4)
    return -(advantage * logp.gather(1, sample[:, None]).squeeze(1)).mean()


def batches(p: ModelPreset, seed: int) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(seed)
    tp = task_preset(p)
    while True:
        yield make_batch(tp, g)


def warmup_lr(p: ModelPreset, i: int) -> float:
    ramp = max(1, p.warmup_steps // 10)
    if i < ramp or not p.warmup_decay:
        return p.warmup_lr * min(1.0, (i + 1) / ramp)
    done = (i - ramp) / max(1, p.warmup_steps - ramp)
    return p.warmup_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


def warm_up(model: nn.Module, p: ModelPreset, seed: int, log: Callable[[str], None] | None = None) -> list[float]:
    """AdamW at ``p.warmup_lr`` (linear warm-up over the first tenth, then with ``p.warmup_decay`` a
    cosine decay to a tenth) on next-token cross-entropy of fresh task batches, so that the weights
    are those of a model in training; returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=p.warmup_lr, weight_decay=0.01, foreach=False)
    data = batches(p, seed)
    losses: list[float] = []
    for i in range(p.warmup_steps):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(p, i)
        loss = next_token_loss(model, *next(data))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(loss.item())
        if log is not None and (i % 25 == 0 or i == p.warmup_steps - 1):
            log(f"warm-up {i:4d} loss {losses[-1]:.4f}")
    return losses
