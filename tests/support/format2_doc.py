"""Payload format 2's position code written again from docs/format.md section 2a alone (a second
implementer's reading, plain Python, no import of protocol/context_coding.py): a bit writer to craft
SPARSE_CTX streams field by field, and a reader that decodes a record's positions, to check the doc
specifies everything the committed vector needs."""

from __future__ import annotations

from collections.abc import Sequence

# Section 2a's constants: (M, E) per dtype, block size, group count field.
FIELD = {"BF16": (7, 8), "F16": (10, 5), "F32": (23, 8), "F64": (52, 11), "F8_E4M3": (3, 4), "F8_E5M2": (2, 5)}
BLOCK = 1 << 20


def golomb_param(n: int, c: int) -> int:
    num = (55448 * n * n - 40000 * n * c - 10000 * c * c) * (2 * n - c)
    return max(1, -(-num // (160000 * n * n * c)))


class BitWriter:
    """Bits least significant first (section 2, "Bit streams")."""

    def __init__(self) -> None:
        self.bits: list[int] = []

    def field(self, value: int, width: int) -> BitWriter:
        self.bits.extend((value >> i) & 1 for i in range(width))
        return self

    def unary(self, q: int) -> BitWriter:
        self.bits.extend([1] * q + [0])
        return self

    def gamma(self, xs: Sequence[int]) -> BitWriter:
        for x in xs:
            self.unary(x.bit_length() - 1)
        for x in xs:
            self.field(x, x.bit_length() - 1)
        return self

    def golomb(self, gaps: Sequence[int], m: int) -> BitWriter:
        """The quotients, then the remainders (section 2a, "Golomb")."""
        for g in gaps:
            self.unary(g // m)
        return self.remainders(gaps, m)

    def remainders(self, gaps: Sequence[int], m: int) -> BitWriter:
        if m == 1:
            return self
        b = (m - 1).bit_length()
        c0 = (1 << b) - m
        vs = [g % m if g % m < c0 else (g % m + c0) >> 1 for g in gaps]
        for v in vs:
            self.field(v, b - 1)
        for g, v in zip(gaps, vs, strict=True):
            if v >= c0:
                self.field((g % m + c0) & 1, 1)
        return self

    def tobytes(self) -> bytes:
        out = bytearray((len(self.bits) + 7) // 8)
        for i, bit in enumerate(self.bits):
            out[i >> 3] |= bit << (i & 7)
        return bytes(out)


class BitReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def bit(self) -> int:
        if self.pos >= 8 * len(self.data):
            raise ValueError("past the end")
        b = (self.data[self.pos >> 3] >> (self.pos & 7)) & 1
        self.pos += 1
        return b

    def field(self, width: int) -> int:
        return sum(self.bit() << i for i in range(width))

    def unary(self) -> int:
        q = 0
        while self.bit():
            q += 1
        return q

    def gamma(self, c: int) -> list[int]:
        lengths = [self.unary() for _ in range(c)]
        return [(1 << L) | self.field(L) for L in lengths]


def read_ctx_positions(r: BitReader, dtype: str, base: Sequence[int], k: int) -> list[int]:
    """A SPARSE_CTX record's positions (section 2a, "Bits" steps 1 and 2); ``base`` the raw base words."""
    m_bits, e_bits = FIELD[dtype]
    n = len(base)
    g_count = r.field(4) + 1
    steps = r.gamma(g_count - 1)
    thresholds = [sum(steps[: j + 1]) for j in range(g_count - 1)]
    group = [sum(t <= (w >> m_bits) & ((1 << e_bits) - 1) for t in thresholds) for w in base]
    out: list[int] = []
    for start in range(0, n, BLOCK):
        members: list[list[int]] = [[] for _ in range(g_count)]
        for i in range(start, min(n, start + BLOCK)):
            members[group[i]].append(i)
        nonempty = [g for g in range(g_count) if members[g]]
        counts = dict.fromkeys(range(g_count), 0)
        counts.update(zip(nonempty, (x - 1 for x in r.gamma(len(nonempty))), strict=True))
        coded = {g: min(counts[g], len(members[g]) - counts[g]) for g in range(g_count) if counts[g]}
        quotients = {g: [r.unary() for _ in range(c)] for g, c in coded.items()}
        block: list[int] = []
        for g, c in coded.items():
            ng = len(members[g])
            ranks: list[int] = []
            if c:
                mg = golomb_param(ng, c)
                b = (mg - 1).bit_length()
                c0 = (1 << b) - mg
                vs = [r.field(b - 1) for _ in range(c)] if mg > 1 else [0] * c
                xs = [v if v < c0 else 2 * v + r.bit() - c0 for v in vs] if mg > 1 else vs
                rank = -1
                for q, x in zip(quotients[g], xs, strict=True):
                    rank += q * mg + x + 1
                    ranks.append(rank)
            if c < counts[g]:  # the unchanged elements were coded
                ranks = sorted(set(range(ng)) - set(ranks))
            block.extend(members[g][rk] for rk in ranks)
        out.extend(sorted(block))
    assert len(out) == k
    return out
