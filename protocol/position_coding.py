"""Where a sparse record's changes are (protocol/codec.py, docs/format.md): the gaps between changed
positions as Rice codes, with a parameter both sides derive from the tensor's size and the number
of changes."""

from __future__ import annotations

import numpy as np

from patchswarm.protocol.errors import FormatError, LimitExceededError
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.streams import Fields, Piece, StreamReader, unary_bits


def rice_bits(n: int, k: int) -> int:
    """Rice parameter of the position gaps of ``k`` changes among ``n`` elements (``1 <= k <= n``).

    The smallest ``r`` with ``2**r >= 0.4812 * (2n - k) / (2k)``: for geometric gaps of success
    rate ``p = k/n``, ``r`` beats ``r + 1`` once ``(1-p)**(2**r) <= (sqrt(5)-1)/2``, i.e.
    ``2**r >= ln(golden ratio) / -ln(1-p)``, with ``-ln(1-p) ~ 2p/(2-p)``.  Integers only, so
    encoder and decoder always agree.
    """
    t = -(-4812 * (2 * n - k) // (20000 * k))
    return (t - 1).bit_length() if t > 1 else 0


def gap_fields(n: int, pos: np.ndarray) -> list[Piece]:
    """The Rice codes of the gaps between the ``k`` ascending positions ``pos`` among ``n`` elements
    (``1 <= k <= n``): the unary quotients, then the remainders (the start of the record's bit
    stream; a float record appends its sign bits)."""
    gaps = np.empty_like(pos)  # pos - prev - 1, prev starting at -1
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    r = rice_bits(n, len(pos))
    return [Fields(unary_bits(gaps >> r), 1), Fields(gaps & ((1 << r) - 1), r)]


def _read_positions(reader: StreamReader, spec: TensorSpec, k: int) -> np.ndarray:
    n = spec.numel
    if not 0 < k <= n:
        raise FormatError(f"{spec.name}: change count {k} impossible for {n} elements")
    r = rice_bits(n, k)
    # Legitimate quotients sum to at most (n-k) >> r: checked before shifting, so nothing overflows.
    try:
        q = reader.read_unary("bits", k, (n - k) >> r)
    except LimitExceededError:
        raise FormatError(f"{spec.name}: change positions fall outside the tensor") from None
    if int(q.sum()) > (n - k) >> r:
        raise FormatError(f"{spec.name}: change positions fall outside the tensor")
    pos = q  # in place, one pass each: pos = cumsum(gaps + 1) - 1, gaps = q << r | remainder >= 0
    pos <<= r
    pos |= reader.read_fields("bits", k, r)
    pos += 1
    np.cumsum(pos, out=pos)
    pos -= 1  # strictly ascending
    if pos[-1] >= n:
        raise FormatError(f"{spec.name}: change positions fall outside the tensor")
    return pos
