"""Where a SPARSE_CTX record's changes are (payload format 2, docs/format.md): positions coded under
a context every host already holds and has verified, the magnitude range of the base value.

A float's exponent sets its rounding step, so small-magnitude weights cross a representable value
far more often than large ones: on real AdamW trajectories an ideal coder conditioned on (tensor,
exponent of the base value) needs about 0.67x the bits of the memoryless ``log2 C(n, k)`` bound
(benchmarks/codec_contexts.py).  Coding each exponent as its own class costs a counting sort of
the whole tensor to decode (~44 ns an element in numpy); a few contiguous exponent ranges
("groups") keep most of the gain (0.69-0.73x) and decode with one compare-and-pack pass per
threshold (bit sets, popcounts and a select per change: ~0.2 ns an element a threshold).  Each
threshold is the exponent of some changed element's base value (checked), which leaves a
corrupted threshold no way to decode to the same positions.

The record's bit stream holds: ``G - 1`` (3 bits), then ``G - 1`` ascending exponent thresholds
(``E`` bits each); then, block by block (``CTX_BLOCK`` elements), the Elias-gamma counts of
changes per group and, per group, the Rice-coded gaps between the ranks of its changes within the
subsequence of the block's elements of that group.  The group of a base word ``w`` is the number
of thresholds ``t`` with ``exponent(w) >= t``; the block's changes come out in ascending position
order once merged.  The encoder picks the thresholds from the exponent histogram (a strided
sample of the base) with a dynamic program over cut points; any thresholds decode.
"""

from __future__ import annotations

import numpy as np

from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.position_coding import rice_bits
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.streams import Fields, Piece, StreamReader, unary_bits

# Elements per block: counts restart per block, so decoding needs one block of group indices at a time.
CTX_BLOCK = 1 << 20
MAX_GROUPS = 8
GROUP_BITS = 3  # G - 1 is written in this many bits
# Mantissa bits of each float dtype: the exponent field sits just above them (below the sign).
MANTISSA = {"BF16": 7, "F16": 10, "F32": 23, "F64": 52, "F8_E4M3": 3, "F8_E5M2": 2}
# Base elements sampled (strided) to estimate the exponent histogram when choosing thresholds.
SAMPLE = 1 << 18
_U64 = np.dtype("<u8")


def exponent_field(spec: TensorSpec) -> tuple[int, int]:
    """(mantissa bits M, exponent bits E) of a float dtype: exponent(w) = (w >> M) & (2**E - 1)."""
    m = MANTISSA[spec.dtype]
    return m, 8 * spec.dt.width - 1 - m


