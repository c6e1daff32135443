"""The transformers engine's API against valid but extreme requests and broken weights: a temperature near
zero samples as greedy does, NaN weights answer 200 (not a 500 from ``torch.multinomial``), and a streaming
client that goes away mid-answer leaves the engine serving the next request."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch

from patchswarm.daemon.openai_api import Admission, make_openai_app
from patchswarm.daemon.sidecar import RunningServer, serve_app
from patchswarm.daemon.tf_engine import StaticWeights, TfEngine
from patchswarm.swarm.serving import ServerLimits
from tests.support.raw_http import unfinished_body
from tests.support.tf_checkpoints import tiny_llama_bf16, write_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tf") / "tiny", tiny_llama_bf16(seed=5))


async def _serve(engine: TfEngine) -> RunningServer:
    engine.note_served(0)
    return await serve_app(make_openai_app(engine), "127.0.0.1", 0)


@pytest_asyncio.fixture
async def api(ckpt: Path) -> AsyncIterator[str]:
    server = await _serve(TfEngine(StaticWeights.from_checkpoint(ckpt), ckpt, max_tokens_limit=16))
    try:
        yield server.url
    finally:
        await server.close()


async def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.text()


@pytest.mark.asyncio
@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30])
async def test_a_temperature_near_zero_samples_the_greedy_tokens(api: str, temperature: float) -> None:
    prompt = [65, 66, 67, 68]
    code, greedy = await post(api + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert code == 200, greedy
    for top_p in (1.0, 0.5):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": temperature, "top_p": top_p, "seed": 3}
        code, text = await post(api + "/v1/completions", body)
        assert code == 200, text
        assert json.loads(text)["choices"][0]["text"] == json.loads(greedy)["choices"][0]["text"]


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_nan_weights_answer_and_keep_serving(ckpt: Path, stream: bool) -> None:
    weights = StaticWeights.from_checkpoint(ckpt)
    weights.tensors()["model.norm.weight"].fill_(float("nan"))  # every logit NaN
    server = await _serve(TfEngine(weights, ckpt, max_tokens_limit=16))
    try:
        for temperature in (0.0, 1.0):
            body = {"prompt": "ab", "max_tokens": 3, "temperature": temperature, "seed": 1, "stream": stream}
            code, text = await post(server.url + "/v1/completions", body)
            assert code == 200, text
            assert "error" not in text and (not stream or text.endswith("data: [DONE]\n\n")), text
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_a_stream_the_client_leaves_does_not_stop_the_engine(api: str) -> None:
    body = {"prompt": "abc", "max_tokens": 16, "temperature": 0, "stream": True}
    for _ in range(3):
        async with aiohttp.ClientSession() as s, s.post(api + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # one event, then the connection closes under the engine
    code, text = await post(api + "/v1/completions", {**body, "stream": False})
    assert code == 200 and json.loads(text)["usage"]["completion_tokens"] > 0, text


def test_nan_logits_never_win_a_greedy_step(ckpt: Path) -> None:
    from patchswarm.daemon.tf_engine import Sampling

    engine = TfEngine(StaticWeights.from_checkpoint(ckpt), ckpt, threaded=False)
    logits = torch.tensor([float("nan"), 1.0, 3.0, float("nan")], dtype=torch.bfloat16)
    assert engine._choose(logits, Sampling(temperature=0.0), None) == 2
    gen = torch.Generator().manual_seed(0)
    assert engine._choose(logits, Sampling(temperature=1e-300), gen) == 2


@pytest.mark.asyncio
async def test_a_step_that_fails_is_one_error_line_and_the_engine_serves_on(ckpt: Path) -> None:
    engine = TfEngine(StaticWeights.from_checkpoint(ckpt), ckpt, max_tokens_limit=16)
    server = await _serve(engine)
    failing = {"after": 0}

    def oom() -> None:
        failing["after"] -= 1
        if failing["after"] < 0:
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB")

    try:
        engine.inside_step = oom
        body = {"prompt": "ab", "max_tokens": 4, "temperature": 0}
        code, text = await post(server.url + "/v1/completions", body)
        assert code == 500 and json.loads(text)["error"]["message"].startswith("generation failed: CUDA out"), text
        failing["after"] = 2  # the prefill and a step pass, then a step fails mid-stream
        code, text = await post(server.url + "/v1/completions", {**body, "stream": True})
        last = text.strip().split("\n\n")[-1]
        assert code == 200 and json.loads(last.removeprefix("data: "))["error"]["code"] == 500, text
        engine.inside_step = None
        code, text = await post(server.url + "/v1/completions", body)
        assert code == 200, text
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_requests_past_the_bound_are_503_and_the_rest_complete(ckpt: Path) -> None:
    engine = TfEngine(StaticWeights.from_checkpoint(ckpt), ckpt, max_tokens_limit=16)
    engine.note_served(0)
    server = await serve_app(make_openai_app(engine, Admission(max_in_flight=3)), "127.0.0.1", 0)
    body = {"prompt": "ab", "max_tokens": 2, "temperature": 0}
    try:
        await engine.pause()  # the admitted requests wait between steps
        held = [asyncio.create_task(post(server.url + "/v1/completions", body)) for _ in range(3)]
        while engine._lock.locked() or sum(not t.done() for t in held) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # (the three are inside the engine: nothing answers them while paused)
        code, text = await post(server.url + "/v1/completions", body)
        assert code == 503 and json.loads(text)["error"]["type"] == "server_busy", text
        engine.resume()
        assert [c for c, _ in await asyncio.gather(*held)] == [200, 200, 200]
        code, text = await post(server.url + "/v1/completions", body)
        assert code == 200, text
    finally:
        engine.resume()
        await server.close()


@pytest.mark.asyncio
async def test_a_stream_nobody_reads_gives_its_slot_back(ckpt: Path) -> None:
    weights = StaticWeights.from_checkpoint(ckpt)
    # Events of 64 KiB each (the model's name is in every one): more than any socket buffers hold.
    engine = TfEngine(weights, ckpt, max_tokens_limit=120, prefix_cache_entries=0, model_name="m" * (64 << 10))
    engine.eos_ids = set()  # (the model would end early)
    engine.note_served(0)
    admission = Admission(max_in_flight=1, write_stall_s=0.2)
    server = await serve_app(make_openai_app(engine, admission), "127.0.0.1", 0)
    try:
        payload = json.dumps({"prompt": "a", "max_tokens": 120, "temperature": 0, "stream": True})
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.connect(("127.0.0.1", server.port))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
        sock.sendall(head.encode() + payload.encode())  # and never read
        while admission.in_flight == 0:
            await asyncio.sleep(0.01)
        for _ in range(1200):  # freed once the stream stalls (else never: the client reads nothing)
            if not admission.in_flight:
                break
            await asyncio.sleep(0.05)
        assert admission.in_flight == 0, "a stream nobody reads still holds its slot"
        code, text = await post(server.url + "/v1/completions", {"prompt": "ab", "max_tokens": 2})
        assert code == 200, text
        sock.close()
    finally:
        await server.close()


class _Recording:
    """The engine's tokenizer, noting which threads encode and render chat templates."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.threads = inner, set[str]()

    def __getattr__(self, name: str) -> Any:
        if name in ("encode", "apply_chat_template"):
            self.threads.add(threading.current_thread().name)
        return getattr(self.inner, name)


