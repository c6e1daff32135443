"""The SPARSE_CTX position decoder on hostile bits, over several blocks: a valid code (any thresholds,
one to sixteen groups) with bits flipped, cut short or padded, and a record count that may lie.  The
decoder refuses (a PatchswarmError) or returns exactly ``k`` strictly ascending positions inside the
tensor, never crashes; an intact code decodes to its positions (test_codec_ctx.py covers one block
and whole payloads)."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import event, given, settings
from hypothesis import strategies as st

from patchswarm.protocol import context_coding
from patchswarm.protocol.codec import encode_patch
from patchswarm.protocol.errors import FormatError, PatchswarmError
from patchswarm.protocol.patch_format import Encoding, read_header
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.streams import StreamReader, StreamWriter
from tests.support.strategies import FLOAT_DTYPES, model_from_words, random_words


def _code(spec: TensorSpec, base: np.ndarray, pos: np.ndarray, thresholds: np.ndarray) -> bytes:
    fields = context_coding.ctx_fields(spec, base, pos, thresholds)
    assert fields is not None
    writer = StreamWriter()
    writer.emit({"bits": fields})
    table, _ = writer.finish()
    return zstandard.ZstdDecompressor().decompress(table[0][2], max_output_size=1 << 20)


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    numel=st.integers(1, 600),
    block=st.sampled_from([8, 64, 100]),
    seed=st.integers(0, 2**32 - 1),
    groups=st.integers(0, 15),
    flips=st.lists(st.integers(0, 1 << 14), max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 64)),
    pad=st.integers(0, 2),
    lie=st.booleans(),
)
def test_hostile_context_codes_are_refused_or_decode_in_range(
    dtype: str,
    numel: int,
    block: int,
    seed: int,
    groups: int,
    flips: list[int],
    cut: int | None,
    pad: int,
    lie: bool,
) -> None:
    old = context_coding.CTX_BLOCK
    context_coding.CTX_BLOCK = block  # several blocks in a small tensor (restored below)
    try:
        _check(dtype, numel, seed, groups, flips, cut, pad, lie)
    finally:
        context_coding.CTX_BLOCK = old


def _check(
    dtype: str, numel: int, seed: int, groups: int, flips: list[int], cut: int | None, pad: int, lie: bool
) -> None:
    rng = np.random.default_rng(seed)
    spec = TensorSpec("w", dtype, (numel,))
    base = random_words(rng, spec.dt.width, numel)
    if rng.random() < 0.5:  # few distinct exponents: big groups, long runs
        base = base[rng.integers(0, min(numel, 4), numel)]
    pos = np.unique(rng.integers(0, numel, int(rng.integers(1, numel + 1)))).astype(np.int64)
    m, e = context_coding.exponent_field(spec)
    ex = np.unique((base[pos].astype(np.int64) >> m) & ((1 << e) - 1))
    ex = ex[ex > 0]
    thresholds = np.sort(rng.choice(ex, min(ex.size, groups), replace=False)) if ex.size else ex
    raw = bytearray(_code(spec, base, pos, thresholds.astype(np.int64)))
    for f in {f % (8 * len(raw)) for f in flips}:
        raw[f >> 3] ^= 1 << (f & 7)
    if cut is not None:
        raw = raw[: max(0, len(raw) - cut)]
    raw += bytes(pad)
    k = int(rng.integers(1, numel + 1)) if lie else pos.size
    intact = not flips and cut is None and not pad and not lie
    reader = StreamReader([("bits", len(raw), memoryview(zstandard.compress(bytes(raw))))])
    try:
        got = context_coding.read_ctx_positions(reader, spec, k, base)
        reader.finish()
    except PatchswarmError:
        assert not intact
        event("refused")
        return
    event("decoded")
    assert got.size == k and got[0] >= 0 and got[-1] < numel and bool(np.all(np.diff(got) > 0))
    if intact:
        np.testing.assert_array_equal(got, pos)


@pytest.mark.parametrize(("served", "as_int"), [("BF16", "I16"), ("F8_E4M3", "U8"), ("F32", "I32")])
def test_a_context_record_on_an_integer_tensor_is_refused_at_the_header(served: str, as_int: str) -> None:
    """The same bytes under a layout that calls the tensor an integer: refused before any stream is read."""
    spec = TensorSpec("w", served, (3000,))
    rng = np.random.default_rng(3)
    base = random_words(rng, spec.dt.width, spec.numel)
    m, e = context_coding.exponent_field(spec)
    ex = (base.astype(np.int64) >> m) & ((1 << e) - 1)
    low = int(np.quantile(ex, 0.1))
    # Every element of exponent <= low changes, and one of the next exponent up (a threshold must be
    # the exponent of a change): the low context is all changes, cheaper than plain gaps.
    changed = np.flatnonzero(ex <= low)
    changed = np.append(changed, np.flatnonzero(ex > low)[np.argmin(ex[ex > low])])
    new = base.copy()
    new[changed] ^= np.array(1, dtype=base.dtype)
    b, t = model_from_words([spec], [base]), model_from_words([spec], [new])
    payload = encode_patch(b, t, payload_format=2).payload
    assert read_header(payload, [spec]).records[0][0] == Encoding.SPARSE_CTX
    with pytest.raises(FormatError, match=f"context coding used on dtype {as_int}"):
        read_header(payload, [TensorSpec("w", as_int, (3000,))])
