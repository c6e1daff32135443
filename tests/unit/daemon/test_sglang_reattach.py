"""SGLang's custom loader (daemon/sglang_loader.py) keeps one store mapping per scheduler: a store that a
restarted daemon made again (another segment, layout or engine buffer) must be mapped again, while a
store that has not reached the version yet (a race) fails that update only.  Real rank stores behind
the daemon's real API (daemon/api.py) on a unix socket, in a thread: the loader asks it for the layout
with its blocking client, as a scheduler does."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from patchswarm.daemon import sglang_loader
from patchswarm.daemon.api import make_api_app, serve_unix
from patchswarm.daemon.copy_drivers import sglang_update_request
from patchswarm.daemon.engine_driver import Activation
from patchswarm.daemon.param_sync import StoreIdentity, SyncError
from patchswarm.daemon.payloads import deserialize_ipc
from patchswarm.daemon.rank_rollout import rank_layout
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.status import Status
from patchswarm.daemon.store_updates import diff_updates
from tests.support.copy_engine import identity_plan, llama_versions, served, stores
from tests.support.rank_plans import LLAMA
from tests.support.store_worker import remove_segments, unique_name

transformers = pytest.importorskip("transformers")


@pytest.fixture
def name() -> Iterator[str]:
    n = unique_name("rea")
    yield n
    remove_segments(n)


@contextmanager
def daemon_api(layout_of: Callable[[int], dict[str, Any] | None], ranks: int = 1) -> Iterator[str]:
    """The daemon's API app serving ``layout_of`` on a unix socket, in a thread with its own loop."""
    sock = str(Path(tempfile.mkdtemp(prefix="psr-")) / "api.sock")  # (short: unix socket paths are bounded)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        app = make_api_app(Status("h", "r"), lambda: layout_of(0), lambda: b"", ranks=ranks, rank_layout=layout_of)
        runner = loop.run_until_complete(serve_unix(app, sock))
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30)
    try:
        yield sock
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)


def update(model: torch.nn.Module, spec: str, act: Activation) -> None:
    req = sglang_update_request(act, 1, spec, full=False)
    assert req.json is not None
    sglang_loader.load_regions(model, deserialize_ipc(req.json["serialized_named_tensors"][0]))


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(99)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)


def equal_to(model: torch.nn.Module, typed: dict[str, torch.Tensor]) -> bool:
    fresh = tiny_llama()
    fresh.load_state_dict(typed)
    want = dict(fresh.named_parameters())
    return all(torch.equal(p.view(torch.uint8), want[n].view(torch.uint8)) for n, p in model.named_parameters())


@pytest.mark.parametrize("form", ["socket", "attach"])
def test_a_store_made_again_by_a_restarted_daemon_is_mapped_again(name: str, tmp_path: Path, form: str) -> None:
    """``socket``: the scheduler asks the daemon; ``attach``: the spec names the store (same name and
    layout after the restart: only the segment's file tells the new store from the old)."""
    v1, v2 = llama_versions()
    plan = identity_plan(served(v1).specs)
    daemon: list[RankStores] = [stores(name, tmp_path, plan, served(v1))]
    with daemon_api(lambda r: rank_layout(daemon[0], r, False)) as sock:
        s0 = daemon[0].store(0)
        assert s0 is not None
        spec = json.dumps(
            {"socket": sock, "ranks": 1, "engine": "sglang", "wait_s": 5}
            if form == "socket"
            else {"attach": [s0.attach_info()]}
        )
        model = tiny_llama()
        update(model, spec, Activation(1, None, True))
        assert equal_to(model, v1)
        first = sglang_loader._SYNCS[spec]
        # The daemon restarts and makes its store again under the same name (another segment: the old
        # one, still mapped by the scheduler, stays at version 1 for ever), then writes version 2.
        old = daemon[0].stores[0]
        assert old is not None
        old.destroy()
        daemon[0].close()
        daemon[0] = stores(name, tmp_path, plan, served(v1))
        daemon[0].apply(2, served(v2), diff_updates(served(v1), served(v2)))
        update(model, spec, Activation(2, 1, True))
        assert equal_to(model, v2)
        second = sglang_loader._SYNCS[spec]
        assert second is not first and first.view.data.numel() == 0  # the stale mapping was let go
        # A race (the same store, not at the version yet): that update fails, the mapping stays.
        with pytest.raises(SyncError, match=r"does not hold version 3 ready \(it holds 2\)"):
            update(model, spec, Activation(3, 2, True))
        assert sglang_loader._SYNCS[spec] is second and equal_to(model, v2)
        sglang_loader._SYNCS.pop(spec).view.close()
        daemon[0].close()


