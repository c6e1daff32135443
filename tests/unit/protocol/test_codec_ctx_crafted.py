"""SPARSE_CTX position streams crafted field by field (not flipped from valid ones), as a malicious
publisher would write them: extreme thresholds, gamma codes of 64+ bits, unary runs past the end,
counts past their group or block, minority sets of tiny groups, k = 0 / 1 / n, one-element tensors,
blocks of exactly B and B + 1 elements.  Both passes (numpy, and torch on CPU) must refuse alike with
one FormatError line, or decode the same positions, which then re-encode to exactly the stream (one
spelling) and match a decoder written from docs/format.md alone (tests/support/format2_doc.py), which
also decodes the committed vector."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import event, given, settings
from hypothesis import strategies as st

from patchswarm.protocol import context_coding, errors
from patchswarm.protocol.safetensors_io import load_safetensors
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.streams import StreamWriter
from tests.support import format2_doc as doc
from tests.support.format2 import ctx_sizes, decode_positions
from tests.support.strategies import FLOAT_DTYPES, random_words

TORCH_DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
VECTORS = Path(__file__).resolve().parents[2] / "vectors" / "_codec"


def _both(raw: bytes, spec: TensorSpec, k: int, base: np.ndarray, block: int) -> str | np.ndarray:
    """What the numpy pass decodes from ``raw``, checked to be what the torch pass decodes (on CPU, and
    on CUDA where there is one)."""
    with ctx_sizes(block, 1 << 23, on_cpu=True):
        want = decode_positions(raw, spec, k, base, None)
        gots = [decode_positions(raw, spec, k, base, d) for d in TORCH_DEVICES]
    if isinstance(want, str):
        assert all(g == want for g in gots)
        name, _, message = want.partition(": ")
        assert issubclass(getattr(errors, name), errors.FormatError), want
        assert message and "\n" not in message
        return want
    for g in gots:
        assert isinstance(g, np.ndarray)
        np.testing.assert_array_equal(g, want)
    return want


def _base(dtype: str, exponents: list[int]) -> np.ndarray:
    """Base words with these exponent fields (mantissa 1, sign +)."""
    m, _ = doc.FIELD[dtype]
    width = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}[dtype]
    return np.array([(x << m) | 1 for x in exponents], dtype=np.dtype(f"<i{width}"))


def _words(spec: TensorSpec, base: np.ndarray) -> list[int]:
    """The raw words as non-negative Python integers (the doc decoder's input)."""
    out: list[int] = base.view(f"<u{spec.dt.width}").tolist()
    return out


def _refused(w: doc.BitWriter, dtype: str, exponents: list[int], k: int, match: str, block: int = 8) -> None:
    spec = TensorSpec("w", dtype, (len(exponents),))
    got = _both(w.tobytes(), spec, k, _base(dtype, exponents), block)
    assert isinstance(got, str) and match in got, got


# Eight elements of exponents 1 and 2 (group sizes 4 and 4 under threshold 2), one block of 8.
EX = [1, 2] * 4


def test_thresholds_past_the_exponent_field_are_refused() -> None:
    _refused(doc.BitWriter().field(15, 4).gamma([20] * 15), "BF16", EX, 1, "exceeds the exponent field")
    _refused(doc.BitWriter().field(1, 4).gamma([16]), "F8_E4M3", EX, 1, "exceeds the exponent field")


@pytest.mark.parametrize("ones", [9, 64, 65, 200])
def test_gamma_codes_of_64_and_more_bits_are_refused(ones: int) -> None:
    w = doc.BitWriter().field(1, 4).field((1 << ones) - 1, ones).field(0, 1).field(0, 256)
    _refused(w, "BF16", EX, 1, "a context threshold step is longer than the exponent field allows")
    w = doc.BitWriter().field(0, 4).field((1 << ones) - 1, ones).field(0, 1).field(0, 256)
    _refused(w, "BF16", EX, 1, "a context count exceeds its block")


def _ones_to_byte(w: doc.BitWriter) -> doc.BitWriter:
    """One bits up to the next byte boundary (no zero padding for a unary code to end in)."""
    r = -len(w.bits) % 8
    return w.field((1 << r) - 1, r)


# Sixteen elements of one exponent (one group, G = 1): one change among 16 has m = 11 (3-bit remainders).
ONE = [5] * 16


@pytest.mark.parametrize("where", ["threshold", "count", "quotient", "remainder"])
def test_codes_running_past_the_end_are_refused_as_such(where: str) -> None:
    """The reader's own error (not one naming a field that is too long): the stream ended."""
    if where == "threshold":
        _refused(_ones_to_byte(doc.BitWriter().field(1, 4)), "BF16", EX, 1, "ends inside a unary code")
    elif where == "count":
        _refused(_ones_to_byte(doc.BitWriter().field(1, 4).gamma([2])), "BF16", EX, 2, "ends inside a unary code")
    elif where == "quotient":
        _refused(_ones_to_byte(doc.BitWriter().field(0, 4).gamma([2])), "BF16", ONE, 1, "ends inside a unary code")
    else:  # 4 + 3 + 1 bits: the remainder field is missing
        assert doc.golomb_param(16, 1) == 11
        _refused(doc.BitWriter().field(0, 4).gamma([2]).unary(0), "BF16", ONE, 1, "past its declared length")


def test_counts_past_their_group_the_block_or_the_record_are_refused() -> None:
    w = doc.BitWriter().field(1, 4).gamma([2])
    _refused(doc.BitWriter().field(1, 4).gamma([2]).gamma([6, 1]), "BF16", EX, 5, "more changes than elements")
    # 4 changes of 4 in each group: 8 > the record's 7.
    _refused(doc.BitWriter().field(1, 4).gamma([2]).gamma([5, 5]), "BF16", EX, 7, "add up to more than")
    _refused(w.gamma([1, 1]), "BF16", EX, 1, "add up to 0, the record says 1")
    # A block of one element (the second of B + 1) with 2 changes: its count's length L = 1 is allowed.
    w = doc.BitWriter().field(0, 4).gamma([1]).gamma([3])
    _refused(w, "BF16", [1] * 9, 2, "more changes than elements")


@pytest.mark.parametrize("k", [0, -1, 9, 1 << 62])
def test_impossible_change_counts_are_refused_before_reading(k: int) -> None:
    _refused(doc.BitWriter().field(0, 4).gamma([2]).unary(0).field(0, 2), "BF16", EX, k, "impossible for 8")


def test_ranks_outside_their_group_are_refused() -> None:
    # One change among 16: m = 11, quotients may sum to (16 - 1) div 11 = 1; a quotient of 2 is refused
    # before multiplying, and quotient 1 with remainder 10 (rank 21 >= 16) after.
    _refused(doc.BitWriter().field(0, 4).gamma([2]).golomb([22], 11), "BF16", ONE, 1, "fall outside their context")
    _refused(doc.BitWriter().field(0, 4).gamma([2]).golomb([21], 11), "BF16", ONE, 1, "fall outside their context")
    # A huge quotient run (a million ones) is refused by the sum check, not multiplied out.
    w = doc.BitWriter().field(0, 4).gamma([2]).unary(1 << 20).field(0, 4)
    _refused(w, "BF16", ONE, 1, "fall outside their context group")
    # One change of group 0 (4 elements under threshold 2, m = 2): quotient 2 > (4 - 1) div 2.
    assert doc.golomb_param(4, 1) == 2
    _refused(doc.BitWriter().field(1, 4).gamma([2]).gamma([2, 1]).golomb([4], 2), "BF16", EX, 1, "fall outside")


def test_a_threshold_no_change_has_is_refused() -> None:
    # Threshold 2; the only change (rank 0 of group 0) has exponent 1.
    w = doc.BitWriter().field(1, 4).gamma([2]).gamma([2, 1]).golomb([0], 2)
    _refused(w, "BF16", EX, 1, "not the exponent of a changed element")


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 17])
def test_every_element_changed_and_single_elements_decode(n: int) -> None:
    """k = n (every group codes its empty minority set), k = 1, over blocks of B = 8 and B + 1."""
    spec = TensorSpec("w", "F8_E5M2", (n,))
    exps = [3 + (i % 3 == 0) for i in range(n)]
    base = _base("F8_E5M2", exps)
    for pos in (np.arange(n), np.array([n - 1]), np.array([0])):
        raw = _encoded(spec, base, pos, np.array([4] if 4 in np.array(exps)[pos] else [], dtype=np.int64), 8)
        got = _both(raw, spec, pos.size, base, 8)
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, pos)


