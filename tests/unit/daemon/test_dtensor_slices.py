"""fp8 over the rows of a sharded tensor: the ranks' rows, quantized under the scale agreed from every
rank's amax contribution, put back together are bitwise what ServedFormat makes of the whole tensor,
version after version (scales fixed, then refreshed past the drift threshold)."""

from __future__ import annotations

import pytest
import torch

from patchswarm.daemon.dtensor_slices import RowSlice, amax_part, fp8_rows, quantized_rows
from patchswarm.daemon.served_format import ServedFormat


def rows_of(t: torch.Tensor, ranks: int) -> list[RowSlice]:
    """torch.chunk's split of the rows (what FSDP2 and Shard(0) hold), empty trailing ranks included."""
    per = -(-t.shape[0] // ranks)
    out = []
    for r in range(ranks):
        first = min(r * per, t.shape[0])
        out.append(RowSlice("w", t[first : first + per], tuple(t.shape), first))
    return out


@pytest.mark.parametrize(
    ("shape", "ranks", "block"),
    [((37, 24), 2, None), ((37, 24), 2, 8), ((21, 40), 3, 8), ((64, 16), 4, 16), ((17, 16), 4, 5), ((50, 33), 7, None)],
)
def test_rows_quantized_under_the_agreed_scale_are_the_whole_tensors_fp8(
    shape: tuple[int, int], ranks: int, block: int | None
) -> None:
    g = torch.Generator().manual_seed(sum(shape) + ranks)
    whole_fmt = ServedFormat("fp8_e4m3", block=block)
    rank_scales: list[dict[str, torch.Tensor]] = [{} for _ in range(ranks)]  # each rank keeps its own
    t = torch.randn(shape, generator=g)
    refreshed = []
    for step in range(4):
        if step == 2:
            t = t * 1.6  # past the drift threshold: every scale moves
        elif step:
            t = t + torch.randn(shape, generator=g) * 1e-3  # within it: scales stay fixed
        want = whole_fmt.convert({"w": t})
        slices = rows_of(t, ranks)
        amax = torch.stack([amax_part(s, block) for s in slices]).amax(dim=0)  # the all-reduce (MAX)
        got = [fp8_rows(whole_fmt, rank_scales[r], s, amax) for r, s in enumerate(slices)]
        q = torch.cat([x[0] for x in got])
        assert torch.equal(q.view(torch.uint8), want["w"].view(torch.uint8)), step
        (scale_name,) = (k for k in want if k != "w")
        assert all(torch.equal(x[1], want[scale_name]) for x in got)
        assert len({x[2] for x in got}) == 1  # every rank makes the same refresh decision
        refreshed.append(got[0][2])
    assert refreshed == [1, 0, 1, 0]


def test_quantized_rows_asks_the_served_format() -> None:
    described = {"big": ((40, 32), "float32"), "thin": ((40, 8), "float32"), "vec": ((40,), "float32")}
    got = quantized_rows(ServedFormat("fp8_e4m3", block=16), described)
    assert set(got) == {"big"}
    scale_name, dtype = got["big"]
    assert dtype == torch.float8_e4m3fn and scale_name.startswith("big")
    assert quantized_rows(ServedFormat("bf16"), described) == {}
