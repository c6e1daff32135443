"""A reference inference engine: a small torch model served over HTTP straight from a weight source.

The engine never loads or copies a checkpoint: every decoding step reads the tensors the
:class:`WeightSource` hands out (zero-copy views of the weight store, in production
``daemon.engine.attach(...)``), so a patch applied in place is what the next step computes with.
It reads the source's version before and after every step and reports both, so a test (or a
demo) can check which weights produced each token.

The model is the decoder-only transformer of ``daemon.trajectory`` (``TinyLM``), computed
functionally from its state-dict names (``tok``, ``pos``, ``blocks.<i>.{ln1,qkv,proj,ln2,fc1,fc2}``,
``ln_f``, ``head``), from either export: bf16, or fp8 with per-tensor ``<name>.scale``.
Generation is greedy; the context is the last ``seq_len`` tokens.

HTTP API (see docs/sidecar.md):

- ``POST /generate {"prompt": [ids], "max_tokens": n, "stream": false}`` ->
  ``{"tokens": [...], "engine_version": {"before": b, "after": a}, "token_versions": [[b, a], ...]}``;
  with ``"stream": true``: ``text/event-stream``, one ``data: {"index", "token", "version"}`` event
  per token, then ``data: [DONE]``.
- ``POST /pause_generation {"mode": "in_place"}``: finish the step in progress, then hold every
  request (KV state kept) until ``POST /continue_generation``.
- ``GET /health``: ``{"status": "ok", "version": v, "paused": bool}``.
- ``POST /patchswarm/v1/commit {"version": v, "flush_cache": bool}`` and ``GET /patchswarm/v1/version``:
  the zero-copy control routes of daemon/engine_driver.py (the daemon's ``engine.kind = "zero-copy"``).
  A commit waits (at most ``COMMIT_WAIT_S``) until the source's fence reads ``v``, then records ``v``
  as served; this engine keeps no KV or prefix cache, so ``flush_cache`` has nothing to drop.

CLI: ``python -m daemon.refengine --listen 127.0.0.1:8000 --safetensors v0001.safetensors``, or from a
rollout daemon's store: ``--daemon-socket /run/patchswarm/api.sock [--device cuda:0] [--engine-name NAME]``
(attach to a shm store; for store.kind cuda / engine-shm allocate the buffer on the device and register
it with POST /v1/store, re-registering whenever the daemon's store shows another buffer); it
acknowledges every version it serves with POST /v1/ack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import re
import signal
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.nn.functional as F
from aiohttp import web

from patchswarm.daemon.sidecar import RunningServer, serve_app
from patchswarm.daemon.trajectory import PRESETS
from patchswarm.protocol.untrusted_json import load_json

T = TypeVar("T")
# How long a step waits for the daemon's write in progress to end (an activation takes milliseconds);
# past it the fence is taken as stuck (a daemon killed mid-write) and steps run unattributed until
# the sequence number moves (the restarted daemon's recovery).
STABLE_WAIT_S = 2.0

DEFAULT_MAX_TOKENS_LIMIT = 1024
MAX_PROMPT_TOKENS = 4096
_BLOCK_RE = re.compile(r"blocks\.(\d+)\.qkv\.weight")
_BLOCK_PARTS = ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")
COMMIT_WAIT_S = 10.0  # a commit follows the daemon's write: the fence reads the version at once


# ---------------------------------------------------------------- weight sources


@runtime_checkable
class WeightSource(Protocol):
    """Where the engine's weights live.  ``tensors()``: zero-copy views, read at every step;
    ``version()``: the version those tensors hold when no write is in progress."""

    def tensors(self) -> Mapping[str, torch.Tensor]: ...

    def version(self) -> int: ...


class StaticSource:
    """An in-memory source for tests and demos.  It keeps the tensors it is given (no copy);
    :meth:`update` writes a new version into them in place, as the weight store would."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: int = 0) -> None:
        if version < 0:
            raise ValueError("version must be non-negative")
        self._tensors = dict(tensors)
        self._version = version

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def version(self) -> int:
        return self._version

    def update(self, new: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``new`` into the held tensors (same names, dtypes, shapes), then publish ``version``."""
        if version <= self._version:
            raise ValueError(f"version {version} does not move past {self._version}")
        if set(new) != set(self._tensors):
            raise ValueError("update must carry exactly the tensors of the current version")
        for name, t in new.items():
            cur = self._tensors[name]
            if t.dtype != cur.dtype or t.shape != cur.shape:
                raise ValueError(f"{name}: {t.dtype}{tuple(t.shape)} does not match {cur.dtype}{tuple(cur.shape)}")
        with torch.no_grad():
            for name, t in new.items():
                self._tensors[name].copy_(t)
        self._version = version


NO_VERSION = -1


class StoreView(Protocol):
    """What ``daemon.engine.attach(info)`` returns, as far as the engine needs it."""

    def tensors(self) -> Mapping[str, torch.Tensor]: ...

    def read_version(self) -> tuple[int, bytes] | None: ...


class StoreViewSource:
    """A :class:`WeightSource` over a weight-store view: the tensors are mapped once (zero-copy
    views of the store), the version comes from the store's fence, and is :data:`NO_VERSION` (-1)
    while the daemon is writing or before the store holds a version.  A view with a ``fence``
    (``daemon.engine.EngineView``) runs each step under ``fence.consistent`` (:meth:`run`)."""

    def __init__(self, view: StoreView) -> None:
        self.view = view
        self._tensors = view.tensors()
        self._stuck_at: int | None = None  # a fence found odd past STABLE_WAIT_S, at this seq

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def version(self) -> int:
        got = self.view.read_version()
        return NO_VERSION if got is None else got[0]

    def run(self, step: Callable[[], T]) -> tuple[T, int, int]:
        """``step`` (one forward pass) and the versions to report for it: (value, before, after).

        Under the view's fence (daemon/engine.py ``FenceReader.consistent``: no write begins
        while the step may read, its device work synchronized before the fence is read again),
        ``before == after`` names the one version the step read; a step the fence saw change
        reports an ``after`` other than ``before``, so that nothing attributes it to one version."""
        fence = getattr(self.view, "fence", None)
        if fence is None:
            before = self.version()
            value = step()
            return value, before, self.version()
        started = False

        def fenced() -> T:
            nonlocal started
            started = True
            return step()

        while True:
            if fence.seq() == self._stuck_at:
                # A fence left odd (a daemon killed mid-write): serve, attributed to no version.
                return step(), NO_VERSION, self.version()
            try:
                obs = fence.consistent(fenced, timeout=STABLE_WAIT_S)
                break
            except TimeoutError:
                if started:
                    raise
                seq = fence.seq()
                if seq % 2:  # (even: a writer waits for other readers, bounded by its deadline; wait on)
                    self._stuck_at = seq
        self._stuck_at = None
        before = NO_VERSION if obs.version is None else obs.version
        if not obs.changed:
            return obs.value, before, before
        after = self.version()
        return obs.value, before, NO_VERSION if after == before else after


# ---------------------------------------------------------------- the model


class ModelLayoutError(ValueError):
    """The source's tensors are not a TinyLM state dict this engine can compute with."""


