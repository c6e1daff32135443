"""The transformers engine's HTTP API: OpenAI-compatible completions and chat, plus the zero-copy control routes.

Routes (docs/engines.md):

- ``POST /v1/completions`` (``prompt``: a string or token ids), ``POST /v1/chat/completions``
  (``messages`` through the tokenizer's chat template); ``stream: true`` answers server-sent
  events in OpenAI's chunk shape, then ``data: [DONE]``.  Fields: ``max_tokens``
  (``max_completion_tokens`` for chat), ``temperature`` (0: greedy), ``top_p``, ``seed`` (a
  seeded ``torch.Generator``), ``stop``, ``n`` (1 only).  Other fields are ignored, as OpenAI
  ignores unknown ones, except ``weight_version``: the sidecar strips it, so one reaching the
  engine is a 400.  Every response carries ``"weight_version": {"start": s, "end": e}``, the
  versions of its first and last steps (streams: in the last chunk).
- ``GET /v1/models``, ``GET /health``.
- ``POST /pause_generation {"mode": "in_place"}``, ``POST /continue_generation``,
  ``POST /patchswarm/v1/commit {"version", "flush_cache"}``, ``GET /patchswarm/v1/version``:
  daemon/engine_driver.py's zero-copy control routes.
- ``POST /patchswarm/v1/logits {"prompt": ...}`` (debug): the last position's logits of a
  whole-prompt forward pass and the version it ran on, for tests that compare with a fresh load;
  a non-finite logit (NaN, an infinity: a diverged model) is sent as null and counted in
  ``non_finite`` (answers are strict JSON: daemon/json_answer.py).

Bodies are bounded (1 MiB) and parsed strictly (protocol/untrusted_json.py); errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request, 503 while no stable
version can be read.  Sources read, nothing copied: https://platform.openai.com/docs/api-reference
(completions, chat, streaming) and vLLM's
https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/openai/protocol.py (field names).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from aiohttp import web

from patchswarm.daemon.json_answer import json_response, strict_dumps
from patchswarm.daemon.json_body import json_object
from patchswarm.daemon.tf_engine import FenceUnavailable, Sampling, Step, TfEngine, VersionMismatch

MAX_BODY = 1 << 20
MAX_PROMPT_CHARS = 512 << 10
MAX_MESSAGES = 1024
MAX_STOPS, MAX_STOP_CHARS = 4, 256
MAX_SEED = (1 << 63) - 1
ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETION_DEFAULT_MAX_TOKENS = 16
T = TypeVar("T")
MAX_IN_FLIGHT = 64  # requests generating or waiting for the engine's lock; more: 503 (each holds a KV cache)
WRITE_STALL_S = 30.0  # a streaming client that reads nothing for this long is dropped (its slot freed)
ENGINE = web.AppKey("patchswarm.tf_engine", TfEngine)


class Admission:
    """How many completions may be in flight at once, and how long a stream may wait on its client."""

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT, write_stall_s: float = WRITE_STALL_S) -> None:
        self.max_in_flight, self.write_stall_s = max_in_flight, write_stall_s
        self.in_flight = 0
        # Tokenizing (a 512 K-character prompt: most of a second) and chat templates run here, off the
        # event loop, so pause/commit/health answer meanwhile; one thread: a fast tokenizer used from
        # two threads at once can fail ("Already borrowed").
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def tokenize(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn)


ADMISSION = web.AppKey("patchswarm.tf_admission", Admission)


class BadRequest(ValueError):
    """A 400: the body (or one field of it) is not what the route takes."""


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return json_response(body, status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    obj = await json_object(request, MAX_BODY)  # (413, 408, or a BodyError: a 400 like BadRequest)
    if "weight_version" in obj:
        raise BadRequest("weight_version reached the engine: send version constraints through the sidecar")
    return obj


def _failed(e: BaseException) -> str:
    """A step that failed (not the request's fault), in one line."""
    return f"generation failed: {' '.join(str(e).split())[:300]}"


def _int(body: dict[str, Any], key: str, default: int | None, low: int, high: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if type(v) is not int or not low <= v <= high:
        raise BadRequest(f"{key} must be an integer in [{low}, {high}]")
    return v


def _num(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if type(v) not in (int, float) or not math.isfinite(v) or not low <= v <= high:
        raise BadRequest(f"{key} must be a number in [{low:g}, {high:g}]")
    return float(v)


def _stops(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOPS} strings")
    for s in stops:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise BadRequest(f"each stop must be a string of 1 to {MAX_STOP_CHARS} characters")
    return list(stops)


def _common(body: dict[str, Any]) -> tuple[Sampling, list[str], bool]:
    if _int(body, "n", 1, 1, 1) != 1 or _int(body, "best_of", 1, 1, 1) != 1:
        raise BadRequest("n must be 1")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    if body.get("logprobs") not in (None, False) or body.get("echo") not in (None, False):
        raise BadRequest("logprobs and echo are not supported (use POST /patchswarm/v1/logits)")
    sampling = Sampling(
        temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 1e-9, 1.0),
        seed=_int(body, "seed", None, 0, MAX_SEED),
    )
    return sampling, _stops(body), stream


def _prompt_ids(engine: TfEngine, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt or len(prompt) > MAX_PROMPT_CHARS:
            raise BadRequest(f"prompt must be a string of 1 to {MAX_PROMPT_CHARS} characters")
        return list(engine.tokenizer.encode(prompt))
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    raise BadRequest("prompt must be a string or a list of token ids (n=1: one prompt)")


def _chat_ids(engine: TfEngine, messages: Any) -> list[int]:
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise BadRequest(f"messages must be a list of 1 to {MAX_MESSAGES} messages")
    clean: list[dict[str, str]] = []
    total = 0
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"each message needs a role among {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):  # fmt: skip
                raise BadRequest("message content parts must be {'type': 'text', 'text': ...}")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest("message content must be a string or a list of text parts")
        total += len(content)
        clean.append({"role": m["role"], "content": content})
    if total > MAX_PROMPT_CHARS:
        raise BadRequest(f"messages hold more than {MAX_PROMPT_CHARS} characters")
    try:
        text = engine.tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own refusals (jinja raise_exception) and its errors
        raise BadRequest(f"the chat template refused the messages: {' '.join(str(e).split())[:200]}") from None
    return list(engine.tokenizer.encode(str(text), add_special_tokens=False))


class _Text:
    """Detokenizes incrementally, holding back what may still become a stop string or a whole character."""

    def __init__(self, engine: TfEngine, stops: list[str]) -> None:
        self.tokenizer, self.stops = engine.tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        self.text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        cut = [i for s in self.stops if (i := self.text.find(s)) >= 0]
        if cut:
            self.text, self.stopped = self.text[: min(cut)], True
            return self.flush()
        safe = len(self.text.rstrip("\ufffd"))  # a character whose bytes have not all come yet
        for s in self.stops:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        out = self.text[self.sent : max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return out

    def flush(self) -> str:
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


def _weight_version(steps: Sequence[Step], engine: TfEngine) -> dict[str, int | None]:
    if not steps:
        v = engine.current_version()
        return {"start": v, "end": v}
    return {"start": steps[0].version, "end": steps[-1].version}


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    admission = request.app[ADMISSION]
    if admission.in_flight >= admission.max_in_flight:
        return _error(503, f"the engine holds {admission.max_in_flight} requests already: retry", "server_busy")
    admission.in_flight += 1
    try:
        return await _admitted(request, chat)
    finally:
        admission.in_flight -= 1


async def _admitted(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await _body(request)
        sampling, stops, stream = _common(body)
        what = body.get("messages") if chat else body.get("prompt")
        ids = await request.app[ADMISSION].tokenize(
            lambda: _chat_ids(engine, what) if chat else _prompt_ids(engine, what)
        )
        room = max(engine.max_positions - len(ids), 0) if engine.max_positions else engine.max_tokens_limit
        default = min(engine.max_tokens_limit, room) if chat else COMPLETION_DEFAULT_MAX_TOKENS
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, key, default, 0, engine.max_tokens_limit)
        assert max_tokens is not None
        engine.check_prompt(ids, max_tokens)
    except ValueError as e:
        return _error(400, str(e), "invalid_request_error")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    head = {"id": rid, "created": int(time.time()), "model": engine.model_name}
    text = _Text(engine, stops)
    steps: list[Step] = []
    finish = "length"
    gen = engine.generate(ids, max_tokens, sampling)

    async def next_delta() -> str | None:
        """The next piece of text (None: generation is over, ``finish`` says why)."""
        nonlocal finish
        if text.stopped or len(steps) == max_tokens:
            return None
        step = await gen.__anext__()
        steps.append(step)
        if step.token in engine.eos_ids:
            finish = "stop"
            return text.flush()
        delta = text.add(step.token)
        if text.stopped:
            finish = "stop"
        elif len(steps) == max_tokens:
            delta += text.flush()
        return delta

    async with contextlib.aclosing(gen):
        try:
            if not stream:
                while await next_delta() is not None and finish != "stop":
                    pass
            else:
                first = await next_delta()  # before the headers: a 503 can still be a status
        except FenceUnavailable as e:
            return _error(503, str(e), "service_unavailable")
        except RuntimeError as e:  # torch's (a device out of memory, a kernel's refusal): one line, keep serving
            return _error(500, _failed(e), "server_error")
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(steps), "total_tokens": len(ids) + len(steps)}
        if not stream:
            out = text.text
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": out}
            else:
                choice["text"] = out
            obj = "chat.completion" if chat else "text_completion"
            return json_response(
                {
                    **head,
                    "object": obj,
                    "choices": [choice],
                    "usage": usage,
                    "weight_version": _weight_version(steps, engine),
                }
            )
        return await _stream(request, engine, head, chat, first, next_delta, steps, lambda: finish, ids)


async def _stream(
    request: web.Request, engine: TfEngine, head: dict[str, Any], chat: bool, first: str | None,
    next_delta: Any, steps: list[Step], finish: Any, ids: list[int],
) -> web.StreamResponse:  # fmt: skip
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    stall = request.app[ADMISSION].write_stall_s

    async def write(data: bytes) -> None:
        await asyncio.wait_for(resp.write(data), stall)  # (a client that never reads: TimeoutError)

    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, reason: str | None, role: bool = False) -> bytes:
        if chat:
            d: dict[str, Any] = {} if delta is None else {"content": delta}
            if role:
                d["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        event: dict[str, Any] = {**head, "object": obj, "choices": [choice]}
        if reason is not None:
            n = len(steps)
            event["usage"] = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
            event["weight_version"] = _weight_version(steps, engine)
        return f"data: {strict_dumps(event, compact=True)}\n\n".encode()

    try:
        if chat:
            await write(chunk(None, None, role=True))
        delta = first
        while delta is not None:
            if delta:
                await write(chunk(delta, None))
            if finish() == "stop":
                break
            try:
                delta = await next_delta()
            except (FenceUnavailable, RuntimeError) as e:
                code, kind = (503, "service_unavailable") if isinstance(e, FenceUnavailable) else (500, "server_error")
                msg = str(e) if code == 503 else _failed(e)
                err = {"error": {"message": msg, "type": kind, "param": None, "code": code}}
                await write(f"data: {strict_dumps(err)}\n\n".encode())
                return resp
        await write(chunk(None if chat else "", finish()))
        await write(b"data: [DONE]\n\n")
        await asyncio.wait_for(resp.write_eof(), stall)
    except ConnectionResetError:
        pass  # the client went away: stop generating
    except TimeoutError:  # the client stopped reading: drop the connection (finishing it would wait again)
        if request.transport is not None:
            request.transport.abort()
    return resp


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    model = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "patchswarm",
             "max_model_len": engine.max_positions}  # fmt: skip
    return json_response({"object": "list", "data": [model]})


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return json_response({"status": "ok", "version": engine.served, "paused": engine.paused})


async def _pause(request: web.Request) -> web.Response:
    try:
        body = await _body(request)
    except ValueError as e:
        return _error(400, str(e), "invalid_request_error")
    if body.get("mode", "in_place") != "in_place":
        return _error(400, f"only mode 'in_place' is supported, got {body.get('mode')!r}", "invalid_request_error")
    await request.app[ENGINE].pause()
    return json_response({"paused": True})


async def _continue(request: web.Request) -> web.Response:
    request.app[ENGINE].resume()
    return json_response({"paused": False})


async def _commit(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await _body(request)
        version = _int(body, "version", None, 0, MAX_SEED)
        flush = body.get("flush_cache", True)
        if version is None or not isinstance(flush, bool):
            raise BadRequest("commit takes {'version': int, 'flush_cache': bool}")
    except ValueError as e:
        return _error(400, str(e), "invalid_request_error")
    try:
        return json_response({"version": await engine.commit(version, flush)})
    except VersionMismatch as e:
        return json_response({"error": "VersionMismatch", "message": str(e), "version": e.held,
                                  "requested": e.wanted}, status=409)  # fmt: skip


async def _version(request: web.Request) -> web.Response:
    return json_response({"version": request.app[ENGINE].served})


async def _logits(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        prompt = (await _body(request)).get("prompt")
        ids = await request.app[ADMISSION].tokenize(lambda: _prompt_ids(engine, prompt))
        engine.check_prompt(ids, 0)
        logits, version = await engine.logits(ids)
    except ValueError as e:
        return _error(400, str(e), "invalid_request_error")
    except FenceUnavailable as e:
        return _error(503, str(e), "service_unavailable")
    except RuntimeError as e:
        return _error(500, _failed(e), "server_error")
    values: list[float | None] = logits.tolist()
    finite = torch.isfinite(logits)
    non_finite = int(finite.numel() - int(finite.sum()))
    if non_finite:  # (strict JSON has no NaN or Infinity: null, and the count says why)
        values = [v if ok else None for v, ok in zip(values, finite.tolist(), strict=True)]
    body = {"logits": values, "non_finite": non_finite, "version": version, "prompt_tokens": len(ids)}
    return json_response(body)


def make_openai_app(engine: TfEngine, admission: Admission | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[ENGINE] = engine
    app[ADMISSION] = admission or Admission()

    async def stop_tokenizing(app: web.Application) -> None:
        app[ADMISSION].tokenizing.shutdown(wait=False)

    app.on_cleanup.append(stop_tokenizing)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_post("/pause_generation", _pause)
    app.router.add_post("/continue_generation", _continue)
    app.router.add_post("/patchswarm/v1/commit", _commit)
    app.router.add_get("/patchswarm/v1/version", _version)
    app.router.add_post("/patchswarm/v1/logits", _logits)
    return app
