"""Casting FP32 master weights to the served format, on whatever device they live.

bf16 and fp16 are plain casts of floating tensors; integer and bool tensors are served as they
are in every format (no float format represents them); ``as_is`` keeps every tensor's bits.
fp16 refuses a tensor with a value beyond its range (65504) rather than serving inf.

fp8 e4m3 quantizes the tensors its selection names (daemon/fp8.py: by default the linear
weights inside decoder layers, as engines quantize them) and serves the other floating tensors
as bf16.  Its scales stay FIXED between refreshes: recomputed every step, every value under a
moved scale would change and the patch would be dense.  A scale (a whole tensor's, or one
128x128 tile's) is refreshed only when its values drift past the threshold (they would clip,
or use under 1-drift of the range); that tensor, or tile, then ships densely once.  Anchors keep
the scales unless ``refresh_at_anchor`` (docs/models.md, "Served formats", says why).

The scales of version N+1 are those of version N whatever process made N: ``follow`` takes
them from N's served tensors (the Publisher's previous version, rebuilt from the board when it
resumes a run), so a publisher per version and one long-lived publisher write the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from patchswarm.daemon import fp8
from patchswarm.protocol.errors import UnservableError
from patchswarm.protocol.served import ServedModel, TensorSpec

FP8_MAX = fp8.FP8_MAX
FORMATS = ("bf16", "fp16", "fp8_e4m3", "as_is")  # as_is: tensors already hold served values
FP16_MAX = 65504.0
MAX_BLOCK = 1 << 16


@dataclass
class ServedFormat:
    name: str = "bf16"  # also accepted as spelled on the command line: fp8-e4m3
    block: int | None = None  # fp8 only: None = per-tensor scale, else square block size (engines: 128)
    drift: float = 0.25  # fp8 only: refresh a scale when amax leaves [scale*448*(1-drift), scale*448]
    headroom: float = 0.05  # fp8 only: new scales leave this much range above amax, so growth does not clip
    quantize: tuple[str, ...] = fp8.DEFAULT_QUANTIZE  # fp8 only: names quantized (fnmatch patterns)...
    keep: tuple[str, ...] = fp8.DEFAULT_KEEP  # ...unless they match one of these
    refresh_at_anchor: bool = False  # fp8 only: an anchor recomputes every scale
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # weight name -> its current scale
    refreshed: list[str] = field(default_factory=list)  # names whose scale changed in the last convert
    basis: int | None = None  # version whose scales ``scales`` holds (None: not known, follow re-reads)
    converted: frozenset[str] = frozenset()  # names of the last convert

    def __post_init__(self) -> None:
        if isinstance(self.name, str):
            self.name = self.name.replace("-", "_")
        if self.name not in FORMATS:
            raise ValueError(f"served format must be one of {', '.join(FORMATS)}, not {self.name!r}")
        if self.block is not None and (
            isinstance(self.block, bool) or not isinstance(self.block, int) or not 1 <= self.block <= MAX_BLOCK
        ):
            raise ValueError(f"block must be a whole number from 1 to {MAX_BLOCK}, or None, not {self.block!r}")
        for what, value in (("drift", self.drift), ("headroom", self.headroom)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
                raise ValueError(f"{what} must be a number in [0, 1), not {value!r}")
        for what, pats in (("quantize", self.quantize), ("keep", self.keep)):
            if not isinstance(pats, tuple | list) or not all(isinstance(p, str) and p for p in pats):
                raise ValueError(f"{what} must be a list of name patterns, not {pats!r}")
        self.quantize, self.keep = tuple(self.quantize), tuple(self.keep)

    @property
    def is_fp8(self) -> bool:
        return self.name == "fp8_e4m3"

    def selects(self, name: str, t: torch.Tensor) -> bool:
        """Whether fp8 quantizes this tensor (a floating, non-empty matrix its patterns name)."""
        return (
            self.is_fp8
            and t.is_floating_point()
            and t.dim() == 2
            and t.numel() > 0
            and fp8.matches(name, self.quantize)
            and not fp8.matches(name, self.keep)
        )

    def convert(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.refreshed = []
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            t = t.detach()
            if not t.is_floating_point() or self.name == "as_is":
                out[name] = t.clone()
            elif self.name == "fp16":
                check_fp16(name, t)
                out[name] = t.to(torch.float16)
            elif self.selects(name, t):
                q, scale = self._fp8(name, t)
                out[name] = q
                out[fp8.scale_name(name, self.block)] = scale
            else:
                out[name] = t.to(torch.bfloat16)
        if self.is_fp8:
            self.converted = frozenset(state)
            clash = sorted(n for n in state if self.selects(n, state[n]) and fp8.scale_name(n, self.block) in state)
            if clash:
                raise UnservableError(f"{clash[0]!r} has a tensor named like its fp8 scale already in the state")
        return out

    def reset(self) -> None:
        """Forget scales (the next convert recomputes every one)."""
        self.scales.clear()

    def follows(self, version: int | None, names: Iterable[str]) -> bool:
        """Whether ``scales`` are already those of served version ``version``: this format made it from
        the same tensor names."""
        return version is not None and self.basis == version and self.converted == frozenset(names)

    def follow(self, version: int | None, model: ServedModel | None, names: Iterable[str]) -> None:
        """Make ``scales`` those of ``model``, served version ``version`` (the next one's base), unless
        this format made that version from the same tensor names (its scales are then those)."""
        if not self.is_fp8:
            return
        if self.follows(version, names):
            return
        self.scales = scales_of(model) if model is not None else {}
        self.basis = version

    def scale_for(self, name: str, a: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``name``'s scale for the amax ``a`` of the WHOLE tensor (computed here by ``convert``, or
        all-reduced from the ranks' rows by daemon/publish_dist.py): its current scale, refreshed in
        the tiles past the drift threshold; recorded in ``scales`` (and ``refreshed`` if it moved)."""
        fp8.check_finite(name, a)
        scale, moved = fp8.next_scale(a, self.scales.get(name), self.drift, self.headroom)
        self.scales[name] = scale
        if moved:
            self.refreshed.append(name)
        return scale, moved

    def _fp8(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = t.float()
        scale, _ = self.scale_for(name, fp8.amax(x, self.block))
        return fp8.quantize(x, scale, self.block), scale.clone()

    # ------------------------------------------------------------ what engines need to know

    def quantization_config(self, specs: Iterable[TensorSpec] | None = None) -> dict[str, object] | None:
        """config.json's ``quantization_config`` for this format (None unless fp8).

        With ``specs`` (a served version's), modules inside decoder layers whose 2-D ``.weight`` was
        left unquantized although engines would quantize it (a narrowed selection) are listed as
        ``modules_to_not_convert``, which vLLM and SGLang read as ``ignored_layers``.
        """
        if not self.is_fp8:
            return None
        cfg: dict[str, object] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if self.block is not None:
            cfg["weight_block_size"] = [self.block, self.block]
        if specs is not None:
            specs = list(specs)
            quantized = {fp8.weight_of_scale(s.name) for s in specs if s.dtype == "F32"}
            skipped = sorted(
                s.name[: -len(".weight")]
                for s in specs
                if s.name.endswith(".weight")
                and len(s.shape) == 2
                and s.name not in quantized
                and fp8.matches(s.name, fp8.DEFAULT_QUANTIZE)
                and not fp8.matches(s.name, fp8.DEFAULT_KEEP)
            )
            if skipped:
                cfg["modules_to_not_convert"] = skipped
        return cfg

    def metadata(self, specs: list[TensorSpec]) -> dict[str, str]:
        """``served.format`` and, for fp8, ``served.quantization_config`` (JSON) of a served version.

        Refuses an fp8 version that quantized nothing: its selection matched no tensor (names that
        are not checkpoint names need ``quantize=fp8.ALL_MATRICES`` or patterns of their own).
        """
        meta = {"served.format": self.name}
        if self.is_fp8:
            if not any(s.dtype == "F8_E4M3" for s in specs):
                raise UnservableError(
                    "served format fp8_e4m3 quantized no tensor: no floating matrix matches "
                    f"{list(self.quantize)} (give ServedFormat(..., quantize=...) patterns that name the weights)"
                )
            meta["served.quantization_config"] = json.dumps(
                self.quantization_config(specs), sort_keys=True, separators=(",", ":")
            )
        return meta


def scales_of(model: ServedModel) -> dict[str, torch.Tensor]:
    """The fp8 scales a served version holds: {weight name: F32 scale}, copied (buffers get recycled)."""
    index = {s.name: i for i, s in enumerate(model.specs)}
    out: dict[str, torch.Tensor] = {}
    for i, s in enumerate(model.specs):
        weight = fp8.weight_of_scale(s.name)
        j = index.get(weight) if weight is not None else None
        if (
            s.dtype == "F32"
            and j is not None
            and model.specs[j].dtype == "F8_E4M3"
            and len(s.shape) in (0, 2)
            and model.data[i].device.type != "meta"  # bytes that did not travel (daemon/publish_dist.py)
        ):
            out[model.specs[j].name] = model.typed(i).clone()
    return out


def check_fp16(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor with finite values fp16 cannot hold (they would become inf)."""
    if t.numel() == 0 or t.dtype == torch.float16:
        return
    a = t.abs().amax()
    if not bool(a <= FP16_MAX):  # (not <=: a NaN anywhere makes amax NaN, which must not pass unchecked)
        finite = t.abs()[torch.isfinite(t)]  # inf stays inf in fp16, NaN stays NaN: only finite ones overflow
        if finite.numel() and bool(finite.amax() > FP16_MAX):
            raise UnservableError(f"{name} holds values beyond fp16's range ({FP16_MAX:g}): serve it as bf16")
