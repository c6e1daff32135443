"""BlockScan (the publisher's in-cache block scan) finds exactly what diffscan.scan finds."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patchswarm.daemon.publish_work import BlockScan
from patchswarm.protocol.diffscan import scan
from patchswarm.protocol.served import ServedModel, word_view

DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.float64, torch.int16]


@settings(max_examples=300, deadline=None)
@given(
    dt=st.sampled_from(DTYPES),
    n=st.integers(0, 300),
    block=st.sampled_from([8, 16, 24, 64, 128, 1 << 20]),
    changes=st.lists(st.integers(0, 299), max_size=40),
    seed=st.integers(0, 2**31),
)
def test_blockscan_matches_scan(dt: torch.dtype, n: int, block: int, changes: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 255, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
    b = a.clone()
    for c in changes:
        if c < n * dt.itemsize:
            b[c] ^= 1 + (c % 255)
    base = ServedModel.from_tensors({"x": a.view(dt)})
    target = ServedModel.from_tensors({"x": b.view(dt)})
    spec = base.specs[0]
    want = scan(word_view(base.data[0], spec), word_view(target.data[0], spec))
    bs = BlockScan(base.data[0], target.data[0], spec)
    for s in range(0, n, block):
        bs.block(s, min(s + block, n))
    got = bs.changes()
    assert torch.equal(got.positions, want.positions)
    assert got.old.dtype == want.old.dtype and torch.equal(got.old, want.old) and torch.equal(got.new, want.new)
