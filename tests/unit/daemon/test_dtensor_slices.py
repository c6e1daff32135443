"""fp8 over the rows of a sharded tensor: the ranks' rows, quantized under the scale every rank decides
(ServedFormat.scale_for) from the MAX of their amax shares, put back together are bitwise what
ServedFormat.convert makes of the whole tensor, version after version (scales fixed, then refreshed
past the drift threshold, block by block)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from patchswarm.daemon import fp8
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
    whole_fmt = ServedFormat("fp8_e4m3", block=block, quantize=fp8.ALL_MATRICES)
    rank_fmts = [dataclasses.replace(whole_fmt, scales={}, refreshed=[]) for _ in range(ranks)]  # each keeps its own
    t = torch.randn(shape, generator=g)
    refreshed = []
    for step in range(5):
        if step == 2:
            t = t * 1.6  # past the drift threshold: every scale moves
        elif step == 4:
            t[: min(5, shape[0])] *= 3  # the first rows' blocks only (every scale when per tensor)
        elif step:
            t = t + torch.randn(shape, generator=g) * 1e-3  # within it: scales stay fixed
        want = whole_fmt.convert({"w": t})
        slices = rows_of(t, ranks)
        amax = torch.stack([amax_part(s, block) for s in slices]).amax(dim=0)  # the all-reduce (MAX)
        assert torch.equal(amax, fp8.amax(t, block))
        moved = {f.scale_for("w", amax)[1] for f in rank_fmts}
        assert len(moved) == 1  # every rank makes the same refresh decision
        q = torch.cat([fp8_rows(f, s) for f, s in zip(rank_fmts, slices, strict=True)])
        assert torch.equal(q.view(torch.uint8), want["w"].view(torch.uint8)), step
        (scale_name,) = (k for k in want if k != "w")
        assert all(torch.equal(f.scales["w"], want[scale_name]) for f in rank_fmts)
        refreshed.append(moved.pop())
        assert refreshed[-1] == (whole_fmt.refreshed == ["w"])
    assert refreshed == [True, False, True, False, True]


def test_a_rank_refuses_its_own_inf_or_nan() -> None:
    t = torch.ones(12, 8)
    t[9, 3] = float("nan")
    slices = rows_of(t, 2)
    assert amax_part(slices[0], 4).shape == (3, 2)
    with pytest.raises(ValueError, match="w holds inf or NaN"):
        amax_part(slices[1], 4)


def test_quantized_rows_asks_the_served_format() -> None:
    described = {
        "model.layers.0.self_attn.q_proj.weight": ((40, 32), "float32"),
        "model.layers.0.input_layernorm.weight": ((40, 32), "float32"),  # kept by the default selection
        "model.embed_tokens.weight": ((40, 32), "float32"),  # not a decoder layer's linear
        "model.layers.0.mlp.down_proj.bias": ((40,), "float32"),
    }
    got = quantized_rows(ServedFormat("fp8_e4m3", block=16), described)
    assert got == {
        "model.layers.0.self_attn.q_proj.weight": (
            "model.layers.0.self_attn.q_proj.weight_scale_inv",
            torch.float8_e4m3fn,
        )
    }
    per_tensor = quantized_rows(ServedFormat("fp8_e4m3", quantize=fp8.ALL_MATRICES), described)
    assert set(per_tensor) == {n for n, (shape, _) in described.items() if len(shape) == 2 and "norm" not in n}
    assert per_tensor["model.embed_tokens.weight"][0] == "model.embed_tokens.weight_scale"
    assert quantized_rows(ServedFormat("bf16"), described) == {}
