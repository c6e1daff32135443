"""The patch codec reproduces the target bit for bit, whatever changed and however."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings

from patchswarm.protocol import value_coding
from patchswarm.protocol.codec import apply_patch, encode_patch, iter_updates
from patchswarm.protocol.errors import LayoutMismatchError
from patchswarm.protocol.patch_format import EncodedPatch, Encoding, read_header
from patchswarm.protocol.served import ServedModel, TensorSpec
from tests.support.strategies import (
    ALL_DTYPES,
    CHANGE_KINDS,
    FLOAT_DTYPES,
    INT_DTYPES,
    model_from_words,
    mutate,
    patch_cases,
    random_words,
    words,
)


def _changed(base: ServedModel, target: ServedModel, i: int) -> int:
    return int(np.count_nonzero(words(base, i) != words(target, i)))


def _round_trip(base: ServedModel | None, target: ServedModel) -> EncodedPatch:
    before = base.clone() if base is not None else None
    patch = encode_patch(base, target)
    if base is not None:
        assert before is not None and base.bitwise_equal(before)  # encoding leaves the base alone
    out = apply_patch(base.clone() if base is not None else None, patch.payload, target.specs)
    assert out.specs == target.specs
    assert out.bitwise_equal(target)
    assert out.root() == target.root()
    return patch


@settings(max_examples=300)
@given(patch_cases())
def test_round_trip_is_bitwise_exact(case: tuple[ServedModel, ServedModel, list[str]]) -> None:
    base, target, kinds = case
    patch = _round_trip(base, target)
    assert [t.name for t in patch.tensors] == [s.name for s in target.specs]
    for i, (stat, spec) in enumerate(zip(patch.tensors, target.specs, strict=True)):
        k = _changed(base, target, i)
        event(f"{kinds[i]} -> {stat.encoding.name}")
        assert stat.changed == k and stat.numel == spec.numel
        if k == 0:
            assert stat.encoding == Encoding.SAME
        else:
            assert stat.encoding != Encoding.SAME
            if stat.encoding == Encoding.SPARSE_ULP:
                assert spec.dt.is_float
        if kinds[i] == "dense" and spec.numel >= 64:
            assert stat.encoding in (Encoding.XOR, Encoding.FULL), (spec, stat)
    assert patch.changed == sum(_changed(base, target, i) for i in range(len(target.specs)))
    assert patch.numel == sum(s.numel for s in target.specs)
    header = read_header(patch.payload, target.specs)
    assert header.records == [(t.encoding, t.changed) for t in patch.tensors]
    assert sum(r for _, r, _ in header.streams) == patch.raw_size


@settings(max_examples=150)
@given(patch_cases(dtypes=FLOAT_DTYPES, max_numel=2000))
def test_float_round_trip(case: tuple[ServedModel, ServedModel, list[str]]) -> None:
    _round_trip(case[0], case[1])


@given(patch_cases())
def test_anchor_round_trip(case: tuple[ServedModel, ServedModel, list[str]]) -> None:
    _, target, _ = case
    patch = _round_trip(None, target)
    assert all(t.encoding == Encoding.FULL for t in patch.tensors)
    assert all(t.changed == t.numel for t in patch.tensors)


@given(patch_cases())
def test_identical_versions_are_all_same(case: tuple[ServedModel, ServedModel, list[str]]) -> None:
    base = case[0]
    patch = _round_trip(base, base.clone())
    assert all(t.encoding == Encoding.SAME and t.changed == 0 for t in patch.tensors)
    assert patch.raw_size == 0
    assert read_header(patch.payload, base.specs).streams == []
    assert list(iter_updates(patch.payload, base.specs, base)) == []


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("kind", CHANGE_KINDS)
def test_every_dtype_and_change_kind(name: str, kind: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{name}/{kind}".encode()))
    spec = [TensorSpec("a", name, (0,)), TensorSpec("w", name, (50, 7)), TensorSpec("z", name, ())]
    old = [random_words(rng, s.dt.width, s.numel) for s in spec]
    new = [mutate(rng, name, o, kind) for o in old]
    base, target = model_from_words(spec, old), model_from_words(spec, new)
    patch = _round_trip(base, target)
    assert patch.tensors[0].encoding == Encoding.SAME  # zero-size tensors never change
    if kind == "same":
        assert all(t.encoding == Encoding.SAME for t in patch.tensors)
    if kind == "dense":
        assert patch.tensors[1].encoding in (Encoding.XOR, Encoding.FULL)
    if kind == "ulp" and name in FLOAT_DTYPES:
        assert patch.tensors[1].encoding == Encoding.SPARSE_ULP
    if kind == "sparse" and name in INT_DTYPES:
        assert patch.tensors[1].encoding == Encoding.SPARSE_RAW
    _round_trip(None, target)


@pytest.mark.parametrize("name", ["BF16", "F32", "F64", "F8_E4M3", "I8", "U64"])
def test_far_apart_changes(name: str) -> None:
    # Changes tens of thousands of elements apart, at both ends, and a run in between.
    spec = [TensorSpec("w", name, (200_003,))]
    rng = np.random.default_rng(1)
    old = random_words(rng, spec[0].dt.width, spec[0].numel)
    new = old.copy()
    for p in (0, 0xFFFF, 0xFFFF + 1 + 0xFFFF, 0x1FFFE + 0x10000 + 5, 200_002):
        new[p] ^= 1
    new[150_000:150_003] ^= 2
    base, target = model_from_words(spec, [old]), model_from_words(spec, [new])
    patch = _round_trip(base, target)
    assert patch.tensors[0].encoding in (Encoding.SPARSE_ULP, Encoding.SPARSE_RAW)


def test_ulp_escapes_and_sign_crossings() -> None:
    # Few enough changes (< DENSE_PROBE) that the sparse encoding is the one used.
    vals = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.0, float("inf"), float("nan"), -2.5] * 400)
    base = ServedModel.from_tensors({"x": vals.bfloat16(), "y": vals.clone()})
    t = {"x": base.typed(0).clone(), "y": base.typed(1).clone()}
    xw, yw = t["x"].view(torch.int16)[:200], t["y"].view(torch.int32)[:200]
    xw[::8] = -0x8000  # +0 -> -0
    xw[1::8] = 0  # -0 -> +0
    xw[2::8] = -xw[2::8]  # far jumps (escapes)
    xw[3::8] += 1  # -1e-40 one step further from zero
    yw[4::8] += 1
    yw[6::8] = 0x7FC00001  # NaN payload change
    yw[7::8] = 0x7F800000  # -2.5 -> +inf (escape)
    target = ServedModel.from_tensors(t)
    patch = _round_trip(base, target)
    # (SPARSE_CTX, where the default format 2 finds contexts pay, codes values exactly as SPARSE_ULP)
    assert all(t.encoding in (Encoding.SPARSE_ULP, Encoding.SPARSE_CTX) for t in patch.tensors)


def test_adam_like_step_is_sparse_ulp_and_small() -> None:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(400, 256, generator=g) * 0.02
    step = master - 1e-6 * torch.sign(torch.randn(master.shape, generator=g)) * 4
    base = ServedModel.from_tensors({"w": master.bfloat16()})
    target = ServedModel.from_tensors({"w": step.bfloat16()})
    patch = _round_trip(base, target)
    assert 0 < patch.changed < patch.numel
    assert patch.tensors[0].encoding in (Encoding.SPARSE_ULP, Encoding.SPARSE_CTX)
    assert len(patch.payload) < target.nbytes / 4


def test_progress_reports_every_tensor() -> None:
    base = ServedModel.from_tensors({"a": torch.zeros(3), "b": torch.ones(5, dtype=torch.int8)})
    target = base.clone()
    target.data[0][0] = 1
    seen: list[int] = []
    encode_patch(base, target, progress=seen.append)
    assert seen == [12, 5]


def test_small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dense encodings go slice by slice: shrink the slice to cover the seams.
    monkeypatch.setattr(value_coding, "SLICE", 7)
    rng = np.random.default_rng(5)
    spec = [TensorSpec("a", "BF16", (50,)), TensorSpec("b", "I64", (23,))]
    old = [random_words(rng, s.dt.width, s.numel) for s in spec]
    new = [mutate(rng, s.dtype, o, "dense") for s, o in zip(spec, old, strict=True)]
    base, target = model_from_words(spec, old), model_from_words(spec, new)
    _round_trip(base, target)
    _round_trip(None, target)


def test_encode_refuses_a_different_layout() -> None:
    a = ServedModel.from_tensors({"x": torch.zeros(4)})
    b = ServedModel.from_tensors({"x": torch.zeros(5)})
    with pytest.raises(LayoutMismatchError):
        encode_patch(a, b)