def test_the_identity_of_an_answer_names_segment_layout_and_buffer(name: str, tmp_path: Path) -> None:
    v1, _ = llama_versions()
    rs = stores(name, tmp_path, identity_plan(served(v1).specs), served(v1))
    store = rs.store(0)
    assert store is not None
    info = store.attach_info()
    base = StoreIdentity.of_answer(info)
    assert base == StoreIdentity.of_answer(json.loads(json.dumps(info)))
    assert base != StoreIdentity.of_answer({**info, "layout_hash": "00" * 32})
    assert base != StoreIdentity.of_answer({**info, "kind": "engine_buffer", "buffer": {"buffer_id": 7}})
    assert base != StoreIdentity.of_answer({**info, "control": {**info["control"], "name": name + "x"}})
    for bad in (
        {},
        {**info, "control": 3},
        {**info, "layout_hash": 5},
        {**info, "buffer": "x", "kind": "engine_buffer"},
    ):
        with pytest.raises(SyncError, match="layout answer"):
            StoreIdentity.of_answer(bad)
    rs.close()


def rank_module(specs: list[Any], leave_out: set[str]) -> torch.nn.Module:
    """A module whose parameters are a rank's runtime parameters (``leave_out``: as if the engine had
    transformed those) and whose ``load_weights`` keeps what it is given, as SGLang's model classes take it."""

    class Rank(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.loaded: dict[str, torch.Tensor] = {}

        def load_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
            self.loaded.update((n, t.clone()) for n, t in items)

    root = Rank()
    for s in specs:
        if s.name in leave_out:
            continue
        *path, leaf = s.name.split(".")
        m: torch.nn.Module = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(s.shape, dtype=s.dt.torch_dtype), False))
    return root


def test_at_tp2_the_loader_takes_the_canonical_tensors_the_daemons_routing_rebuilds(name: str, tmp_path: Path) -> None:
    """Each scheduler's entries that do not match a parameter reach ``load_weights`` as the canonical
    tensors they come from (the daemon's layout answer carries the plan's routing): sharded again by
    vLLM's rules (tests/support/rank_plans.py ``llama_rank``, independent of the plan) they are the rank's
    own entries."""
    from patchswarm.protocol.layout_builtin import builtin_plan
    from tests.support.rank_plans import llama_rank, llama_state

    v1, _ = llama_versions()
    _, cfg = llama_state(3)
    plan = builtin_plan(json.loads(cfg), served(v1).specs, 2)
    rs = stores(name, tmp_path, plan, served(v1))
    fused = {n for n in plan.params[0] if "qkv_proj" in n or "gate_up_proj" in n}
    with daemon_api(lambda r: rank_layout(rs, r, False), ranks=2) as sock:
        spec = json.dumps({"socket": sock, "ranks": 2, "engine": "sglang", "wait_s": 5})
        req = sglang_update_request(Activation(1, None, True), 2, spec, full=False)
        assert req.json is not None
        for rank in range(2):
            model = rank_module(plan.rank_specs(rank), fused)
            sglang_loader.load_regions(model, deserialize_ipc(req.json["serialized_named_tensors"][rank]))
            sglang_loader._SYNCS.pop(spec).view.close()  # (one process per rank in SGLang)
            loaded: dict[str, torch.Tensor] = model.loaded  # type: ignore[assignment]
            parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
            assert sorted(loaded) == sorted(n for n in v1 if n.split(".")[-2] in parts)
            assert all(loaded[n].shape == v1[n].shape for n in loaded)
            want = llama_rank(v1, 2, rank)
            again = llama_rank({n: loaded.get(n, torch.zeros_like(t)) for n, t in v1.items()}, 2, rank)
            assert all(torch.equal(again[n], want[n]) for n in fused), rank
            params = dict(model.named_parameters())
            assert all(torch.equal(p, want[n]) for n, p in params.items()), rank
    rs.close()
