"""A reference inference engine: a small torch model served over HTTP straight from a weight source.

The engine never loads or copies a checkpoint: every decoding step reads the tensors the
:class:`WeightSource` hands out (zero-copy views of the weight store, in production
``daemon.engine.attach(...)``), so a patch applied in place is what the next step computes with.
It reads the source's version before and after every step and reports both, so a test (or a
demo) can check which weights produced each token.

The model is the decoder-only transformer of ``daemon.trajectory`` (``TinyLM``, daemon/ref_model.py);
the sources are in daemon/ref_sources.py.  Generation is greedy; the context is the last ``seq_len`` tokens.

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
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from patchswarm.daemon.engine_serve import serve_until_signal
from patchswarm.daemon.json_answer import json_response, strict_dumps
from patchswarm.daemon.json_body import json_object
from patchswarm.daemon.ref_model import LMShape, greedy_next
from patchswarm.daemon.ref_sources import NO_VERSION, StaticSource, StoreViewSource, WeightSource
from patchswarm.daemon.sidecar import RunningServer, serve_app

DEFAULT_MAX_TOKENS_LIMIT = 1024
MAX_PROMPT_TOKENS = 4096
COMMIT_WAIT_S = 10.0  # a commit follows the daemon's write: the fence reads the version at once


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
MAX_BODY = 1 << 20


def make_engine_app(source: WeightSource | RefEngine, **options: Any) -> web.Application:
    """The engine's HTTP API; ``options`` are :class:`RefEngine` keyword arguments (when given a source)."""
    engine = source if isinstance(source, RefEngine) else RefEngine(source, **options)
    app = web.Application(client_max_size=MAX_BODY)
    app[ENGINE_KEY] = engine
    app.router.add_post("/generate", _generate)
    app.router.add_post("/pause_generation", _pause)
    app.router.add_post("/continue_generation", _continue)
    app.router.add_get("/health", _health)
    app.router.add_post("/patchswarm/v1/commit", _commit)
    app.router.add_get("/patchswarm/v1/version", _served_version)
    return app


def _bad(detail: str) -> web.Response:
    return json_response({"error": "BadRequest", "detail": detail}, status=400)


async def _generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        body = await json_object(request, MAX_BODY)
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
    return json_response(
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
                await resp.write(f"data: {strict_dumps(event, compact=True)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away: stop generating
    return resp


async def _pause(request: web.Request) -> web.Response:
    try:
        body = await json_object(request, MAX_BODY)
    except ValueError as e:
        return _bad(str(e))
    mode = body.get("mode", "in_place")
    if mode != "in_place":
        return _bad(f"only mode 'in_place' is supported, got {mode!r}")
    await request.app[ENGINE_KEY].pause()
    return json_response({"paused": True})


async def _continue(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].resume()
    return json_response({"paused": False})


async def _commit(request: web.Request) -> web.Response:
    try:
        body = await json_object(request, MAX_BODY)
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
        return json_response(
            {"error": "VersionMismatch", "message": f"the store holds {shown}, not {version}", "version": seen},
            status=409,
        )
    return json_response({"version": version})


async def _served_version(request: web.Request) -> web.Response:
    return json_response({"version": request.app[ENGINE_KEY].served})


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return json_response({"status": "ok", "version": engine.source.version(), "paused": engine.paused})


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
    client = None
    if args.daemon_socket:
        source: WeightSource
        source, client = _source_from_daemon(args.daemon_socket, args.device, args.engine_name, args.wait)
    else:
        source = _source_from_file(args.safetensors, args.version)

    def started(server: RunningServer) -> None:
        print(f"refengine serving version {source.version()} at {server.url}", flush=True)

    async def follow() -> None:
        from patchswarm.daemon.engine import EngineView
        from patchswarm.daemon.engine_client import follow_daemon

        assert isinstance(source, StoreViewSource) and isinstance(source.view, EngineView) and client is not None

        def registered(state: str) -> None:
            print(f"refengine re-registered its buffer ({state})", flush=True)

        await follow_daemon(client, source.view, args.engine_name, every_s=0.5, on_register=registered)

    async def run() -> None:
        following = client is not None and isinstance(source, StoreViewSource)
        await serve_until_signal(
            make_engine_app(source, n_heads=args.n_heads), args.listen, default_host="127.0.0.1",
            follow=follow if following else None, started=started,
        )  # fmt: skip

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
