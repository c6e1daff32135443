"""Served versions: safetensors round trip, digests, layout hash, and refusal of bad files."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol import safetensors_io
from patchswarm.protocol.dtypes import BY_NAME, BY_TORCH, dtype, from_torch
from patchswarm.protocol.errors import FormatError, LayoutMismatchError, UnsupportedDtypeError
from patchswarm.protocol.safetensors_io import load_safetensors, save_safetensors
from patchswarm.protocol.served import ServedModel, TensorSpec, layout_hash, raw_bytes, typed_view, word_view
from tests.support.strategies import ALL_DTYPES, model_from_words, models, random_words, seeds

EXPECTED_DTYPES = {
    "BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2",
    "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL",
}  # fmt: skip


def _one_of_each(seed: int, shape: tuple[int, ...] = (3, 5)) -> ServedModel:
    rng = np.random.default_rng(seed)
    specs = [TensorSpec(f"t.{name}", name, shape) for name in ALL_DTYPES]
    arrays = []
    for s in specs:
        w = random_words(rng, s.dt.width, s.numel)
        if s.dtype == "BOOL":
            w = w & 1  # keep bools canonical: torch may normalise other byte values
        arrays.append(w)
    return model_from_words(specs, arrays, {"format": "pt", "step": str(seed)})


def _save_load(model: ServedModel) -> ServedModel:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.safetensors"
        save_safetensors(model, path)
        assert sorted(os.listdir(d)) == ["m.safetensors"]  # atomic write leaves no temp file
        return load_safetensors(path)


def test_dtype_table_covers_the_safetensors_dtypes() -> None:
    assert set(BY_NAME) >= EXPECTED_DTYPES
    if hasattr(torch, "float8_e8m0fnu"):
        assert "F8_E8M0" in BY_NAME and not BY_NAME["F8_E8M0"].is_float
    for name, dt in BY_NAME.items():
        assert dtype(name) is dt and from_torch(dt.torch_dtype) is dt and BY_TORCH[dt.torch_dtype] is dt
        assert torch.empty(0, dtype=dt.torch_dtype).element_size() == dt.width
        assert dt.word_dtype.itemsize == dt.width and dt.word_dtype.is_signed
    with pytest.raises(UnsupportedDtypeError):
        dtype("C64")
    with pytest.raises(UnsupportedDtypeError):
        from_torch(torch.complex64)
    assert issubclass(UnsupportedDtypeError, FormatError)


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_every_dtype_round_trips_through_safetensors(name: str) -> None:
    rng = np.random.default_rng(7)
    spec = TensorSpec("w", name, (4, 3, 2))
    w = random_words(rng, spec.dt.width, spec.numel)
    if name == "BOOL":
        w = w & 1
    model = model_from_words([spec], [w], {"k": "v"})
    back = _save_load(model)
    assert back.bitwise_equal(model)
    assert back.metadata == {"k": "v"}
    assert back.typed(0).dtype == BY_NAME[name].torch_dtype and tuple(back.typed(0).shape) == (4, 3, 2)
    assert back.root() == model.root()


def test_all_dtypes_together_round_trip_with_metadata() -> None:
    model = _one_of_each(1)
    back = _save_load(model)
    assert back.bitwise_equal(model)
    assert back.metadata == model.metadata
    assert back.layout_hash() == model.layout_hash()
    assert back.digests() == model.digests()


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 2), ()])
def test_zero_size_and_scalar_tensors_round_trip(shape: tuple[int, ...]) -> None:
    model = _one_of_each(2, shape)
    back = _save_load(model)
    assert back.bitwise_equal(model)
    for i, spec in enumerate(back.specs):
        assert spec.shape == shape
        assert tuple(back.typed(i).shape) == shape
        assert word_view(back.data[i], spec).numel() == spec.numel


@given(models(max_numel=64))
def test_random_models_round_trip(model: ServedModel) -> None:
    # Random bits everywhere (NaN payloads, -0, non-canonical bools): safetensors moves bytes only.
    back = _save_load(model)
    assert back.bitwise_equal(model)
    assert back.metadata == model.metadata
    assert back.root() == model.root()


def test_from_tensors_sorts_and_shares_bytes() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    model = ServedModel.from_tensors({"z": a, "a": torch.ones(2, dtype=torch.int64)}, {"m": "1"})
    assert [s.name for s in model.specs] == ["a", "z"]
    assert model.specs[1] == TensorSpec("z", "F32", (2, 3))
    assert model.data[1].data_ptr() == a.data_ptr()  # contiguous tensors are viewed, not copied
    assert torch.equal(model.typed(1), a)
    t = a.t()  # non-contiguous: copied in row-major order of its own shape
    assert torch.equal(typed_view(raw_bytes(t), TensorSpec("t", "F32", (3, 2))), t)
    with pytest.raises(ValueError):
        ServedModel([TensorSpec("b", "U8", (1,)), TensorSpec("a", "U8", (1,))], [torch.zeros(1, dtype=torch.uint8)] * 2)
    with pytest.raises(ValueError):
        ServedModel([TensorSpec("a", "F32", (2,))], [torch.zeros(4, dtype=torch.uint8)])


@given(models(max_numel=32), seeds)
def test_digests_are_stable_and_sensitive_to_any_bit(model: ServedModel, seed: int) -> None:
    root = model.root()
    digests = model.digests()
    assert model.clone().root() == root and model.root() == root
    assert all(len(d) == 32 for d in digests) and len(root) == 32
    nonempty = [i for i, s in enumerate(model.specs) if s.nbytes]
    if not nonempty:
        return
    rng = np.random.default_rng(seed)
    i = int(rng.choice(nonempty))
    byte = int(rng.integers(model.specs[i].nbytes))
    bit = int(rng.integers(8))
    other = model.clone()
    other.data[i][byte] ^= 1 << bit
    assert not other.bitwise_equal(model)
    assert other.digests()[i] != digests[i]
    assert [d for j, d in enumerate(other.digests()) if j != i] == [d for j, d in enumerate(digests) if j != i]
    assert other.root() != root
    assert other.layout_hash() == model.layout_hash()


def test_digest_of_known_values() -> None:
    import blake3

    model = ServedModel.from_tensors({"x": torch.tensor([1, 2, 3], dtype=torch.uint8)})
    assert model.digests() == [blake3.blake3(b"\x01\x02\x03").digest()]
    assert ServedModel.from_tensors({"x": torch.empty(0)}).digests() == [blake3.blake3(b"").digest()]


def test_layout_hash_and_root_are_sensitive_to_name_dtype_and_shape() -> None:
    base = [TensorSpec("a", "F32", (2, 3)), TensorSpec("b", "I8", (4,))]
    variants = [
        [TensorSpec("a2", "F32", (2, 3)), base[1]],
        [TensorSpec("a", "I32", (2, 3)), base[1]],
        [TensorSpec("a", "U32", (2, 3)), base[1]],
        [TensorSpec("a", "F32", (3, 2)), base[1]],
        [TensorSpec("a", "F32", (6,)), base[1]],
        [TensorSpec("a", "F32", (2, 3, 1)), base[1]],
        [base[0], TensorSpec("b", "U8", (4,))],
        [base[0]],
    ]
    h = layout_hash(base)
    assert layout_hash(list(base)) == h
    hashes = {layout_hash(v) for v in variants}
    assert h not in hashes and len(hashes) == len(variants)
    # Same bytes under a different layout: the state root differs as well.
    data = [torch.zeros(24, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    root = ServedModel(base, data).root()
    for v in variants[1:6]:
        assert ServedModel(v, data).root() != root


def test_same_layout() -> None:
    a = _one_of_each(3)
    b = _one_of_each(4)
    a.same_layout(b)
    c = _one_of_each(3, (15,))
    with pytest.raises(LayoutMismatchError):
        a.same_layout(c)


# ---------------------------------------------------------------- bad files


def _valid_file_bytes() -> bytes:
    return safetensors.torch.save(
        {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 3, dtype=torch.bfloat16)},
        metadata={"x": "y"},
    )


def _load_bytes(blob: bytes) -> ServedModel:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "f.safetensors"
        p.write_bytes(blob)
        return load_safetensors(p)


def test_valid_bytes_load() -> None:
    m = _load_bytes(_valid_file_bytes())
    assert [s.name for s in m.specs] == ["a", "b"] and m.metadata == {"x": "y"}


def test_truncated_file_at_every_length_is_a_format_error() -> None:
    blob = _valid_file_bytes()
    for n in range(len(blob)):
        with pytest.raises(FormatError):
            _load_bytes(blob[:n])


@given(st.binary(max_size=200))
def test_garbage_file_is_a_format_error(blob: bytes) -> None:
    with pytest.raises(FormatError):
        _load_bytes(blob)


@pytest.mark.parametrize(
    "header",
    [
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 9]}},  # offsets do not match the shape
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4096]}},  # past the end of the file
        {"a": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}},  # unknown dtype
        {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}},
        {"a": {"dtype": "F32", "shape": [2]}},
        [1, 2, 3],
    ],
)
def test_forged_headers_are_format_errors(header: object) -> None:
    h = json.dumps(header).encode()
    with pytest.raises(FormatError):
        _load_bytes(struct.pack("<Q", len(h)) + h + bytes(8))
    with pytest.raises(FormatError):  # a header length far past the end of the file
        _load_bytes(struct.pack("<Q", 1 << 40) + h)


def test_missing_file_is_not_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_safetensors(tmp_path / "nope.safetensors")


def test_atomic_save_replaces_whole_file_and_cleans_up_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.safetensors"
    first = _one_of_each(5)
    save_safetensors(first, path)
    second = _one_of_each(6)
    save_safetensors(second, path)
    assert os.listdir(tmp_path) == ["m.safetensors"]
    assert load_safetensors(path).bitwise_equal(second)

    def failing_save(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_io.safetensors.torch, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(first, path)
    assert os.listdir(tmp_path) == ["m.safetensors"]  # no temp file left behind
    monkeypatch.undo()
    assert load_safetensors(path).bitwise_equal(second)  # the old file is untouched
