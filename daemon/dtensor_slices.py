"""A rank's part of a sharded state dict: whole tensors, and the rows of DTensors sharded on dim 0
(FSDP2's ``fully_shard``), with fp8 scales agreed over the whole tensor.

FSDP2 shards every parameter on dim 0 over a 1-D mesh the way ``torch.chunk`` splits rows: each
rank holds ceil(rows / ranks) rows, the last ranks fewer or none
(https://github.com/pytorch/pytorch/blob/main/torch/distributed/tensor/placement_types.py,
``Shard._split_tensor``).  A rank's rows are therefore one contiguous run of the canonical
tensor's elements, starting at ``first_row * row_elements``.

fp8 scales are fixed per tensor (or per block) from the WHOLE tensor's amax, so that a sharded
trainer serves the bytes a single process would: each rank contributes its rows' amax (the block
grid of the whole tensor, zero where its rows do not reach) and an all-reduce (MAX) combines them.
The decision and the arithmetic are ServedFormat's and daemon/fp8.py's own (``scale_for``: fixed
scales, refreshed past the drift threshold, headroom above amax; ``fp8.quantize`` of a row range),
applied to that amax: there is no second copy of the rules here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from patchswarm.daemon import fp8
from patchswarm.daemon.served_format import ServedFormat


@dataclass(slots=True)
class RowSlice:
    """A rank's rows of a tensor sharded on dim 0."""

    name: str
    local: torch.Tensor
    shape: tuple[int, ...]  # the canonical tensor's
    start_row: int


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[RowSlice]]:
    """Split a rank's state dict into whole tensors and rows of DTensors sharded on dim 0.

    A replicated DTensor counts as whole on the mesh's first rank only; a DTensor on a mesh
    this rank is not part of is someone else's.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole: dict[str, torch.Tensor] = {}
    slices: list[RowSlice] = []
    for name, t in state.items():
        if not isinstance(name, str):
            raise ValueError(f"state dict keys must be strings, not {type(name).__name__}")
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            if mesh.ndim != 1:
                raise ValueError(f"{name}: DTensors on a {mesh.ndim}-D device mesh are not supported (1-D meshes only)")
            coord = mesh.get_coordinate()
            if coord is None:
                continue
            (p,) = t.placements
            local = t.to_local()
            if isinstance(p, Replicate):
                if coord[0] == 0:
                    whole[name] = local
            elif isinstance(p, Shard) and p.dim == 0 and t.dim() > 0:
                shape = tuple(t.shape)
                per = -(-shape[0] // mesh.size())  # torch.chunk's rows per rank; the last may have fewer or none
                first = min(coord[0] * per, shape[0])
                rows = min(per, shape[0] - first)
                if tuple(local.shape) != (rows, *shape[1:]):
                    raise ValueError(
                        f"{name}: rank {coord[0]}'s shard has shape {tuple(local.shape)}, not torch.chunk's "
                        f"{(rows, *shape[1:])} of {shape}"
                    )
                slices.append(RowSlice(name, local, shape, first))
            else:
                raise ValueError(f"{name}: placement {p} is not supported (Shard(0) or Replicate)")
        elif isinstance(t, torch.Tensor):
            whole[name] = t
        else:
            raise ValueError(f"{name}: not a tensor but {type(t).__name__}")
    return whole, slices


def describe(slices: list[RowSlice]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(s.name, s.shape, str(s.local.dtype).removeprefix("torch.")) for s in slices]


def grid_shape(shape: tuple[int, ...], block: int | None) -> tuple[int, ...]:
    if block is None:
        return ()
    return (math.ceil(shape[0] / block), math.ceil(shape[1] / block))


def amax_part(s: RowSlice, block: int | None) -> torch.Tensor:
    """This rank's rows' share of the whole tensor's amax: a scalar, or the whole block grid with
    zeros in the blocks these rows do not reach (amax is never below zero, so MAX over ranks is exact).
    A rank refuses its own inf or NaN here: a MAX over ranks need not carry a NaN through."""
    a = fp8.amax(s.local.detach().float(), block, first_row=s.start_row, rows=s.shape[0])
    fp8.check_finite(s.name, a)
    return a


def quantized_rows(
    fmt: ServedFormat, described: Mapping[str, tuple[tuple[int, ...], str]]
) -> dict[str, tuple[str, torch.dtype]]:
    """Sliced tensors the served format quantizes: name -> (scale tensor name, served dtype).

    Asks ServedFormat itself, on a shape-only (meta) tensor of the canonical shape, so the
    selection and the scale's name are the format's own.
    """
    out: dict[str, tuple[str, torch.dtype]] = {}
    for name in sorted(described):
        shape, dtype = described[name]
        if fmt.selects(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta")):
            out[name] = (fp8.scale_name(name, fmt.block), torch.float8_e4m3fn)
    return out


def fp8_rows(fmt: ServedFormat, s: RowSlice) -> torch.Tensor:
    """fp8 rows of a sliced tensor under ``fmt``'s scale of the whole tensor, which every rank decided
    with ``ServedFormat.scale_for`` from the all-reduced amax: the bytes ``convert`` makes of these
    rows of the whole tensor."""
    return fp8.quantize(s.local.detach().float(), fmt.scales[s.name], fmt.block, first_row=s.start_row)
