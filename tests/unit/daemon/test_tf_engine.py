"""The transformers engine over a real weight store: parameters are views of the store, logits are bitwise
those of ``from_pretrained``, a version written in place is what the next step computes with, a step
racing a write is redone, a fence left odd answers 503, the prefix cache never crosses versions."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from patchswarm.daemon.checkpoint import read_served
from patchswarm.daemon.engine import EngineView, attach
from patchswarm.daemon.store_format import StoreLayout, StoreState
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.tf_engine import FenceUnavailable, Sampling, TfEngine, VersionMismatch
from patchswarm.daemon.tf_model import ModelMismatch, build_model, load_config
from patchswarm.daemon.weightstore import WeightStore
from tests.support.tf_checkpoints import tiny_llama_bf16, write_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[104, 101, 108, 108, 111], [1, 2, 3], [259, 120, 121, 257, 260, 50, 60, 70, 80, 90]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("tf")
    return [write_checkpoint(base / f"v{i}", tiny_llama_bf16(seed=i)) for i in (1, 2, 3)]


class Store:
    """A real WeightStore (shared memory) holding checkpoint versions, and the engine's view of it."""

    def __init__(self, first: Path, journal: Path) -> None:
        self.model = read_served(first)
        self.store = WeightStore.create(f"ps-test-tf-{uuid.uuid4().hex[:12]}", StoreLayout.from_specs(self.model.specs))
        self.store.load(self.model, 1, self.model.root())
        self.view: EngineView = attach(self.store.attach_info())
        self.journal = journal
        journal.mkdir(exist_ok=True)

    def write(self, ckpt: Path, version: int) -> None:
        new = read_served(ckpt)
        self.store.activate(version, new.root(), diff_updates(self.model, new), self.journal)
        self.model = new

    def close(self) -> None:
        self.view.close()
        self.store.destroy()


@pytest.fixture
def store(ckpts: list[Path], tmp_path: Path) -> Iterator[Store]:
    s = Store(ckpts[0], tmp_path / "journal")
    try:
        yield s
    finally:
        s.close()


def reference(ckpt: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt)


def ref_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def engine_on(store: Store, ckpt: Path, **kw: Any) -> TfEngine:
    return TfEngine(store.view, ckpt, threaded=False, **kw)


def test_parameters_are_zero_copy_views_of_the_store(store: Store, ckpts: list[Path]) -> None:
    engine = engine_on(store, ckpts[0])
    lo = store.view.data.data_ptr()
    hi = lo + store.view.data.numel()
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    assert len(params) == len(store.view.layout.slots) + 1  # + lm_head, tied to the embedding
    for name, p in params.items():
        assert lo <= p.data_ptr() < hi, name
        src = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert p.data_ptr() == store.view.tensor(src).data_ptr(), name
    inv = engine.model.model.rotary_emb.inv_freq
    assert torch.equal(inv, reference(ckpts[0]).model.rotary_emb.inv_freq)


@pytest.mark.asyncio
async def test_logits_are_bitwise_those_of_from_pretrained_and_follow_writes(store: Store, ckpts: list[Path]) -> None:
    engine = engine_on(store, ckpts[0])
    for version, ckpt in enumerate(ckpts, start=1):
        if version > 1:
            store.write(ckpt, version)
        ref = reference(ckpt)
        for ids in PROMPTS:
            got, v = await engine.logits(ids)
            assert v == version
            assert torch.equal(got, ref_logits(ref, ids)), (version, ids)
        # Generation too: greedy tokens as transformers' own generate() picks them on this version.
        steps = [s async for s in engine.generate(PROMPTS[0], 6)]
        expected = ref.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert [s.token for s in steps] == expected[0, len(PROMPTS[0]) :].tolist()
        assert {s.version for s in steps} == {version}