def _encoded(spec: TensorSpec, base: np.ndarray, pos: np.ndarray, thresholds: np.ndarray, block: int) -> bytes:
    with ctx_sizes(block, 1 << 23):
        fields = context_coding.ctx_fields(spec, base, pos, thresholds)
    assert fields is not None
    writer = StreamWriter()
    writer.emit({"bits": fields})
    table, _ = writer.finish()
    return zstandard.ZstdDecompressor().decompress(table[0][2], max_output_size=1 << 20) if table else b""


@st.composite
def crafted(draw: st.DrawFn) -> tuple[TensorSpec, np.ndarray, int, int, bytes]:
    """A SPARSE_CTX stream drawn field by field: near-valid (right group sizes) with extreme values mixed in."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    m, e = doc.FIELD[dtype]
    n = draw(st.integers(1, 80))
    block = draw(st.sampled_from([1, 8, 9, 64, 1 << 20]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spec = TensorSpec("w", dtype, (n,))
    base = random_words(rng, spec.dt.width, n)
    if draw(st.booleans()):  # few exponents: big groups, tiny or empty ones
        base = base[rng.integers(0, min(n, 3), n)]
    words = _words(spec, base)
    exps = sorted({(x >> m) & ((1 << e) - 1) for x in words} - {0})
    thresholds = sorted(draw(st.sets(st.sampled_from(exps), max_size=15))) if exps and draw(st.booleans()) else []
    if draw(st.booleans()):
        thresholds = sorted(draw(st.sets(st.integers(1, (1 << e) + 2), max_size=15)))
    w = doc.BitWriter().field(len(thresholds), 4)
    w.gamma([b - a for a, b in zip([0, *thresholds], thresholds, strict=False)])
    group = [sum(t <= (x >> m) & ((1 << e) - 1) for t in thresholds) for x in words]
    extreme = st.sampled_from([0, 1, 2, 63, 64, 1 << 16])
    total = 0
    for start in range(0, n, block):
        members = [
            [i for i in range(start, min(n, start + block)) if group[i] == g] for g in range(len(thresholds) + 1)
        ]
        counts = [min(len(g), rng.binomial(len(g), rng.random())) for g in members]
        if draw(st.integers(0, 9)) == 0:  # a count past its group or block
            counts[draw(st.integers(0, len(counts) - 1))] += draw(extreme)
        w.gamma([c + 1 for c, g in zip(counts, members, strict=True) if g])
        total += sum(counts)
        groups = [(len(g), c, min(c, len(g) - c)) for g, c in zip(members, counts, strict=True) if g and c]
        gaps_of = []
        for ng, _, c in groups:
            if c <= 0 or c > ng:
                continue
            ranks = np.sort(rng.choice(ng, c, replace=False))
            gaps = np.diff(ranks, prepend=-1) - 1
            if draw(st.integers(0, 9)) == 0:  # a gap past the group
                gaps[-1] += draw(extreme)
            gaps_of.append((gaps.tolist(), doc.golomb_param(ng, c)))
        for gaps, mg in gaps_of:
            for g in gaps:
                w.unary(g // mg)
        for gaps, mg in gaps_of:
            w.remainders(gaps, mg)
    k = total if draw(st.integers(0, 4)) else draw(st.one_of(extreme, st.integers(0, n + 1)))
    return spec, base, k, block, w.tobytes()


@settings(max_examples=400, deadline=None)
@given(case=crafted())
def test_crafted_streams_are_refused_alike_or_decode_to_their_one_spelling(
    case: tuple[TensorSpec, np.ndarray, int, int, bytes],
) -> None:
    spec, base, k, block, raw = case
    got = _both(raw, spec, k, base, block)
    if isinstance(got, str):
        event(re.sub(r"\d+", "N", got.partition(": ")[2].partition(": ")[2]))
        return
    event("decoded")
    assert got.size == k and bool(np.all(np.diff(got) > 0)) and got[0] >= 0 and got[-1] < spec.numel
    old = doc.BLOCK
    doc.BLOCK = block
    try:
        words = _words(spec, base)
        assert doc.read_ctx_positions(doc.BitReader(raw), spec.dtype, words, k) == got.tolist()
    finally:
        doc.BLOCK = old
    # What decodes is the encoder's stream for those positions and thresholds, bit for bit.
    reader = doc.BitReader(raw)
    g_count = reader.field(4) + 1
    thresholds = np.cumsum(reader.gamma(g_count - 1)).astype(np.int64)
    assert _encoded(spec, base, got, thresholds, block) == raw


def test_a_decoder_written_from_the_doc_decodes_the_committed_vector() -> None:
    """docs/format.md section 2a (and section 2's container) suffice to decode payload-format2.bin's
    positions: they are where the base and target words differ, and the bits stream ends in padding."""
    base = load_safetensors(VECTORS / "base.safetensors")
    target = load_safetensors(VECTORS / "target.safetensors")
    payload = (VECTORS / "payload-format2.bin").read_bytes()
    _, fmt, hlen = struct.unpack_from("<4sB3xI", payload)
    records, table = msgpack.unpackb(zstandard.decompress(payload[12 : 12 + hlen]))
    off, streams = 12 + hlen, {}
    for name, raw_len, comp_len in table:
        streams[name] = zstandard.ZstdDecompressor().decompress(payload[off : off + comp_len], max_output_size=raw_len)
        off += comp_len
    reader = doc.BitReader(streams["bits"])
    assert fmt == 2 and [enc for enc, _ in records] == [5, 5]
    for spec, b, t, (_, k) in zip(target.specs, base.data, target.data, records, strict=True):
        bw = b.contiguous().view(-1).view(torch.uint8).numpy().view(f"<u{spec.dt.width}").astype(np.int64)
        tw = t.contiguous().view(-1).view(torch.uint8).numpy().view(f"<u{spec.dt.width}").astype(np.int64)
        pos = doc.read_ctx_positions(reader, spec.dtype, bw.tolist(), k)
        assert pos == np.flatnonzero(bw != tw).tolist()
        reader.pos += k  # the sign bits (section 2, SPARSE_ULP)
    assert 8 * len(streams["bits"]) - reader.pos < 8
    assert reader.field(8 * len(streams["bits"]) - reader.pos) == 0


@pytest.mark.parametrize("n", [context_coding.CTX_BLOCK, context_coding.CTX_BLOCK + 1])
def test_blocks_of_exactly_b_and_b_plus_one_elements_at_the_real_block_size(n: int) -> None:
    """B = 2**20 itself: changes at the last element of the first block and the first of the next
    decode through both passes (two groups: the torch pass sorts); a lone last element claiming two
    changes is refused."""
    spec = TensorSpec("w", "BF16", (n,))
    base = _base("BF16", [100 + (i & 1) for i in range(n)])
    block = context_coding.CTX_BLOCK
    pos = np.array([0, block - 1, *([block] if n > block else [])])
    raw = _encoded(spec, base, pos, np.array([101], dtype=np.int64), block)
    got = _both(raw, spec, pos.size, base, block)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, pos)
    if n > block:  # G = 1: block 0 has no change (count 0), block 1 (one element) claims 2
        w = doc.BitWriter().field(0, 4).gamma([1]).gamma([3])
        _refused(w, "BF16", [100] * n, 2, "more changes than elements", block)
