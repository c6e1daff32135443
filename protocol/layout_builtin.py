"""Built-in layout plans: vLLM's runtime parameters for the Llama / Qwen2 / Qwen3 / Mistral families
and for Qwen3-MoE and DeepSeek-V2/V3 style MoE, under tensor parallelism (experts tensor- or
expert-parallel).  The layout is the one the engine's ``weight_loader`` produces (before any kernel
specific post-processing such as fp8 scale maxing or Marlin repacking).

Sources read (vLLM main, 2025): model_executor/layers/linear.py (QKVParallelLinear: q heads split, kv
heads split or replicated when there are fewer kv heads than ranks, rank r taking kv head
r // (tp / kv_heads); MergedColumnParallelLinear; RowParallelLinear: input dim split, bias whole),
layers/vocab_parallel_embedding.py (vocab padded to a multiple of 64, then cut in tp equal shards; rows
past the vocabulary are zero), layers/fused_moe/layer.py (w13_weight [E, 2*I/tp, H] gate then up,
w2_weight [E, H, I/tp]; with expert parallelism rank r holds experts [r*E/ep, (r+1)*E/ep) whole),
layers/quantization/fp8.py (per-tensor fp8: one scale per logical shard, ``weight_scale`` of a fused
linear has one element per source, w13_weight_scale [E, 2], w2_weight_scale [E]; 128x128 block scales
``weight_scale_inv`` cut with the weight's blocks), models/llama.py, qwen2.py, qwen3.py, qwen3_moe.py,
deepseek_v2.py (MLA: q_a_proj and kv_a_proj_with_mqa fused into a replicated fused_qkv_a_proj;
q_b_proj / kv_b_proj column-parallel; shared experts as a plain MLP).  SGLang uses the same names and
shards for these families (its differences are in docs/models.md).
https://github.com/vllm-project/vllm/tree/main/vllm/model_executor
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_plan import Box, LayoutPlan, PlanBuilder, full_box
from patchswarm.protocol.served import TensorSpec

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE
BLOCK = 128  # fp8 block-scale tile

DENSE = {"llama", "mistral", "qwen2", "qwen3"}
MOE = {"qwen3_moe", "deepseek_v2", "deepseek_v3"}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
ENGINES = ("vllm", "sglang")
SUFFIXES = ("weight", "bias", "weight_scale", "weight_scale_inv", "input_scale")

_LAYER = re.compile(r"^(model\.layers\.\d+\.)(.+)$")
_MODULE = re.compile(r"^(.+)\.(weight|bias|weight_scale|weight_scale_inv|input_scale)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_scale_inv)$")


def family_of(config: Mapping[str, Any]) -> str:
    """The built-in family a config.json names (model_type first, then architectures)."""
    mt = config.get("model_type")
    if isinstance(mt, str) and mt in DENSE | MOE:
        return mt
    archs = config.get("architectures")
    if isinstance(archs, list):
        for a in archs:
            if isinstance(a, str) and a in ARCHITECTURES:
                return ARCHITECTURES[a]
    raise PlanError(
        f"layout plan: no built-in plan for model_type {str(mt)[:64]!r} (architectures {str(archs)[:128]});"
        " give a plan file"
    )


def _cfg_int(config: Mapping[str, Any], key: str, default: int | None = None, top: int = 1 << 20) -> int:
    v = config.get(key, default)
    if v is None and default is not None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= top:
        raise PlanError(f"layout plan: config.json {key} is {str(v)[:32]}, not an integer 1..{top}")
    return v


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise PlanError(f"layout plan: {what} ({n}) does not divide by {d}")
    return n // d


def _per_tensor(s: TensorSpec) -> None:
    if s.numel != 1:
        raise PlanError(f"layout plan: {s.name} has shape {list(s.shape)}, not a per-tensor scale")


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


@dataclass(frozen=True, slots=True)
class Shard:
    """One logical source of a column-parallel (possibly fused) runtime linear."""

    module: str  # canonical module (name without the .weight suffix), relative to the layer prefix
    rows: int  # its total output rows
    mode: str  # "split" (rows / tp per rank), "whole" (every rank holds all rows), "kv" (kv heads)
    heads: int = 0  # for "split" of attention heads and "kv": how many heads the rows hold


def _shard_rows(s: Shard, rank: int, tp: int) -> tuple[int, int]:
    """The canonical rows ``[a, b)`` of shard ``s`` that rank ``rank`` holds."""
    if s.mode == "whole" or tp == 1:
        return 0, s.rows
    if s.mode == "kv" and s.heads < tp:
        if tp % s.heads:
            raise PlanError(f"layout plan: {s.module}: {tp} ranks is not a multiple of {s.heads} kv heads")
        per_head = s.rows // s.heads
        head = rank // (tp // s.heads)
        return head * per_head, (head + 1) * per_head
    if s.heads:
        _divide(s.heads, tp, f"{s.module}: heads")
    n = _divide(s.rows, tp, f"{s.module}: rows")
    return rank * n, (rank + 1) * n


class _Emit:
    """Places canonical tensors of one family on ``tp`` ranks."""

    def __init__(self, specs: Sequence[TensorSpec], tp: int, family: str) -> None:
        self.by_name = {s.name: s for s in specs}
        self.tp = tp
        self.b = PlanBuilder(tp, family)
        self.done: set[str] = set()

    def spec(self, name: str) -> TensorSpec | None:
        return self.by_name.get(name)

    def replicate(self, name: str, param: str | None = None) -> None:
        s = self.by_name[name]
        for r in range(self.tp):
            self.b.param(r, param or name, s.shape, s.dtype)
            self.b.place(name, r, param or name, full_box(s.shape), full_box(s.shape))
        self.done.add(name)

    def column(self, prefix: str, param_module: str, shards: Sequence[Shard]) -> None:
        """Column-parallel (fused) linear: each shard's rows of every rank, one after the other."""
        for k, sh in enumerate(shards):
            for suffix in SUFFIXES:
                name = f"{prefix}{sh.module}.{suffix}"
                s = self.by_name.get(name)
                if s is None:
                    continue
                self.done.add(name)
                for r in range(self.tp):
                    self._column_piece(prefix, param_module, shards, k, suffix, s, r)

    def _column_piece(
        self, prefix: str, module: str, shards: Sequence[Shard], k: int, suffix: str, s: TensorSpec, r: int
    ) -> None:
        tp = self.tp
        spans = [_shard_rows(sh, r, tp) for sh in shards]
        sizes = [b - a for a, b in spans]
        a, b = spans[k]
        off = sum(sizes[:k])
        param = f"{prefix}{module}.{suffix}"
        src: Box
        dst: Box
        if suffix in ("weight", "bias"):
            cols = s.shape[1:]
            shape = (sum(sizes), *cols)
            src = ((a, b), *full_box(cols))
            dst = ((off, off + b - a), *full_box(cols))
        elif suffix in ("weight_scale", "input_scale"):
            _per_tensor(s)
            shape, src, dst = (len(shards),), full_box(s.shape), ((k, k + 1),)
        else:  # weight_scale_inv: 128-row blocks follow the weight's rows
            for j, sh in enumerate(shards):
                whole = sizes[j] == sh.rows
                if (not whole or j != len(shards) - 1) and sizes[j] % BLOCK:
                    raise PlanError(
                        f"layout plan: {prefix}{sh.module}: {sizes[j]} rows per rank do not fill {BLOCK}-row"
                        " blocks of its fp8 block scales"
                    )
            blocks = [_cdiv(n, BLOCK) for n in sizes]
            cols = s.shape[1:]
            shape = (sum(blocks), *cols)
            src = ((a // BLOCK, a // BLOCK + blocks[k]), *full_box(cols))
            boff = sum(blocks[:k])
            dst = ((boff, boff + blocks[k]), *full_box(cols))
        self.b.param(r, param, shape, s.dtype)
        self.b.place(s.name, r, param, src, dst)

    def row(self, prefix: str, module: str) -> None:
        """Row-parallel linear: the input dim cut in tp; bias and per-tensor scales whole on every rank."""
        tp = self.tp
        for suffix in SUFFIXES:
            name = f"{prefix}{module}.{suffix}"
            s = self.by_name.get(name)
            if s is None:
                continue
            self.done.add(name)
            for r in range(tp):
                param = name
                if suffix == "bias":
                    shape, src, dst = s.shape, full_box(s.shape), full_box(s.shape)
                elif suffix in ("weight_scale", "input_scale"):
                    _per_tensor(s)
                    shape, src, dst = (1,), full_box(s.shape), ((0, 1),)
                elif suffix == "weight":
                    if len(s.shape) != 2:
                        raise PlanError(f"layout plan: {name} has shape {list(s.shape)}, not [out, in]")
                    n = _divide(s.shape[1], tp, f"{name}: input size")
                    shape = (s.shape[0], n)
                    src, dst = ((0, s.shape[0]), (r * n, (r + 1) * n)), full_box(shape)
                else:
                    w = self.by_name.get(f"{prefix}{module}.weight")
                    if w is None or len(w.shape) != 2 or len(s.shape) != 2:
                        raise PlanError(f"layout plan: {name} without a 2-d weight")
                    n = _divide(w.shape[1], tp, f"{prefix}{module}.weight: input size")
                    if tp > 1 and n % BLOCK:
                        raise PlanError(
                            f"layout plan: {prefix}{module}: {n} input columns per rank do not fill"
                            f" {BLOCK}-column blocks of its fp8 block scales"
                        )
                    nb = _cdiv(n, BLOCK)
                    shape = (s.shape[0], nb)
                    src, dst = ((0, s.shape[0]), (r * nb, (r + 1) * nb)), full_box(shape)
                self.b.param(r, param, shape, s.dtype)
                self.b.place(name, r, param, src, dst)

    def vocab(self, name: str) -> None:
        """Vocab-parallel: the vocabulary padded to a multiple of 64, cut in tp equal row ranges."""
        s = self.by_name[name]
        vocab = s.shape[0]
        padded = _cdiv(vocab, VOCAB_PADDING) * VOCAB_PADDING
        per = _divide(padded, self.tp, f"{name}: padded vocabulary")
        rest = s.shape[1:]
        for r in range(self.tp):
            self.b.param(r, name, (per, *rest), s.dtype, padded=True)
            a, b = r * per, min((r + 1) * per, vocab)
            if a < b:
                self.b.place(name, r, name, ((a, b), *full_box(rest)), ((0, b - a), *full_box(rest)))
        self.done.add(name)

    def experts(self, prefix: str, num_experts: int, expert_parallel: bool) -> None:
        """Routed experts of one layer fused into w13_weight / w2_weight (and their fp8 scales)."""
        tp = self.tp
        gate0 = self.by_name.get(f"{prefix}mlp.experts.0.gate_proj.weight")
        if gate0 is None or len(gate0.shape) != 2:
            raise PlanError(f"layout plan: {prefix}mlp.experts.0.gate_proj.weight is missing or not 2-d")
        inter = gate0.shape[0]
        if expert_parallel:
            local = _divide(num_experts, tp, "experts over expert-parallel ranks")
            moe_tp = 1
        else:
            local = num_experts
            moe_tp = tp
        i_tp = _divide(inter, moe_tp, f"{prefix}mlp.experts: moe_intermediate_size")
        if moe_tp > 1 and i_tp % BLOCK and f"{prefix}mlp.experts.0.gate_proj.weight_scale_inv" in self.by_name:
            raise PlanError(
                f"layout plan: {prefix}mlp.experts: {i_tp} rows per rank do not fill {BLOCK}-row fp8 scale blocks"
            )
        ib = _cdiv(i_tp, BLOCK)
        for e in range(num_experts):
            ranks = [e // local] if expert_parallel else list(range(tp))
            le = e % local
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for suffix in ("weight", "weight_scale", "weight_scale_inv"):
                    name = f"{prefix}mlp.experts.{e}.{proj}.{suffix}"
                    s = self.by_name.get(name)
                    if s is None:
                        continue
                    self.done.add(name)
                    for r in ranks:
                        part = 0 if expert_parallel else r
                        self._expert_piece(prefix, local, le, proj, suffix, s, r, part, i_tp, ib)

    def _expert_piece(
        self,
        prefix: str,
        local: int,
        le: int,
        proj: str,
        suffix: str,
        s: TensorSpec,
        r: int,
        part: int,
        i_tp: int,
        ib: int,
    ) -> None:
        w13 = proj != "down_proj"
        half = 0 if proj == "gate_proj" else 1
        base = f"{prefix}mlp.experts.{'w13' if w13 else 'w2'}_{suffix}"
        src: Box
        dst: Box
        if suffix == "weight":
            if len(s.shape) != 2:
                raise PlanError(f"layout plan: {s.name} is not 2-d")
            if w13:
                h = s.shape[1]
                shape: tuple[int, ...] = (local, 2 * i_tp, h)
                src = ((part * i_tp, (part + 1) * i_tp), (0, h))
                dst = ((le, le + 1), (half * i_tp, (half + 1) * i_tp), (0, h))
            else:
                h = s.shape[0]
                shape = (local, h, i_tp)
                src = ((0, h), (part * i_tp, (part + 1) * i_tp))
                dst = ((le, le + 1), (0, h), (0, i_tp))
        elif suffix == "weight_scale":
            _per_tensor(s)
            src = full_box(s.shape)
            if w13:
                shape, dst = (local, 2), ((le, le + 1), (half, half + 1))
            else:
                shape, dst = (local,), ((le, le + 1),)
        else:
            if len(s.shape) != 2:
                raise PlanError(f"layout plan: {s.name} is not 2-d")
            if w13:
                hb = s.shape[1]
                shape = (local, 2 * ib, hb)
                src = ((part * ib, part * ib + ib), (0, hb))
                dst = ((le, le + 1), (half * ib, (half + 1) * ib), (0, hb))
            else:
                hb = s.shape[0]
                shape = (local, hb, ib)
                src = ((0, hb), (part * ib, part * ib + ib))
                dst = ((le, le + 1), (0, hb), (0, ib))
        self.b.param(r, base, shape, s.dtype)
        self.b.place(s.name, r, base, src, dst)


def builtin_plan(
    config: Mapping[str, Any],
    canonical_specs: Sequence[TensorSpec],
    tp: int,
    *,
    expert_parallel: bool = False,
    engine: str = "vllm",
) -> LayoutPlan:
    """The plan of ``config``'s family for ``tp`` ranks (MoE experts expert-parallel if asked), checked.

    ``engine`` "sglang" differs only in DeepSeek's fused MLA input projection: SGLang names it
    ``fused_qkv_a_proj_with_mqa`` and keeps a single per-tensor scale for it (so a per-tensor fp8
    checkpoint is refused there; block scales are concatenated as vLLM does)."""
    if engine not in ENGINES:
        raise PlanError(f"layout plan: engine {engine[:32]!r} is not one of {', '.join(ENGINES)}")
    family = family_of(config)
    if expert_parallel and family not in MOE:
        raise PlanError(f"layout plan: expert parallelism asked for {family}, which has no experts")
    heads = _cfg_int(config, "num_attention_heads")
    kv_heads = _cfg_int(config, "num_key_value_heads", heads)
    tied = bool(config.get("tie_word_embeddings", False))
    em = _Emit(canonical_specs, tp, family + (" (expert parallel)" if expert_parallel else ""))
    names = [s.name for s in canonical_specs]
    num_experts = 0
    if family in MOE:
        num_experts = _cfg_int(config, "num_experts" if family == "qwen3_moe" else "n_routed_experts")
    layer_prefixes = sorted({m.group(1) for n in names if (m := _LAYER.match(n))})
    if "num_hidden_layers" in config:
        # layers past num_hidden_layers are DeepSeek-V3's multi-token-prediction layers: the serving
        # model skips them (vLLM loads them only for speculative decoding)
        layers = _cfg_int(config, "num_hidden_layers")
        for name in names:
            m = _LAYER.match(name)
            if m is not None and int(m.group(1).split(".")[2]) >= layers:
                em.b.ignore(name)
                em.done.add(name)
        layer_prefixes = [p for p in layer_prefixes if int(p.split(".")[2]) < layers]
    for prefix in layer_prefixes:
        _attention(em, prefix, family, heads, kv_heads, engine)
        _mlp(em, prefix)
        if em.spec(f"{prefix}mlp.experts.0.gate_proj.weight") is not None:
            em.experts(prefix, num_experts, expert_parallel)
    for name in names:
        if name in em.done:
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name == "lm_head.weight" and tied:
                em.b.ignore(name)  # vLLM skips it: lm_head is embed_tokens
            else:
                em.vocab(name)
        elif name.endswith("rotary_emb.inv_freq"):
            em.b.ignore(name)
        elif name.endswith("norm.weight") or name.endswith("norm.bias") or name.endswith("e_score_correction_bias"):
            em.replicate(name)
    plan = em.b.build()
    plan.check(canonical_specs)
    return plan


def _attention(em: _Emit, prefix: str, family: str, heads: int, kv_heads: int, engine: str) -> None:
    q = em.spec(f"{prefix}self_attn.q_proj.weight")
    if family.startswith("deepseek"):
        _mla(em, prefix, heads, engine)
    elif q is not None:
        k = em.spec(f"{prefix}self_attn.k_proj.weight")
        if k is None:
            raise PlanError(f"layout plan: {prefix}self_attn has q_proj but no k_proj")
        em.column(
            prefix,
            "self_attn.qkv_proj",
            [
                Shard("self_attn.q_proj", q.shape[0], "split", heads),
                Shard("self_attn.k_proj", k.shape[0], "kv", kv_heads),
                Shard("self_attn.v_proj", k.shape[0], "kv", kv_heads),
            ],
        )
    em.row(prefix, "self_attn.o_proj")


def _mla(em: _Emit, prefix: str, heads: int, engine: str) -> None:
    a = f"{prefix}self_attn."
    kv_a = em.spec(a + "kv_a_proj_with_mqa.weight")
    q_a = em.spec(a + "q_a_proj.weight")
    if kv_a is not None and q_a is not None:
        fused = "self_attn.fused_qkv_a_proj"
        if engine == "sglang":
            fused += "_with_mqa"
            if em.spec(a + "q_a_proj.weight_scale") is not None:
                raise PlanError(f"layout plan: SGLang keeps one per-tensor scale for {prefix}{fused}: use block scales")
        em.column(
            prefix,
            fused,
            [
                Shard("self_attn.q_a_proj", q_a.shape[0], "whole"),
                Shard("self_attn.kv_a_proj_with_mqa", kv_a.shape[0], "whole"),
            ],
        )
    elif kv_a is not None:
        em.column(
            prefix, "self_attn.kv_a_proj_with_mqa", [Shard("self_attn.kv_a_proj_with_mqa", kv_a.shape[0], "whole")]
        )
    for module in ("q_b_proj", "q_proj", "kv_b_proj"):
        s = em.spec(f"{a}{module}.weight")
        if s is not None:
            em.column(prefix, f"self_attn.{module}", [Shard(f"self_attn.{module}", s.shape[0], "split", heads)])


def _mlp(em: _Emit, prefix: str) -> None:
    for mlp in ("mlp", "mlp.shared_experts"):
        g = em.spec(f"{prefix}{mlp}.gate_proj.weight")
        if g is None:
            continue
        em.column(
            prefix,
            f"{mlp}.gate_up_proj",
            [Shard(f"{mlp}.gate_proj", g.shape[0], "split"), Shard(f"{mlp}.up_proj", g.shape[0], "split")],
        )
        em.row(prefix, f"{mlp}.down_proj")
    gate = f"{prefix}mlp.gate.weight"
    if em.spec(gate) is not None:
        em.replicate(gate)