def group_words(words: np.ndarray, m: int, thresholds: np.ndarray) -> list[np.ndarray]:
    """Per group, which of the block's base ``words`` belong to it, as bits packed in uint64 words
    (element i is bit i % 64 of word i // 64): one compare and pack pass per threshold."""
    nb = words.size
    mag = words & np.array((1 << (8 * words.dtype.itemsize - 1)) - 1, dtype=words.dtype)
    nwords = -(-nb // 64)
    valid = np.full(nwords, ~np.uint64(0), dtype=_U64)
    if nb % 64:
        valid[-1] = np.uint64((1 << (nb % 64)) - 1)
    ge = [valid]
    buf = np.zeros(nwords * 64, dtype=bool)
    for t in thresholds.tolist():
        # exponent(w) >= t  <=>  (w & magnitude mask) >= t << M: compare magnitudes, no shift.
        np.greater_equal(mag, t << m, out=buf[:nb])
        ge.append(np.packbits(buf, bitorder="little").view(_U64))
    ge.append(np.zeros(nwords, dtype=_U64))
    return [ge[g] & ~ge[g + 1] for g in range(len(ge) - 1)]


def _select_table() -> np.ndarray:
    """SELECT[b, j]: the index of the j-th set bit of byte b (8 where b has fewer set bits)."""
    table = np.full((256, 9), 8, dtype=np.int64)
    for b in range(256):
        ones = [i for i in range(8) if b >> i & 1]
        table[b, : len(ones)] = ones
    return table


_SELECT = _select_table()


def _select(words: np.ndarray, j: np.ndarray) -> np.ndarray:
    """The index of the ``j``-th (0-based) set bit of each uint64 word (which has more than j)."""
    by = words.astype(_U64, copy=False).view(np.uint8).reshape(-1, 8)
    upto = np.cumsum(np.bitwise_count(by), axis=1, dtype=np.int64)  # set bits in bytes 0..i
    byte = np.count_nonzero(upto <= j[:, None], axis=1)  # the byte holding the j-th bit
    rows = np.arange(words.size)
    before = np.where(byte > 0, upto[rows, np.maximum(byte - 1, 0)], 0)
    out: np.ndarray = byte * 8 + _SELECT[by[rows, byte], j - before]
    return out


def ctx_bound_bits(n: int, k: int, e: int) -> int:
    """Most bits a SPARSE_CTX record's positions may take (``patch_format.raw_bound``)."""
    bits = GROUP_BITS + (MAX_GROUPS - 1) * e + n + k * (1 + rice_bits(min(n, CTX_BLOCK), 1))
    full, last = divmod(n, CTX_BLOCK)
    for nb, count in ((CTX_BLOCK, full), (last, 1 if last else 0)):
        bits += count * MAX_GROUPS * (2 * (nb + 1).bit_length() - 1)
    return bits


# ---------------------------------------------------------------- encoding


def _entropy_cost(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """n * H(k / n) bits, elementwise (0 where n is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.where(n > 0, n, 1), 0.0)
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    out: np.ndarray = n * h
    return out


def choose_thresholds(n_c: np.ndarray, k_c: np.ndarray, e: int, blocks: int) -> np.ndarray:
    """Thresholds (ascending exponents) cutting the exponent classes into contiguous groups that
    minimize the estimated bits: sum n H(k/n) over groups, plus thresholds and per-block counts."""
    present = np.flatnonzero(n_c)
    n = np.concatenate([[0.0], np.cumsum(n_c[present], dtype=np.float64)])
    k = np.concatenate([[0.0], np.cumsum(k_c[present], dtype=np.float64)])
    m = present.size
    cost = _entropy_cost(n[None, :] - n[:, None], k[None, :] - k[:, None])
    cost = np.where(np.triu(np.ones((m + 1, m + 1), dtype=bool), 1), cost, np.inf)  # group = classes i..j-1
    # A group starts (a threshold is) only at an exponent some change has: read_ctx_positions checks it.
    cost[1:m][k_c[present[1:]] == 0] = np.inf
    dp = cost[0].copy()  # one group: classes 0..j-1
    backs: list[np.ndarray] = []
    best_g, best = 1, dp[m]
    for g in range(2, min(MAX_GROUPS, m) + 1):
        tot = dp[:, None] + cost
        back = np.argmin(tot, axis=0)
        dp = tot[back, np.arange(m + 1)]
        backs.append(back)
        est = dp[m] + (g - 1) * (e + 12 * blocks)  # a threshold, and a count per block (about 12 bits)
        if est < best:
            best_g, best = g, est
    cuts: list[int] = []
    j = m
    for back in reversed(backs[: best_g - 1]):
        j = int(back[j])
        cuts.append(j)
    return np.array(sorted(int(present[c]) for c in cuts), dtype=np.int64)


def _gamma(x: np.ndarray) -> list[Piece]:
    """Elias-gamma codes of positive integers: all lengths L = bit_length - 1 in unary, then the
    low L bits of each, least significant first."""
    lengths = np.array([int(v).bit_length() - 1 for v in x.tolist()], dtype=np.int64)
    low = [(int(v) >> np.arange(L)) & 1 for v, L in zip(x.tolist(), lengths.tolist(), strict=True)]
    return [Fields(unary_bits(lengths), 1), Fields(np.concatenate([np.zeros(0, np.int64), *low]), 1)]


def context_thresholds(spec: TensorSpec, base: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The thresholds the encoder uses for these changes (empty: contexts would not pay)."""
    n = spec.numel
    m, e = exponent_field(spec)
    step = max(1, n // SAMPLE)
    mask = (1 << e) - 1
    n_c = np.bincount((base[::step] >> m).astype(np.int64) & mask, minlength=1 << e) * step
    k_c = np.bincount((base[pos] >> m).astype(np.int64) & mask, minlength=1 << e)
    return choose_thresholds(np.maximum(n_c, k_c), k_c, e, -(-n // CTX_BLOCK))


def ctx_fields(
    spec: TensorSpec, base: np.ndarray, pos: np.ndarray, thresholds: np.ndarray | None = None
) -> list[Piece] | None:
    """The SPARSE_CTX position fields of the ascending changed positions ``pos`` (at least one) of a
    float tensor whose base words (host numpy, signed) are ``base``: with the given ``thresholds``,
    else with the encoder's, or None where it finds one group best (plain gaps then cost less)."""
    n = spec.numel
    m, e = exponent_field(spec)
    if thresholds is None:
        thresholds = context_thresholds(spec, base, pos)
        if thresholds.size == 0:
            return None
    g_count = thresholds.size + 1
    out: list[Piece] = [Fields(np.array([g_count - 1]), GROUP_BITS), Fields(thresholds, e)]
    bounds = np.searchsorted(pos, np.arange(0, n + CTX_BLOCK, CTX_BLOCK))
    for b, start in enumerate(range(0, n, CTX_BLOCK)):
        local = pos[bounds[b] : bounds[b + 1]] - start
        if local.size == 0:
            out.append(Fields(np.zeros(g_count, dtype=np.uint8), 1))  # gamma(1) per group: a 0 bit
            continue
        members = group_words(base[start : start + CTX_BLOCK], m, thresholds)
        mag = base[start + local] & np.array((1 << (8 * base.dtype.itemsize - 1)) - 1, dtype=base.dtype)
        of_change = np.zeros(local.size, dtype=np.int64)
        for t in thresholds.tolist():
            of_change += mag >= t << m
        counts = np.bincount(of_change, minlength=g_count)
        out.extend(_gamma(counts + 1))
        quotients: list[np.ndarray] = []
        remainders: list[Piece] = []
        for g in np.flatnonzero(counts).tolist():
            # rank = members of g before the change: whole words before it, then the bits below it
            p = local[of_change == g]
            per_word = np.bitwise_count(members[g]).astype(np.int64)
            before = np.cumsum(per_word) - per_word
            below = members[g][p >> 6] & ((np.uint64(1) << (p & 63).astype(_U64)) - np.uint64(1))
            ranks = before[p >> 6] + np.bitwise_count(below)
            gaps = np.diff(ranks, prepend=-1) - 1
            r = rice_bits(int(per_word.sum()), ranks.size)
            quotients.append(gaps >> r)
            remainders.append(Fields(gaps & ((1 << r) - 1), r))
        out.append(Fields(unary_bits(np.concatenate(quotients)), 1))
        out.extend(remainders)
    return out


def field_bits(pieces: list[Piece]) -> int:
    return sum(p.values.size * p.width if isinstance(p, Fields) else 8 * p.nbytes for p in pieces)


# ---------------------------------------------------------------- decoding


def read_ctx_positions(reader: StreamReader, spec: TensorSpec, k: int, base: np.ndarray) -> np.ndarray:
    """The ascending changed positions of a SPARSE_CTX record; ``base`` is the verified base's words."""
    n = spec.numel
    if not 0 < k <= n:
        raise FormatError(f"{spec.name}: change count {k} impossible for {n} elements")
    m, e = exponent_field(spec)
    g_count = int(reader.read_fields("bits", 1, GROUP_BITS)[0]) + 1
    thresholds = reader.read_fields("bits", g_count - 1, e)
    if thresholds.size and (thresholds[0] < 1 or np.any(np.diff(thresholds) <= 0)):
        raise FormatError(f"{spec.name}: context thresholds are not strictly ascending and positive")
    out = np.empty(k, dtype=np.int64)
    done = 0
    for start in range(0, n, CTX_BLOCK):
        nb = min(CTX_BLOCK, n - start)
        lengths = reader.read_unary("bits", g_count)
        if int(lengths.max()) >= (nb + 1).bit_length():
            raise FormatError(f"{spec.name}: a context count exceeds its block")
        low = reader.read_bits("bits", int(lengths.sum())).astype(np.int64)
        counts = np.empty(g_count, dtype=np.int64)
        o = 0
        for g, length in enumerate(lengths.tolist()):
            counts[g] = ((1 << length) | int(np.sum(low[o : o + length] << np.arange(length)))) - 1
            o += length
        kb = int(counts.sum())
        if done + kb > k:
            raise FormatError(f"{spec.name}: context counts add up to more than the record's {k} changes")
        if kb == 0:
            continue
        members = group_words(base[start : start + nb], m, thresholds)
        q = reader.read_unary("bits", kb)
        parts: list[np.ndarray] = []
        o = 0
        for g in np.flatnonzero(counts).tolist():
            kg = int(counts[g])
            per_word = np.bitwise_count(members[g]).astype(np.int64)
            upto = np.cumsum(per_word)
            ng = int(upto[-1])
            if kg > ng:
                raise FormatError(f"{spec.name}: more changes than elements in a context group")
            r = rice_bits(ng, kg)
            ranks = q[o : o + kg]
            o += kg
            # Legitimate quotients sum to at most (n_g - k_g) >> r: checked before shifting.
            if int(ranks.sum()) > (ng - kg) >> r:
                raise FormatError(f"{spec.name}: change ranks fall outside their context group")
            ranks = ranks << r
            ranks |= reader.read_fields("bits", kg, r)
            ranks += 1
            np.cumsum(ranks, out=ranks)
            ranks -= 1
            if ranks[-1] >= ng:
                raise FormatError(f"{spec.name}: change ranks fall outside their context group")
            # The word holding each rank's member, then the member's bit within it.
            word = np.searchsorted(upto, ranks, side="right")
            parts.append(word * 64 + _select(members[g][word], ranks - (upto[word] - per_word[word])))
        block = np.concatenate(parts) if len(parts) > 1 else parts[0]
        block.sort()
        out[done : done + kb] = block + start
        done += kb
    if done != k:
        raise FormatError(f"{spec.name}: context counts add up to {done}, the record says {k}")
    # Each threshold must be the exponent of a changed element's base value: then a threshold moved
    # to any other value moves that element to another group, whose count no longer matches, so no
    # corrupted threshold decodes to the same positions (one spelling, as format 1).
    if thresholds.size:
        ex = (base[out] >> m).astype(np.int64) & ((1 << e) - 1)
        if not np.isin(thresholds, ex).all():
            raise FormatError(f"{spec.name}: a context threshold is not the exponent of a changed element")
    return out
