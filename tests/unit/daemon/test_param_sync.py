"""Copy engines' side (daemon/param_sync.py, daemon/vllm_worker.py, daemon/sglang_loader.py) against real
torch modules: a transformers Llama (TP=1) and the runtime parameters of vLLM's TP=2 layout (the built-in
plan), fed from real rank stores.  Expected values are computed independently: a fresh
``load_state_dict`` of the target version, or tests/support/rank_plans.py ``llama_rank`` (torch.chunk / cat).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.engine import EngineView, attach
from patchswarm.daemon.engine_driver import Activation, Region
from patchswarm.daemon.param_sync import ParamSync, SyncError, apply_wire, parse_apply
from patchswarm.daemon.payloads import deserialize_ipc
from patchswarm.daemon.rank_stores import RankStores
from patchswarm.daemon.sglang_loader import load_regions
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.vllm_worker import PatchswarmWorkerExtension
from patchswarm.protocol.layout_builtin import builtin_plan
from tests.support.copy_engine import changed_regions, identity_plan, llama_versions, served, stores
from tests.support.rank_plans import LLAMA, SPECS, llama_rank, llama_state, version_model
from tests.support.store_worker import remove_segments, unique_name

transformers = pytest.importorskip("transformers")


@pytest.fixture
def name() -> Iterator[str]:
    n = unique_name("ps")
    yield n
    remove_segments(n)


def tiny_llama(lm_head_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(99)  # other values than the versions': a copy that misses a byte shows
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)
    m.lm_head.to(lm_head_dtype)
    return m


def assert_params_equal(got: torch.nn.Module, want: torch.nn.Module) -> None:
    w = dict(want.named_parameters())
    for n, p in got.named_parameters():
        assert p.dtype == w[n].dtype and torch.equal(p.view(torch.uint8), w[n].view(torch.uint8)), n


def test_tp1_transformers_llama_equals_a_fresh_load_after_each_version(name: str, tmp_path: Path) -> None:
    v1, v2 = llama_versions()
    plan = identity_plan(served(v1).specs)
    rs = stores(name, tmp_path, plan, served(v1))
    store = rs.store(0)
    assert store is not None
    view = attach(store.attach_info())
    model = tiny_llama(torch.float32)  # lm_head kept in fp32 by the engine: the loader's entry
    params = dict(model.named_parameters())
    loaded: list[list[str]] = []

    def loader(items: list[tuple[str, torch.Tensor]]) -> None:
        loaded.append([n for n, _ in items])
        with torch.no_grad():
            for n, t in items:
                params[n].copy_(t.to(params[n].dtype))

    sync = ParamSync(view, params, loader)
    assert sync.fallback == ["lm_head.weight"]
    for version, typed, regions in ((1, v1, None), (2, v2, "diff")):
        if regions is not None:
            before = view.data.clone()
            rs.apply(version, served(typed), diff_updates(served(v1), served(typed)))
            regs: list[Region] | None = changed_regions(view, before)
        else:
            regs = None
        got = sync.apply(version, regs)
        fresh = tiny_llama(torch.float32)
        fresh.load_state_dict({k: v.to(torch.float32) if k == "lm_head.weight" else v for k, v in typed.items()})
        assert_params_equal(model, fresh)
        assert got.version == version and got.loaded == ("lm_head.weight",)
    assert loaded == [["lm_head.weight"], ["lm_head.weight"]]
    # a version that leaves lm_head alone never calls the loader
    v3 = {k: v.clone() for k, v in v2.items()}
    v3["model.norm.weight"][0] = -1.0
    before = view.data.clone()
    rs.apply(3, served(v3), diff_updates(served(v2), served(v3)))
    regs = changed_regions(view, before)
    assert [r.name for r in regs] == ["model.norm.weight"]
    assert sync.apply(3, regs).loaded == () and len(loaded) == 2
    assert torch.equal(model.model.norm.weight, v3["model.norm.weight"])
    view.close()
    rs.close()


def test_tp2_runtime_parameters_equal_vllms_slices_of_the_target(name: str, tmp_path: Path) -> None:
    v1, v2 = llama_versions()
    _, cfg = llama_state(3)
    plan = builtin_plan(json.loads(cfg), served(v1).specs, 2)
    rs = stores(name, tmp_path, plan, served(v1))
    views, syncs, params = [], [], []
    for r in range(2):
        s = rs.store(r)
        assert s is not None
        views.append(attach(s.attach_info()))
        ps = {sp.name: torch.full(sp.shape, 0.125, dtype=sp.dt.torch_dtype) for sp in plan.rank_specs(r)}
        params.append(ps)
        syncs.append(ParamSync(views[r], ps, None, r))
    for r in range(2):
        syncs[r].apply(1, None)
        want = llama_rank(v1, 2, r)
        assert sorted(params[r]) == sorted(want)
        assert all(torch.equal(params[r][n], want[n]) for n in want), r
    befores = [v.data.clone() for v in views]
    rs.apply(2, served(v2), diff_updates(served(v1), served(v2)))
    act = Activation(2, 1, False, {r: tuple(changed_regions(views[r], befores[r])) for r in range(2)})
    for r in range(2):
        version, regs = parse_apply(apply_wire(act), r)
        syncs[r].apply(version, regs)
        want = llama_rank(v2, 2, r)
        assert all(torch.equal(params[r][n], want[n]) for n in want), r
    for v in views:
        v.close()
    rs.close()


# ---------------------------------------------------------------- regions copy only what they name


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RankStores, EngineView]]:
    n = unique_name("psr")
    m = version_model(5, 1, SPECS)
    rs = stores(n, tmp_path_factory.mktemp("ps"), identity_plan(SPECS), m)
    s = rs.store(0)
    assert s is not None
    view = attach(s.attach_info())
    yield rs, view
    view.close()
    rs.close()
    remove_segments(n)


@st.composite
def regions(draw: st.DrawFn) -> list[Region]:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        s = SPECS[draw(st.integers(0, len(SPECS) - 1))]
        a = draw(st.integers(0, s.nbytes - 1))
        out.append(Region(s.name, a, draw(st.integers(a + 1, s.nbytes))))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regs=regions())
def test_regions_copy_exactly_the_bytes_they_name(
    small_store: tuple[RankStores, EngineView], regs: list[Region]
) -> None:
    _, view = small_store
    params = {
        s.name: torch.full((s.nbytes,), 0xA5, dtype=torch.uint8).view(s.dt.torch_dtype).view(s.shape) for s in SPECS
    }
    ParamSync(view, params).apply(1, regs)
    for s in view.layout.slots:
        want = torch.full((s.nbytes,), 0xA5, dtype=torch.uint8)
        for r in regs:
            if r.name == s.name:
                want[r.start : r.end] = view.data[s.offset + r.start : s.offset + r.end]
        assert torch.equal(params[s.name].reshape(-1).view(torch.uint8), want), s.name


def test_bad_applies_write_nothing(small_store: tuple[RankStores, EngineView]) -> None:
    _, view = small_store
    params = {s.name: torch.zeros(s.shape, dtype=s.dt.torch_dtype) for s in SPECS}
    sync = ParamSync(view, params)
    s0 = SPECS[0]
    for bad, why in (
        ([Region(s0.name, 0, 4), Region(s0.name, 0, s0.nbytes + 1)], "outside"),
        ([Region(s0.name, 0, 4), Region("nope", 0, 1)], "does not hold"),
        ([Region(s0.name, 4, 4)], "outside"),
    ):
        with pytest.raises(SyncError, match=why) as e:
            sync.apply(1, bad)
        assert not e.value.copied
    with pytest.raises(SyncError, match="does not hold version 2"):
        sync.apply(2, None)
    assert all(not p.any() for p in params.values())
    with pytest.raises(SyncError, match="no loader"):
        ParamSync(view, {**params, s0.name: torch.zeros(s0.shape, dtype=torch.float32)})


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        st.recursive(
            st.none() | st.integers() | st.text(max_size=8),
            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
            max_leaves=12,
        ).map(json.dumps),
    )
)
def test_hostile_apply_payloads_give_one_error(text: str) -> None:
    try:
        version, regs = parse_apply(text, 0)
    except SyncError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(version, int) and (regs is None or all(isinstance(r, Region) for r in regs))


# ---------------------------------------------------------------- the engine glue, on plain torch modules


class _Runner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


class _Worker:  # what vLLM's Worker offers the extension: model_runner and device
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = _Runner(model)
        self.device = torch.device("cpu")


class _ExtendedWorker(_Worker, PatchswarmWorkerExtension):  # as vLLM mixes it in (appended base)
    pass


class _LoadingLlama(transformers.LlamaForCausalLM):  # type: ignore[misc]
    def load_weights(self, items: list[tuple[str, torch.Tensor]]) -> set[str]:
        with torch.no_grad():
            for n, t in items:
                self.get_parameter(n).copy_(t)
        return {n for n, _ in items}


def test_the_vllm_extension_attaches_once_and_applies_each_version(name: str, tmp_path: Path) -> None:
    v1, v2 = llama_versions()
    rs = stores(name, tmp_path, identity_plan(served(v1).specs), served(v1))
    store = rs.store(0)
    assert store is not None
    torch.manual_seed(1)
    model = _LoadingLlama(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)
    worker = _ExtendedWorker(model)
    answer = worker.patchswarm_apply(apply_wire(Activation(1, None, True)))
    assert answer["ok"] is False and "patchswarm_attach" in answer["error"] and answer["copied"] is False
    assert answer["attached"] is False  # (the driver attaches again: a restarted vLLM)
    info = worker.patchswarm_attach(json.dumps({"attach": [store.attach_info()]}))
    assert info["rank"] == 0 and info["loader_count"] == 0
    assert worker.patchswarm_apply(apply_wire(Activation(1, None, True)))["ok"] is True
    assert worker.patchswarm_apply(apply_wire(Activation(2, 1, True)))["error"].endswith("(it holds 1)")
    rs.apply(2, served(v2), diff_updates(served(v1), served(v2)))
    answer = worker.patchswarm_apply(apply_wire(Activation(2, 1, True)))
    assert answer["ok"] is True and answer["version"] == 2
    fresh = tiny_llama()
    fresh.load_state_dict(v2)
    assert_params_equal(model, fresh)
    first = worker.patchswarm_sync
    assert first is not None
    worker.patchswarm_attach(json.dumps({"attach": [store.attach_info()]}))  # a restarted daemon attaches again
    assert first.view.data.numel() == 0  # the first mapping was let go, not kept beside the new one
    assert worker.patchswarm_apply(apply_wire(Activation(2, 1, True)))["ok"] is True
    worker.patchswarm_detach()
    rs.close()


def test_the_sglang_loader_applies_what_the_driver_sends(name: str, tmp_path: Path) -> None:
    from patchswarm.daemon.copy_drivers import LOADER, sglang_update_request

    v1, v2 = llama_versions()
    rs = stores(name, tmp_path, identity_plan(served(v1).specs), served(v1))
    store = rs.store(0)
    assert store is not None
    model = tiny_llama()
    spec = json.dumps({"attach": [store.attach_info()]})
    rs.apply(2, served(v2), diff_updates(served(v1), served(v2)))
    req = sglang_update_request(Activation(2, 1, True), 1, spec, full=False)
    assert req.json is not None and req.json["load_format"] == LOADER and req.json["weight_version"] == "2"
    (entry,) = req.json["serialized_named_tensors"]
    named = deserialize_ipc(entry)  # what SGLang's MultiprocessingSerializer.deserialize gives the loader
    assert len(named) == 1 and named[0][1].numel() == 0
    load_regions(model, named)
    fresh = tiny_llama()
    fresh.load_state_dict(v2)
    assert_params_equal(model, fresh)
    rs.close()


def test_bad_attach_specs_give_one_line() -> None:
    from patchswarm.daemon.param_sync import open_rank_store

    for spec, why in (
        (None, "JSON text"),
        ("{", "not JSON"),
        ("[]", "JSON object"),
        ('{"attach": []}', "no attach info for rank 0"),
        ('{"attach": [1]}', "no attach info for rank 0"),
        ('{"socket": "/x", "ranks": 1}', None),  # rank 1 of 1: refused below
        ('{"ranks": 2}', "needs socket"),
        ('{"socket": "/x", "ranks": 2, "wait_s": -1}', "wait_s"),
    ):
        if why is None:
            with pytest.raises(SyncError, match="ranks > 1"):
                open_rank_store(spec, 1, "cpu")
            continue
        with pytest.raises(SyncError, match=why):
            open_rank_store(spec, 0, "cpu")


def test_the_sglang_loader_refuses_loader_entries_at_tp2(name: str, tmp_path: Path) -> None:
    """A transformers Llama has no ``qkv_proj``: at TP=2 those entries would need SGLang's checkpoint
    loader on a rank's shard, which it cannot take: refused, nothing copied."""
    from patchswarm.daemon.copy_drivers import sglang_update_request

    v1, _ = llama_versions()
    _, cfg = llama_state(3)
    rs = stores(name, tmp_path, builtin_plan(json.loads(cfg), served(v1).specs, 2), served(v1))
    spec = json.dumps({"attach": [s.attach_info() for s in rs.stores if s is not None]})
    model = _LoadingLlama(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)
    before = {n: p.clone() for n, p in model.named_parameters()}
    req = sglang_update_request(Activation(1, None, True), 2, spec, full=False)
    assert req.json is not None
    with pytest.raises(SyncError, match=r"rank 1: \d+ store entries .*TP > 1"):
        load_regions(model, deserialize_ipc(req.json["serialized_named_tensors"][1]))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    rs.close()
