"""A loopback swarm publishing a tiny Llama (with its config.json in the manifest metadata) and checks
of a daemon's rank stores against vLLM's tensor-parallel rules, for the rank-store system tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from patchswarm.daemon.store_format import StoreState
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import ServedModel, raw_bytes
from tests.support.rank_plans import llama_rank, llama_state
from tests.support.swarmkit import Swarm


def llama_swarm(tmp: Path, seed: int = 0, *, with_config: bool = True) -> Swarm:
    """A Swarm whose trainer publishes a tiny Llama; its manifests carry ``checkpoint.files`` (config.json),
    which ``store.plan = auto`` reads."""
    sw = Swarm(tmp)
    state, config = llama_state(seed)
    sw.weights = state
    assert sw.pub is not None
    if with_config:
        meta = {"checkpoint.files": json.dumps({"config.json": config})}
        publish = sw.pub.publish
        sw.pub.publish = lambda m, **kw: publish(m, metadata=meta, **kw)  # type: ignore[method-assign]
    return sw


def rank_names(store: str, tp: int) -> list[str]:
    return [store] if tp == 1 else [f"{store}.r{k}" for k in range(tp)]


def check_rank_stores(store: str, tp: int, served: dict[int, ServedModel], version: int | None = None) -> int:
    """Every rank store READY at one version (``version`` if given), each holding exactly its slice of
    that version by vLLM's rules (computed here with chunk/cat), its root verified over its bytes.
    Returns the version.  Call only while no daemon writes the stores."""
    stores = [WeightStore.open(n) for n in rank_names(store, tp)]
    try:
        headers = [s.header() for s in stores]
        assert all(h.state == StoreState.READY and h.stable for h in headers), [h.state for h in headers]
        versions = {h.version for h in headers}
        assert len(versions) == 1, f"ranks at different versions: {[h.version for h in headers]}"
        v = versions.pop()
        assert version is None or v == version, (v, version)
        model = served[v]
        typed = {s.name: model.typed(i) for i, s in enumerate(model.specs)}
        for k, s in enumerate(stores):
            want = llama_rank(typed, tp, k)
            assert [x.name for x in s.layout.specs] == sorted(want)
            for i, spec in enumerate(s.layout.specs):
                assert torch.equal(s.slot_bytes(i), raw_bytes(want[spec.name])), f"rank {k} {spec.name} v{v}"
            assert s.root() == headers[k].root, f"rank {k}: root does not verify"
        return v
    finally:
        for s in stores:
            s.close()
