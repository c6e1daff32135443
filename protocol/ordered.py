"""Float bits on their ordered integer line, and the "ulp-delta" code of a change.

For a sign-magnitude float of ``b`` bits viewed as a signed integer ``w``, the map
``key(w) = w ^ ((w >> (b-1)) & (2**(b-1) - 1))`` is a monotone bijection onto the integers
(+0 -> 0, -0 -> -1, larger floats -> larger keys) and is its own inverse.  A weight that
moved by one rounding step moves by one on this line, sign crossings included, so the
delta ``key(new) - key(old)`` is small and nearly always +-1.  Deltas are stored zigzagged
minus one (a change is never zero): -1 -> 0, +1 -> 1, -2 -> 2, +2 -> 3, ...; codes from
``ESCAPE`` up are escaped and their new raw bits stored instead.  All arithmetic wraps
modulo 2**64, so 64-bit floats round-trip as well.  Everything here is torch and runs on the
tensors' own device.
"""

from __future__ import annotations

import torch

ESCAPE = 255


def ordered_key(words: torch.Tensor, width: int) -> torch.Tensor:
    w = words.to(torch.int64)
    bits = 8 * width
    return w ^ ((w >> (bits - 1)) & ((1 << (bits - 1)) - 1))


def from_ordered_key(key: torch.Tensor, width: int, word_dtype: torch.dtype) -> torch.Tensor:
    bits = 8 * width
    return (key ^ ((key >> 63) & ((1 << (bits - 1)) - 1))).to(word_dtype)


def ulp_codes(old: torch.Tensor, new: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8) of changes old -> new, and the mask of those that must be escaped."""
    d = ordered_key(new, width) - ordered_key(old, width)
    zz = (d << 1) ^ (d >> 63)
    code = zz - 1
    escaped = (code < 0) | (code >= ESCAPE)  # code < 0: zigzag value past 2**63 (wrapped)
    return torch.where(escaped, ESCAPE, code).to(torch.uint8), escaped


def apply_ulp_codes(old: torch.Tensor, codes: torch.Tensor, width: int, word_dtype: torch.dtype) -> torch.Tensor:
    """New words from old words and non-escaped codes (escapes are filled in by the caller)."""
    zz = codes.to(torch.int64) + 1
    d = (zz >> 1) ^ -(zz & 1)
    return from_ordered_key(ordered_key(old, width) + d, width, word_dtype)
