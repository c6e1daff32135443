"""The local HTTP API on a unix socket: how engines and operators talk to the daemon.

    GET  /v1/status                  state, versions, progress, peers (also what `patchswarm status` shows)
    GET  /v1/version                 the store's version, its state root, the version the engine serves
    GET  /v1/wait?version=N&timeout=S[&served=true]   long poll until the store holds version N
                                     (served=true: until the engine acknowledged it) or the timeout
    GET  /v1/events                  server-sent events: one per state change
    GET  /v1/layout?rank=K           the weight layout and how to attach to the store (of rank K: store.ranks > 1)
    POST /v1/ack                     an engine acknowledges the version it now serves
    POST /v1/store                   an engine registers the buffer it allocated (store.kind cuda, engine-shm)
    GET  /metrics                    Prometheus metrics

The socket is created with mode 0660 (and the configured group), so only the daemon's user
and that group can reach it.  The spec is docs/api/openapi.yaml, checked against this server.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from patchswarm.daemon.exporter import peer_pid
from patchswarm.daemon.json_answer import json_response, strict_dumps
from patchswarm.daemon.json_body import json_object
from patchswarm.daemon.status import MAX_SUBSCRIBERS, Status
from patchswarm.swarm.serving import HardenedRunner, ServerLimits

MAX_WAIT_S = 300.0
MAX_BODY_BYTES = 1 << 16
PROBE_TIMEOUT_S = 2.0  # a live server accepts at once (the kernel queues the connection)


class SocketInUseError(Exception):
    """Something live answers on the configured socket path (another daemon, most likely)."""


STATUS_KEY: web.AppKey[Status] = web.AppKey("status", Status)
LAYOUT_KEY: web.AppKey[Callable[[], dict[str, Any] | None]] = web.AppKey("layout", object)  # type: ignore[arg-type]
METRICS_KEY: web.AppKey[Callable[[], bytes]] = web.AppKey("metrics", object)  # type: ignore[arg-type]
# (body, pid of the registering process or None) -> (HTTP status, JSON answer); the daemon checks
# and maps the engine's buffer, and watches that process (daemon/exporter.py)
StoreRegistrar = Callable[[Any, int | None], Awaitable[tuple[int, dict[str, Any]]]]
REGISTER_KEY: web.AppKey[StoreRegistrar | None] = web.AppKey("register", object)  # type: ignore[arg-type]
RANK_LAYOUT_KEY: web.AppKey[Callable[[int], dict[str, Any] | None]] = web.AppKey("rank_layout", object)  # type: ignore[arg-type]
RANKS_KEY: web.AppKey[int] = web.AppKey("ranks", int)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(data, status=status, headers=headers, compact=True)


def _bad(message: str) -> web.Response:
    return _json({"error": "BadRequest", "message": message}, 400)


async def status(request: web.Request) -> web.Response:
    return _json(request.app[STATUS_KEY].snapshot())


async def version(request: web.Request) -> web.Response:
    s = request.app[STATUS_KEY]
    return _json({"version": s.version, "served_version": s.served_version, "root": s.root, "state": str(s.phase)})


async def wait(request: web.Request) -> web.Response:
    s = request.app[STATUS_KEY]
    try:
        if len(request.query) != len(set(request.query)):  # ?served=true&served=false: not ours to guess
            raise ValueError("a query key given twice")
        raw = request.query["version"]
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 19):  # (int() takes '٣', '+3', ' 3' and '1_0')
            raise ValueError("version is not a whole number")
        want = int(raw)
        timeout = float(request.query.get("timeout", "30"))
        served = {"true": True, "1": True, "false": False, "0": False}[request.query.get("served", "false")]
    except (KeyError, ValueError):
        return _bad("query needs version=<int> and optionally timeout=<seconds>, served=true|false")
    if want < 0 or not 0 <= timeout <= MAX_WAIT_S:
        return _bad(f"version must be >= 0 and timeout within [0, {MAX_WAIT_S:g}] seconds")
    reached = await s.wait_version(want, timeout, served=served)
    answer = {"reached": reached, "version": s.version, "served_version": s.served_version, "state": str(s.phase)}
    return _json(answer)


async def events(request: web.Request) -> web.StreamResponse:
    s = request.app[STATUS_KEY]
    q = s.subscribe()
    if q is None:
        msg = f"{MAX_SUBSCRIBERS} event streams are open already; poll /v1/status or retry"
        return _json({"error": "TooManyStreams", "message": msg}, 503, headers={"Retry-After": "5"})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        snap = s.snapshot()
        keys = ("state", "reason", "version", "served_version", "target", "progress")
        first = {"event": "state", **{k: snap[k] for k in keys}}
        await resp.write(f"event: state\ndata: {strict_dumps(first)}\n\n".encode())
        while True:
            try:
                ev = await asyncio.wait_for(q.get(), timeout=15)
                await resp.write(f"event: {ev['event']}\ndata: {strict_dumps(ev)}\n\n".encode())
            except TimeoutError:
                if not s.subscribed(q):
                    break  # dropped for not reading: end the stream so the client reconnects, not a silent one
                await resp.write(b": keep-alive\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        s.unsubscribe(q)
    return resp


def parse_rank(raw: Any, ranks: int) -> int:
    """A rank number in [0, ranks) from a query string or a JSON body; ValueError (one line) otherwise.
    None means rank 0 when the daemon feeds one store, and is refused when it feeds several."""
    if raw is None:
        if ranks > 1:
            raise ValueError(f"rank is needed: this daemon feeds {ranks} rank stores (rank=0..{ranks - 1})")
        return 0
    # ASCII digits only: str.isdigit() is also true of '٣' and '²' (int() takes the first, not the second)
    if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 6:
        raw = int(raw)
    if type(raw) is not int or not 0 <= raw < ranks:  # (not bool, float or a string left over)
        raise ValueError(f"rank must be a whole number from 0 to {ranks - 1}")
    return raw


async def layout(request: web.Request) -> web.Response:
    try:
        ranks = request.query.getall("rank", [])
        if len(ranks) > 1:  # ?rank=0&rank=1: which was meant is not ours to guess
            raise ValueError("rank is given more than once")
        rank = parse_rank(ranks[0] if ranks else None, request.app[RANKS_KEY])
    except ValueError as e:
        return _bad(str(e))
    info = request.app[RANK_LAYOUT_KEY](rank)
    if info is None:
        return _json({"error": "NotReady", "message": "no version loaded into the store yet"}, 409)
    return _json(info)


async def ack(request: web.Request) -> web.Response:
    s = request.app[STATUS_KEY]
    try:
        body = await json_object(request, MAX_BODY_BYTES)
        engine, ver = body["engine"], body["version"]
    except (ValueError, KeyError, TypeError):
        return _bad('body must be {"engine": <name>, "version": <int>}')
    # Exactly a non-negative integer: not a bool, float, string or infinity dressed as a version.
    if type(engine) is not str or type(ver) is not int or not 0 <= ver < 1 << 63:
        return _bad('body must be {"engine": <name>, "version": <int>}')
    if not engine or len(engine) > 128 or not engine.isprintable():
        return _bad("engine name must be 1 to 128 printable characters")
    s.ack(engine, ver)  # (a bounded table: any client of the socket may name engines)
    return _json({"engine": engine, "version": ver, "applied": s.version})


async def store_registration(request: web.Request) -> web.Response:
    registrar = request.app[REGISTER_KEY]
    if registrar is None:
        return _json({"error": "NotEngineStore", "message": "this daemon does not take engine buffers"}, 409)
    try:
        body = await json_object(request, MAX_BODY_BYTES)
    except ValueError:
        return _bad("body must be JSON: {engine, layout_hash, buffer}")
    # The kernel's word on who registers (SO_PEERCRED), not the body's: the buffer is that process's memory.
    transport = request.transport
    pid = peer_pid(transport.get_extra_info("socket") if transport is not None else None)
    code, answer = await registrar(body, pid)
    return _json(answer, code)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY](), content_type="text/plain", charset="utf-8")


def make_api_app(
    st: Status,
    layout_info: Callable[[], dict[str, Any] | None],
    metrics_text: Callable[[], bytes],
    *,
    register_store: StoreRegistrar | None = None,
    ranks: int = 1,
    rank_layout: Callable[[int], dict[str, Any] | None] | None = None,
) -> web.Application:
    """``layout_info`` answers GET /v1/layout for one store; a daemon feeding ``ranks`` rank stores gives
    ``rank_layout`` (rank -> layout) instead, and /v1/layout then needs ?rank=K when ranks > 1."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[STATUS_KEY] = st
    app[LAYOUT_KEY] = layout_info
    app[METRICS_KEY] = metrics_text
    app[REGISTER_KEY] = register_store
    app[RANKS_KEY] = ranks
    app[RANK_LAYOUT_KEY] = rank_layout if rank_layout is not None else (lambda rank: layout_info())
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/version", version)
    app.router.add_get("/v1/wait", wait)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/v1/layout", layout)
    app.router.add_post("/v1/ack", ack)
    app.router.add_post("/v1/store", store_registration)
    app.router.add_get("/metrics", metrics)
    return app


