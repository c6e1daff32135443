"""daemon/param_sync.py against vLLM's own LlamaForCausalLM on CPU, where vLLM imports (skipped elsewhere).

The rank store is laid out by the project's built-in plan (protocol/layout_builtin.py, TP=1); after each
apply, every parameter of the vLLM model equals, bit for bit, that of a fresh vLLM model given the
target checkpoint through vLLM's own ``load_weights`` (vllm/model_executor/models/llama.py).  vLLM's
x86 CPU platform insists on triton-cpu when a config is built; that check is skipped here (the model
classes and their weight loaders do not use it).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from patchswarm.daemon.engine import attach
from patchswarm.daemon.param_sync import ParamSync
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.protocol.layout_builtin import builtin_plan
from tests.support.copy_engine import changed_regions, llama_versions, served, stores
from tests.support.store_worker import remove_segments, unique_name

vllm_llama = pytest.importorskip("vllm.model_executor.models.llama")


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import LlamaConfig
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.platforms import current_platform

    from tests.support.rank_plans import LLAMA

    d = tmp_path_factory.mktemp("vllm-llama")
    (d / "config.json").write_text(LlamaConfig(**LLAMA, torch_dtype="bfloat16").to_json_string())
    saved = current_platform.check_and_update_config
    current_platform.check_and_update_config = lambda c: None  # (triton-cpu check, see the docstring)
    try:
        vc = VllmConfig(model_config=ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="bfloat16"))
    finally:
        current_platform.check_and_update_config = saved
    with set_current_vllm_config(vc):
        init_distributed_environment(1, 0, f"file://{d}/init", 0, backend="gloo")
        initialize_model_parallel(1)
    yield vc, set_current_vllm_config


def vllm_model(env: tuple[Any, Any]) -> torch.nn.Module:
    vc, ctx = env
    torch.manual_seed(11)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as vLLM's loader does (set_default_torch_dtype)
    vc.compilation_config.static_forward_context.clear()  # (attention layers register by name)
    try:
        with ctx(vc):
            m: torch.nn.Module = vllm_llama.LlamaForCausalLM(vllm_config=vc)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


@contextlib.contextmanager
def rank0_store(
    tmp_path: Path, prefix: str
) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any, Any, Any]]:
    """Versions 1 and 2 of the tiny Llama, the built-in TP=1 plan, its rank store at version 1 and a view
    attached to it (closed and removed after)."""
    from tests.support.rank_plans import llama_state

    name = unique_name(prefix)
    try:
        v1, v2 = llama_versions()
        _, cfg = llama_state(3)
        plan = builtin_plan(json.loads(cfg), served(v1).specs, 1)
        rs = stores(name, tmp_path, plan, served(v1))
        store = rs.store(0)
        assert store is not None
        view = attach(store.attach_info())
        yield v1, v2, plan, rs, view
        view.close()
        rs.close()
    finally:
        remove_segments(name)


def same_as_fresh_load(
    env: tuple[Any, Any], model: torch.nn.Module, target: dict[str, torch.Tensor], tag: object
) -> None:
    """Every parameter of ``model`` equals, bit for bit, that of a fresh vLLM model given ``target``
    through vLLM's own ``load_weights``."""
    fresh = vllm_model(env)
    fresh.load_weights(list(target.items()))  # type: ignore[operator]
    want = dict(fresh.named_parameters())
    for n, p in model.named_parameters():
        w = want[n]
        if n in ("model.embed_tokens.weight", "lm_head.weight"):  # rows past the vocabulary: padding
            p, w = p[:500], w[:500]
        assert torch.equal(p.view(torch.uint8), w.view(torch.uint8)), (tag, n)


def test_vllm_llama_parameters_equal_vllms_own_load_of_each_version(vllm_env: tuple[Any, Any], tmp_path: Path) -> None:
    with rank0_store(tmp_path, "psv") as (v1, v2, _, rs, view):
        model = vllm_model(vllm_env)
        sync = ParamSync(view, dict(model.named_parameters()), None)
        assert sync.fallback == []  # the plan's runtime names, shapes and dtypes are vLLM's
        for version, typed in ((1, v1), (2, v2)):
            if version == 1:
                sync.apply(1, None)
            else:
                before = view.data.clone()
                rs.apply(2, served(v2), diff_updates(served(v1), served(v2)))
                sync.apply(2, changed_regions(view, before))
            same_as_fresh_load(vllm_env, model, typed, version)


def test_entries_through_vllms_loader_take_their_canonical_tensors(vllm_env: tuple[Any, Any], tmp_path: Path) -> None:
    """The fused entries (qkv_proj, gate_up_proj) sent through vLLM's own ``load_weights`` as the canonical
    q/k/v and gate/up tensors the plan's routing rebuilds (protocol/layout_inverse.py): the parameters
    equal vLLM's own load of each version."""
    from patchswarm.protocol.layout_inverse import routing_for

    with rank0_store(tmp_path, "psr") as (v1, v2, plan, rs, view):
        model = vllm_model(vllm_env)
        fused = [n for n in plan.params[0] if "qkv_proj" in n or "gate_up_proj" in n]
        params = {n: p for n, p in model.named_parameters() if n not in fused}  # (as if vLLM transformed them)
        loaded: list[list[str]] = []

        def load(items: list[tuple[str, torch.Tensor]]) -> object:
            loaded.append([n for n, _ in items])
            return model.load_weights(items)  # type: ignore[operator]

        routing = routing_for(plan, served(v1).specs, 0, fused)
        sync = ParamSync(view, params, load, 0, routing)
        assert sorted(sync.fallback) == sorted(fused) and sync.routed
        sync.apply(1, None)
        before = view.data.clone()
        rs.apply(2, served(v2), diff_updates(served(v1), served(v2)))
        got = sync.apply(2, changed_regions(view, before))
        assert got.loaded == ("model.layers.1.self_attn.qkv_proj.weight",)  # (v2 changes k_proj of layer 1)
        assert sorted(loaded[-1]) == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "kqv"]
        same_as_fresh_load(vllm_env, model, v2, 2)
