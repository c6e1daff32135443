"""A version-aware reverse proxy in front of an inference engine's HTTP API.

The sidecar sits between rollout clients and the engine on a rollout host.  It fails closed: only
the inference and metadata routes of its allow list (daemon/sidecar_routes.py, plus the operator's
``sidecar.allow_routes``) reach the engine; the engine's control routes get 403, other paths 404.
Every request that can run a generation (any method but GET/HEAD/OPTIONS, or any request carrying
a constraint) goes through a :class:`VersionGate`:

- a request may carry ``weight_version: {min_version, exact_version}`` in its JSON body, or the
  headers ``X-Weight-Version-Min`` / ``X-Weight-Version-Exact``; the body key is removed before the
  request is forwarded, so the engine never sees it;
- an unmet constraint gets a retryable ``409 WeightVersionNotReady`` (with the applied and target
  versions and ``Retry-After``); an exact pin to a version the engine has already replaced gets a
  non-retryable ``409 WeightVersionUnavailable`` (a version pointer never rewinds);
- while an activation is in progress, admission is closed: new requests wait at the gate (up to the
  gate's ``admission_timeout_s``, then ``503 WeightActivationInProgress``) instead of running across
  the switch;
- responses carry the version at admission (``X-Weight-Version-Start``) and at completion
  (``X-Weight-Version-End``, and ``weight_version: {start, end}`` in a JSON object body).  A
  streamed response carries the start version in its headers, the end version in its headers only
  when it is known in advance (an exact pin), and, for ``text/event-stream``, in a final
  ``event: weight_version`` appended after the engine's last event.

Attribution guarantee: every version any part of a request ran on lies in ``[start, end]``.  With
commit mode ``quiesce`` (drain every in-flight request before the switch) and for exact-pinned
requests in either mode, ``start == end``.  With ``in_place`` (pause the engine, drain only exact
pins) an unpinned request may span the switch and reports ``start < end``.  The guarantee holds
when the activation driver follows the protocol: ``begin_activation`` before touching the weights,
``end_activation`` after the new weights are complete and before the engine resumes generating.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from patchswarm.daemon.json_answer import json_response, strict_dumps
from patchswarm.daemon.sidecar_constraints import (
    BODY_KEY,
    constraint_from_headers,
    dumps_json,
    header_values,
    is_json,
    loads_json,
    split_body_constraint,
)
from patchswarm.daemon.sidecar_constraints import HEADER_EXACT as HEADER_EXACT
from patchswarm.daemon.sidecar_constraints import HEADER_MIN as HEADER_MIN
from patchswarm.daemon.sidecar_constraints import constraint_from_json as constraint_from_json
from patchswarm.daemon.sidecar_gate import ActivationError as ActivationError
from patchswarm.daemon.sidecar_gate import CommitMode as CommitMode
from patchswarm.daemon.sidecar_gate import ConstraintError, NotReady, Ticket, VersionConstraint, VersionGate
from patchswarm.daemon.sidecar_gate import DrainTimeoutError as DrainTimeoutError
from patchswarm.daemon.sidecar_routes import CONTROL_ROUTES as CONTROL_ROUTES
from patchswarm.daemon.sidecar_routes import OPTION, RoutePolicy, control_route, normalize
from patchswarm.swarm.client_errors import describe
from patchswarm.swarm.serving import ServerLimits, read_body, serve_tcp

log = logging.getLogger(__name__)

HEADER_START = "X-Weight-Version-Start"
HEADER_END = "X-Weight-Version-End"
STATUS_PATH = "/_patchswarm/version"
SSE_EVENT = "weight_version"

DEFAULT_MAX_BODY_BYTES = 64 << 20
# At shutdown the requests in flight get this long to finish, then are cut: a generation that
# never ends must not hold SIGTERM past the service manager's stop timeout (systemd: 90 s).
SHUTDOWN_GRACE_S = 10.0
DEFAULT_MAX_BUFFERED_RESPONSE_BYTES = 16 << 20
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# RFC 9110 7.6.1 hop-by-hop fields, plus those the proxy recomputes itself.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
        "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip


# ---------------------------------------------------------------- the proxy


_SESSION = web.AppKey("patchswarm.sidecar.session", aiohttp.ClientSession)


@dataclass(frozen=True, slots=True)
class _Settings:
    upstream: str
    gate: VersionGate
    max_body_bytes: int
    max_buffered_response_bytes: int
    sse_version_event: bool
    routes: RoutePolicy


_SETTINGS = web.AppKey("patchswarm.sidecar.settings", _Settings)


class _Lease:
    """The admitted ticket of one proxied request; released once, at the end of its response."""

    def __init__(self, gate: VersionGate, ticket: Ticket) -> None:
        self.gate, self.ticket = gate, ticket
        self.end: int | None = None

    def finish(self) -> int:
        if self.end is None:
            self.end = self.gate.release(self.ticket)
        return self.end


def make_sidecar_app(
    upstream_url: str,
    gate: VersionGate,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_buffered_response_bytes: int = DEFAULT_MAX_BUFFERED_RESPONSE_BYTES,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float | None = 600.0,
    max_connections: int = 1024,
    sse_version_event: bool = True,
    allow_routes: Iterable[str] = (),
) -> web.Application:
    """The proxy as an aiohttp application (serve it with :func:`start_sidecar` or any runner).

    ``max_body_bytes`` bounds request bodies (413 beyond).  Responses with a ``Content-Length`` up
    to ``max_buffered_response_bytes`` are buffered (so they get the end version in headers and
    JSON body); every other response streams through chunk by chunk.  ``read_timeout_s`` bounds
    the wait for each read from the engine (not the whole response).  Only the allow list's routes
    are forwarded (daemon/sidecar_routes.py), plus ``allow_routes`` (exact paths, or ``P/*`` for the
    paths below ``P``; a control route among them: ValueError).
    """
    upstream = upstream_url.rstrip("/")
    if not upstream.startswith(("http://", "https://")):
        raise ValueError(f"upstream must be an http(s) URL, got {upstream_url!r}")
    routes = RoutePolicy.with_routes(allow_routes)
    app = web.Application(client_max_size=max_body_bytes)
    app[_SETTINGS] = _Settings(upstream, gate, max_body_bytes, max_buffered_response_bytes, sse_version_event, routes)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        connector = aiohttp.TCPConnector(limit=max_connections)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False) as session:
            app[_SESSION] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    app.router.add_get(STATUS_PATH, _status)
    app.router.add_route("*", "/{tail:.*}", _proxy)
    return app


async def _status(request: web.Request) -> web.Response:
    return json_response(request.app[_SETTINGS].gate.snapshot())


def _error(status: int, error: str, detail: str, **extra: Any) -> web.Response:
    return json_response({"error": error, "detail": detail, **extra}, status=status)


def _refusal_response(refusal: NotReady, constraint: VersionConstraint) -> web.Response:
    body: dict[str, Any] = {
        "error": refusal.error,
        "applied_version": refusal.applied,
        "target_version": refusal.target,
        "retryable": refusal.retryable,
        "requested": constraint.to_json(),
    }
    if refusal.activating is not None:
        body["activating_version"] = refusal.activating
    headers = {"Retry-After": str(max(0, round(refusal.retry_after_s)))} if refusal.retryable else {}
    return json_response(body, status=refusal.status, headers=headers)


def _allowed_target(request: web.Request, upstream: str, routes: RoutePolicy) -> URL | web.Response:
    """The engine URL for ``request``, or its refusal: 403 for a control route, 404 for a path not on
    the allow list (daemon/sidecar_routes.py).

    Every form of the path must pass: as the client sent it (decoded and raw) and as it goes to the
    engine (the URL the sidecar requests, which yarl decodes where unreserved and dot-resolves), so no
    decoding step between the client and the engine's router turns an allowed path into another."""
    try:
        target = URL(upstream + str(request.rel_url))
    except ValueError:
        target = None
    paths = [request.path, request.rel_url.raw_path]  # (the raw path less its query and fragment)
    paths += [target.path, target.raw_path] if target is not None else []
    if any(control_route(p) for p in paths):
        return _error(403, "EngineControlRoute", "the engine's control routes are the daemon's, not served here")
    refused = [p for p in paths if not routes.allows(p)]
    if target is None or refused:
        shown = normalize(refused[0] if refused else request.path)[:200] or "/"
        detail = f"route {shown} is not served by the sidecar (add routes with the {OPTION} setting)"
        return _error(404, "RouteNotServed", detail)
    return target


async def _proxy(request: web.Request) -> web.StreamResponse:
    settings = request.app[_SETTINGS]
    target = _allowed_target(request, settings.upstream, settings.routes)
    if isinstance(target, web.Response):
        return target
    try:
        header_constraint = constraint_from_headers(request.headers)
        body = await read_body(request, settings.max_body_bytes)
        # An empty Content-Type is sniffed as none (FastAPI, vLLM's server, parses such a body as JSON)
        content_type = request.content_type if request.headers.get("Content-Type", "").strip() else ""
        encoding = ",".join(request.headers.getall("Content-Encoding", ["identity"]))
        body, body_constraint = split_body_constraint(body, content_type, encoding)
        constraint = header_constraint.merged(body_constraint)
    except ConstraintError as e:
        return _error(400, "InvalidWeightVersion", str(e))
    except web.HTTPRequestEntityTooLarge:
        return _error(413, "RequestTooLarge", f"request body larger than {settings.max_body_bytes} bytes")
    if request.method in _SAFE_METHODS and constraint.unconstrained:
        return await _forward(request, target, body, None)
    outcome = await settings.gate.admit(constraint)
    if isinstance(outcome, NotReady):
        return _refusal_response(outcome, constraint)
    lease = _Lease(settings.gate, outcome)
    try:
        return await _forward(request, target, body, lease)
    finally:
        lease.finish()


def _forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    listed = {t.strip().lower() for v in header_values(headers, "Connection") for t in v.split(",")}
    dropped = _HOP_BY_HOP | listed | {"accept-encoding", "expect", HEADER_MIN.lower(), HEADER_EXACT.lower()}
    out: CIMultiDict[str] = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)
    out["Accept-Encoding"] = "identity"  # so JSON bodies come back rewritable
    return out


def _response_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in _HOP_BY_HOP:
            out.add(k, v)
    return out


async def _forward(request: web.Request, url: URL, body: bytes, lease: _Lease | None) -> web.StreamResponse:
    settings = request.app[_SETTINGS]
    session = request.app[_SESSION]
    try:
        upstream = await session.request(
            request.method, url, headers=_forward_headers(request.headers), data=body or None, allow_redirects=False
        )
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return _error(502, "UpstreamUnavailable", f"engine at {settings.upstream}: {describe(e)}")
    async with upstream:
        headers = _response_headers(upstream.headers)
        if lease is not None:
            headers[HEADER_START] = str(lease.ticket.start_version)
        length = upstream.content_length
        is_sse = upstream.content_type == "text/event-stream"
        if not is_sse and length is not None and length <= settings.max_buffered_response_bytes:
            return await _buffered(upstream, headers, lease)
        return await _streamed(request, upstream, headers, lease, is_sse)


async def _buffered(
    upstream: aiohttp.ClientResponse, headers: CIMultiDict[str], lease: _Lease | None
) -> web.StreamResponse:
    try:
        data = await upstream.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return _error(502, "UpstreamFailed", f"engine response broke off: {describe(e)}")
    if lease is not None:
        end = lease.finish()
        headers[HEADER_END] = str(end)
        encoded = headers.get("Content-Encoding", "identity").lower() != "identity"
        if is_json(upstream.content_type) and not encoded:
            data = _with_versions(data, lease.ticket.start_version, end)
    return web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=data)


def _with_versions(data: bytes, start: int, end: int) -> bytes:
    obj = loads_json(data)
    if not isinstance(obj, dict):
        return data
    obj[BODY_KEY] = {"start": start, "end": end}
    return dumps_json(obj)


async def _streamed(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    headers: CIMultiDict[str],
    lease: _Lease | None,
    is_sse: bool,
) -> web.StreamResponse:
    settings = request.app[_SETTINGS]
    if lease is not None and lease.ticket.pinned:
        headers[HEADER_END] = str(lease.ticket.start_version)  # an exact pin cannot span a switch
    resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    tail = b""
    complete = True
    try:
        await resp.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
                tail = (tail + chunk)[-4:]
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
            complete = False
            log.warning("engine stream for %s broke off: %s: %s", request.rel_url, type(e).__name__, e)
        if lease is not None:
            end = lease.finish()
            if is_sse and complete and settings.sse_version_event:
                await resp.write(_sse_version_event(tail, lease.ticket.start_version, end))
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client of %s went away mid-stream", request.rel_url)
    return resp


def _sse_version_event(tail: bytes, start: int, end: int) -> bytes:
    if tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")) or not tail:
        sep = b""
    elif tail.endswith((b"\n", b"\r")):
        sep = b"\n"
    else:
        sep = b"\n\n"
    data = strict_dumps({BODY_KEY: {"start": start, "end": end}}, compact=True)
    return sep + f"event: {SSE_EVENT}\ndata: {data}\n\n".encode()


# ---------------------------------------------------------------- serving


@dataclass(slots=True)
class RunningServer:
    """An application served on a TCP port; ``url`` is where to reach it."""

    runner: web.BaseRunner
    host: str
    port: int
    scheme: str = "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve_app(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ServerLimits | None = None,
    shutdown_grace_s: float = 60.0,
    ssl_context: ssl.SSLContext | None = None,
) -> RunningServer:
    """Serve ``app`` on ``host:port`` (port 0: any free port, reported in the result) under ``limits``
    (the connection cap and deadlines; default: ServerLimits.from_env()).  ``close()`` gives the
    requests in flight ``shutdown_grace_s`` to finish, then cuts them.  (swarm/serving.py's
    ``serve_tcp`` serves it; this names the result, with its URL.)"""
    runner, bound = await serve_tcp(app, host, port, limits, ssl_context, shutdown_grace_s=shutdown_grace_s)
    return RunningServer(runner, host, bound, "https" if ssl_context else "http")


async def start_sidecar(
    upstream_url: str,
    gate: VersionGate,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ServerLimits | None = None,
    ssl_context: ssl.SSLContext | None = None,
    **options: Any,
) -> RunningServer:
    """Run the sidecar on a TCP port (``options``: keyword arguments of :func:`make_sidecar_app`), over
    mutual TLS with ``ssl_context`` (swarm/tls.py: rollout clients then present a cluster certificate)."""
    app = make_sidecar_app(upstream_url, gate, **options)
    return await serve_app(app, host, port, limits, shutdown_grace_s=SHUTDOWN_GRACE_S, ssl_context=ssl_context)
