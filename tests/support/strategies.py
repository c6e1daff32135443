"""Shared hypothesis strategies for the protocol-core tests.

Tests build tensors from raw bits (numpy generators seeded by hypothesis), never from float
arithmetic, so every bit pattern (NaN payloads, -0, subnormals, invalid bools) is reachable.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from patchswarm.protocol.dtypes import BY_NAME
from patchswarm.protocol.served import ServedModel, TensorSpec

ALL_DTYPES: list[str] = sorted(BY_NAME)
FLOAT_DTYPES: list[str] = [n for n in ALL_DTYPES if BY_NAME[n].is_float]
INT_DTYPES: list[str] = [n for n in ALL_DTYPES if not BY_NAME[n].is_float]
LE_WORDS: dict[int, np.dtype[np.signedinteger]] = {
    1: np.dtype("<i1"),
    2: np.dtype("<i2"),
    4: np.dtype("<i4"),
    8: np.dtype("<i8"),
}

seeds = st.integers(min_value=0, max_value=2**32 - 1)
tensor_names = st.text(alphabet="abcxyz._0123", min_size=1, max_size=8)


def random_words(rng: np.random.Generator, width: int, n: int) -> np.ndarray:
    """``n`` uniformly random raw words of ``width`` bytes (every bit pattern possible)."""
    return rng.integers(0, 256, size=n * width, dtype=np.uint8).view(LE_WORDS[width])


def words(model: ServedModel, i: int) -> np.ndarray:
    """Writable signed-integer numpy view of tensor ``i``'s elements (shares the model's memory)."""
    return model.data[i].numpy().view(LE_WORDS[model.specs[i].dt.width])


def model_from_words(
    specs: list[TensorSpec], arrays: list[np.ndarray], meta: dict[str, str] | None = None
) -> ServedModel:
    data = [torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).copy()) for a in arrays]
    return ServedModel(list(specs), data, dict(meta or {}))


@st.composite
def shapes(draw: st.DrawFn, max_numel: int = 300) -> tuple[int, ...]:
    ndim = draw(st.integers(0, 3))
    dims: list[int] = []
    left = max_numel
    for _ in range(ndim):
        d = draw(st.integers(0, max(0, min(left, 40 if ndim > 1 else max_numel))))
        dims.append(d)
        left = max(1, left // max(d, 1))
    return tuple(dims)


@st.composite
def layouts(
    draw: st.DrawFn, dtypes: list[str] | None = None, max_tensors: int = 4, max_numel: int = 300
) -> list[TensorSpec]:
    names = draw(st.lists(tensor_names, min_size=1, max_size=max_tensors, unique=True))
    pool = dtypes or ALL_DTYPES
    return [TensorSpec(name, draw(st.sampled_from(pool)), draw(shapes(max_numel))) for name in sorted(names)]


@st.composite
def models(draw: st.DrawFn, dtypes: list[str] | None = None, max_tensors: int = 4, max_numel: int = 300) -> ServedModel:
    """A served model with random layout and random raw bits in every tensor."""
    specs = draw(layouts(dtypes, max_tensors, max_numel))
    rng = np.random.default_rng(draw(seeds))
    arrays = [random_words(rng, s.dt.width, s.numel) for s in specs]
    meta = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=10), max_size=3))
    return model_from_words(specs, arrays, meta)


# ---------------------------------------------------------------- change patterns

CHANGE_KINDS = ["same", "sparse", "ulp", "ulp_dense", "dense", "signflip", "nan", "huge", "allsame"]
_EXPONENT_MASK = {"BF16": 0x7F80, "F16": 0x7C00, "F32": 0x7F800000, "F64": 0x7FF0000000000000,
                  "F8_E4M3": 0x78, "F8_E5M2": 0x7C}  # fmt: skip


def _key(w: np.ndarray, bits: int) -> np.ndarray:
    w = w.astype(np.int64)
    return w ^ ((w >> (bits - 1)) & ((1 << (bits - 1)) - 1))


def mutate(rng: np.random.Generator, dtype_name: str, old: np.ndarray, kind: str) -> np.ndarray:
    """A new version of the words ``old`` changed in the way ``kind`` names (see CHANGE_KINDS)."""
    dt = BY_NAME[dtype_name]
    width, bits, n = dt.width, 8 * dt.width, old.size
    new = old.copy()
    if n == 0 or kind == "same":
        return new
    if kind == "dense":
        return random_words(rng, width, n)
    if kind == "allsame":
        return np.full(n, random_words(rng, width, 1)[0], dtype=old.dtype)
    frac = {"sparse": 0.02, "ulp": 0.03, "ulp_dense": 0.7, "signflip": 0.3, "nan": 0.1, "huge": 0.2}[kind]
    m = rng.random(n) < frac
    if not m.any():
        m[rng.integers(n)] = True
    k = int(m.sum())
    sign = np.array(-1 << (bits - 1), dtype=np.int64).astype(old.dtype)
    if kind == "sparse":
        new[m] = random_words(rng, width, k)
    elif kind in ("ulp", "ulp_dense"):
        # Steps of a few units on the ordered line (a rounding step of a real update), signs crossed.
        step = rng.choice(np.array([-3, -2, -1, 1, 1, 1, 2, 3, 200, -200]), size=k)
        key = _key(old[m], bits) + step
        if width < 8:
            key = np.clip(key, -(1 << (bits - 1)), (1 << (bits - 1)) - 1)
        new[m] = (key ^ ((key >> 63) & ((1 << (bits - 1)) - 1))).astype(old.dtype)
    elif kind == "signflip":
        new[m] = old[m] ^ sign
    elif kind == "nan":
        exp = np.array(_EXPONENT_MASK.get(dtype_name, -1), dtype=np.int64).astype(old.dtype)
        new[m] = old[m] | exp | np.array(1, dtype=old.dtype)  # NaN bit patterns (any payload, either sign)
    elif kind == "huge":
        new[m] = old[m] ^ (random_words(rng, width, k) | np.array(1 << (bits - 2), dtype=np.int64).astype(old.dtype))
    return new


@st.composite
def patch_cases(
    draw: st.DrawFn, dtypes: list[str] | None = None, max_numel: int = 300
) -> tuple[ServedModel, ServedModel, list[str]]:
    """(base, target, change kind per tensor) over a random layout."""
    specs = draw(layouts(dtypes, max_tensors=5, max_numel=max_numel))
    kinds = [draw(st.sampled_from(CHANGE_KINDS)) for _ in specs]
    rng = np.random.default_rng(draw(seeds))
    old = [random_words(rng, s.dt.width, s.numel) for s in specs]
    new = [mutate(rng, s.dtype, o, kind) for s, o, kind in zip(specs, old, kinds, strict=True)]
    return model_from_words(specs, old), model_from_words(specs, new, {"step": "2"}), kinds
