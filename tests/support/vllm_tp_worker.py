"""One rank of vLLM's LlamaForCausalLM at TP=N on CPU (a gloo group of N processes), fed from its rank
store by daemon/param_sync.py with the fused entries (qkv_proj, gate_up_proj) sent through vLLM's own
``load_weights`` as the canonical tensors the plan's routing rebuilds (protocol/layout_inverse.py).

``python -m tests.support.vllm_tp_worker RANK WORLD DIR``: DIR holds config.json, ``rank<k>.json``
({"attach": attach info, "routing": routing JSON, "version": v}) and ``target.pt`` (the checkpoint of
that version).  Prints one JSON line: the parameters that differ from a fresh vLLM model of the same
rank given the checkpoint through ``load_weights`` (none expected) and what went through the loader.
vLLM's CPU platform insists on triton-cpu when a config is built; that check is skipped (as in
tests/unit/daemon/test_param_sync_vllm.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> None:
    rank, world, d = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.platforms import current_platform

    from patchswarm.daemon.engine import attach
    from patchswarm.daemon.param_sync import ParamSync
    from patchswarm.protocol.layout_inverse import routing_from_json

    saved = current_platform.check_and_update_config
    current_platform.check_and_update_config = lambda c: None  # type: ignore[method-assign]
    try:
        vc = VllmConfig(
            model_config=ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="bfloat16"),
            parallel_config=ParallelConfig(tensor_parallel_size=world),
        )
    finally:
        current_platform.check_and_update_config = saved  # type: ignore[method-assign]

    def model(seed: int) -> Any:
        torch.manual_seed(seed)
        vc.compilation_config.static_forward_context.clear()  # (attention layers register by name)
        torch.set_default_dtype(torch.bfloat16)
        try:
            m = LlamaForCausalLM(vllm_config=vc)
        finally:
            torch.set_default_dtype(torch.float32)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_()
        return m

    with set_current_vllm_config(vc):
        init_distributed_environment(world, rank, f"file://{d}/init", rank, backend="gloo")
        initialize_model_parallel(world)
        job = json.loads((d / f"rank{rank}.json").read_text())
        routing = routing_from_json(job["routing"])
        view = attach(job["attach"])
        m = model(100 + rank)
        fused = set(routing.params) & {n for n, _ in m.named_parameters() if "qkv" in n or "gate_up" in n}
        params = {n: p for n, p in m.named_parameters() if n not in fused}  # (as if vLLM transformed them)
        loaded: list[str] = []

        def load(items: list[tuple[str, torch.Tensor]]) -> object:
            loaded.extend(n for n, _ in items)
            return m.load_weights(items)

        sync = ParamSync(view, params, load, rank, routing)
        applied = sync.apply(int(job["version"]), None)
        fresh = model(7)
        fresh.load_weights(list(torch.load(d / "target.pt").items()))
        want = dict(fresh.named_parameters())
        differ = [n for n, p in m.named_parameters() if not torch.equal(p.view(torch.uint8), want[n].view(torch.uint8))]
        view.close()
    out = {"rank": rank, "routed": sync.routed, "fallback": sorted(sync.fallback)}
    out |= {"loaded_entries": sorted(applied.loaded), "loaded": sorted(loaded), "differ": differ}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