async def serve_unix(
    app: web.Application, path: str | Path, group: str = "", limits: ServerLimits | None = None
) -> web.AppRunner:
    """Serve on a unix socket with mode 0660 (and the group, if given); replaces a stale socket file,
    refuses (SocketInUseError) one something still answers on (a second daemon given the same
    api.socket must not take the first one's API).  ``limits``: the connection cap and deadlines
    (default: ServerLimits.from_env())."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(f"api.socket: cannot create {path.parent}: {e.strerror}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"api.socket: no permission to create a socket in {path.parent}")
    _replace_stale(path)
    runner = HardenedRunner(app, limits)
    await runner.setup()
    site = web.UnixSite(runner, str(path))
    await site.start()
    os.chmod(path, 0o660)
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            await runner.cleanup()
            raise PermissionError(f"api.group: no such group {group!r}") from None
    return runner


def _replace_stale(path: Path) -> None:
    """Remove what a dead daemon left at ``path``; a live socket or anything but a socket stays."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUseError(f"api.socket: {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listens: a stale socket
    except OSError as e:  # (a timeout: a live server with a full backlog)
        why = "does not answer in time" if isinstance(e, TimeoutError) else e.strerror
        raise SocketInUseError(
            f"api.socket: {path} is in use or unusable ({why}); stop its daemon or choose another path"
        ) from None
    else:
        raise SocketInUseError(
            f"api.socket: {path} is in use by a running daemon; stop it, or give this one its own api.socket"
        )
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def file_id(path: str | Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``path`` itself, None if it is gone: tells the socket this process bound from
    one bound later in its place."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
