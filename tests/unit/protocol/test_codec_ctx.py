"""Payload format 2 (SPARSE_CTX: positions coded under base-value contexts) and the format-1 it keeps.

Round trips over random float dtypes, shapes and change patterns, the context position code
alone (whatever the encoder would choose), corruption, a wrong base, and the committed test
vectors of docs/format.md (tests/vectors/_codec/)."""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from patchswarm.protocol import context_coding
from patchswarm.protocol.codec import apply_patch, encode_patch
from patchswarm.protocol.context_coding import ctx_fields, read_ctx_positions
from patchswarm.protocol.errors import BaseMismatchError, FormatError, PatchswarmError
from patchswarm.protocol.patch_format import Encoding, read_header
from patchswarm.protocol.patchfile import apply_version, build_version
from patchswarm.protocol.safetensors_io import load_safetensors
from patchswarm.protocol.served import ServedModel, TensorSpec
from patchswarm.protocol.streams import Fields, Piece, StreamReader, StreamWriter, unary_bits
from tests.support.format2 import ctx_case, magnitude_skewed, with_bits_flipped
from tests.support.helpers import adam_like_pair
from tests.support.strategies import FLOAT_DTYPES, model_from_words, patch_cases, random_words

VECTORS = Path(__file__).parents[2] / "vectors" / "_codec"


# ---------------------------------------------------------------- round trips


def _round_trip(base: ServedModel, target: ServedModel, fmt: int) -> list[Encoding]:
    before = base.clone()
    patch = encode_patch(base, target, payload_format=fmt)
    assert base.bitwise_equal(before)
    out = apply_patch(base.clone(), patch.payload, target.specs)
    assert out.bitwise_equal(target)
    encs = [t.encoding for t in patch.tensors]
    assert patch.payload[4] == (2 if Encoding.SPARSE_CTX in encs else 1)  # the lowest format that holds them
    return encs


@settings(max_examples=30, deadline=None)
@given(patch_cases(dtypes=FLOAT_DTYPES, max_numel=3000))
def test_format2_round_trip_random_patterns(case: tuple[ServedModel, ServedModel, list[str]]) -> None:
    base, target, _ = case
    for enc in _round_trip(base, target, 2):
        event(enc.name)
    assert Encoding.SPARSE_CTX not in _round_trip(base, target, 1)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    numel=st.integers(1, 5000),
    rate=st.floats(0.001, 0.5),
    seed=st.integers(0, 2**32 - 1),
)
def test_format2_round_trip_skewed_changes(dtype: str, numel: int, rate: float, seed: int) -> None:
    spec = TensorSpec("w", dtype, (numel,))
    old, new = magnitude_skewed(np.random.default_rng(seed), spec, rate)
    encs = _round_trip(model_from_words([spec], [old]), model_from_words([spec], [new]), 2)
    event(encs[0].name)


def _ctx_round_trip(spec: TensorSpec, base: np.ndarray, pos: np.ndarray) -> np.ndarray:
    fields = ctx_fields(spec, base, pos)
    if fields is None:  # one group: the encoder codes plain gaps; force two groups to test the code
        fields = _forced_two_groups(spec, base, pos)
    writer = StreamWriter()
    writer.emit({"bits": fields})
    table, _ = writer.finish()
    reader = StreamReader([(name, raw, memoryview(comp)) for name, raw, comp in table])
    got = read_ctx_positions(reader, spec, pos.size, base)
    reader.finish()
    return got


def _forced_two_groups(spec: TensorSpec, base: np.ndarray, pos: np.ndarray) -> list[Piece]:
    """Fields with one threshold at the largest exponent of a changed element (none if that is 0)."""
    m, e = context_coding.exponent_field(spec)
    top = int(((base[pos].astype(np.int64) >> m) & ((1 << e) - 1)).max())
    fields = ctx_fields(spec, base, pos, np.array([top] if top else [], dtype=np.int64))
    assert fields is not None
    return fields