@dataclass(frozen=True, slots=True)
class LMShape:
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int

    @classmethod
    def infer(cls, tensors: Mapping[str, torch.Tensor], n_heads: int | None = None) -> LMShape:
        """Read the dimensions off the tensor shapes; ``n_heads`` (not in a state dict) defaults
        to that of the ``daemon.trajectory`` preset with the same dimensions."""
        for name in ("tok.weight", "pos.weight", "ln_f.weight", "head.weight"):
            if name not in tensors:
                raise ModelLayoutError(f"missing tensor {name!r}")
        vocab, d_model = tensors["tok.weight"].shape
        seq_len = tensors["pos.weight"].shape[0]
        layers = sorted(int(m.group(1)) for name in tensors if (m := _BLOCK_RE.fullmatch(name)))
        if layers != list(range(len(layers))) or not layers:
            raise ModelLayoutError(f"blocks must be numbered 0..n-1, found {layers}")
        d_ff = tensors["blocks.0.fc1.weight"].shape[0] if "blocks.0.fc1.weight" in tensors else 0
        if n_heads is None:
            matches = [
                p.n_heads
                for p in PRESETS.values()
                if (p.vocab, p.d_model, p.n_layers, p.d_ff, p.seq_len) == (vocab, d_model, len(layers), d_ff, seq_len)
            ]
            if not matches:
                raise ModelLayoutError("no trajectory preset has these dimensions: pass n_heads")
            n_heads = matches[0]
        shape = cls(int(vocab), int(d_model), len(layers), n_heads, int(d_ff), int(seq_len))
        shape.check(tensors)
        return shape

    def expected(self) -> dict[str, tuple[int, ...]]:
        d, f = self.d_model, self.d_ff
        out: dict[str, tuple[int, ...]] = {
            "tok.weight": (self.vocab, d),
            "pos.weight": (self.seq_len, d),
            "ln_f.weight": (d,),
            "ln_f.bias": (d,),
            "head.weight": (self.vocab, d),
        }
        for i in range(self.n_layers):
            p = f"blocks.{i}."
            out |= {
                p + "ln1.weight": (d,), p + "ln1.bias": (d,),
                p + "qkv.weight": (3 * d, d), p + "qkv.bias": (3 * d,),
                p + "proj.weight": (d, d), p + "proj.bias": (d,),
                p + "ln2.weight": (d,), p + "ln2.bias": (d,),
                p + "fc1.weight": (f, d), p + "fc1.bias": (f,),
                p + "fc2.weight": (d, f), p + "fc2.bias": (d,),
            }  # fmt: skip
        return out

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self.n_heads <= 0 or self.d_model % self.n_heads:
            raise ModelLayoutError(f"d_model {self.d_model} is not divisible into {self.n_heads} heads")
        for name, shape in self.expected().items():
            t = tensors.get(name)
            if t is None:
                raise ModelLayoutError(f"missing tensor {name!r}")
            if tuple(t.shape) != shape:
                raise ModelLayoutError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            scale = tensors.get(f"{name}.scale")
            if scale is not None and scale.numel() != 1:
                raise ModelLayoutError(f"{name}.scale must hold one value")