@pytest.mark.asyncio
async def test_a_step_racing_a_write_is_redone_on_the_new_version(
    store: Store, ckpts: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The readers' lock keeps a daemon from writing inside a step at all (tests/unit/daemon/test_fence_async.py);
    # a reader of the seqlock alone must still never report a step a write raced: it is redone.
    monkeypatch.setattr(store.view.fence, "lock", None)
    engine = engine_on(store, ckpts[0], prefix_cache_entries=0)
    calls = 0

    def write_during_step_two() -> None:  # the daemon writes v2 while the first decode step computes
        nonlocal calls
        calls += 1
        if calls == 2:
            store.write(ckpts[1], 2)

    engine.inside_step = write_during_step_two
    steps = [s async for s in engine.generate(PROMPTS[2], 4)]
    assert engine.redone == 1 and calls == 5
    assert [s.version for s in steps] == [1, 2, 2, 2]
    # Independently: prefill on v1, then every decode step on v2 over the same (cropped) cache.
    ref1, ref2 = reference(ckpts[0]), reference(ckpts[1])
    cache = {engine._cache_arg: transformers.DynamicCache(config=ref1.config)}
    with torch.inference_mode():
        tok = int(ref1(input_ids=torch.tensor([PROMPTS[2]]), **cache).logits[0, -1].argmax())
        want = [tok]
        for _ in range(3):
            tok = int(ref2(input_ids=torch.tensor([[tok]]), **cache).logits[0, -1].argmax())
            want.append(tok)
    assert [s.token for s in steps] == want


@pytest.mark.asyncio
async def test_logits_racing_a_write_are_recomputed(
    store: Store, ckpts: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The readers' lock keeps a daemon from writing inside a step at all (tests/unit/daemon/test_fence_async.py);
    # a reader of the seqlock alone must still never report a step a write raced: it is redone.
    monkeypatch.setattr(store.view.fence, "lock", None)
    engine = engine_on(store, ckpts[0])
    done = False

    def write_once() -> None:
        nonlocal done
        if not done:
            done = True
            store.write(ckpts[2], 5)

    engine.inside_step = write_once
    got, v = await engine.logits(PROMPTS[1])
    assert (v, engine.redone) == (5, 1)
    assert torch.equal(got, ref_logits(reference(ckpts[2]), PROMPTS[1]))


@pytest.mark.asyncio
async def test_a_fence_left_odd_fails_requests_instead_of_reading_torn_weights(store: Store, ckpts: list[Path]) -> None:
    engine = engine_on(store, ckpts[0], fence_wait_s=0.2)
    store.store.control.begin(StoreState.WRITING)  # a daemon killed mid-write leaves this
    with pytest.raises(FenceUnavailable, match="mid-write"):
        await engine.logits(PROMPTS[0])
    with pytest.raises(FenceUnavailable):
        _ = [s async for s in engine.generate(PROMPTS[0], 2)]
    hdr = store.store.header()
    store.store.control.publish(1, store.model.root(), StoreState.READY)
    assert hdr.state == StoreState.WRITING
    assert (await engine.logits(PROMPTS[0]))[1] == 1


@pytest.mark.asyncio
async def test_prefix_cache_is_per_version_and_commit_flushes(store: Store, ckpts: list[Path]) -> None:
    engine = engine_on(store, ckpts[0], prefix_cache_entries=4)
    first = [s.token async for s in engine.generate(PROMPTS[2], 5)]
    assert len(engine.prefix) == 1
    assert [s.token async for s in engine.generate(PROMPTS[2], 5)] == first  # from the cached prefix
    longer = [*PROMPTS[2], *first[:2]]
    cold = engine_on(store, ckpts[0], prefix_cache_entries=0)
    assert [s.token async for s in engine.generate(longer, 3)] == [s.token async for s in cold.generate(longer, 3)]
    store.write(ckpts[1], 2)
    on_v2 = [s async for s in engine.generate(PROMPTS[2], 5)]
    fresh = [s async for s in cold.generate(PROMPTS[2], 5)]
    assert [s.token for s in on_v2] == [s.token for s in fresh] and {s.version for s in on_v2} == {2}
    assert len(engine.prefix) == 3  # two entries of v1 kept (LRU), none of them used
    assert await engine.commit(2, flush_cache=True) == 2
    assert len(engine.prefix) == 1 and engine.served == 2
    with pytest.raises(VersionMismatch):
        await engine.commit(1, flush_cache=False, timeout_s=0.05)  # versions never rewind: at once
    with pytest.raises(VersionMismatch):
        await engine.commit(3, flush_cache=False, timeout_s=0.05)  # not (yet) in the store


@pytest.mark.asyncio
async def test_sampling_is_seeded(store: Store, ckpts: list[Path]) -> None:
    engine = engine_on(store, ckpts[0])
    hot = Sampling(temperature=1.5, top_p=0.9, seed=7)
    a = [s.token async for s in engine.generate(PROMPTS[0], 12, hot)]
    b = [s.token async for s in engine.generate(PROMPTS[0], 12, hot)]
    c = [s.token async for s in engine.generate(PROMPTS[0], 12, Sampling(temperature=1.5, top_p=0.9, seed=8))]
    assert a == b and a != c


def test_a_store_that_does_not_fit_the_config_is_refused(ckpts: list[Path]) -> None:
    cfg = load_config(ckpts[0])
    model = read_served(ckpts[0])
    tensors = {s.name: model.typed(i).clone() for i, s in enumerate(model.specs)}
    build_model(cfg, tensors)  # fits
    cases: list[tuple[dict[str, torch.Tensor], str]] = [
        ({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, "no tensor model.layers.1.mlp.up"),
        ({**tensors, "extra.weight": torch.zeros(2)}, "holds extra.weight"),
        ({**tensors, "model.norm.weight": torch.zeros(65, dtype=torch.bfloat16)}, r"bfloat16\[65\]"),
        ({**tensors, "model.norm.weight": torch.zeros(64)}, "float32"),  # mixed: the config's bf16 then
        ({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, "which the config ties"),
        (
            {
                **tensors,
                "model.layers.0.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"]
                .float()
                .to(torch.float8_e4m3fn),
            },
            "fp8",
        ),
    ]
    for bad, why in cases:
        with pytest.raises(ModelMismatch, match=why):
            build_model(cfg, bad)


@pytest.mark.asyncio
async def test_a_pause_holds_requests_at_most_its_limit(store: Store, ckpts: list[Path]) -> None:
    engine = engine_on(store, ckpts[0], pause_limit_s=0.2)
    await engine.pause()
    assert engine.paused
    steps = [s async for s in engine.generate(PROMPTS[0], 2)]  # the daemon never resumed: it goes on, fenced
    assert [s.version for s in steps] == [1, 1] and engine.paused


@pytest.mark.asyncio
async def test_a_pause_past_its_limit_holds_no_step_any_more(store: Store, ckpts: list[Path]) -> None:
    now = [0.0]
    engine = engine_on(store, ckpts[0], pause_limit_s=3600.0, clock=lambda: now[0])
    await engine.pause()
    now[0] = 3601.0  # the daemon paused an hour ago and never resumed
    # Each step runs at once (before: each waited the whole limit again, an hour per token).
    steps = await asyncio.wait_for(_collect(engine.generate(PROMPTS[0], 4)), 120)
    assert [s.version for s in steps] == [1, 1, 1, 1] and engine.paused
    await engine.pause()  # a new pause (a restarted daemon) holds again, for its own limit
    task = asyncio.create_task(_collect(engine.generate(PROMPTS[0], 1)))
    await asyncio.sleep(0.2)
    assert not task.done()
    engine.resume()
    assert len(await task) == 1


async def _collect(gen: Any) -> list[Any]:
    return [s async for s in gen]
