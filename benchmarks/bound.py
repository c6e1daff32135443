"""The memoryless information bound on a patch, shared by the codec benchmark and the absorption study.

A patch that knows nothing beyond the base version must name which of the ``n`` values of a tensor
changed (``log2 C(n, k)`` bits for ``k`` changes) and what each became; with the value deltas drawn
i.i.d. from their empirical distribution that costs ``K * H(deltas)`` bits more:

    bound = sum over tensors of log2 C(n_t, k_t)  +  K * H(value deltas)   bits.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import numpy as np

LN2 = math.log(2.0)


def log2_binom(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / LN2


def log2_binom_sum(n: np.ndarray, k: np.ndarray) -> float:
    """``sum(log2 C(n_i, k_i))`` over arrays (one entry per context class)."""
    n64, k64 = n.astype(np.float64), k.astype(np.float64)
    lg = np.vectorize(math.lgamma, otypes=[np.float64])
    return float(np.sum(lg(n64 + 1) - lg(k64 + 1) - lg(n64 - k64 + 1))) / LN2


def entropy_bits(counts: Counter[int]) -> float:
    """Empirical entropy, in bits per symbol."""
    total = sum(counts.values())
    if total == 0:
        return 0.0
    return -sum(c / total * math.log2(c / total) for c in counts.values())


def counter(values: np.ndarray) -> Counter[int]:
    uniq, cnt = np.unique(values, return_counts=True)
    return Counter(dict(zip(uniq.tolist(), cnt.tolist(), strict=True)))


def bound_bytes(sizes: Iterable[tuple[int, int]], deltas: Iterable[Counter[int]]) -> tuple[float, float]:
    """(position bytes, total bytes) of the bound: ``sizes`` the (n, k) of every tensor, ``deltas``
    the value-delta counts of each pool (one entropy per pool, e.g. per dtype)."""
    pos_bits = sum(log2_binom(n, k) for n, k in sizes)
    val_bits = sum(sum(c.values()) * entropy_bits(c) for c in deltas)
    return pos_bits / 8, (pos_bits + val_bits) / 8
