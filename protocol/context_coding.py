"""Where a SPARSE_CTX record's changes are (payload format 2, docs/format.md): positions coded under
a context every host already holds and has verified, the magnitude range of the base value.

A float's exponent sets its rounding step, so small-magnitude weights cross a representable value
far more often than large ones: on real AdamW trajectories an ideal coder conditioned on (tensor,
exponent of the base value) needs about 0.67x the bits of the memoryless ``log2 C(n, k)`` bound
(benchmarks/codec_contexts.py).  Coding each exponent as its own class costs a counting sort of
the whole tensor to decode (~44 ns an element in numpy); a few contiguous exponent ranges
("groups", up to 16) keep nearly all of it and decode with one compare-and-pack pass per
threshold (~0.05 ns an element each), then prefix counts and a select per change.  Each
threshold is the exponent of some changed element's base value (checked), which leaves a
corrupted threshold no way to decode to the same positions.

The record's bit stream holds: ``G - 1`` (4 bits), then the ``G - 1`` ascending exponent thresholds
as Elias-gamma codes of their differences; then, block by block (``CTX_BLOCK`` elements), the
Elias-gamma counts of changes per non-empty group and, per group, the Golomb-coded gaps between the ranks of
its changes (or, where more than half of the group's elements changed, of its unchanged elements)
within the subsequence of the block's elements of that group.  The group of a base word ``w`` is
the number of thresholds ``t`` with ``exponent(w) >= t``; the block's changes come out in
ascending position order once merged.  The encoder picks the thresholds from the exponent
histogram (a strided sample of the base) with a dynamic program over cut points; any thresholds
decode.  Golomb rather than Rice codes, and the minority set of a dense group, because dense groups
(small exponents, about a quarter of the changes) cost a Rice code 17% over their ideal
(docs/benchmarks.md).

Decoding reads the bit stream here (``decode_ctx``) and the base through a ``ContextPass``: the
numpy pass here for host words, protocol/context_pass_torch.py's where a device base lives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np

from patchswarm.protocol.errors import FormatError, LimitExceededError
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.streams import Fields, Piece, StreamReader, unary_bits

# Elements per block: counts restart per block, so decoding needs one block of group indices at a time.
CTX_BLOCK = 1 << 20
MAX_GROUPS = 16
GROUP_BITS = 4  # G - 1 is written in this many bits
# Mantissa bits of each float dtype: the exponent field sits just above them (below the sign).
MANTISSA = {"BF16": 7, "F16": 10, "F32": 23, "F64": 52, "F8_E4M3": 3, "F8_E5M2": 2}
# Base elements sampled (strided) to estimate the exponent histogram when choosing thresholds.
SAMPLE = 1 << 18
_U64 = np.dtype("<u8")
P_co = TypeVar("P_co", covariant=True)  # the positions a context pass returns (numpy, or a torch tensor)


def exponent_field(spec: TensorSpec) -> tuple[int, int]:
    """(mantissa bits M, exponent bits E) of a float dtype: exponent(w) = (w >> M) & (2**E - 1)."""
    m = MANTISSA[spec.dtype]
    return m, 8 * spec.dt.width - 1 - m


def group_words(words: np.ndarray, m: int, thresholds: np.ndarray) -> np.ndarray:
    """Row ``g``: which of the block's base ``words`` belong to group ``g``, as bits packed in uint64
    words (element i is bit i % 64 of word i // 64): one compare and pack pass per threshold."""
    nb = words.size
    e = 8 * words.dtype.itemsize - 1 - m
    # The exponent field once, in the narrowest integer that holds it (compares on bytes are cheapest).
    ex = ((words >> m) & ((1 << e) - 1)).astype(np.uint8 if e <= 8 else np.uint16)
    nwords = -(-nb // 64)
    ge = np.zeros((thresholds.size + 2, nwords), dtype=_U64)  # row j: exponent >= threshold j (row 0: all)
    ge[0] = ~np.uint64(0)
    if nb % 64:
        ge[0, -1] = np.uint64((1 << (nb % 64)) - 1)
    buf = np.zeros(nwords * 64, dtype=bool)
    for j, t in enumerate(thresholds.tolist(), start=1):
        np.greater_equal(ex, t, out=buf[:nb])
        ge[j] = np.packbits(buf, bitorder="little").view(_U64)
    out: np.ndarray = ge[:-1] & ~ge[1:]
    return out


class _Groups:
    """A block's groups as one flat bit set (group after group), with prefix counts: the rank of an
    element in its group and the element of a given rank are one vectorized step for all groups."""

    def __init__(self, words: np.ndarray, m: int, thresholds: np.ndarray) -> None:
        members = group_words(words, m, thresholds)
        self.nwords = members.shape[1]
        self.flat = members.ravel()
        self.per_word = np.bitwise_count(self.flat).astype(np.int64)
        self.upto = np.cumsum(self.per_word)
        self.sizes = self.per_word.reshape(members.shape).sum(axis=1)
        self.offset = np.cumsum(self.sizes) - self.sizes  # members of the groups before each

    def ranks(self, group: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The rank of each element ``local`` (block positions) within its ``group``."""
        fi = group * self.nwords + (local >> 6)
        below = self.flat[fi] & ((np.uint64(1) << (local & 63).astype(_U64)) - np.uint64(1))
        out: np.ndarray = self.upto[fi] - self.per_word[fi] + np.bitwise_count(below) - self.offset[group]
        return out

    def elements(self, flat_ranks: np.ndarray) -> np.ndarray:
        """The block positions of the members of ranks ``offset[g] + rank`` (all groups at once)."""
        word = np.searchsorted(self.upto, flat_ranks, side="right")
        bit = _select(self.flat[word], flat_ranks - (self.upto[word] - self.per_word[word]))
        out: np.ndarray = (word % self.nwords) * 64 + bit
        return out


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


def golomb_param(n: int, k: int) -> int:
    """Golomb parameter ``m`` of the gaps of ``k`` ranks among ``n`` (``1 <= k <= n``): the integer
    form of ``ceil(ln(2 - p) / -ln(1 - p))``, ``p = k/n``, the optimal ``m`` for geometric gaps,
    with ``ln(2 - p) ~ ln 2 - p/2 - p**2/8`` and ``-ln(1 - p) ~ 2p / (2 - p)``.  Integers only, so encoder and
    decoder always agree."""
    n, k = int(n), int(k)  # Python integers: the products overflow 64 bits
    return max(1, -(-(55448 * n * n - 40000 * n * k - 10000 * k * k) * (2 * n - k) // (160000 * n * n * k)))


def ctx_bound_bits(n: int, k: int, e: int) -> int:
    """Most bits a SPARSE_CTX record's positions may take (``patch_format.raw_bound``): a group's
    Golomb codes of ``c`` ranks among ``n_g`` take at most ``n_g`` unary bits and ``c`` remainders of
    at most ``bit_length(m - 1)`` bits, ``m`` largest for ``c = 1`` and the largest group."""
    b = (golomb_param(min(n, CTX_BLOCK), 1) - 1).bit_length()
    bits = GROUP_BITS + (MAX_GROUPS - 1) * (2 * e + 1) + n + k * (1 + b)
    full, last = divmod(n, CTX_BLOCK)
    for nb, count in ((CTX_BLOCK, full), (last, 1 if last else 0)):
        bits += count * MAX_GROUPS * (2 * (nb + 1).bit_length() - 1)
    return bits


class ContextPass(Protocol[P_co]):
    """The pass over the base, block by block: group sizes, and ranks in groups to positions (decoding)
    or positions to ranks (encoding).  Here the numpy pass over host words; protocol/context_pass_torch.py
    runs it where a torch base lives."""

    def sizes(self, block: int) -> np.ndarray:
        """The sizes of the groups (int64, one per group) in block ``block``; blocks are asked in order."""

    def select(self, block: int, flat_ranks: np.ndarray) -> None:
        """Decoding: the changes of the block last sized, as flat ranks (members of earlier groups + rank in group)."""

    def changes(self, block: int, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encoding: the group and the rank in it (int64) of each change at ``local`` (ascending
        positions in the block last sized)."""

    def finish(self) -> P_co:
        """Every selected position, ascending."""

    def covers(self, thresholds: np.ndarray) -> bool:
        """After :meth:`finish`: whether every threshold is the exponent of some changed element."""


class _NumpyPass:
    """:class:`ContextPass` over host words, one block at a time (``_Groups``)."""

    def __init__(self, base: np.ndarray, m: int, e: int, thresholds: np.ndarray, k: int, block: int) -> None:
        self.base, self.m, self.e, self.thresholds, self.block = base, m, e, thresholds, block
        self.out = np.empty(k, dtype=np.int64)
        self.done = 0
        self.groups: _Groups | None = None
        # (the sign bit off: the exponent field is then the top of what is left)
        self.magnitude = np.array((1 << (8 * base.dtype.itemsize - 1)) - 1, dtype=base.dtype)

    def sizes(self, block: int) -> np.ndarray:
        start = block * self.block
        self.groups = _Groups(self.base[start : start + self.block], self.m, self.thresholds)
        out: np.ndarray = self.groups.sizes
        return out

    def select(self, block: int, flat_ranks: np.ndarray) -> None:
        assert self.groups is not None
        local = self.groups.elements(flat_ranks)
        local.sort()
        self.out[self.done : self.done + local.size] = local + block * self.block
        self.done += local.size

    def changes(self, block: int, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self.groups is not None
        words = self.base[block * self.block + local]
        group = np.searchsorted(self.thresholds << self.m, words & self.magnitude, side="right")
        return group, self.groups.ranks(group, local)

    def finish(self) -> np.ndarray:
        return self.out

    def covers(self, thresholds: np.ndarray) -> bool:
        ex = (self.base[self.out] >> self.m).astype(np.int64) & ((1 << self.e) - 1)
        return bool(np.isin(thresholds, ex).all())


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
    minimize the estimated bits: n H(k/n) and the per-block counts of each group, plus thresholds."""
    present = np.flatnonzero(n_c)
    n = np.concatenate([[0.0], np.cumsum(n_c[present], dtype=np.float64)])
    k = np.concatenate([[0.0], np.cumsum(k_c[present], dtype=np.float64)])
    m = present.size
    kk = k[None, :] - k[:, None]
    # A group's positions (n H(k/n)) and its count in each block (Elias gamma, about 2 log2(k + 1) + 1).
    cost = _entropy_cost(n[None, :] - n[:, None], kk) + blocks * (2 * np.log2(np.maximum(kk, 0) / blocks + 1) + 1)
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
        est = dp[m] + (g - 1) * 6  # a threshold (gamma of a difference)
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
    return thresholds_of(spec, base[:: sample_step(spec.numel)], base[pos])


def sample_step(n: int) -> int:
    """The stride of the base sample that estimates the exponent histogram."""
    return max(1, n // SAMPLE)


def thresholds_of(spec: TensorSpec, sample: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """:func:`context_thresholds` from the strided ``sample`` of the base words and the base words of the changes."""
    n = spec.numel
    m, e = exponent_field(spec)
    mask = (1 << e) - 1
    n_c = np.bincount((sample >> m).astype(np.int64) & mask, minlength=1 << e) * sample_step(n)
    k_c = np.bincount((changed >> m).astype(np.int64) & mask, minlength=1 << e)
    return choose_thresholds(np.maximum(n_c, k_c), k_c, e, -(-n // CTX_BLOCK))


def _golomb(gaps: np.ndarray, m: int) -> tuple[np.ndarray, list[Piece]]:
    """The unary quotients and the remainder fields of the Golomb codes (parameter ``m``) of ``gaps``:
    remainders ``x < c = 2**b - m`` (``b = bit_length(m - 1)``) in ``b - 1`` bits, the others as
    ``(x + c) >> 1`` in ``b - 1`` bits and then, after all of them, one bit ``(x + c) & 1`` each."""
    q = gaps // m
    if m == 1:
        return q, []
    b = (m - 1).bit_length()
    c = (1 << b) - m
    x = gaps - q * m
    hi = x >= c
    return q, [Fields(np.where(hi, (x + c) >> 1, x), b - 1), Fields((x[hi] + c) & 1, 1)]


def _read_golomb_remainders(reader: StreamReader, q: np.ndarray, m: int) -> np.ndarray:
    """The gaps of the quotients ``q`` (checked: ``q * m`` fits) and their remainders, read next."""
    if m == 1:
        return q
    b = (m - 1).bit_length()
    c = (1 << b) - m
    x = reader.read_fields("bits", q.size, b - 1)
    hi = np.flatnonzero(x >= c)
    x[hi] = (x[hi] << 1 | reader.read_bits("bits", hi.size)) - c
    q *= m
    q += x
    return q


def _minority(ranks: np.ndarray, ng: int) -> np.ndarray:
    """The ranks a group codes: its changes' ``ranks``, or where more than half of its ``ng`` elements
    changed, the ranks of the unchanged ones (the same set either way, in fewer codes)."""
    if 2 * ranks.size <= ng:
        return ranks
    keep = np.ones(ng, dtype=bool)
    keep[ranks] = False
    return np.flatnonzero(keep)


def ctx_fields(
    spec: TensorSpec, base: np.ndarray, pos: np.ndarray, thresholds: np.ndarray | None = None
) -> list[Piece] | None:
    """The SPARSE_CTX position fields of the ascending changed positions ``pos`` (at least one) of a
    float tensor whose base words (host numpy, signed) are ``base``: with the given ``thresholds``,
    else with the encoder's, or None where it finds one group best (plain gaps then cost less)."""
    if thresholds is None:
        thresholds = context_thresholds(spec, base, pos)
        if thresholds.size == 0:
            return None
    m, e = exponent_field(spec)
    return encode_ctx(spec, pos, thresholds, _NumpyPass(base, m, e, thresholds, 0, CTX_BLOCK))


def encode_ctx(spec: TensorSpec, pos: np.ndarray, thresholds: np.ndarray, cpass: ContextPass[object]) -> list[Piece]:
    """The SPARSE_CTX position fields of ``pos`` under ``thresholds``, the base read by ``cpass``."""
    n = spec.numel
    g_count = thresholds.size + 1
    out: list[Piece] = [Fields(np.array([g_count - 1]), GROUP_BITS)]
    if thresholds.size:
        out.extend(_gamma(np.diff(thresholds, prepend=0)))
    bounds = np.searchsorted(pos, np.arange(0, n + CTX_BLOCK, CTX_BLOCK))
    for b, start in enumerate(range(0, n, CTX_BLOCK)):
        local = pos[bounds[b] : bounds[b + 1]] - start
        sizes = cpass.sizes(b)
        if local.size == 0:
            out.extend(_gamma(np.ones(int(np.count_nonzero(sizes)), dtype=np.int64)))  # every count 0
            continue
        of_change, ranks = cpass.changes(b, local)
        counts = np.bincount(of_change, minlength=g_count)
        out.extend(_gamma(counts[sizes > 0] + 1))  # an empty group's count (0) goes without saying
        quotients: list[np.ndarray] = []
        remainders: list[Piece] = []
        for g in np.flatnonzero(counts).tolist():
            ng = int(sizes[g])
            coded = _minority(ranks[of_change == g], ng)  # ascending: positions ascend within a group
            if coded.size == 0:
                continue
            q, rem = _golomb(np.diff(coded, prepend=-1) - 1, golomb_param(ng, coded.size))
            quotients.append(q)
            remainders.extend(rem)
        if quotients:
            out.append(Fields(unary_bits(np.concatenate(quotients)), 1))
        out.extend(remainders)
    return out


def field_bits(pieces: list[Piece]) -> int:
    return sum(p.values.size * p.width if isinstance(p, Fields) else 8 * p.nbytes for p in pieces)


# ---------------------------------------------------------------- decoding


def _read_gamma(reader: StreamReader, count: int, most: int, refusal: str) -> np.ndarray:
    """``count`` Elias-gamma codes (see :func:`_gamma`), refused with ``refusal`` unless each length
    is below ``most``; a stream that ends early keeps the reader's own error."""
    try:
        lengths = reader.read_unary("bits", count, count * (most - 1))
    except LimitExceededError:
        raise FormatError(refusal) from None
    if int(lengths.max()) >= most:
        raise FormatError(refusal)
    low = reader.read_bits("bits", int(lengths.sum())).astype(np.int64)
    out = np.empty(count, dtype=np.int64)
    o = 0
    for i, length in enumerate(lengths.tolist()):
        out[i] = (1 << length) | int(np.sum(low[o : o + length] << np.arange(length)))
        o += length
    return out


def read_ctx_positions(reader: StreamReader, spec: TensorSpec, k: int, base: np.ndarray) -> np.ndarray:
    """The ascending changed positions of a SPARSE_CTX record; ``base`` is the verified base's words."""
    m, e = exponent_field(spec)
    return decode_ctx(reader, spec, k, lambda th, block: _NumpyPass(base, m, e, th, k, block))


def decode_ctx(
    reader: StreamReader,
    spec: TensorSpec,
    k: int,
    make_pass: Callable[[np.ndarray, int], ContextPass[P_co]],
) -> P_co:
    """A SPARSE_CTX record's positions: the bit stream read here, the base read by the pass that
    ``make_pass(thresholds, block elements)`` returns (for ``k`` changes, validated first)."""
    n = spec.numel
    if not 0 < k <= n:
        raise FormatError(f"{spec.name}: change count {k} impossible for {n} elements")
    _, e = exponent_field(spec)
    g_count = int(reader.read_fields("bits", 1, GROUP_BITS)[0]) + 1
    thresholds = np.zeros(0, dtype=np.int64)
    if g_count > 1:
        refusal = f"{spec.name}: a context threshold step is longer than the exponent field allows"
        thresholds = np.cumsum(_read_gamma(reader, g_count - 1, e + 1, refusal))
        if thresholds[-1] >= 1 << e:
            raise FormatError(f"{spec.name}: a context threshold exceeds the exponent field")
    block = CTX_BLOCK
    cpass = make_pass(thresholds, block)
    done = 0
    for b, start in enumerate(range(0, n, block)):
        nb = min(block, n - start)
        sizes = cpass.sizes(b)
        counts = np.zeros(g_count, dtype=np.int64)
        nonempty = sizes > 0
        refusal = f"{spec.name}: a context count exceeds its block"
        counts[nonempty] = _read_gamma(reader, int(nonempty.sum()), (nb + 1).bit_length(), refusal) - 1
        if np.any(counts > sizes):
            raise FormatError(f"{spec.name}: more changes than elements in a context group")
        kb = int(counts.sum())
        if done + kb > k:
            raise FormatError(f"{spec.name}: context counts add up to more than the record's {k} changes")
        if kb == 0:
            continue
        offset = np.cumsum(sizes) - sizes  # members of the groups before each
        present = np.flatnonzero(counts).tolist()
        coded = [min(int(counts[g]), int(sizes[g] - counts[g])) for g in present]
        # Each group's quotients add up to at most its size (gaps between its members' ranks).
        try:
            q_all = reader.read_unary("bits", sum(coded), int(sizes[present].sum()))
        except LimitExceededError:
            raise FormatError(f"{spec.name}: change ranks fall outside their context group") from None
        parts: list[np.ndarray] = []
        o = 0
        for g, c in zip(present, coded, strict=True):
            kg, ng = int(counts[g]), int(sizes[g])
            q = q_all[o : o + c]
            o += c
            if c == 0:  # every element of the group changed
                ranks = np.arange(ng)
            else:
                gm = golomb_param(ng, c)
                # Legitimate quotients sum to at most (n_g - c) // m: checked before multiplying.
                if int(q.sum()) > (ng - c) // gm:
                    raise FormatError(f"{spec.name}: change ranks fall outside their context group")
                ranks = _read_golomb_remainders(reader, q, gm)
                ranks += 1
                np.cumsum(ranks, out=ranks)
                ranks -= 1
                if ranks[-1] >= ng:
                    raise FormatError(f"{spec.name}: change ranks fall outside their context group")
                if c < kg:  # the group coded its unchanged elements
                    keep = np.ones(ng, dtype=bool)
                    keep[ranks] = False
                    ranks = np.flatnonzero(keep)
            ranks += int(offset[g])
            parts.append(ranks)
        cpass.select(b, np.concatenate(parts) if len(parts) > 1 else parts[0])
        done += kb
    if done != k:
        raise FormatError(f"{spec.name}: context counts add up to {done}, the record says {k}")
    out = cpass.finish()
    # Each threshold must be the exponent of a changed element's base value: then a threshold moved
    # to any other value moves that element to another group, whose count no longer matches, so no
    # corrupted threshold decodes to the same positions (one spelling, as format 1).
    if thresholds.size and not cpass.covers(thresholds):
        raise FormatError(f"{spec.name}: a context threshold is not the exponent of a changed element")
    return out
