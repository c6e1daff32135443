"""The ordered integer line of float bits and the ulp-delta code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol import ordered
from patchswarm.protocol.dtypes import BY_NAME
from tests.support.strategies import FLOAT_DTYPES, random_words, seeds

WIDTH_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(name: str, seed: int, n: int) -> torch.Tensor:
    dt = BY_NAME[name]
    return torch.from_numpy(random_words(np.random.default_rng(seed), dt.width, n).copy())


def _sign_bit(w: torch.Tensor, width: int) -> torch.Tensor:
    return (w.to(torch.int64) >> (8 * width - 1)) & 1


def _assert_strictly_monotone(name: str, w: torch.Tensor) -> None:
    """Sorted by key, the non-NaN values of ``w`` must rise strictly in float order (-0 < +0)."""
    dt = BY_NAME[name]
    vals = w.view(dt.torch_dtype).to(torch.float64)  # exact widening for every float format
    ok = ~torch.isnan(vals)
    w, vals = w[ok], vals[ok]
    key, order = torch.sort(ordered.ordered_key(w, dt.width))
    w, vals = w[order], vals[order]
    neg = _sign_bit(w, dt.width).bool()
    same_bits = w[1:] == w[:-1]
    assert torch.equal(key[1:] == key[:-1], same_bits)  # injective
    less = (vals[:-1] < vals[1:]) | ((vals[:-1] == vals[1:]) & neg[:-1] & ~neg[1:])
    assert bool((less | same_bits).all())  # adjacent keys agree with float order: monotone


@pytest.mark.parametrize("name", [n for n in FLOAT_DTYPES if BY_NAME[n].width <= 2])
def test_key_is_monotone_on_every_pattern(name: str) -> None:
    width = BY_NAME[name].width
    top = 1 << (8 * width - 1)
    _assert_strictly_monotone(name, torch.arange(-top, top, dtype=torch.int64).to(WIDTH_DTYPES[width]))


@pytest.mark.parametrize("name", FLOAT_DTYPES)
@given(seed=seeds)
def test_key_is_monotone_in_float_order(name: str, seed: int) -> None:
    w = _words(name, seed, 2000)
    if BY_NAME[name].width >= 4:  # add neighbours and sign twins so that close pairs are compared too
        w = torch.cat([w, w + 1, w - 1, w ^ torch.tensor(-1 << (8 * BY_NAME[name].width - 1)).to(w.dtype)])
    _assert_strictly_monotone(name, w)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_key_landmarks(width: int) -> None:
    wd = WIDTH_DTYPES[width]
    top = 1 << (8 * width - 1)
    words = torch.tensor([0, -top, 1, -top + 1, top - 1, -1], dtype=torch.int64).to(wd)
    key = ordered.ordered_key(words, width).tolist()
    # +0 -> 0, -0 -> -1, smallest positive -> 1, smallest negative -> -2, max pattern -> max, min -> min
    assert key == [0, -1, 1, -2, top - 1, -top]


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@given(seed=seeds)
def test_key_is_an_involution_and_a_bijection(width: int, seed: int) -> None:
    wd = WIDTH_DTYPES[width]
    w = torch.from_numpy(random_words(np.random.default_rng(seed), width, 512).copy())
    key = ordered.ordered_key(w, width)
    lo, hi = -(1 << (8 * width - 1)), (1 << (8 * width - 1)) - 1
    assert bool((key >= lo).all()) and bool((key <= hi).all())
    back = ordered.from_ordered_key(key, width, wd)
    assert back.dtype == wd and torch.equal(back, w)
    # Its own inverse on words: key(key(w)) == w.
    assert torch.equal(ordered.ordered_key(key.to(wd), width).to(wd), w)


@pytest.mark.parametrize("width", [1, 2])
def test_key_is_a_bijection_on_every_pattern(width: int) -> None:
    top = 1 << (8 * width - 1)
    allw = torch.arange(-top, top, dtype=torch.int64).to(WIDTH_DTYPES[width])
    k = ordered.ordered_key(allw, width)
    assert torch.equal(torch.sort(k).values, torch.arange(-top, top, dtype=torch.int64))
    assert torch.equal(ordered.from_ordered_key(k, width, WIDTH_DTYPES[width]), allw)


def _check_round_trip(old: torch.Tensor, new: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    wd = WIDTH_DTYPES[width]
    changed = old != new
    old, new = old[changed], new[changed]
    codes, escaped = ordered.ulp_codes(old, new, width)
    assert codes.dtype == torch.uint8 and escaped.dtype == torch.bool
    assert torch.equal(codes == ordered.ESCAPE, escaped)
    out = ordered.apply_ulp_codes(old, codes, width, wd)
    assert out.dtype == wd
    assert torch.equal(out[~escaped], new[~escaped])
    # Escapes are exactly the changes whose ordered-line step does not fit a code.
    d = ordered.ordered_key(new, width) - ordered.ordered_key(old, width)
    if width < 8:
        fits = (d >= -128) & (d <= 127)
        assert torch.equal(~escaped, fits)
    return codes, escaped


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@given(seed=seeds, mode=st.sampled_from(["random", "small", "cross", "mixed"]))
def test_ulp_codes_round_trip(width: int, seed: int, mode: str) -> None:
    rng = np.random.default_rng(seed)
    wd = WIDTH_DTYPES[width]
    n = 300
    old = torch.from_numpy(random_words(rng, width, n).copy())
    key = ordered.ordered_key(old, width)
    lo, hi = -(1 << (8 * width - 1)), (1 << (8 * width - 1)) - 1
    if mode == "random":
        new = torch.from_numpy(random_words(rng, width, n).copy())
    else:
        step = torch.from_numpy(rng.integers(-140, 141, n))  # around the escape threshold
        if mode == "cross":  # start near zero so that steps cross the sign (+0 / -0 included)
            key = torch.from_numpy(rng.integers(-4, 4, n))
        elif mode == "mixed":
            big = torch.from_numpy(rng.integers(lo, hi, n, dtype=np.int64, endpoint=True))
            step = torch.where(torch.from_numpy(rng.random(n) < 0.5), step, big - key)
        newkey = torch.clamp(key + step, lo, hi) if width < 8 else key + step  # 64-bit: wraps
        old = ordered.from_ordered_key(key, width, wd)
        new = ordered.from_ordered_key(newkey, width, wd)
    _check_round_trip(old, new, width)


def test_ulp_code_values() -> None:
    # bf16 1.0 -> one step up / one step down
    one = torch.tensor([1.0], dtype=torch.bfloat16).view(torch.int16)
    assert float((one + 1).view(torch.bfloat16)) > 1.0 > float((one - 1).view(torch.bfloat16))
    codes, esc = ordered.ulp_codes(one, one + 1, 2)
    assert codes.tolist() == [1] and not esc.any()  # +1 -> zigzag 2 -> code 1
    codes, esc = ordered.ulp_codes(one, one - 1, 2)
    assert codes.tolist() == [0] and not esc.any()  # -1 -> zigzag 1 -> code 0
    pz = torch.tensor([0], dtype=torch.int16)
    nz = torch.tensor([-0x8000], dtype=torch.int16)
    assert ordered.ulp_codes(pz, nz, 2)[0].tolist() == [0]  # +0 -> -0 is one step down
    tiny_neg = torch.tensor([-0x7FFF], dtype=torch.int16)  # -smallest subnormal
    assert ordered.ulp_codes(pz, tiny_neg, 2)[0].tolist() == [2]  # two steps down
    # d = -128 -> zigzag 255 -> code 254, the last unescaped code; d = +128 -> code 255: escaped
    c, e = ordered.ulp_codes(pz, ordered.from_ordered_key(torch.tensor([-128]), 2, torch.int16), 2)
    assert c.tolist() == [254] and not e.any()
    c, e = ordered.ulp_codes(pz, ordered.from_ordered_key(torch.tensor([128]), 2, torch.int16), 2)
    assert c.tolist() == [ordered.ESCAPE] and e.all()
    c, e = ordered.ulp_codes(pz, pz, 2)  # an unchanged element never gets a code
    assert e.all()


def test_64bit_wraparound() -> None:
    wd = torch.int64
    kmax, kmin = (1 << 63) - 1, -(1 << 63)
    wmax = ordered.from_ordered_key(torch.tensor([kmax]), 8, wd)
    wmin = ordered.from_ordered_key(torch.tensor([kmin]), 8, wd)
    # key(new) - key(old) = -(2**64 - 1) wraps to +1: one step up the (circular) line.
    codes, esc = ordered.ulp_codes(wmax, wmin, 8)
    assert codes.tolist() == [1] and not esc.any()
    assert torch.equal(ordered.apply_ulp_codes(wmax, codes, 8, wd), wmin)
    codes, esc = ordered.ulp_codes(wmin, wmax, 8)
    assert codes.tolist() == [0] and not esc.any()
    assert torch.equal(ordered.apply_ulp_codes(wmin, codes, 8, wd), wmax)
    # Differences of 2**63 (the zigzag overflows) and of +-2**62 are escaped.
    zero = torch.tensor([0], dtype=wd)
    for k in (kmin, kmax, 1 << 62, -(1 << 62)):
        new = ordered.from_ordered_key(torch.tensor([k]), 8, wd)
        assert ordered.ulp_codes(zero, new, 8)[1].all()
    # +inf -> -inf and NaN patterns are raw-escaped in f64
    inf = torch.tensor([float("inf")], dtype=torch.float64).view(wd)
    ninf = torch.tensor([float("-inf")], dtype=torch.float64).view(wd)
    assert ordered.ulp_codes(inf, ninf, 8)[1].all()
    nan = torch.tensor([0x7FF0000000000000], dtype=wd)  # +inf's neighbour is the first NaN
    codes, esc = ordered.ulp_codes(inf, nan + 1, 8)
    assert codes.tolist() == [1] and torch.equal(ordered.apply_ulp_codes(inf, codes, 8, wd), nan + 1)