PATTERNS = ("one", "all", "clustered", "random", "one_group", "block_edges")


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    numel=st.integers(1, 4000),
    pattern=st.sampled_from(PATTERNS),
    seed=st.integers(0, 2**32 - 1),
    block=st.sampled_from([64, 1000, 1 << 20]),
)
def test_context_positions_round_trip(dtype: str, numel: int, pattern: str, seed: int, block: int) -> None:
    """The position code alone, for every change pattern (the encoder may prefer plain gaps)."""
    rng = np.random.default_rng(seed)
    spec = TensorSpec("w", dtype, (numel,))
    base = random_words(rng, spec.dt.width, numel)
    if pattern == "one":
        pos = rng.integers(0, numel, 1)
    elif pattern == "all":
        pos = np.arange(numel)
    elif pattern == "clustered":
        start = int(rng.integers(0, numel))
        pos = np.arange(start, min(numel, start + int(rng.integers(1, 200))))
    elif pattern == "one_group":  # every change in the elements of one exponent class
        m, e = context_coding.exponent_field(spec)
        ex = (base.astype(np.int64) >> m) & ((1 << e) - 1)
        pos = np.flatnonzero(ex == ex[int(rng.integers(0, numel))])
    elif pattern == "block_edges":
        pos = np.array([p for p in (0, block - 1, block, 2 * block - 1, numel - 1) if p < numel])
    else:
        pos = np.flatnonzero(rng.random(numel) < rng.random())
    pos = np.unique(pos).astype(np.int64)
    if pos.size == 0:
        pos = np.array([numel - 1])
    old = context_coding.CTX_BLOCK
    context_coding.CTX_BLOCK = block  # several blocks in a small tensor (restored below)
    try:
        got = _ctx_round_trip(spec, base, pos)
    finally:
        context_coding.CTX_BLOCK = old
    np.testing.assert_array_equal(got, pos)


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(0, 5000), min_size=1, max_size=50), m=st.integers(1, 3000))
def test_golomb_codes_round_trip(gaps: list[int], m: int) -> None:
    """Quotients in unary, remainders in truncated binary (b - 1 bits, then an extra bit for the long ones)."""
    q, rem = context_coding._golomb(np.array(gaps, dtype=np.int64), m)
    writer = StreamWriter()
    writer.emit({"bits": [Fields(unary_bits(q), 1), *rem]})
    table, _ = writer.finish()
    reader = StreamReader([(name, raw, memoryview(comp)) for name, raw, comp in table])
    got = context_coding._read_golomb_remainders(reader, reader.read_unary("bits", len(gaps)), m)
    reader.finish()
    assert got.tolist() == gaps
    b = (m - 1).bit_length()
    # each remainder costs b - 1 or b bits (b for all when m is a power of two: Rice)
    assert sum(p.values.size * p.width for p in rem) == sum(b - ((g % m) < (1 << b) - m) for g in gaps)


