"""The reference engine: TinyLM computed from named tensors, served over HTTP, reading weights in place."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import torch

from patchswarm.daemon import ref_sources
from patchswarm.daemon import trajectory as tr
from patchswarm.daemon.ref_model import LMShape, ModelLayoutError, forward_logits, greedy_next
from patchswarm.daemon.ref_sources import NO_VERSION, StaticSource, StoreViewSource, WeightSource
from patchswarm.daemon.refengine import RefEngine, make_engine_app, start_engine
from patchswarm.daemon.sidecar import serve_app
from patchswarm.swarm.serving import ServerLimits
from tests.support.raw_http import unfinished_body
from tests.support.tinylm import PRESET, greedy_reference, module_from_export, random_export

T = TypeVar("T")


@pytest.fixture(scope="module")
def trained() -> tr.Trajectory:
    return tr.generate("tiny", steps=1, warmup_steps=3)


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_functional_forward_matches_tinylm(trained: tr.Trajectory, kind: str) -> None:
    w = trained.versions(kind)[1]
    shape = LMShape.infer(w)
    assert shape == LMShape(PRESET.vocab, PRESET.d_model, PRESET.n_layers, PRESET.n_heads, PRESET.d_ff, PRESET.seq_len)
    idx = torch.randint(0, PRESET.vocab, (PRESET.seq_len,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module_from_export(w)(idx[None])[0]
    torch.testing.assert_close(forward_logits(w, shape, idx), expected, rtol=1e-5, atol=1e-5)


def test_greedy_next_uses_a_sliding_window() -> None:
    w = random_export(3)
    shape = LMShape.infer(w)
    long = [5 + i % 20 for i in range(PRESET.seq_len + 9)]
    assert greedy_next(w, shape, long) == greedy_next(w, shape, long[-PRESET.seq_len :])
    assert greedy_reference(w, long, 3)[0] == greedy_next(w, shape, long)


def test_shape_inference_rejects_foreign_layouts() -> None:
    w = random_export(0)
    assert LMShape.infer(w, n_heads=8).n_heads == 8
    with pytest.raises(ModelLayoutError, match="missing"):
        LMShape.infer({k: v for k, v in w.items() if k != "blocks.1.fc2.bias"})
    with pytest.raises(ModelLayoutError, match="shape"):
        LMShape.infer(w | {"ln_f.bias": torch.zeros(3)})
    with pytest.raises(ModelLayoutError, match="heads"):
        LMShape.infer(w, n_heads=5)
    with pytest.raises(ModelLayoutError, match="preset"):
        LMShape.infer(w | {"pos.weight": torch.zeros(40, PRESET.d_model)})
    with pytest.raises(ModelLayoutError, match="missing"):
        LMShape.infer({"x": torch.zeros(1)})


def test_static_source_updates_in_place() -> None:
    w1, w2 = random_export(1), random_export(2)
    held = {k: v.clone() for k, v in w1.items()}
    src = StaticSource(held, version=1)
    assert isinstance(src, WeightSource)
    before = {k: v.data_ptr() for k, v in src.tensors().items()}
    src.update(w2, 2)
    assert src.version() == 2
    assert {k: v.data_ptr() for k, v in src.tensors().items()} == before  # same memory, new bits
    assert all(torch.equal(src.tensors()[k], w2[k]) for k in w2)
    assert torch.equal(held["head.weight"], w2["head.weight"])  # the caller's tensors were written
    with pytest.raises(ValueError, match="does not move past"):
        src.update(w1, 2)
    with pytest.raises(ValueError, match="exactly the tensors"):
        src.update({"tok.weight": w1["tok.weight"]}, 3)
    with pytest.raises(ValueError, match="does not match"):
        src.update(w1 | {"tok.weight": w1["tok.weight"].float()}, 3)


class FakeView:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.data = tensors
        self.state: tuple[int, bytes] | None = None
        self.calls = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return self.data

    def read_version(self) -> tuple[int, bytes] | None:
        return self.state


def test_store_view_source_maps_once_and_reads_the_fence() -> None:
    view = FakeView(random_export(11))
    src = StoreViewSource(view)
    assert isinstance(src, WeightSource)
    assert src.version() == NO_VERSION  # no version yet (or a write in progress)
    view.state = (4, b"root")
    assert src.version() == 4
    assert src.tensors() is src.tensors() and view.calls == 1
    engine = RefEngine(src, threaded=False)
    assert engine.shape.n_layers == PRESET.n_layers


# ---------------------------------------------------------------- HTTP


@dataclass
class Served:
    url: str
    engine: RefEngine
    source: StaticSource
    http: aiohttp.ClientSession


@asynccontextmanager
async def served(source: StaticSource, **options: object) -> AsyncIterator[Served]:
    engine = RefEngine(source, **options)  # type: ignore[arg-type]
    server = await start_engine(engine)
    try:
        async with aiohttp.ClientSession() as http:
            yield Served(server.url, engine, source, http)
    finally:
        await server.close()


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    while True:
        block = await resp.content.readuntil(b"\n\n")
        if not block:
            return
        for line in block.decode().splitlines():
            if line.startswith("data: "):
                yield line[6:]


@pytest.mark.asyncio
async def test_generate_serves_greedy_tokens_with_versions() -> None:
    w = random_export(4)
    async with served(StaticSource({k: v.clone() for k, v in w.items()}, version=7)) as s:
        prompt = [2, 9, 10, 11, 1]
        async with s.http.post(f"{s.url}/generate", json={"prompt": prompt, "max_tokens": 6}) as r:
            assert r.status == 200
            body = await r.json()
        assert body["tokens"] == greedy_reference(w, prompt, 6)
        assert body["engine_version"] == {"before": 7, "after": 7}
        assert body["token_versions"] == [[7, 7]] * 6
        async with s.http.post(f"{s.url}/generate", json={"prompt": prompt, "max_tokens": 0}) as r:
            assert await r.json() == {"tokens": [], "engine_version": {"before": 7, "after": 7}, "token_versions": []}
        async with s.http.get(f"{s.url}/health") as r:
            assert await r.json() == {"status": "ok", "version": 7, "paused": False}


@pytest.mark.asyncio
async def test_stream_sends_one_event_per_token() -> None:
    w = random_export(5)
    async with served(StaticSource(w, version=1), threaded=False) as s:
        prompt = [3, 6, 7, 1]
        async with s.http.post(f"{s.url}/generate", json={"prompt": prompt, "max_tokens": 5, "stream": True}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            events = [e async for e in sse_events(r)]
        assert events[-1] == "[DONE]"
        steps = [json.loads(e) for e in events[:-1]]
        assert [e["index"] for e in steps] == list(range(5))
        assert [e["token"] for e in steps] == greedy_reference(w, prompt, 5)
        assert all(e["version"] == {"before": 1, "after": 1} for e in steps)


@pytest.mark.asyncio
async def test_weights_are_read_in_place_without_reloading() -> None:
    w1, w2 = random_export(6), random_export(7)
    source = StaticSource({k: v.clone() for k, v in w1.items()}, version=1)
    async with served(source) as s:
        prompt = [4, 8, 12, 1]
        async with s.http.post(f"{s.url}/generate", json={"prompt": prompt, "max_tokens": 8}) as r:
            first = await r.json()
        source.update(w2, 2)
        async with s.http.post(f"{s.url}/generate", json={"prompt": prompt, "max_tokens": 8}) as r:
            second = await r.json()
    assert first["tokens"] == greedy_reference(w1, prompt, 8) and first["engine_version"]["after"] == 1
    assert second["tokens"] == greedy_reference(w2, prompt, 8) and second["engine_version"] == {"before": 2, "after": 2}


@pytest.mark.asyncio
async def test_pause_holds_generation_across_an_in_place_switch() -> None:
    w1, w2 = random_export(8), random_export(9)
    held, go_on = asyncio.Event(), asyncio.Event()

    async def hook(prompt: tuple[int, ...], index: int) -> None:
        if index == 2:
            held.set()
            await go_on.wait()

    source = StaticSource({k: v.clone() for k, v in w1.items()}, version=1)
    async with served(source, step_hook=hook) as s:
        prompt = [2, 5, 6, 1]
        task = asyncio.create_task(s.http.post(f"{s.url}/generate", json={"prompt": prompt, "max_tokens": 5}))
        await held.wait()  # two tokens generated at version 1, the third not started
        async with s.http.post(f"{s.url}/pause_generation", json={"mode": "in_place"}) as r:
            assert await r.json() == {"paused": True}
        go_on.set()
        async with s.http.get(f"{s.url}/health") as r:
            assert (await r.json())["paused"] is True
        source.update(w2, 2)  # the engine is paused: nothing reads while this writes
        async with s.http.post(f"{s.url}/continue_generation") as r:
            assert r.status == 200
        async with await task as r:
            body = await r.json()
    assert body["token_versions"] == [[1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]
    assert body["engine_version"] == {"before": 1, "after": 2}
    assert body["tokens"][:2] == greedy_reference(w1, prompt, 2)


@pytest.mark.asyncio
async def test_bad_requests_get_400() -> None:
    async with served(StaticSource(random_export(10), version=0), max_tokens_limit=8) as s:
        bad: list[object] = [
            {"prompt": [1, 2], "max_tokens": 2, "weight_version": {"min_version": 1}},  # unknown key
            {"prompt": [], "max_tokens": 2},
            {"prompt": [1, PRESET.vocab], "max_tokens": 2},
            {"prompt": [1, True], "max_tokens": 2},
            {"prompt": [1, 2], "max_tokens": 9},
            {"prompt": [1, 2], "max_tokens": -1},
            {"prompt": "12", "max_tokens": 2},
            {"prompt": [1, 2], "stream": "yes"},
            [1, 2],
        ]
        for body in bad:
            async with s.http.post(f"{s.url}/generate", json=body) as r:
                assert r.status == 400, body
                assert (await r.json())["error"] == "BadRequest"
        async with s.http.post(f"{s.url}/generate", data=b"{not json") as r:
            assert r.status == 400
        async with s.http.post(f"{s.url}/pause_generation", json={"mode": "abort"}) as r:
            assert r.status == 400


# ---------------------------------------------------------------- under a real store's fence


def test_steps_run_under_the_store_fence_and_a_changed_step_is_never_one_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from patchswarm.daemon.engine import FenceReader, Observed, attach
    from patchswarm.daemon.store_format import StoreLayout, StoreState
    from patchswarm.daemon.store_updates import diff_updates
    from patchswarm.daemon.weightstore import WeightStore
    from patchswarm.protocol.served import ServedModel
    from tests.support.store_worker import remove_segments, unique_name

    v1, v2 = ServedModel.from_tensors(random_export(21)), ServedModel.from_tensors(random_export(22))
    name = unique_name("ref")
    store = WeightStore.create(name, StoreLayout.from_specs(v1.specs))
    try:
        store.load(v1, 1, v1.root())
        view = attach(store.attach_info())
        held: list[bool] = []

        class Watched(FenceReader):  # (records that each step ran holding the store's read lock)
            def consistent(self, fn: Callable[[], T], **kw: Any) -> Observed[T]:
                return super().consistent(
                    lambda: (held.append(self.lock is not None and self.lock.count > 0), fn())[1], **kw
                )

        view.fence = Watched(view.fence.control, lock=view.fence.lock, device=view.data.device)
        src = StoreViewSource(view)
        engine = RefEngine(src, threaded=False)
        prompt = [3, 1, 4, 1, 5]

        async def run() -> list[tuple[int, int, int]]:
            return [(s.token, s.before, s.after) async for s in engine.generate(prompt, 2)]

        steps = asyncio.run(run())
        expected = greedy_reference(random_export(21), prompt, 2)
        assert steps == [(expected[0], 1, 1), (expected[1], 1, 1)] and held == [True, True]
        # A step the fence saw change (here a reader without the lock, the write inside the step)
        # is reported with two versions, never attributed to one.
        view.fence.close()
        view.fence = FenceReader(view.fence.control, device=view.data.device)
        value, before, after = src.run(lambda: store.activate(2, v2.root(), diff_updates(v1, v2), tmp_path))
        assert (before, after) == (1, 2) and value.changed > 0
        assert src.run(lambda: 0) == (0, 2, 2)
        # A fence left odd (a daemon killed mid-write): after a bounded wait the engine serves on,
        # attributed to no version, until the restarted daemon's recovery moves the fence.
        monkeypatch.setattr(ref_sources, "STABLE_WAIT_S", 0.05)
        store.control.begin(StoreState.WRITING, gated=False)
        assert src.run(lambda: 0) == (0, NO_VERSION, NO_VERSION)
        assert src.run(lambda: 1) == (1, NO_VERSION, NO_VERSION)
        store.control.publish(2, v2.root(), StoreState.READY)
        assert src.run(lambda: 2) == (2, 2, 2)
        view.close()
    finally:
        store.close()
        remove_segments(name)


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/generate", "/patchswarm/v1/commit", "/pause_generation"])
async def test_a_body_that_never_finishes_gets_408_at_the_body_deadline(path: str) -> None:
    # request.read() has no deadline: the connection was held for as long as the client dripped bytes
    app = make_engine_app(StaticSource(random_export(4), version=1))
    server = await serve_app(app, "127.0.0.1", 0, ServerLimits(body_timeout_s=0.5))
    try:
        assert (await unfinished_body(server.port, path)).startswith(b"HTTP/1.1 408")
    finally:
        await server.close()
