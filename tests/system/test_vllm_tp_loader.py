"""vLLM's own LlamaForCausalLM at TP=2 on CPU, two processes in a gloo group (where vLLM imports): each
rank's fused entries go through vLLM's ``load_weights`` as the canonical q/k/v and gate/up tensors
the plan's routing rebuilds (protocol/layout_inverse.py, daemon/param_sync.py); every parameter then
equals a fresh vLLM model's of that rank given the checkpoint through ``load_weights``
(tests/support/vllm_tp_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.store_updates import diff_updates
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.layout_inverse import routing_for, routing_to_json
from tests.support.copy_engine import llama_versions, served, stores
from tests.support.rank_plans import LLAMA, llama_state
from tests.support.store_worker import remove_segments, unique_name

pytest.importorskip("vllm.model_executor.models.llama")
transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_vllm_tp2_loads_the_rebuilt_canonical_tensors_of_each_ranks_loader_entries(tmp_path: Path) -> None:
    name = unique_name("vtp")
    world = 2
    try:
        v1, v2 = llama_versions()
        _, cfg = llama_state(3)
        plan = builtin_plan(json.loads(cfg), served(v1).specs, world)
        rs = stores(name, tmp_path, plan, served(v1))
        rs.apply(2, served(v2), diff_updates(served(v1), served(v2)))
        d = tmp_path / "w"
        d.mkdir()
        (d / "config.json").write_text(transformers.LlamaConfig(**LLAMA, torch_dtype="bfloat16").to_json_string())
        torch.save(v2, d / "target.pt")
        for r in range(world):
            store = rs.store(r)
            assert store is not None
            routing = routing_for(plan, served(v1).specs, r, plan.params[r])
            job = {"attach": store.attach_info(), "routing": routing_to_json(routing), "version": 2}
            (d / f"rank{r}.json").write_text(json.dumps(job))
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.vllm_tp_worker", str(r), str(world), str(d)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(world)
        ]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err[-3000:]
        results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        for r, res in enumerate(results):
            fused = sorted(n for n in plan.params[r] if "qkv_proj" in n or "gate_up_proj" in n)
            assert res["rank"] == r and res["routed"] is True and res["fallback"] == fused
            assert res["loaded_entries"] == fused
            parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
            assert res["loaded"] == sorted(n for n in v1 if n.split(".")[-2] in parts)
            assert res["differ"] == [], (r, res["differ"])
        rs.close()
    finally:
        remove_segments(name)
