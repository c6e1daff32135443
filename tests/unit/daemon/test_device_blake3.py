"""The device BLAKE3's scratch memory (daemon/device_blake3.py): the tree phase works in passes of
a bounded number of parent nodes, in place over the chaining values, however deep the tree.

Measured on the CPU with torch's profiler, which records every allocation and free of torch's CPU
allocator with the op that made it: the peak of their running sum is the scratch peak.  (Digests
against the blake3 library: tests/unit/daemon/test_weightstore.py; the whole digest's peak against
``scratch_bound`` on a real GPU: benchmarks/gpu_check.py.)"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from patchswarm.daemon.device_blake3 import (
    _IV,
    CHUNK_SCRATCH,
    CV_BYTES,
    GPU_SCRATCH,
    TREE_SCRATCH,
    _tree,
    default_batch,
)


def peak_torch_bytes(fn: Callable[[], object]) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    for e in prof.events():
        if e.name == "[memory]":  # a free outside any op
            events.append((e.time_range.start, e.cpu_memory_usage))
        elif e.self_cpu_memory_usage:
            events.append((e.time_range.start, e.self_cpu_memory_usage))
    events.sort()
    cur = peak = 0
    for _, used in events:
        cur += used
        peak = max(peak, cur)
    return peak


def test_tree_phase_scratch_is_one_pass_however_many_nodes() -> None:
    """1040 chunk chaining values of 4 tensors (an 11-level tree), 32 parents a pass: the scratch is
    that of one pass.  (The whole-level version this replaces took about 200 bytes per node: 200 KB.)"""
    counts = [1000, 33, 1, 6]
    g = torch.Generator().manual_seed(5)
    level = torch.randint(-(2**31), 2**31 - 1, (8, sum(counts)), dtype=torch.int32, generator=g)
    iv = torch.tensor(_IV, dtype=torch.int64).unsqueeze(1)
    batch = 32
    peak = peak_torch_bytes(lambda: _tree(level, counts, batch, iv))
    print(f"tree phase: peak {peak} bytes for {sum(counts)} nodes in passes of {batch}")
    assert 0 < peak <= TREE_SCRATCH * batch + (4 << 10)
    assert peak < 64 * sum(counts)  # below even one int64 level of the nodes


def test_default_batch_keeps_a_14_gb_store_within_the_documented_scratch() -> None:
    gpu = torch.device("cuda", 0)  # (only its type is read)
    for nbytes in (1 << 20, 2 << 30, 14 << 30, 28 << 30, 80 << 30):
        chunks = nbytes // 1024
        batch = default_batch(chunks, gpu)
        assert batch & (batch - 1) == 0 and 1 << 14 <= batch <= 1 << 18
        if CV_BYTES * chunks + CHUNK_SCRATCH * (1 << 14) <= GPU_SCRATCH:
            assert CV_BYTES * chunks + CHUNK_SCRATCH * batch <= GPU_SCRATCH
    assert default_batch((14 << 30) // 1024, gpu) == 1 << 17
    assert default_batch(1 << 10, torch.device("cpu")) == 1 << 16
