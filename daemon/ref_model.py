"""The reference engine's model (daemon/refengine.py): the decoder-only transformer of
``daemon.trajectory`` (``TinyLM``) computed functionally from its state-dict names (``tok``, ``pos``,
``blocks.<i>.{ln1,qkv,proj,ln2,fc1,fc2}``, ``ln_f``, ``head``), from either export: bf16, or fp8
with per-tensor ``<name>.scale``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from patchswarm.daemon.trajectory import PRESETS

__all__ = ["LMShape", "ModelLayoutError", "forward_logits", "greedy_next"]

_BLOCK_RE = re.compile(r"blocks\.(\d+)\.qkv\.weight")


class ModelLayoutError(ValueError):
    """The source's tensors are not a TinyLM state dict this engine can compute with."""


@dataclass(frozen=True, slots=True)
class LMShape:
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int

    @classmethod
    def infer(cls, tensors: Mapping[str, torch.Tensor], n_heads: int | None = None) -> LMShape:
        """Read the dimensions off the tensor shapes; ``n_heads`` (not in a state dict) defaults
        to that of the ``daemon.trajectory`` preset with the same dimensions."""
        for name in ("tok.weight", "pos.weight", "ln_f.weight", "head.weight"):
            if name not in tensors:
                raise ModelLayoutError(f"missing tensor {name!r}")
        vocab, d_model = tensors["tok.weight"].shape
        seq_len = tensors["pos.weight"].shape[0]
        layers = sorted(int(m.group(1)) for name in tensors if (m := _BLOCK_RE.fullmatch(name)))
        if layers != list(range(len(layers))) or not layers:
            raise ModelLayoutError(f"blocks must be numbered 0..n-1, found {layers}")
        d_ff = tensors["blocks.0.fc1.weight"].shape[0] if "blocks.0.fc1.weight" in tensors else 0
        if n_heads is None:
            matches = [
                p.n_heads
                for p in PRESETS.values()
                if (p.vocab, p.d_model, p.n_layers, p.d_ff, p.seq_len) == (vocab, d_model, len(layers), d_ff, seq_len)
            ]
            if not matches:
                raise ModelLayoutError("no trajectory preset has these dimensions: pass n_heads")
            n_heads = matches[0]
        shape = cls(int(vocab), int(d_model), len(layers), n_heads, int(d_ff), int(seq_len))
        shape.check(tensors)
        return shape

    def expected(self) -> dict[str, tuple[int, ...]]:
        d, f = self.d_model, self.d_ff
        out: dict[str, tuple[int, ...]] = {
            "tok.weight": (self.vocab, d),
            "pos.weight": (self.seq_len, d),
            "ln_f.weight": (d,),
            "ln_f.bias": (d,),
            "head.weight": (self.vocab, d),
        }
        for i in range(self.n_layers):
            p = f"blocks.{i}."
            out |= {
                p + "ln1.weight": (d,), p + "ln1.bias": (d,),
                p + "qkv.weight": (3 * d, d), p + "qkv.bias": (3 * d,),
                p + "proj.weight": (d, d), p + "proj.bias": (d,),
                p + "ln2.weight": (d,), p + "ln2.bias": (d,),
                p + "fc1.weight": (f, d), p + "fc1.bias": (f,),
                p + "fc2.weight": (d, f), p + "fc2.bias": (d,),
            }  # fmt: skip
        return out

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self.n_heads <= 0 or self.d_model % self.n_heads:
            raise ModelLayoutError(f"d_model {self.d_model} is not divisible into {self.n_heads} heads")
        for name, shape in self.expected().items():
            t = tensors.get(name)
            if t is None:
                raise ModelLayoutError(f"missing tensor {name!r}")
            if tuple(t.shape) != shape:
                raise ModelLayoutError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            scale = tensors.get(f"{name}.scale")
            if scale is not None and scale.numel() != 1:
                raise ModelLayoutError(f"{name}.scale must hold one value")


def _weight(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """A float32 copy of a tensor, dequantized (``q * scale``) when it has a scale."""
    x = tensors[name].to(torch.float32)
    scale = tensors.get(f"{name}.scale")
    return x * scale.to(torch.float32).reshape(()) if scale is not None else x


def forward_logits(tensors: Mapping[str, torch.Tensor], shape: LMShape, idx: torch.Tensor) -> torch.Tensor:
    """TinyLM's forward pass over one sequence ``idx`` (1-D token ids, at most ``seq_len``) -> logits ``[t, vocab]``."""
    t, d, h = idx.shape[0], shape.d_model, shape.n_heads

    def w(name: str) -> torch.Tensor:
        return _weight(tensors, name)

    def norm(prefix: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (d,), w(prefix + ".weight"), w(prefix + ".bias"))

    def linear(prefix: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w(prefix + ".weight"), w(prefix + ".bias"))

    x = (F.embedding(idx, w("tok.weight")) + w("pos.weight")[:t]).unsqueeze(0)
    for i in range(shape.n_layers):
        p = f"blocks.{i}."
        q, k, v = (z.view(1, t, h, d // h).transpose(1, 2) for z in linear(p + "qkv", norm(p + "ln1", x)).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, t, d)
        x = x + linear(p + "proj", y)
        x = x + linear(p + "fc2", F.gelu(linear(p + "fc1", norm(p + "ln2", x))))
    logits = F.linear(norm("ln_f", x), w("head.weight"))
    return logits[0]


def greedy_next(tensors: Mapping[str, torch.Tensor], shape: LMShape, context: Sequence[int]) -> int:
    with torch.inference_mode():
        idx = torch.tensor(list(context[-shape.seq_len :]), dtype=torch.long, device=tensors["tok.weight"].device)
        return int(forward_logits(tensors, shape, idx)[-1].argmax())
