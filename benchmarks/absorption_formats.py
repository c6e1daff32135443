"""Served formats of the absorption study and what a version pair costs in each.

- ``bf16``: every weight cast to bfloat16.
- ``fp8``: the linear projections engines quantize (daemon/fp8.py's default selection: decoder
  layers' attention and MLP/expert matrices; never embeddings, lm_head, norms or routers) as
  float8_e4m3fn with one F32 scale per tensor, ``amax / 448``, taken at the first measured version
  and kept (as daemon/trajectory.py does), named ``<module>.weight_scale`` as engines load them; the
  rest bfloat16.
- ``int4``: the same matrices as symmetric 4-bit integers (codes -8..7) with one scale per group
  of 128 consecutive values of a row (``absmax / 7``, fixed at the first measured version; the
  last group of a row may be shorter), two codes per byte and a bf16 scale per group, as
  GPTQ/AWQ-style W4 checkpoints store them; the rest bfloat16.  A value changed when its 4-bit
  code changed.  Patch size: the bound only.  The codec diffs whole words of a ServedModel: a
  packed byte holds two codes, so a codec number would be of bytes, not values, and of a format no
  engine this project serves loads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from benchmarks.bound import bound_bytes, counter
from patchswarm.daemon import fp8
from patchswarm.protocol import ordered
from patchswarm.protocol.codec import encode_patch
from patchswarm.protocol.diffscan import scan
from patchswarm.protocol.served import ServedModel, word_view

# Pinned, not the codec's default: every run of the study reports the same payload format's bytes.
PAYLOAD_FORMAT = 2

FORMATS = ("bf16", "fp8", "int4")
FP8_MAX = 448.0
INT4_GROUP = 128


def quantized(name: str, w: torch.Tensor) -> bool:
    return w.dim() == 2 and fp8.matches(name, fp8.DEFAULT_QUANTIZE) and not fp8.matches(name, fp8.DEFAULT_KEEP)


def fp8_scales(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        n: (w.abs().max().clamp_min(1e-12) / FP8_MAX).to(torch.float32).reshape(())
        for n, w in weights.items()
        if quantized(n, w)
    }


def int4_scales(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (groups(w).abs().amax(dim=2) / 7.0).clamp_min(1e-12) for n, w in weights.items() if quantized(n, w)}


def groups(w: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> [rows, ceil(cols/128), 128], zero-padded."""
    rows, cols = w.shape
    ng = -(-cols // INT4_GROUP)
    padded = torch.zeros(rows, ng * INT4_GROUP, dtype=w.dtype)
    padded[:, :cols] = w
    return padded.view(rows, ng, INT4_GROUP)


def int4_codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = torch.round(groups(w) / scale[:, :, None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(w.shape[0], -1)[:, : w.shape[1]].contiguous()


@dataclass(slots=True)
class Version:
    """One version in each format: bf16 and fp8 as ServedModels, int4 as codes plus the bf16 rest."""

    bf16: ServedModel
    fp8: ServedModel
    int4_codes: dict[str, torch.Tensor]
    int4_rest: ServedModel


@dataclass(slots=True)
class Exporter:
    """Exports versions with the scales of the first one (fixed scales, as a served run keeps them)."""

    fp8_scale: dict[str, torch.Tensor] = field(default_factory=dict)
    int4_scale: dict[str, torch.Tensor] = field(default_factory=dict)

    def export(self, weights: dict[str, torch.Tensor]) -> Version:
        if not self.fp8_scale:
            self.fp8_scale = fp8_scales(weights)
            self.int4_scale = int4_scales(weights)
        bf16 = {n: w.to(torch.bfloat16).contiguous() for n, w in weights.items()}
        f8: dict[str, torch.Tensor] = {}
        rest: dict[str, torch.Tensor] = {}
        codes: dict[str, torch.Tensor] = {}
        for n, w in weights.items():
            if n in self.fp8_scale:
                s = self.fp8_scale[n]
                f8[n] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
                f8[fp8.scale_name(n, None)] = s.clone()
                codes[n] = int4_codes(w, self.int4_scale[n])
            else:
                f8[n] = bf16[n]
                rest[n] = bf16[n]
        return Version(
            ServedModel.from_tensors(bf16), ServedModel.from_tensors(f8), codes, ServedModel.from_tensors(rest)
        )

    def int4_full_bytes(self, v: Version) -> int:
        packed = sum((c.numel() + 1) // 2 for c in v.int4_codes.values())
        scales = 2 * sum(s.numel() for s in self.int4_scale.values())
        return packed + scales + v.int4_rest.nbytes

    def anchor_bytes(self, v: Version) -> dict[str, int]:
        """A full version: the codec's anchor for bf16 and fp8, the packed size for int4."""
        return {
            "bf16": len(encode_patch(None, v.bf16, payload_format=PAYLOAD_FORMAT).payload),
            "fp8": len(encode_patch(None, v.fp8, payload_format=PAYLOAD_FORMAT).payload),
            "int4": self.int4_full_bytes(v),
        }


@dataclass(slots=True)
class PairCost:
    changed: int
    numel: int
    bound: float
    codec: int | None  # None: no codec number for this format


def served_changes(a: ServedModel, b: ServedModel) -> tuple[list[tuple[int, int]], dict[str, Counter[int]]]:
    """Per tensor (n, k), and the ordered-line value deltas pooled per dtype (codec_bench's measure)."""
    sizes: list[tuple[int, int]] = []
    deltas: dict[str, Counter[int]] = {}
    for i, (spec, tdata) in enumerate(b):
        ch = scan(word_view(a.data[i], spec), word_view(tdata, spec))
        sizes.append((spec.numel, len(ch)))
        if len(ch) and spec.dt.is_float:
            d = (ordered.ordered_key(ch.new, spec.dt.width) - ordered.ordered_key(ch.old, spec.dt.width)).numpy()
            deltas.setdefault(spec.dtype, Counter()).update(counter(d))
    return sizes, deltas


def served_cost(a: ServedModel, b: ServedModel, *, codec: bool = True) -> PairCost:
    sizes, deltas = served_changes(a, b)
    _, total = bound_bytes(sizes, deltas.values())
    return PairCost(
        changed=sum(k for _, k in sizes),
        numel=sum(n for n, _ in sizes),
        bound=total,
        codec=len(encode_patch(a, b, payload_format=PAYLOAD_FORMAT).payload) if codec else None,
    )


def int4_changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Boolean masks of the codes that differ, per tensor."""
    return {n: a[n] != b[n] for n in a}


def int4_cost(a: Version, b: Version) -> PairCost:
    sizes, deltas = served_changes(a.int4_rest, b.int4_rest)
    code_deltas: Counter[int] = Counter()
    for n, ca in a.int4_codes.items():
        cb = b.int4_codes[n]
        diff = ca != cb
        k = int(diff.sum())
        sizes.append((ca.numel(), k))
        if k:
            code_deltas.update(counter((cb[diff].to(torch.int16) - ca[diff].to(torch.int16)).numpy().astype(np.int64)))
    _, total = bound_bytes(sizes, [*deltas.values(), code_deltas])
    return PairCost(sum(k for _, k in sizes), sum(n for n, _ in sizes), total, None)


def pair_cost(fmt: str, a: Version, b: Version) -> PairCost:
    if fmt == "bf16":
        return served_cost(a.bf16, b.bf16)
    if fmt == "fp8":
        return served_cost(a.fp8, b.fp8)
    if fmt == "int4":
        return int4_cost(a, b)
    raise ValueError(f"unknown format {fmt!r}")


def changed_masks(fmt: str, a: Version, b: Version) -> list[torch.Tensor]:
    """Which served values differ, per tensor, for the union of a chain's positions."""
    if fmt == "int4":
        pairs = [(a.int4_codes[n], b.int4_codes[n]) for n in sorted(a.int4_codes)]
        models = (a.int4_rest, b.int4_rest)
    else:
        pairs = []
        models = (a.bf16, b.bf16) if fmt == "bf16" else (a.fp8, b.fp8)
    out = [x != y for x, y in pairs]
    for i, spec in enumerate(models[1].specs):
        out.append(word_view(models[0].data[i], spec) != word_view(models[1].data[i], spec))
    return out
