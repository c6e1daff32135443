"""Casting FP32 master weights to the served format, on whatever device they live.

bf16 and fp16 are plain casts.  fp8 e4m3 keeps its scales FIXED between refreshes: if scales
were recomputed every step, every value under a changed scale would change and the patch would
be dense.  A tensor's scale is refreshed only when its values drift past the threshold (they
would clip, or use too little of the range); that tensor then ships densely once.
Scales are exported as F32 tensors named ``<name>.scale`` (a scalar for per-tensor scaling,
a [rows/B, cols/B] grid for block scaling).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FORMATS = ("bf16", "fp16", "fp8_e4m3", "as_is")  # as_is: tensors already hold served values


@dataclass
class ServedFormat:
    name: str = "bf16"
    block: int | None = None  # fp8 only: None = per-tensor scale, else square block size
    drift: float = 0.25  # fp8 only: refresh a scale when amax leaves [scale*448*(1-drift), scale*448]
    headroom: float = 0.05  # fp8 only: new scales leave this much range above amax, so growth does not clip
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    refreshed: list[str] = field(default_factory=list)  # names whose scale changed in the last convert

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"served format must be one of {', '.join(FORMATS)}, not {self.name!r}")

    def convert(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.refreshed = []
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            t = t.detach()
            if not t.is_floating_point() or self.name == "as_is":
                out[name] = t.clone()
            elif self.name == "fp16":
                out[name] = t.to(torch.float16)
            elif self.name == "fp8_e4m3" and self._quantizable(t):
                q, scale = self._fp8(name, t)
                out[name] = q
                out[f"{name}.scale"] = scale
            else:
                out[name] = t.to(torch.bfloat16)
        return out

    @staticmethod
    def _quantizable(t: torch.Tensor) -> bool:
        return t.dim() == 2 and min(t.shape) >= 16

    def reset(self) -> None:
        """Forget scales (an anchor may refresh them all)."""
        self.scales.clear()

    def _fp8(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = t.float()
        amax = self._amax(x)
        scale = self.scales.get(name)
        if scale is None or scale.shape != amax.shape or scale.device != amax.device or self._drifted(amax, scale):
            scale = torch.where(amax > 0, amax * (1 + self.headroom) / FP8_MAX, torch.ones_like(amax))
            self.scales[name] = scale
            self.refreshed.append(name)
        q = (x / self._expand(scale, x.shape)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, scale.clone()

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is None:
            return x.abs().amax()
        b = self.block
        r, c = x.shape
        pr, pc = math.ceil(r / b) * b, math.ceil(c / b) * b
        padded = torch.nn.functional.pad(x.abs(), (0, pc - c, 0, pr - r))
        return padded.reshape(pr // b, b, pc // b, b).amax(dim=(1, 3))

    def _expand(self, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.block is None:
            return scale
        b = self.block
        return scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[: shape[0], : shape[1]]

    def _drifted(self, amax: torch.Tensor, scale: torch.Tensor) -> bool:
        ratio = amax / (scale * FP8_MAX)
        return bool(((ratio > 1.0) | (ratio < 1.0 - self.drift)).any())
