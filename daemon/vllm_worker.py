"""vLLM worker extension: each vLLM worker maps its rank's store once and copies each version in place.

Run vLLM with ``--worker-extension-cls patchswarm.daemon.vllm_worker.PatchswarmWorkerExtension``:
vLLM resolves the class by its qualified name and appends it to the worker class's bases, refusing
any attribute the worker already has (vllm/v1/worker/worker_base.py, ``WorkerWrapperBase.init_worker``,
https://github.com/vllm-project/vllm/blob/main/vllm/v1/worker/worker_base.py), so every name here
starts with ``patchswarm_``.  The daemon calls the methods through ``collective_rpc`` (HTTP:
``POST /collective_rpc {"method", "args": [<str>], "timeout"}``, a dev-mode route,
``VLLM_SERVER_DEV_MODE=1``; it passes only strings: vllm/entrypoints/serve/dev/rpc/api_router.py).

No vLLM import at module level: the class is plain Python over the worker's ``model_runner`` and
``device``; the copy itself is daemon/param_sync.py.  Parameters vLLM transformed after loading go
through the model's ``load_weights`` for those tensors only.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from patchswarm.daemon.param_sync import ParamSync, SyncError, open_rank_store_routed, parse_apply


def _tp_rank() -> int:
    """The worker's rank in its tensor-parallel group (vllm/distributed/parallel_state.py); 0 outside vLLM."""
    try:
        dist = importlib.import_module("vllm.distributed")
        return int(dist.get_tensor_model_parallel_rank())
    except (ImportError, AssertionError):  # (not in vLLM, or no TP group: one rank)
        return 0


class PatchswarmWorkerExtension:
    """Mixed into vLLM's Worker: ``patchswarm_attach`` once, ``patchswarm_apply`` per version."""

    patchswarm_sync: ParamSync | None = None

    def patchswarm_model(self) -> torch.nn.Module:
        runner: Any = getattr(self, "model_runner")  # noqa: B009 (the worker's, once mixed in)
        model: torch.nn.Module = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return model

    def patchswarm_attach(self, spec: str) -> dict[str, Any]:
        """Map this worker's rank store (daemon/param_sync.py ``open_rank_store``) and match its entries
        to the model's parameters; returns the rank, how many entries go through the loader and whether
        the plan's routing gives the loader their canonical tensors (``loader_routed``: needed at TP > 1)."""
        rank = _tp_rank()
        device = getattr(self, "device", "cpu")
        view, routing = open_rank_store_routed(spec, rank, device)
        model = self.patchswarm_model()
        params = dict(model.named_parameters())

        def load(items: list[tuple[str, torch.Tensor]]) -> object:
            return model.load_weights(items)  # type: ignore[operator]  # vLLM models have it

        try:
            sync = ParamSync(view, params, load, rank, routing)
        except BaseException:
            view.close()
            raise
        # Attached again (a restarted daemon): the previous mapping goes, else each attach kept another
        # whole-model mapping (an engine-allocated store: another buffer of the model's size on the GPU).
        self.patchswarm_detach()
        self.patchswarm_sync = sync
        return {"rank": rank, "entries": len(view.layout.slots), "loader": sync.fallback[:64],
                "loader_count": len(sync.fallback), "loader_routed": sync.routed}  # fmt: skip

    def patchswarm_apply(self, payload: str) -> dict[str, Any]:
        """Copy this rank's regions of one version (daemon/param_sync.py ``apply_wire``) into the weights.
        Errors come back as ``{"ok": false, "rank", "error", "copied"}`` (collective_rpc gives them to the
        driver, which says why the engine stays on its version)."""
        sync = self.patchswarm_sync
        rank = sync.rank if sync is not None else _tp_rank()
        try:
            if sync is None:
                raise SyncError(f"rank {rank}: patchswarm_attach was not called")
            version, regions = parse_apply(payload, rank)
            return sync.apply(version, regions).to_json()
        except SyncError as e:  # ("attached": False tells the driver to attach again: a restarted vLLM)
            return {"ok": False, "rank": rank, "error": str(e), "copied": e.copied, "attached": sync is not None}
        except Exception as e:  # the engine's loader or a device error: parameters may be part written
            return {"ok": False, "rank": rank, "error": f"rank {rank}: {type(e).__name__}: {e}"[:500], "copied": True}

    def patchswarm_detach(self) -> None:
        if self.patchswarm_sync is not None:
            self.patchswarm_sync.view.close()
            self.patchswarm_sync = None
