"""The SPARSE_CTX context pass in torch (protocol/context_pass_torch.py) against the numpy pass
(protocol/context_coding.py): decoding, the same positions or the same refusal; encoding, the same
fields; for every float dtype, shape, threshold set (1 to 16 groups), density, block size and batch
size; on CPU tensors (the CPU twin) and on CUDA where there is one.  Then whole patches through it:
encoded from torch tensors into the same bytes, applied to a base held as torch tensors bitwise,
and a corrupted record refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import event, given, settings
from hypothesis import strategies as st

from patchswarm.protocol import context_coding, context_pass_torch
from patchswarm.protocol.codec import apply_patch, encode_patch
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.patch_format import Encoding, read_header
from patchswarm.protocol.served import ServedModel, TensorSpec
from patchswarm.protocol.streams import Piece, StreamWriter
from tests.support.format2 import (
    case_thresholds,
    ctx_case,
    ctx_sizes,
    decode_positions,
    magnitude_skewed,
    with_bits_flipped,
)
from tests.support.helpers import adam_like_pair
from tests.support.strategies import FLOAT_DTYPES, model_from_words, patch_cases

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CPU twin runs")
    ),
]

# A record's shape, blocks, batches, density and thresholds: what both passes' tests draw.
CASES = {
    "dtype": st.sampled_from(FLOAT_DTYPES),
    "numel": st.integers(1, 3000),
    "block": st.sampled_from([8, 64, 1000, 1 << 20]),
    "batch": st.sampled_from([1, 100, 1 << 23]),
    "rate": st.floats(0.0, 1.0),
    "groups": st.integers(0, 15),
    "few_exponents": st.booleans(),
}


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=200, deadline=None)
@given(
    **CASES,
    flips=st.lists(st.integers(0, 1 << 14), max_size=3),
    lie=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_torch_pass_decodes_what_the_numpy_pass_decodes(
    device: str,
    dtype: str,
    numel: int,
    block: int,
    batch: int,
    rate: float,
    groups: int,
    few_exponents: bool,
    flips: list[int],
    lie: bool,
    seed: int,
) -> None:
    """Intact codes: both passes give the encoded positions.  Flipped bits or a lying change count:
    both give the same positions or the same error (the passes differ only in where they compute)."""
    rng = np.random.default_rng(seed)
    spec = TensorSpec("w", dtype, (numel,))
    base, pos, th = ctx_case(rng, spec, rate, groups, few_exponents=few_exponents)
    with ctx_sizes(block, batch):
        fields = context_coding.ctx_fields(spec, base, pos, th)
        assert fields is not None
        writer = StreamWriter()
        writer.emit({"bits": fields})
        table, _ = writer.finish()
        raw = bytearray(zstandard.ZstdDecompressor().decompress(table[0][2], max_output_size=1 << 20))
        for f in {f % (8 * len(raw)) for f in flips}:
            raw[f >> 3] ^= 1 << (f & 7)
        k = int(rng.integers(1, numel + 1)) if lie else pos.size
        want = decode_positions(bytes(raw), spec, k, base, None)
        got = decode_positions(bytes(raw), spec, k, base, device)
    if isinstance(want, str):
        assert got == want
        event("refused")
        return
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, want)
    if not flips and not lie:
        np.testing.assert_array_equal(got, pos)
    event(f"{th.size + 1} groups" if th.size < 3 else "3+ groups")


def _stream(fields: list[Piece] | None) -> object:
    if fields is None:
        return None
    writer = StreamWriter()
    writer.emit({"bits": fields})
    return writer.finish()


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=150, deadline=None)
@given(
    **CASES,
    skewed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_torch_pass_encodes_what_the_numpy_pass_encodes(
    device: str,
    dtype: str,
    numel: int,
    block: int,
    batch: int,
    rate: float,
    groups: int,
    few_exponents: bool,
    skewed: bool,
    seed: int,
) -> None:
    """The encoder's side: the same fields for given thresholds (1 to 16 groups) and for the
    thresholds the encoder picks itself (or the same refusal to use contexts)."""
    rng = np.random.default_rng(seed)
    spec = TensorSpec("w", dtype, (numel,))
    if skewed:  # changes favouring small magnitudes: the encoder picks contexts
        base, new = magnitude_skewed(rng, spec, 0.01 + rate / 2)
        pos, th = case_thresholds(rng, spec, base, np.flatnonzero(base != new), groups)
    else:
        base, pos, th = ctx_case(rng, spec, rate, groups, few_exponents=few_exponents)
    m, e = context_coding.exponent_field(spec)
    words = torch.from_numpy(base).to(device)
    with ctx_sizes(block, batch):
        given_np = context_coding.ctx_fields(spec, base, pos, th)
        given_torch = context_coding.encode_ctx(spec, pos, th, context_pass_torch.TorchPass(words, m, e, th, 0, block))
        assert _stream(given_torch) == _stream(given_np)
        chosen = context_coding.ctx_fields(spec, base, pos)
        assert _stream(context_pass_torch.ctx_fields_torch(spec, words, pos)) == _stream(chosen)
    event("contexts chosen" if chosen is not None else "plain gaps chosen")


def _on(model: ServedModel, device: str) -> ServedModel:
    """A copy of ``model`` on ``device`` (on its own device too: an in-place apply must not reach the original)."""
    return ServedModel(model.specs, [t.to(device, copy=True) for t in model.data])


# Refusals by the stream-end checks (StreamReader.finish), which run after the last record is
# applied: apply_patch's caller then discards the model (its docstring).
AFTER_THE_LAST_RECORD = ("bytes left unused", "unused bits at its end", "more data than declared")


def _format2_pairs() -> st.SearchStrategy[tuple[ServedModel, ServedModel]]:
    """Random float layouts and change patterns, and magnitude-skewed steps (which pick SPARSE_CTX)."""

    def skewed(dtype: str, numel: int, rate: float, seed: int) -> tuple[ServedModel, ServedModel]:
        spec = TensorSpec("w", dtype, (numel,))
        old, new = magnitude_skewed(np.random.default_rng(seed), spec, rate)
        return model_from_words([spec], [old]), model_from_words([spec], [new])

    cases = patch_cases(dtypes=FLOAT_DTYPES, max_numel=3000).map(lambda c: (c[0], c[1]))
    skewed_pairs = st.builds(
        skewed, st.sampled_from(FLOAT_DTYPES), st.integers(1000, 20000), st.floats(0.01, 0.5), st.integers(0, 2**32 - 1)
    )
    return st.integers(0, 3).flatmap(lambda i: cases if i == 0 else skewed_pairs)  # 3 in 4 skewed


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(pair=_format2_pairs(), block=st.sampled_from([1000, 1 << 20]), batch=st.sampled_from([1, 1 << 23]))
def test_apply_patch_with_a_torch_base_rebuilds_the_target(
    device: str, pair: tuple[ServedModel, ServedModel], block: int, batch: int
) -> None:
    """Encoded where the base lives (the same bytes as from host numpy) and applied there."""
    base, target = pair
    with ctx_sizes(block, batch):
        payload = encode_patch(base, target, payload_format=2).payload
    with ctx_sizes(block, batch, on_cpu=True):
        assert encode_patch(_on(base, device), _on(target, device), payload_format=2).payload == payload
        out = apply_patch(_on(base, device), payload, target.specs)
    assert all(t.device.type == device for t in out.data)
    assert _on(out, "cpu").bitwise_equal(target)
    event("format 2" if payload[4] == 2 else "format 1 (contexts did not pay)")


@pytest.mark.parametrize("device", DEVICES)
def test_a_real_like_step_applies_through_the_torch_pass(device: str) -> None:
    """Several SPARSE_CTX tensors of an AdamW-like step, with the default block and batch sizes."""
    base, target = adam_like_pair(seed=5, rows=600)
    payload = encode_patch(base, target, payload_format=2).payload
    assert Encoding.SPARSE_CTX in {e for e, _ in read_header(payload, target.specs).records}
    with ctx_sizes(context_coding.CTX_BLOCK, context_pass_torch.BATCH_ELEMENTS, on_cpu=True):
        out = apply_patch(_on(base, device), payload, target.specs)
    assert _on(out, "cpu").bitwise_equal(target)


def test_the_torch_pass_is_taken_for_device_bases_and_only_on_request_for_cpu_ones() -> None:
    """The switch itself: numpy on CPU bases unless ON_CPU (the CPU twin), torch on any other device."""
    assert not context_pass_torch.use_torch_pass(torch.zeros(1))
    assert context_pass_torch.use_torch_pass(torch.zeros(1, device="meta"))
    with ctx_sizes(context_coding.CTX_BLOCK, context_pass_torch.BATCH_ELEMENTS, on_cpu=True):
        assert context_pass_torch.use_torch_pass(torch.zeros(1))


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(flips=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_a_corrupted_context_record_is_refused_before_any_write(device: str, flips: list[int], seed: int) -> None:
    """Bits of a one-tensor format-2 payload's context code flipped: the torch pass refuses exactly
    where the numpy pass does, and then the base is untouched; else both decode the same other target."""
    spec = TensorSpec("w", "BF16", (4000,))
    old, new = magnitude_skewed(np.random.default_rng(seed), spec, 0.05)
    base, target = model_from_words([spec], [old]), model_from_words([spec], [new])
    payload = encode_patch(base, target, payload_format=2).payload
    if read_header(payload, [spec]).records[0][0] != Encoding.SPARSE_CTX:
        event("plain gaps chosen")
        return
    bad = with_bits_flipped(payload, flips)
    outcomes: list[str | ServedModel] = []
    for on_cpu, dev in ((False, "cpu"), (True, device)):
        work = _on(base, dev)
        with ctx_sizes(context_coding.CTX_BLOCK, context_pass_torch.BATCH_ELEMENTS, on_cpu=on_cpu):
            try:
                outcomes.append(_on(apply_patch(work, bad, [spec]), "cpu"))
            except PatchswarmError as exc:
                if not any(end in str(exc) for end in AFTER_THE_LAST_RECORD):
                    assert _on(work, "cpu").bitwise_equal(base)  # nothing written
                outcomes.append(f"{type(exc).__name__}: {exc}")
    numpy_out, torch_out = outcomes
    if isinstance(numpy_out, str):
        assert torch_out == numpy_out
        event("refused")
    else:
        assert isinstance(torch_out, ServedModel) and torch_out.bitwise_equal(numpy_out)
        assert not torch_out.bitwise_equal(target)
        event("decoded another target")
