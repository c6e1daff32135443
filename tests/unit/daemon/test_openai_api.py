"""The transformers engine's OpenAI-compatible API over HTTP (standalone weights, version 0): response and
stream shapes, chat, stop strings, seeds, pause, the control routes, and bounds (400s, never a 500)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon.openai_api import make_openai_app
from patchswarm.daemon.sidecar import RunningServer, serve_app
from patchswarm.daemon.tf_engine import StaticWeights, TfEngine
from tests.support.tf_checkpoints import tiny_llama_bf16, write_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tf") / "tiny", tiny_llama_bf16(seed=4))


@pytest_asyncio.fixture
async def api(ckpt: Path) -> AsyncIterator[tuple[TfEngine, str]]:
    engine = TfEngine(StaticWeights.from_checkpoint(ckpt), ckpt, max_tokens_limit=32)
    engine.commit_wait_s = 0.1
    engine.note_served(0)
    server: RunningServer = await serve_app(make_openai_app(engine), "127.0.0.1", 0)
    try:
        yield engine, server.url
    finally:
        await server.close()


async def post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, data=body if isinstance(body, bytes) else None,
                                                      json=None if isinstance(body, bytes) else body) as r:  # fmt: skip
        return r.status, await r.json()


async def events(url: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def greedy(ckpt: Path, ids: list[int], n: int) -> list[int]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return [int(t) for t in out[0, len(ids) :]]


@pytest.mark.asyncio
async def test_completions_text_stream_and_versions(api: tuple[TfEngine, str], ckpt: Path) -> None:
    engine, url = api
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "model": "whatever", "user": "ignored"}
    code, out = await post(f"{url}/v1/completions", body)
    assert code == 200, out
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == "tiny"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert out["weight_version"] == {"start": 0, "end": 0}
    (choice,) = out["choices"]
    want = greedy(ckpt, list(b"hello"), 8)
    text = engine.tokenizer.decode(want, skip_special_tokens=True)
    assert choice == {"index": 0, "finish_reason": "length", "logprobs": None, "text": text}
    # Token ids as the prompt: the same.
    assert (await post(f"{url}/v1/completions", {**body, "prompt": list(b"hello")}))[1]["choices"][0]["text"] == text

    got = await events(f"{url}/v1/completions", {**body, "stream": True})
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert chunks[-1]["weight_version"] == {"start": 0, "end": 0}

    if len(text) >= 5:  # a stop string cuts the text, in both forms
        stop = text[3:5]
        code, out = await post(f"{url}/v1/completions", {**body, "stop": [stop]})
        assert out["choices"][0]["text"] == text[: text.find(stop)] and out["choices"][0]["finish_reason"] == "stop"
        streamed = await events(f"{url}/v1/completions", {**body, "stop": stop, "stream": True})
        assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == text[: text.find(stop)]


@pytest.mark.asyncio
async def test_chat_and_its_stream(api: tuple[TfEngine, str], ckpt: Path) -> None:
    engine, url = api
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0}
    code, out = await post(f"{url}/v1/chat/completions", body)
    assert code == 200, out
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    ids = engine.tokenizer.encode("<|system|>be brief<|eos|><|user|>hi<|eos|><|assistant|>", add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == len(ids)
    want = greedy(ckpt, ids, 6)
    cut = [*want, 257].index(257)  # <|eos|> ends the answer
    text = engine.tokenizer.decode(want[:cut], skip_special_tokens=True)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert out["choices"][0]["finish_reason"] == ("stop" if cut < 6 else "length")
    got = await events(f"{url}/v1/chat/completions", {**body, "stream": True})
    assert got[-1] == "[DONE]" and got[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" for c in got[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-1]) == text
    assert got[-2]["weight_version"] == {"start": 0, "end": 0}


@pytest.mark.asyncio
async def test_seeded_sampling_repeats(api: tuple[TfEngine, str]) -> None:
    _, url = api
    body = {"prompt": [1, 2, 3], "max_tokens": 12, "temperature": 1.2, "top_p": 0.95, "seed": 11}
    a = (await post(f"{url}/v1/completions", body))[1]["choices"][0]["text"]
    b = (await post(f"{url}/v1/completions", body))[1]["choices"][0]["text"]
    c = (await post(f"{url}/v1/completions", {**body, "seed": 12}))[1]["choices"][0]["text"]
    assert a == b != c


@pytest.mark.asyncio
async def test_models_health_pause_and_control_routes(api: tuple[TfEngine, str]) -> None:
    engine, url = api
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "tiny"
        async with s.post(f"{url}/pause_generation", json={"mode": "in_place"}) as r:
            assert r.status == 200
        held = asyncio.ensure_future(post(f"{url}/v1/completions", {"prompt": "x", "max_tokens": 2}))
        async with s.get(f"{url}/health") as r:
            assert await r.json() == {"status": "ok", "version": 0, "paused": True}
        await asyncio.sleep(0.2)
        assert not held.done()  # held between steps while paused
        async with s.post(f"{url}/continue_generation") as r:
            assert r.status == 200
        assert (await held)[0] == 200
        async with s.get(f"{url}/patchswarm/v1/version") as r:
            assert await r.json() == {"version": 0}
    assert await post(f"{url}/patchswarm/v1/commit", {"version": 0, "flush_cache": True}) == (200, {"version": 0})
    code, out = await post(f"{url}/patchswarm/v1/commit", {"version": 1 << 40})
    assert code == 409 and out["error"] == "VersionMismatch" and out["version"] == 0
    code, out = await post(f"{url}/patchswarm/v1/logits", {"prompt": "hi"})
    assert code == 200 and out["version"] == 0 and len(out["logits"]) == engine.vocab


BAD = [
    {"prompt": "hi", "max_tokens": 33},
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "max_tokens": True},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [300]},
    {"prompt": [1, "a"]},
    {"prompt": ["a", "b"]},
    {"prompt": "hi", "n": 2},
    {"prompt": "hi", "temperature": 3},
    {"prompt": "hi", "top_p": 0},
    {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": "hi", "stop": [""]},
    {"prompt": "hi", "stream": "yes"},
    {"prompt": "hi", "logprobs": 2},
    {"prompt": "hi", "seed": -1},
    {"prompt": "hi", "weight_version": {"exact_version": 1}},
    {"prompt": [1] * 120, "max_tokens": 9},  # 129 positions: more than the model's 128
]


@pytest.mark.asyncio
async def test_bad_bodies_are_400s(api: tuple[TfEngine, str]) -> None:
    _, url = api
    for body in BAD:
        code, out = await post(f"{url}/v1/completions", body)
        assert code == 400 and out["error"]["type"] == "invalid_request_error", (body, out)
    for raw in (b"{", b"[1]", b'{"prompt": NaN}', b'{"prompt": "a", "prompt": "b"}', b"\xff"):
        assert (await post(f"{url}/v1/completions", raw))[0] == 400, raw
    for msgs in (None, [], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url"}]}]):  # fmt: skip
        assert (await post(f"{url}/v1/chat/completions", {"messages": msgs}))[0] == 400, msgs
    assert (await post(f"{url}/pause_generation", {"mode": "abort"}))[0] == 400
    assert (await post(f"{url}/patchswarm/v1/commit", {"version": "1"}))[0] == 400
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", data=io.BytesIO(b" " * (2 << 20))) as r:
        assert r.status == 413


values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 400), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.lists(st.integers(-2, 320), max_size=6), st.lists(st.text(max_size=3), max_size=5),
)  # fmt: skip
keys = st.sampled_from(["prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "echo", "x"])


@pytest.fixture(scope="module")
def weights(ckpt: Path) -> StaticWeights:
    return StaticWeights.from_checkpoint(ckpt)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(keys, values, max_size=6))
def test_any_body_is_answered_200_or_400(ckpt: Path, weights: StaticWeights, body: dict[str, Any]) -> None:
    body.setdefault("max_tokens", 2)

    async def one() -> None:
        engine = TfEngine(weights, ckpt, max_tokens_limit=4)
        server = await serve_app(make_openai_app(engine), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s, s.post(f"{server.url}/v1/completions", json=body) as r:
                assert r.status in (200, 400), (body, await r.text())
                if r.headers["Content-Type"].startswith("application/json"):
                    out = await r.json()
                    assert ("choices" in out) == (r.status == 200)
        finally:
            await server.close()

    asyncio.run(one())


def _refuse_constant(name: str) -> object:
    raise AssertionError(f"the answer holds a bare {name}: not JSON")


@pytest.mark.asyncio
async def test_logits_send_non_finite_values_as_null_in_strict_json(ckpt: Path) -> None:
    weights = StaticWeights.from_checkpoint(ckpt)
    with torch.no_grad():  # (the LM head's rows, tied or not): token 7's logit NaN, token 9's infinite
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights.tensors():
                head = weights.tensors()[name]
                head[7].fill_(float("nan"))
                head[9].zero_()
                head[9, 0] = float("inf")
    engine = TfEngine(weights, ckpt, max_tokens_limit=32)
    engine.note_served(0)
    ids = [1, 2, 3]
    with torch.inference_mode():
        want = engine.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    finite = torch.isfinite(want)
    assert not finite[7] and not finite[9]
    server = await serve_app(make_openai_app(engine), "127.0.0.1", 0)
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{server.url}/patchswarm/v1/logits", json={"prompt": ids}) as r,
        ):
            assert r.status == 200
            out = json.loads(await r.read(), parse_constant=_refuse_constant)
    finally:
        await server.close()
    assert out["non_finite"] == int((~finite).sum()) and out["version"] == 0
    assert [v is None for v in out["logits"]] == (~finite).tolist()
    assert torch.equal(torch.tensor([v for v in out["logits"] if v is not None]), want[finite])