@pytest.mark.asyncio
async def test_prompts_are_tokenized_off_the_event_loop(ckpt: Path) -> None:
    engine = TfEngine(StaticWeights.from_checkpoint(ckpt), ckpt, max_tokens_limit=4)
    recording = _Recording(engine.tokenizer)
    engine.tokenizer = recording
    server = await _serve(engine)
    try:
        code, text = await post(server.url + "/v1/completions", {"prompt": "ab c" * 20, "max_tokens": 1})
        assert code == 200, text
        code, text = await post(server.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                       "max_tokens": 1})  # fmt: skip
        assert code == 200, text
        code, text = await post(server.url + "/patchswarm/v1/logits", {"prompt": "ab"})
        assert code == 200, text
    finally:
        await server.close()
    # (a 512 K-character prompt takes most of a second to encode: on the loop, pause and commit waited)
    assert recording.threads and threading.main_thread().name not in recording.threads, recording.threads


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/patchswarm/v1/commit"])
async def test_a_body_that_never_finishes_gets_408_at_the_body_deadline(ckpt: Path, path: str) -> None:
    # request.read() has no deadline: the connection was held for as long as the client dripped bytes
    engine = TfEngine(StaticWeights.from_checkpoint(ckpt), ckpt, max_tokens_limit=16)
    engine.note_served(0)
    server = await serve_app(make_openai_app(engine), "127.0.0.1", 0, ServerLimits(body_timeout_s=0.5))
    try:
        assert (await unfinished_body(server.port, path)).startswith(b"HTTP/1.1 408")
    finally:
        await server.close()