def _weight(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """A float32 copy of a tensor, dequantized (``q * scale``) when it has a scale."""
    x = tensors[name].to(torch.float32)
    scale = tensors.get(f"{name}.scale")
    return x * scale.to(torch.float32).reshape(()) if scale is not None else x


def forward_logits(tensors: Mapping[str, torch.Tensor], shape: LMShape, idx: torch.Tensor) -> torch.Tensor:
    """TinyLM's forward pass over one sequence ``idx`` (1-D token ids, at most ``seq_len``) -> logits ``[t, vocab]``."""
    t, d, h = idx.shape[0], shape.d_model, shape.n_heads

    def w(name: str) -> torch.Tensor:
        return _weight(tensors, name)

    def norm(prefix: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (d,), w(prefix + ".weight"), w(prefix + ".bias"))

    def linear(prefix: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w(prefix + ".weight"), w(prefix + ".bias"))

    x = (F.embedding(idx, w("tok.weight")) + w("pos.weight")[:t]).unsqueeze(0)
    for i in range(shape.n_layers):
        p = f"blocks.{i}."
        q, k, v = (z.view(1, t, h, d // h).transpose(1, 2) for z in linear(p + "qkv", norm(p + "ln1", x)).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, t, d)
        x = x + linear(p + "proj", y)
        x = x + linear(p + "fc2", F.gelu(linear(p + "fc1", norm(p + "ln2", x))))
    logits = F.linear(norm("ln_f", x), w("head.weight"))
    return logits[0]


def greedy_next(tensors: Mapping[str, torch.Tensor], shape: LMShape, context: Sequence[int]) -> int:
    with torch.inference_mode():
        idx = torch.tensor(list(context[-shape.seq_len :]), dtype=torch.long, device=tensors["tok.weight"].device)
        return int(forward_logits(tensors, shape, idx)[-1].argmax())


# ---------------------------------------------------------------- the engine


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token and the source versions read just before and just after its forward pass."""

    index: int
    token: int
    before: int
    after: int


StepHook = Callable[[tuple[int, ...], int], Awaitable[None]]


class RefEngine:
    """Greedy generation over a :class:`WeightSource`, one forward pass at a time.

    ``step_hook(prompt, index)`` is awaited before each decoding step (tests use it to hold a
    request mid-generation).  ``threaded``: run forward passes in a worker thread so the event
    loop stays responsive; steps are serialized either way.
    """

    def __init__(
        self,
        source: WeightSource,
        *,
        n_heads: int | None = None,
        max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
        step_hook: StepHook | None = None,
        threaded: bool = True,
    ) -> None:
        self.source = source
        self.shape = LMShape.infer(source.tensors(), n_heads)
        self.max_tokens_limit = max_tokens_limit
        self.step_hook = step_hook
        self.threaded = threaded
        self._running = asyncio.Event()
        self._running.set()
        self._step_lock = asyncio.Lock()
        self.served: int | None = None  # the version last committed (the zero-copy control routes)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def pause(self) -> None:
        """Stop generating: returns once the step in progress (if any) has finished."""
        self._running.clear()
        async with self._step_lock:
            pass

    def resume(self) -> None:
        self._running.set()

    async def commit(self, version: int, wait_s: float = COMMIT_WAIT_S) -> int | None:
        """Record ``version`` as served once the source's fence reads it (waiting out a write in
        progress, at most ``wait_s``); else the version the fence reads (NO_VERSION: none ready)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            seen = self.source.version()
            if seen == version:
                self.served = version
                return None
            if seen != NO_VERSION or asyncio.get_running_loop().time() > deadline:
                return seen
            await asyncio.sleep(0.005)

    def check_request(self, prompt: Sequence[int], max_tokens: int) -> None:
        if not prompt or len(prompt) > MAX_PROMPT_TOKENS:
            raise ValueError(f"prompt must hold 1 to {MAX_PROMPT_TOKENS} token ids")
        for tok in prompt:
            if type(tok) is not int or not 0 <= tok < self.shape.vocab:
                raise ValueError(f"token ids must be integers in [0, {self.shape.vocab}), got {tok!r}")
        if type(max_tokens) is not int or not 0 <= max_tokens <= self.max_tokens_limit:
            raise ValueError(f"max_tokens must be an integer in [0, {self.max_tokens_limit}]")

    async def generate(self, prompt: Sequence[int], max_tokens: int) -> AsyncGenerator[TokenStep, None]:
        self.check_request(prompt, max_tokens)
        key = tuple(prompt)
        context = list(prompt)
        for index in range(max_tokens):
            if self.step_hook is not None:
                await self.step_hook(key, index)
            step = await self._step(context, index)
            context.append(step.token)
            yield step

    async def _step(self, context: list[int], index: int) -> TokenStep:
        while True:
            await self._running.wait()
            async with self._step_lock:
                if not self._running.is_set():
                    continue  # paused while queued for the lock
                tensors = self.source.tensors()
                forward = functools.partial(greedy_next, tensors, self.shape, list(context))
                if isinstance(self.source, StoreViewSource):  # (under the store's fence)
                    run = functools.partial(self.source.run, forward)
                    token, before, after = await asyncio.to_thread(run) if self.threaded else run()
                    return TokenStep(index, token, before, after)
                before = self.source.version()
                token = await asyncio.to_thread(forward) if self.threaded else forward()
                return TokenStep(index, token, before, self.source.version())


# ---------------------------------------------------------------- HTTP


ENGINE_KEY = web.AppKey("patchswarm.refengine", RefEngine)


def make_engine_app(source: WeightSource | RefEngine, **options: Any) -> web.Application:
    """The engine's HTTP API; ``options`` are :class:`RefEngine` keyword arguments (when given a source)."""
    engine = source if isinstance(source, RefEngine) else RefEngine(source, **options)
    app = web.Application(client_max_size=1 << 20)
    app[ENGINE_KEY] = engine
    app.router.add_post("/generate", _generate)
    app.router.add_post("/pause_generation", _pause)
    app.router.add_post("/continue_generation", _continue)
    app.router.add_get("/health", _health)
    app.router.add_post("/patchswarm/v1/commit", _commit)
    app.router.add_get("/patchswarm/v1/version", _served_version)
    return app


def _bad(detail: str) -> web.Response:
    return web.json_response({"error": "BadRequest", "detail": detail}, status=400)


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        return {}
    try:
        obj = load_json(raw, max_bytes=1 << 20)
    except ValueError as e:
        raise ValueError(f"body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("body must be a JSON object")
    return obj


async def _generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        body = await _json_object(request)
        unknown = sorted(set(body) - {"prompt", "max_tokens", "stream"})
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        prompt, max_tokens, stream = body.get("prompt"), body.get("max_tokens", 16), body.get("stream", False)
        if not isinstance(prompt, list) or not isinstance(stream, bool):
            raise ValueError("prompt must be a list of token ids and stream a boolean")
        engine.check_request(prompt, max_tokens)
    except ValueError as e:
        return _bad(str(e))
    if stream:
        return await _generate_stream(request, engine, prompt, max_tokens)
    steps = [s async for s in engine.generate(prompt, max_tokens)]
    if steps:
        before, after = steps[0].before, steps[-1].after
    else:
        before = after = engine.source.version()
    return web.json_response(
        {
            "tokens": [s.token for s in steps],
            "engine_version": {"before": before, "after": after},
            "token_versions": [[s.before, s.after] for s in steps],
        }
    )


async def _generate_stream(
    request: web.Request, engine: RefEngine, prompt: list[int], max_tokens: int
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async with contextlib.aclosing(engine.generate(prompt, max_tokens)) as steps:
            async for s in steps:
                event = {"index": s.index, "token": s.token, "version": {"before": s.before, "after": s.after}}
                await resp.write(f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away: stop generating
    return resp


async def _pause(request: web.Request) -> web.Response:
    try:
        body = await _json_object(request)
    except ValueError as e:
        return _bad(str(e))
    mode = body.get("mode", "in_place")
    if mode != "in_place":
        return _bad(f"only mode 'in_place' is supported, got {mode!r}")
    await request.app[ENGINE_KEY].pause()
    return web.json_response({"paused": True})


async def _continue(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].resume()
    return web.json_response({"paused": False})


async def _commit(request: web.Request) -> web.Response:
    try:
        body = await _json_object(request)
        unknown = sorted(set(body) - {"version", "flush_cache"})
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        version, flush = body.get("version"), body.get("flush_cache", True)
        if type(version) is not int or version < 0 or not isinstance(flush, bool):
            raise ValueError("version must be a non-negative integer and flush_cache a boolean")
    except ValueError as e:
        return _bad(str(e))
    seen = await request.app[ENGINE_KEY].commit(version)
    if seen is not None:
        shown = "no ready version" if seen == NO_VERSION else f"version {seen}"
        return web.json_response(
            {"error": "VersionMismatch", "message": f"the store holds {shown}, not {version}", "version": seen},
            status=409,
        )
    return web.json_response({"version": version})


async def _served_version(request: web.Request) -> web.Response:
    return web.json_response({"version": request.app[ENGINE_KEY].served})


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"status": "ok", "version": engine.source.version(), "paused": engine.paused})


async def start_engine(
    source: WeightSource | RefEngine, host: str = "127.0.0.1", port: int = 0, **options: Any
) -> RunningServer:
    """Serve the engine on a TCP port (port 0: any free port, see ``RunningServer.port``)."""
    return await serve_app(make_engine_app(source, **options), host, port)


# ---------------------------------------------------------------- CLI


def _source_from_file(path: Path, version: int | None) -> StaticSource:
    from patchswarm.protocol.safetensors_io import load_safetensors

    model = load_safetensors(path)
    tensors = {spec.name: model.typed(i) for i, spec in enumerate(model.specs)}
    if version is None:
        version = int(model.metadata.get("trajectory.version", "0"))
    return StaticSource(tensors, version)


async def _follow_daemon(client: Any, view: Any, engine: str, every_s: float = 0.5) -> None:
    """Acknowledge each version the engine now serves (POST /v1/ack); for an engine-allocated buffer,
    register it again when the daemon's store shows none or another one (a store re-created, a
    registration lost; a restarted daemon re-imports the buffer by itself, so this is the fallback)."""
    from patchswarm.daemon.store_format import StoreError

    loop = asyncio.get_running_loop()
    acked, acked_at = None, 0.0
    while True:
        await asyncio.sleep(every_s)
        try:
            got = view.read_version()
            # Again every few seconds too: a restarted daemon has forgotten the acknowledgements.
            if got is not None and (got[0] != acked or loop.time() - acked_at > 5.0):
                await asyncio.to_thread(client.ack, engine, got[0])
                acked, acked_at = got[0], loop.time()
            if view.handle is None:
                continue
            info = (await asyncio.to_thread(client.layout))["attach"]
            buf = info.get("buffer")
            if buf is None or buf.get("buffer_id") != view.handle["buffer_id"]:
                await asyncio.to_thread(client.register, view, engine)
                print(f"refengine re-registered its buffer ({info.get('state')})", flush=True)
        except (StoreError, OSError, KeyError, ValueError):
            pass  # the daemon is down or restarting: keep serving, try again


def _source_from_daemon(socket_path: str, device: str, engine: str, wait_s: float) -> tuple[StoreViewSource, Any]:
    """Open the daemon's store and wait (up to ``wait_s``) for a version in it."""
    import time

    from patchswarm.daemon.engine_client import DaemonClient

    client = DaemonClient(socket_path)
    view = client.open_store(device, engine, wait_s)
    deadline = time.monotonic() + wait_s
    while view.read_version() is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"refengine: no version in the store after {wait_s:g} s")
        time.sleep(0.05)
    return StoreViewSource(view), client


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m daemon.refengine", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--safetensors", type=Path, help="served version to load (a TinyLM export)")
    src.add_argument("--daemon-socket", help="serve from a rollout daemon's weight store (its api.socket)")
    ap.add_argument("--device", default="cpu", help="where an engine-allocated buffer lives (cpu, cuda:N)")
    ap.add_argument("--engine-name", default="refengine", help="name given to the daemon (registration, acks)")
    ap.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the daemon's first version")
    ap.add_argument("--version", type=int, default=None, help="version to report (default: file metadata, else 0)")
    ap.add_argument("--n-heads", type=int, default=None)
    args = ap.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    client = None
    if args.daemon_socket:
        source: WeightSource
        source, client = _source_from_daemon(args.daemon_socket, args.device, args.engine_name, args.wait)
    else:
        source = _source_from_file(args.safetensors, args.version)

    async def run() -> None:
        server = await start_engine(source, host.strip("[]") or "127.0.0.1", int(port), n_heads=args.n_heads)
        print(f"refengine serving version {source.version()} at {server.url}", flush=True)
        keeper = None
        if client is not None and isinstance(source, StoreViewSource):
            keeper = asyncio.create_task(_follow_daemon(client, source.view, args.engine_name))
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            if keeper is not None:
                keeper.cancel()
            await server.close()

    try:
        asyncio.run(run())
    finally:
        if isinstance(source, StoreViewSource):
            close = getattr(source.view, "close", None)
            if close is not None:
                close()  # an engine-owned CPU buffer is removed with it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
