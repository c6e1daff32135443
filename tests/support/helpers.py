"""Small served models for tests: realistic Adam-like steps without training anything."""

from __future__ import annotations

import torch

from patchswarm.protocol.served import ServedModel


def adam_like_pair(seed: int = 0, rows: int = 300, lr: float = 1e-6) -> tuple[ServedModel, ServedModel]:
    """Two bf16 versions one small dense FP32 step apart (a fraction of values changes)."""
    g = torch.Generator().manual_seed(seed)
    master = {
        "layers.0.attn.weight": torch.randn(rows, 64, generator=g) * 0.02,
        "layers.0.mlp.weight": torch.randn(rows, 128, generator=g) * 0.02,
        "norm.weight": torch.ones(64) + torch.randn(64, generator=g) * 0.01,
        "embed.weight": torch.randn(500, 64, generator=g) * 0.02,
    }
    step = {k: v - lr * torch.sign(torch.randn(v.shape, generator=g)) * 4 for k, v in master.items()}
    to_served = lambda d: ServedModel.from_tensors({k: v.bfloat16() for k, v in d.items()}, {"format": "pt"})  # noqa: E731
    return to_served(master), to_served(step)