def _golomb_mean_bits(p: float, m: int) -> float:
    """Expected Golomb code length (parameter m) of a geometric gap with success rate p."""
    theta = 1 - p
    tail = theta**m
    b = (m - 1).bit_length()
    short = (1 - theta ** ((1 << b) - m)) / (1 - tail)  # P(remainder < c): those take b - 1 bits
    return 1 + tail / (1 - tail) + b - short


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 1 << 20), frac=st.floats(0.0001, 1.0))
def test_golomb_param_is_near_optimal_for_geometric_gaps(n: int, frac: float) -> None:
    k = max(1, min(n, round(frac * n)))
    m = context_coding.golomb_param(n, k)
    p = k / n
    if p >= 1:
        assert m == 1
        return
    best = min(_golomb_mean_bits(p, j) for j in range(max(1, m // 2), 2 * m + 3))
    assert _golomb_mean_bits(p, m) <= best * 1.01  # the integer approximation: within 1% (0.7% at worst)


@settings(max_examples=100, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    numel=st.integers(1, 3000),
    rate=st.floats(0.0, 1.0),
    groups=st.integers(0, 15),
    seed=st.integers(0, 2**32 - 1),
)
def test_context_bits_stay_within_the_declared_bound(
    dtype: str, numel: int, rate: float, groups: int, seed: int
) -> None:
    """What the encoder writes never exceeds the bound a reader enforces (patch_format.raw_bound),
    for any thresholds and densities (dense groups code their unchanged elements)."""
    rng = np.random.default_rng(seed)
    spec = TensorSpec("w", dtype, (numel,))
    base, pos, th = ctx_case(rng, spec, rate, groups)
    e = context_coding.exponent_field(spec)[1]
    fields = ctx_fields(spec, base, pos, th)
    assert fields is not None
    assert context_coding.field_bits(fields) <= context_coding.ctx_bound_bits(numel, pos.size, e)
    writer = StreamWriter()
    writer.emit({"bits": fields})
    table, _ = writer.finish()
    reader = StreamReader([(name, raw, memoryview(comp)) for name, raw, comp in table])
    np.testing.assert_array_equal(read_ctx_positions(reader, spec, pos.size, base), pos)
    event("dense" if 2 * pos.size > numel else "sparse")


def test_real_like_step_chooses_contexts_and_is_smaller() -> None:
    base, target = adam_like_pair(seed=5, rows=600)
    v1 = encode_patch(base, target, payload_format=1)
    v2 = encode_patch(base, target, payload_format=2)
    assert Counter(t.encoding for t in v2.tensors)[Encoding.SPARSE_CTX] >= 2
    assert len(v2.payload) < 0.9 * len(v1.payload)
    assert apply_patch(base.clone(), v2.payload, target.specs).bitwise_equal(target)


# ---------------------------------------------------------------- hostile input


@cache
def _ctx_case() -> tuple[ServedModel, ServedModel, bytes]:
    spec = [TensorSpec("a", "BF16", (1500,)), TensorSpec("b", "F8_E4M3", (700,))]
    rng = np.random.default_rng(7)
    pairs = [magnitude_skewed(rng, s, 0.05) for s in spec]
    base = model_from_words(spec, [p[0] for p in pairs])
    target = model_from_words(spec, [p[1] for p in pairs])
    payload = encode_patch(base, target, payload_format=2).payload
    assert Encoding.SPARSE_CTX in [e for e, _ in read_header(payload, target.specs).records]
    return base, target, payload


def _outcome(payload: bytes) -> str:
    base, target, _ = _ctx_case()
    try:
        out = apply_patch(base.clone(), payload, target.specs)
    except PatchswarmError:
        return "error"
    return "same" if out.bitwise_equal(target) else "differs"


def _window_bytes(payload: bytes) -> set[int]:
    """Offsets of the window-descriptor bytes of zstd frames without the single-segment flag: the
    only bytes whose corruption can leave the decoded result unchanged (test_codec_bad_input.py)."""
    out = set()
    at = payload.find(b"\x28\xb5\x2f\xfd")
    while at >= 0:
        if not payload[at + 4] & 0x20:
            out.add(at + 5)
        at = payload.find(b"\x28\xb5\x2f\xfd", at + 1)
    return out


def test_every_single_byte_corruption_of_a_format2_payload_is_refused_or_visible() -> None:
    """The decoder refuses or decodes something else; the manifest's chunk hashes and the target root
    (test_patchfile.py) catch what decodes."""
    _, _, payload = _ctx_case()
    slack = _window_bytes(payload)
    outcomes: Counter[str] = Counter()
    for pos in range(len(payload)):
        for xor in (0x01, 0x02, 0x10, 0x80):
            bad = bytearray(payload)
            bad[pos] ^= xor
            result = _outcome(bytes(bad))
            outcomes[result] += 1
            if pos < 12:
                assert result == "error", (pos, xor)
            if result == "same":
                assert pos in slack, (pos, xor)
    assert outcomes["error"] > 0 and outcomes["differs"] > 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4))
def test_flipped_context_bits_are_refused_or_visible(flips: list[int]) -> None:
    """Bits of the context code flipped: a FormatError or another target, never a crash and never the
    same target (the code is a sequence of prefix codes and checked thresholds: one spelling)."""
    outcome = _outcome(with_bits_flipped(_ctx_case()[2], flips))
    event(outcome)
    assert outcome != "same"


def test_format2_records_in_a_format1_payload_are_refused() -> None:
    _, target, payload = _ctx_case()
    with pytest.raises(FormatError, match="needs payload format 2"):
        apply_patch(_ctx_case()[0].clone(), payload[:4] + b"\x01" + payload[5:], target.specs)


def test_a_wrong_base_is_refused_before_any_write() -> None:
    base, target = adam_like_pair(seed=9)
    patch = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0, payload_format=2)
    assert patch.payload[4] == 2
    wrong = base.clone()
    wrong.data[0][0] ^= 1  # a base whose digest differs by one bit
    before = wrong.clone()
    with pytest.raises(BaseMismatchError):
        apply_version(wrong, patch.manifest, patch.payload)
    assert wrong.bitwise_equal(before)
    model, _ = apply_version(base.clone(), patch.manifest, patch.payload)
    assert model.bitwise_equal(target)


# ---------------------------------------------------------------- committed test vectors


@pytest.mark.parametrize("fmt", [1, 2])
def test_committed_vectors_decode_to_their_target(fmt: int) -> None:
    base = load_safetensors(VECTORS / "base.safetensors")
    target = load_safetensors(VECTORS / "target.safetensors")
    payload = (VECTORS / f"payload-format{fmt}.bin").read_bytes()
    assert payload[4] == fmt
    encs = {e for e, _ in read_header(payload, target.specs).records}
    assert (Encoding.SPARSE_CTX in encs) == (fmt == 2)
    assert apply_patch(base, payload, target.specs).bitwise_equal(target)
