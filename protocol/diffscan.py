"""Finding the elements that differ between two versions of a tensor, fast.

The scan compares 64-bit words first (four bf16 elements at a time), then looks inside only
the words that differ, block by block so that the second look hits cache.  On the CPU the
blocks run on a small thread pool with numpy (whose kernels release the GIL); on other
devices (CUDA) the same two-level scan runs as torch ops over large blocks.  Both paths
return the same positions, old words and new words.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

# 128 Ki words = 1 MiB per operand: both operands of a block stay in L2/L3 between the two looks.
CPU_BLOCK_WORDS = 1 << 17
# Large blocks amortize kernel launches on accelerators while bounding temporary memory.
DEVICE_BLOCK_ELEMS = 1 << 26
# Below this size the thread pool costs more than it saves.
PARALLEL_MIN_WORDS = 1 << 19


@dataclass(frozen=True, slots=True)
class Changes:
    """Changed elements of one tensor: ascending positions, and the old and new raw words there."""

    positions: torch.Tensor  # int64
    old: torch.Tensor  # signed int words of the element width
    new: torch.Tensor

    def __len__(self) -> int:
        return int(self.positions.numel())


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="diffscan")


def scan(base: torch.Tensor, target: torch.Tensor) -> Changes:
    """Changed positions between two flat word tensors of the same dtype, shape and device."""
    if base.shape != target.shape or base.dtype != target.dtype or base.dim() != 1:
        raise ValueError("scan needs two flat tensors of the same dtype and length")
    if base.device.type == "cpu":
        return _scan_cpu(base, target)
    return scan_torch(base, target)


def scan_torch(base: torch.Tensor, target: torch.Tensor) -> Changes:
    """Device-agnostic path: blocked elementwise compare with torch ops."""
    pos_parts: list[torch.Tensor] = []
    for start in range(0, base.numel(), DEVICE_BLOCK_ELEMS):
        a = base[start : start + DEVICE_BLOCK_ELEMS]
        b = target[start : start + DEVICE_BLOCK_ELEMS]
        pos_parts.append(torch.nonzero(a != b).squeeze(1) + start)
    pos = torch.cat(pos_parts) if pos_parts else torch.empty(0, dtype=torch.int64, device=base.device)
    return Changes(pos, base[pos], target[pos])


def _scan_cpu(base: torch.Tensor, target: torch.Tensor) -> Changes:
    a = base.numpy()
    b = target.numpy()
    width = a.itemsize
    lanes = 8 // width
    nwords = a.size // lanes
    a64 = a[: nwords * lanes].view(np.int64)
    b64 = b[: nwords * lanes].view(np.int64)

    def run(lo: int, hi: int) -> tuple[np.ndarray, ...]:
        return _scan_words(a64, b64, a, b, lanes, lo, hi)

    if nwords >= PARALLEL_MIN_WORDS:
        pool = _pool()
        nparts = pool._max_workers
        step = -(-nwords // nparts)  # equal parts: a part need not be whole blocks
        parts = list(pool.map(lambda lo: run(lo, min(lo + step, nwords)), range(0, nwords, step)))
    else:
        parts = [run(0, nwords)]
    tail = nwords * lanes
    if tail < a.size:  # elements past the last whole 64-bit word
        t = np.flatnonzero(a[tail:] != b[tail:]) + tail
        parts.append((t, a[t], b[t]))
    pos = np.concatenate([p[0] for p in parts]).astype(np.int64, copy=False)
    old = np.concatenate([p[1] for p in parts])
    new = np.concatenate([p[2] for p in parts])
    return Changes(torch.from_numpy(pos), torch.from_numpy(old), torch.from_numpy(new))


def _scan_words(
    a64: np.ndarray, b64: np.ndarray, a: np.ndarray, b: np.ndarray, lanes: int, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pos_parts: list[np.ndarray] = []
    old_parts: list[np.ndarray] = []
    new_parts: list[np.ndarray] = []
    mask = np.empty(min(CPU_BLOCK_WORDS, max(hi - lo, 1)), dtype=bool)
    shift = lanes.bit_length() - 1
    # Few numpy calls per block: the calls on small arrays hold the GIL that the two threads share.
    for s in range(lo, hi, CPU_BLOCK_WORDS):
        e = min(s + CPU_BLOCK_WORDS, hi)
        x = a64[s:e]
        y = b64[s:e]
        w = np.not_equal(x, y, out=mask[: e - s]).nonzero()[0]
        if w.size == 0:
            continue
        # Second look, at the changed words only (gathered while the block is in cache): which lanes differ.
        xo = x.take(w).view(a.dtype)
        yn = y.take(w).view(a.dtype)
        if lanes == 1:
            w += s
            pos_parts.append(w)
            old_parts.append(xo)
            new_parts.append(yn)
            continue
        hit = np.not_equal(xo, yn).nonzero()[0]
        pos = w.take(hit >> shift)
        pos += s
        pos *= lanes
        pos += hit & (lanes - 1)
        pos_parts.append(pos)
        old_parts.append(xo.take(hit))  # from the gathered words, not from the block again
        new_parts.append(yn.take(hit))
    if not pos_parts:
        return np.empty(0, dtype=np.int64), a[:0], b[:0]
    return np.concatenate(pos_parts), np.concatenate(old_parts), np.concatenate(new_parts)
