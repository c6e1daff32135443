"""The element types a served tensor may have, described by their raw bits.

patchswarm never does arithmetic on weights: it moves bit patterns.  What it needs per dtype
is the element width and whether the bits are a sign-magnitude float (so that a change can
be coded as a step count along the float's ordered integer line) or anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from patchswarm.protocol.errors import UnsupportedDtypeError


@dataclass(frozen=True, slots=True)
class DType:
    name: str  # safetensors spelling
    width: int  # bytes per element
    is_float: bool  # sign-magnitude float: the ordered-line ("ulp") delta applies
    torch_dtype: torch.dtype

    @property
    def word_dtype(self) -> torch.dtype:
        """Signed integer dtype of the same width: the view all bit operations use."""
        return WORD_DTYPES[self.width]


WORD_DTYPES: dict[int, torch.dtype] = {
    1: torch.int8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}

_ALL = [
    DType("BOOL", 1, False, torch.bool),
    DType("U8", 1, False, torch.uint8),
    DType("I8", 1, False, torch.int8),
    DType("F8_E4M3", 1, True, torch.float8_e4m3fn),
    DType("F8_E5M2", 1, True, torch.float8_e5m2),
    DType("I16", 2, False, torch.int16),
    DType("U16", 2, False, torch.uint16),
    DType("F16", 2, True, torch.float16),
    DType("BF16", 2, True, torch.bfloat16),
    DType("I32", 4, False, torch.int32),
    DType("U32", 4, False, torch.uint32),
    DType("F32", 4, True, torch.float32),
    DType("I64", 8, False, torch.int64),
    DType("U64", 8, False, torch.uint64),
    DType("F64", 8, True, torch.float64),
]
# E8M0 (MX block scales) is an unsigned exponent: its raw bits are already ordered, so plain
# integer replacement is exact and about as small.
if hasattr(torch, "float8_e8m0fnu"):
    _ALL.append(DType("F8_E8M0", 1, False, torch.float8_e8m0fnu))

BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in _ALL}


def dtype(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise UnsupportedDtypeError(f"unsupported dtype {name!r}") from None


def from_torch(t: torch.dtype) -> DType:
    try:
        return BY_TORCH[t]
    except KeyError:
        raise UnsupportedDtypeError(f"unsupported torch dtype {t}") from None
