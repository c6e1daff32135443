"""fp8 e4m3 weights as inference engines load them: which tensors, scale names, scale math.

Engines read an fp8 checkpoint as ``<module>.weight`` (``float8_e4m3fn``) plus an F32 scale
that MULTIPLIES the fp8 values back (w ~= q * scale):

- per tensor: ``<module>.weight_scale``, one value (vLLM and SGLang ``Fp8Config`` without
  ``weight_block_size``; shape [] here, as AutoFP8 wrote them: vLLM's loaders reshape a 0-d
  scale to [1], vllm/model_executor/parameter.py);
- 128x128 blocks: ``<module>.weight_scale_inv``, [ceil(rows/128), ceil(cols/128)], block (i, j)
  scaling rows 128i.. and columns 128j..; partial blocks at the edges are scaled by the amax
  of what is there.  Despite the name it is a multiplier too (DeepSeek-V3's README_WEIGHTS.md:
  "(128x128 weight block) * weight_scale_inv"; vLLM registers the block scale under this name
  "for deepseekv3"; transformers' FineGrainedFP8 dequantizes with ``weight * weight_scale_inv``).

Sources read (none copied): vllm-project/vllm vllm/model_executor/layers/quantization/fp8.py
(Fp8Config.from_config, Fp8LinearMethod/Fp8MoEMethod.create_weights), deepseek-ai/DeepSeek-V3
README_WEIGHTS.md, huggingface/transformers src/transformers/integrations/finegrained_fp8.py
and utils/quantization_config.py (FineGrainedFP8Config), sgl-project/sglang
python/sglang/srt/layers/quantization/fp8.py (Fp8Config.from_config).  Names that do not end in ``.weight``
(tests, non-HF trainers) get ``<name>.scale`` whatever the scaling.

The rules take the amax as input (``next_scale``; ``quantize`` of a row range): a one-process
``ServedFormat.convert`` computes it over the whole tensor, the ranks of a sharded trainer
(daemon/publish_dist.py) each over their rows (``amax`` of a row range) and combine them with an
all-reduce (MAX); both then call the same functions, so their bytes are the same.
"""

from __future__ import annotations

import fnmatch
import math

import torch

from patchswarm.protocol.errors import UnservableError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ENGINE_BLOCK = 128  # the block size vLLM, SGLang and transformers' FineGrainedFP8 use

# What engines quantize in a Hugging Face checkpoint: the linear projections inside decoder
# layers (attention, dense MLP, every MoE expert and shared expert), never embeddings, lm_head,
# norms, biases or MoE routers (vLLM builds routers with quant_config=None).  Patterns are
# fnmatch-style over canonical names (``*`` crosses dots); a tensor must also be a floating,
# non-empty 2-D matrix.
DEFAULT_QUANTIZE = (
    "*.layers.*.self_attn.*.weight",
    "*.layers.*.mlp.*.weight",
    "*.layers.*.block_sparse_moe.*.weight",  # Mixtral's experts.N.w1/w2/w3
)
DEFAULT_KEEP = (
    "*.mlp.gate.weight",  # Qwen-MoE / DeepSeek router
    "*.block_sparse_moe.gate.weight",  # Mixtral router
    "*.mlp.shared_expert_gate.weight",  # Qwen2-MoE shared-expert gate (one row)
    "*norm*",
)
ALL_MATRICES = ("*",)  # every floating matrix: trainers whose names are not checkpoint names


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def scale_name(name: str, block: int | None) -> str:
    if name.endswith(".weight"):
        return name + ("_scale_inv" if block is not None else "_scale")
    return name + ".scale"


