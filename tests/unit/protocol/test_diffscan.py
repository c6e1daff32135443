"""The CPU fast path of the diff scan agrees with the generic torch path, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.protocol import diffscan
from patchswarm.protocol.diffscan import Changes, scan, scan_torch
from tests.support.strategies import random_words, seeds

WIDTHS = [1, 2, 4, 8]
PATTERNS = ["none", "all", "one", "sparse", "dense", "runs", "tail", "head"]


def _pair(width: int, n: int, pattern: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    a = random_words(rng, width, n)
    b = a.copy()
    if n:
        if pattern == "all":
            b = ~a  # every element differs
        elif pattern == "one":
            b[rng.integers(n)] ^= 1
        elif pattern == "sparse":
            idx = rng.integers(0, n, size=max(1, n // 50))
            b[idx] = random_words(rng, width, idx.size)
        elif pattern == "dense":
            m = rng.random(n) < 0.6
            b[m] = random_words(rng, width, int(m.sum()))
        elif pattern == "runs":  # whole 64-bit words changed next to untouched ones
            for s in rng.integers(0, n, size=5):
                b[s : s + int(rng.integers(1, 40))] ^= 1
        elif pattern == "tail":  # only the elements past the last whole 64-bit word
            b[-(n % (8 // width) or 1) :] ^= -1
        elif pattern == "head":
            b[0] ^= -1
    # The top bit of each element matters as much as the others (signed comparisons).
    return torch.from_numpy(a), torch.from_numpy(b)


def _expected(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(a != b).squeeze(1)


def _assert_same(got: Changes, want: Changes, a: torch.Tensor, b: torch.Tensor) -> None:
    pos = _expected(a, b)
    for ch in (got, want):
        assert ch.positions.dtype == torch.int64
        assert ch.old.dtype == a.dtype and ch.new.dtype == a.dtype
        assert torch.equal(ch.positions, pos)
        assert torch.equal(ch.old, a[pos]) and torch.equal(ch.new, b[pos])
        assert len(ch) == pos.numel()


@pytest.mark.parametrize("width", WIDTHS)
@given(n=st.integers(0, 2000), pattern=st.sampled_from(PATTERNS), seed=seeds)
def test_scan_equals_scan_torch(width: int, n: int, pattern: str, seed: int) -> None:
    a, b = _pair(width, n, pattern, seed)
    _assert_same(scan(a, b), scan_torch(a, b), a, b)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 63])
@pytest.mark.parametrize("pattern", ["none", "all", "tail"])
def test_small_and_unaligned_lengths(width: int, n: int, pattern: str) -> None:
    a, b = _pair(width, n, pattern, n)
    _assert_same(scan(a, b), scan_torch(a, b), a, b)


@pytest.mark.parametrize("width", WIDTHS)
def test_unaligned_views(width: int) -> None:
    # Views that start mid-buffer (as word views of a tensor inside a larger buffer do).
    a, b = _pair(width, 1001, "dense", 3)
    for off in (1, 3):
        x, y = a[off:], b[off:]
        _assert_same(scan(x, y), scan_torch(x, y), x, y)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the block and thread-pool thresholds so the blocked, threaded paths run on small data."""
    monkeypatch.setattr(diffscan, "CPU_BLOCK_WORDS", 16)
    monkeypatch.setattr(diffscan, "PARALLEL_MIN_WORDS", 64)
    monkeypatch.setattr(diffscan, "DEVICE_BLOCK_ELEMS", 37)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_threaded_and_blocked_paths(width: int, pattern: str) -> None:
    for n in (64 * (8 // width) - 1, 64 * (8 // width), 1000 * (8 // width) + 3, 5003):
        a, b = _pair(width, n, pattern, n + width)
        _assert_same(scan(a, b), scan_torch(a, b), a, b)


@pytest.mark.usefixtures("small_blocks")
@settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)  # the patch holds for every example
@given(width=st.sampled_from(WIDTHS), n=st.integers(0, 3000), pattern=st.sampled_from(PATTERNS), seed=seeds)
def test_threaded_path_random(width: int, n: int, pattern: str, seed: int) -> None:
    a, b = _pair(width, n, pattern, seed)
    _assert_same(scan(a, b), scan_torch(a, b), a, b)


def test_real_thresholds_above_parallel_min_words() -> None:
    # One real-size case just above the threshold (a few MiB): the default thresholds are sane.
    n = diffscan.PARALLEL_MIN_WORDS * 2 + 5  # int32 words: 2 lanes per 64-bit word
    a, b = _pair(4, n, "sparse", 11)
    b[-1] ^= 1
    _assert_same(scan(a, b), scan_torch(a, b), a, b)


def test_scan_rejects_mismatched_operands() -> None:
    a = torch.zeros(8, dtype=torch.int16)
    with pytest.raises(ValueError):
        scan(a, torch.zeros(9, dtype=torch.int16))
    with pytest.raises(ValueError):
        scan(a, torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError):
        scan(a.reshape(2, 4), a.reshape(2, 4))
