"""Per-rank tensor digests computed from the canonical model, one runtime parameter at a time.

A rank store's state root is BLAKE3 over its runtime parameters' digests (served.state_root).
Building the whole rank (``layout_plan.rank_model``) for every version costs a fresh allocation and
a strided copy of every rank's bytes; a version applied in place changes few parameters' digests
only in principle, but every byte of a changed parameter must be hashed again.  Here one
parameter's digest is computed from the canonical tensors directly: when its pieces are flat runs
of the canonical tensors that tile the parameter in order (row-split and fused column-parallel
weights, replicated norms) the runs are hashed where they lie, without a copy; otherwise (the
column-split row-parallel weights, padded vocabulary rows) they are assembled into one reused
scratch buffer first.  The bytes hashed are the bytes ``rank_model`` would build, so the digests
and roots are the same (tests/unit/daemon/test_rank_stores.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import torch

from patchswarm.protocol.layout_plan import (
    LayoutPlan,
    box_contiguous,
    box_extents,
    box_flat_start,
)
from patchswarm.protocol.served import ServedModel, TensorSpec, bytes_digest, state_root, word_view

MULTI_THREAD_BYTES = 1 << 22  # as served.bytes_digest: larger inputs hash on every core


@dataclass(frozen=True, slots=True)
class _Part:
    """One piece of a runtime parameter: canonical slot ``source``'s ``src`` box into the ``dst`` box."""

    source: int
    src: tuple[tuple[int, int], ...]
    dst: tuple[tuple[int, int], ...]
    src_start: int  # flat element offset of the source box (used when it is one run)
    numel: int


@dataclass(frozen=True, slots=True)
class _Param:
    spec: TensorSpec
    parts: tuple[_Part, ...]  # sorted by their flat start in the parameter
    runs: bool  # every part is one flat run at both ends and together they tile the parameter in order


class RankDigests:
    """Digests of each rank's runtime parameters for one (checked) plan and one canonical layout."""

    def __init__(self, plan: LayoutPlan, canonical_specs: Sequence[TensorSpec]) -> None:
        self.canonical = list(canonical_specs)
        self.rank_specs = [plan.rank_specs(r) for r in range(plan.world)]
        slots = [{s.name: i for i, s in enumerate(specs)} for specs in self.rank_specs]
        parts: list[list[list[tuple[int, _Part]]]] = [[[] for _ in specs] for specs in self.rank_specs]
        for ci, cspec in enumerate(self.canonical):
            for p in plan.pieces_of(cspec.name):
                pspec = plan.params[p.rank][p.param]
                n = 1
                for e in box_extents(p.dst):
                    n *= e
                runs = box_contiguous(p.src, cspec.shape) and box_contiguous(p.dst, pspec.shape)
                part = _Part(ci, p.src, p.dst, box_flat_start(p.src, cspec.shape) if runs else -1, n)
                parts[p.rank][slots[p.rank][p.param]].append((box_flat_start(p.dst, pspec.shape), part))
        self.params: list[list[_Param]] = []
        for r, specs in enumerate(self.rank_specs):
            row = []
            for i, spec in enumerate(specs):
                ordered = sorted(parts[r][i], key=lambda sp: sp[0])
                at, runs = 0, True
                for start, part in ordered:
                    runs = runs and part.src_start >= 0 and start == at
                    at = start + part.numel
                runs = runs and at == spec.numel
                row.append(_Param(spec, tuple(p for _, p in ordered), runs))
            self.params.append(row)
        # per rank, per runtime parameter: the canonical tensors it is made of
        self.sources = [[frozenset(p.source for p in param.parts) for param in row] for row in self.params]
        self._scratch: dict[int, torch.Tensor] = {}  # per worker: see ``digest``
        # while ``hold`` is in effect: the held model's host tensors as numpy arrays, made once per
        # tensor rather than once per piece (a torch slice and ``.numpy()`` per piece cost ~5 us, and
        # TP=8 hashes ~300 pieces a version); dropped by ``release`` so no model outlives its use
        self._held: ServedModel | None = None
        self._views: dict[int, np.ndarray[Any, Any]] = {}

    def hold(self, model: ServedModel) -> None:
        """Hash ``model`` with its tensors' numpy views kept until ``release``."""
        self._held, self._views = model, {}

    def release(self) -> None:
        self._held, self._views = None, {}

    def _host(self, model: ServedModel, source: int) -> np.ndarray[Any, Any] | None:
        """Canonical tensor ``source``'s bytes as a numpy array, or None when not on the host."""
        held = model is self._held
        if held and (v := self._views.get(source)) is not None:
            return v
        t = model.data[source]
        if t.device.type != "cpu":
            return None
        v = t.numpy()
        if held:
            self._views[source] = v
        return v

    def in_place(self, model: ServedModel, rank: int, slot: int) -> bool:
        """Whether ``digest`` hashes the parameter where its bytes lie (no scratch buffer: such calls
        may run on several threads at once, BLAKE3 letting go of the GIL)."""
        param = self.params[rank][slot]
        return param.runs and param.spec.numel > 0 and all(self._host(model, p.source) is not None for p in param.parts)

    def digest(self, model: ServedModel, rank: int, slot: int, worker: int = 0) -> bytes:
        """BLAKE3 of rank ``rank``'s runtime parameter ``slot`` as ``model`` makes it (padding zero).
        Calls with different ``worker`` numbers may run on several threads at once (each assembles
        in its own scratch buffer)."""
        param = self.params[rank][slot]
        spec = param.spec
        if self.in_place(model, rank, slot):
            big = spec.nbytes > MULTI_THREAD_BYTES
            h = blake3.blake3(max_threads=blake3.blake3.AUTO) if big else blake3.blake3()
            width = spec.dt.width
            for p in param.parts:
                src = self._host(model, p.source)
                assert src is not None
                h.update(src[p.src_start * width : (p.src_start + p.numel) * width].data)
            return h.digest()
        return bytes_digest(self._assemble(model, param, worker))

    def _assemble(self, model: ServedModel, param: _Param, worker: int) -> torch.Tensor:
        """The parameter's bytes in the worker's scratch buffer (reused: allocated once per size and device)."""
        spec = param.spec
        device = model.data[param.parts[0].source].device if param.parts else torch.device("cpu")
        scratch = self._scratch.get(worker)
        if scratch is None or scratch.device != device or scratch.numel() < spec.nbytes:
            need = max(p.spec.nbytes for row in self.params for p in row)
            scratch = self._scratch[worker] = torch.empty(need, dtype=torch.uint8, device=device)
        out = scratch[: spec.nbytes]
        if not spec.numel:
            return out
        words = word_view(out, spec).reshape(spec.shape)
        if sum(p.numel for p in param.parts) < spec.numel:
            words.zero_()  # padding (vocabulary rows past the checkpoint's) is zero
        for p in param.parts:
            cspec = self.canonical[p.source]
            src = word_view(model.data[p.source], cspec).reshape(cspec.shape)
            words[tuple(slice(a, b) for a, b in p.dst)] = src[tuple(slice(a, b) for a, b in p.src)].reshape(
                box_extents(p.dst)
            )
        return out

    def nbytes(self, rank: int, slot: int) -> int:
        return self.params[rank][slot].spec.nbytes

    def rank_digests(self, model: ServedModel, rank: int) -> list[bytes]:
        """Every runtime parameter's digest of rank ``rank``."""
        self.hold(model)
        try:
            return [self.digest(model, rank, i) for i in range(len(self.params[rank]))]
        finally:
            self.release()

    def root(self, rank: int, digests: list[bytes]) -> bytes:
        return state_root(self.rank_specs[rank], digests)