def weight_of_scale(name: str) -> str | None:
    """The weight a scale tensor belongs to, by the naming above (None: not a scale name)."""
    for suffix in (".weight_scale_inv", ".weight_scale"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    if name.endswith(".scale"):
        return name[: -len(".scale")]
    return None


def _tiles(x: torch.Tensor, block: int, top: int = 0) -> torch.Tensor:
    """``x`` as [rows/block, block, cols/block, block] tiles, its first row ``top`` rows into the first
    tile: a view when nothing needs padding, else zero-padded (zeros never raise an amax)."""
    r, c = x.shape
    pr, pc = math.ceil((top + r) / block) * block, math.ceil(c / block) * block
    if (pr, pc) != (r, c):
        x = torch.nn.functional.pad(x, (0, pc - c, top, pr - r - top))
    return x.reshape(pr // block, block, pc // block, block)


def amax(x: torch.Tensor, block: int | None, *, first_row: int = 0, rows: int | None = None) -> torch.Tensor:
    """abs max of a float32 matrix: a 0-d tensor, or one per ``block`` x ``block`` tile (edges partial).

    ``x`` may be rows ``first_row``.. of a matrix of ``rows`` rows (a rank's shard): then this is its
    share, the whole matrix's tile grid with zeros where its rows do not reach, and the MAX of every
    share (an all-reduce) is exactly the whole matrix's amax.  Max and min reductions, no |x|
    temporary: read passes only.
    """
    if block is None:
        if x.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        lo, hi = torch.aminmax(x)
        return torch.maximum(hi, -lo)
    total = x.shape[0] if rows is None else rows
    if first_row == 0 and total == x.shape[0]:
        t = _tiles(x, block)
        return torch.maximum(t.amax(dim=(1, 3)), -t.amin(dim=(1, 3)))
    grid = torch.zeros((math.ceil(total / block), math.ceil(x.shape[1] / block)), dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return grid
    t = _tiles(x, block, first_row % block)
    first = first_row // block
    grid[first : first + t.shape[0]] = torch.maximum(t.amax(dim=(1, 3)), -t.amin(dim=(1, 3)))
    return grid


def check_finite(name: str, a: torch.Tensor) -> None:
    """Refuse a tensor whose amax is inf or NaN (fp8 e4m3 has neither)."""
    if not bool(torch.isfinite(a).all()):
        raise UnservableError(f"{name} holds inf or NaN: fp8 e4m3 cannot serve it")


def expand(scale: torch.Tensor, shape: torch.Size | tuple[int, ...], block: int | None) -> torch.Tensor:
    """The scale of every element of a ``shape`` matrix."""
    if block is None:
        return scale
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


def fresh_scale(a: torch.Tensor, headroom: float) -> torch.Tensor:
    """Scales that put ``a`` at 1/(1+headroom) of the fp8 range.  An all-zero tile gets 1.0; the
    floor (smallest normal float32) keeps tiny tiles from a zero scale and x/0."""
    s = (a.double() * (1 + headroom) / FP8_MAX).float()
    s = torch.where(a > 0, s, torch.ones_like(s))
    return s.clamp_(min=torch.finfo(torch.float32).tiny)


def drifted(a: torch.Tensor, scale: torch.Tensor, drift: float) -> torch.Tensor:
    """Tiles whose values would clip under ``scale``, or shrank to use under (1-drift) of its range.
    All-zero tiles never drift: any scale represents zero exactly."""
    top = scale.double() * FP8_MAX
    return (a.double() > top) | ((a > 0) & (a.double() < top * (1 - drift)))


def next_scale(a: torch.Tensor, old: torch.Tensor | None, drift: float, headroom: float) -> tuple[torch.Tensor, bool]:
    """The scale of a tensor whose amax (0-d, or per tile) is ``a``, given its current scale ``old``
    (None: none yet): ``old`` where it still fits, a fresh one in the tiles that drifted; and
    whether it changed.  A scale of another layout (the block size changed) is replaced whole."""
    if old is None or old.shape != a.shape or old.dtype != torch.float32:
        return fresh_scale(a, headroom), True
    old = old.to(a.device)
    moved = drifted(a, old, drift)
    if not bool(moved.any()):
        return old, False
    scale = torch.where(moved, fresh_scale(a, headroom), old)
    return scale, not torch.equal(scale, old)


def quantize(x: torch.Tensor, scale: torch.Tensor, block: int | None, *, first_row: int = 0) -> torch.Tensor:
    """float32 matrix -> float8_e4m3fn with x ~= q * scale (round to nearest; clamped, so never NaN).

    ``x`` may be rows ``first_row``.. of the matrix ``scale`` (its whole tile grid) belongs to.
    """
    if block is not None:
        top, n = first_row // block, x.shape[0]
        scale = scale[top : max(top, -(-(first_row + n) // block))]  # the tile rows these rows fall in
        skip = first_row - top * block
        if skip:
            return (
                (x / expand(scale, (skip + n, x.shape[1]), block)[skip:])
                .clamp_(-FP8_MAX, FP8_MAX)
                .to(torch.float8_e4m3fn)
            )
    if block is not None and x.shape[0] % block == 0 and x.shape[1] % block == 0:
        r, c = x.shape  # whole tiles: divide through a broadcast view, no expanded scale
        y = x.reshape(r // block, block, c // block, block) / scale[:, None, :, None]
        return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(r, c)
    return (x / expand(scale, x.shape, block)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int | None) -> torch.Tensor:
    """What an engine computes with: q * scale, in float32."""
    return q.float() * expand(scale.float(), q.shape, block)
