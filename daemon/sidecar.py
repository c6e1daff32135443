"""A version-aware reverse proxy in front of an inference engine's HTTP API.

The sidecar sits between rollout clients and the engine on a rollout host.  Every request that
can run a generation (any method but GET/HEAD/OPTIONS, or any request carrying a constraint) goes
through a :class:`VersionGate`:

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

import asyncio
import contextlib
import itertools
import json
import logging
import re
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from patchswarm.swarm.client_errors import describe
from patchswarm.swarm.serving import HardenedRunner, ServerLimits, read_body

log = logging.getLogger(__name__)

HEADER_MIN = "X-Weight-Version-Min"
HEADER_EXACT = "X-Weight-Version-Exact"
HEADER_START = "X-Weight-Version-Start"
HEADER_END = "X-Weight-Version-End"
BODY_KEY = "weight_version"
STATUS_PATH = "/_patchswarm/version"
SSE_EVENT = "weight_version"

CommitMode = Literal["quiesce", "in_place"]
COMMIT_MODES: tuple[CommitMode, ...] = ("quiesce", "in_place")

DEFAULT_MAX_BODY_BYTES = 64 << 20
# At shutdown the requests in flight get this long to finish, then are cut: a generation that
# never ends must not hold SIGTERM past the service manager's stop timeout (systemd: 90 s).
SHUTDOWN_GRACE_S = 10.0
DEFAULT_MAX_BUFFERED_RESPONSE_BYTES = 16 << 20
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_VERSION_RE = re.compile(r"[0-9]{1,18}")
# RFC 9110 7.6.1 hop-by-hop fields, plus those the proxy recomputes itself.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
        "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip


# ---------------------------------------------------------------- vocabulary


class ConstraintError(ValueError):
    """A malformed or unsatisfiable version constraint (the client's mistake: HTTP 400)."""


class ActivationError(RuntimeError):
    """The activation API was misused (overlapping activations, a version that rewinds)."""


class DrainTimeoutError(TimeoutError):
    """The drain before a switch outlasted its deadline; admission is open again, nothing switched."""

    def __init__(self, timeout_s: float, blocking: int) -> None:
        self.timeout_s, self.blocking = timeout_s, blocking
        super().__init__(f"sidecar drain timed out after {timeout_s:g} s with {blocking} requests in flight")


@dataclass(frozen=True, slots=True)
class VersionConstraint:
    """What a request demands of the weights it runs on; both fields ``None``: anything goes."""

    min_version: int | None = None
    exact_version: int | None = None

    def __post_init__(self) -> None:
        for field_name in ("min_version", "exact_version"):
            v = getattr(self, field_name)
            if v is not None and (type(v) is not int or v < 0):
                raise ConstraintError(f"{field_name} must be a non-negative integer, got {v!r}")
        if self.min_version is not None and self.exact_version is not None and self.exact_version < self.min_version:
            raise ConstraintError(
                f"exact_version {self.exact_version} is below min_version {self.min_version}: no version satisfies both"
            )

    @property
    def pinned(self) -> bool:
        return self.exact_version is not None

    @property
    def unconstrained(self) -> bool:
        return self.min_version is None and self.exact_version is None

    def satisfied_by(self, version: int) -> bool:
        if self.exact_version is not None:
            return version == self.exact_version
        return self.min_version is None or version >= self.min_version

    def unreachable_after(self, version: int) -> bool:
        """True when no version from ``version`` on can satisfy this constraint (versions never rewind)."""
        return self.exact_version is not None and self.exact_version < version

    def merged(self, other: VersionConstraint) -> VersionConstraint:
        """Combine the header and body forms; the same field given twice must agree."""
        fields: dict[str, int | None] = {}
        for field_name in ("min_version", "exact_version"):
            a, b = getattr(self, field_name), getattr(other, field_name)
            if a is not None and b is not None and a != b:
                raise ConstraintError(f"{field_name} given twice with different values ({a} and {b})")
            fields[field_name] = a if a is not None else b
        return VersionConstraint(**fields)

    def to_json(self) -> dict[str, int | None]:
        return {"min_version": self.min_version, "exact_version": self.exact_version}


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: released exactly once, when its response is complete."""

    id: int
    start_version: int
    constraint: VersionConstraint

    @property
    def pinned(self) -> bool:
        return self.constraint.pinned


NotReadyReason = Literal["not_ready", "unavailable", "activating"]


@dataclass(frozen=True, slots=True)
class NotReady:
    """Why a request was refused, with the versions the client needs to decide what to do next.

    ``not_ready``: the version asked for is not (yet) served: retry later (409).
    ``unavailable``: an exact pin to a version already replaced: retrying is pointless (409).
    ``activating``: an activation outlasted the admission wait: retry later (503).
    """

    reason: NotReadyReason
    applied: int
    target: int
    activating: int | None
    retry_after_s: float

    @property
    def retryable(self) -> bool:
        return self.reason != "unavailable"

    @property
    def status(self) -> int:
        return 503 if self.reason == "activating" else 409

    @property
    def error(self) -> str:
        return {
            "not_ready": "WeightVersionNotReady",
            "unavailable": "WeightVersionUnavailable",
            "activating": "WeightActivationInProgress",
        }[self.reason]


# ---------------------------------------------------------------- the gate


class VersionGate:
    """Admission control keyed on the weight version the engine serves.

    Single event loop, no locks: every state change happens between awaits.  The daemon that
    applies patches drives the activation side; the sidecar drives the request side.
    """

    def __init__(
        self,
        applied: int,
        target: int | None = None,
        *,
        admission_timeout_s: float = 30.0,
        retry_after_s: float = 1.0,
    ) -> None:
        if applied < 0:
            raise ValueError("applied version must be non-negative")
        if admission_timeout_s < 0 or retry_after_s < 0:
            raise ValueError("timeouts must be non-negative")
        self._applied = applied
        self._target = max(applied, target if target is not None else applied)
        self.admission_timeout_s = admission_timeout_s
        self.retry_after_s = retry_after_s
        self._activating: int | None = None
        self._mode: CommitMode | None = None
        self._in_flight: dict[int, Ticket] = {}
        self._pinned_in_flight = 0
        self._waiting = 0
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()

    # -- state

    @property
    def applied(self) -> int:
        """The version the engine serves (moves only in :meth:`end_activation`)."""
        return self._applied

    @property
    def target(self) -> int:
        """The newest version known to exist (never below ``applied``)."""
        return self._target

    @property
    def activating(self) -> int | None:
        """The version being activated, or ``None`` when admission is open."""
        return self._activating

    @property
    def mode(self) -> CommitMode | None:
        return self._mode

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def pinned_in_flight(self) -> int:
        return self._pinned_in_flight

    @property
    def waiting(self) -> int:
        """Requests held at the gate by an activation in progress."""
        return self._waiting

    def snapshot(self) -> dict[str, Any]:
        return {
            "applied_version": self._applied,
            "target_version": self._target,
            "activating_version": self._activating,
            "commit_mode": self._mode,
            "in_flight": self.in_flight,
            "pinned_in_flight": self._pinned_in_flight,
            "waiting": self._waiting,
        }

    def set_target(self, version: int) -> None:
        """Record that ``version`` exists (published, being fetched); lower values are ignored."""
        if version > self._target:
            self._target = version
            self._notify()

    async def wait_until(self, predicate: Callable[[VersionGate], bool]) -> None:
        """Return once ``predicate(self)`` holds (re-checked after every state change)."""
        while not predicate(self):
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- request side

    async def admit(self, constraint: VersionConstraint | None = None) -> Ticket | NotReady:
        """Admit a request now, refuse it, or (during an activation) wait for the switch first."""
        c = constraint or VersionConstraint()
        if self._activating is None:
            return self._decide(c)
        if not self._worth_waiting(c):
            return self._refusal(c)
        self._waiting += 1
        self._notify()
        try:
            async with asyncio.timeout(self.admission_timeout_s):
                while self._activating is not None:
                    await self._changed.wait()
                    if self._activating is not None and not self._worth_waiting(c):
                        return self._refusal(c)
        except TimeoutError:
            return NotReady("activating", self._applied, self._target, self._activating, self.retry_after_s)
        finally:
            self._waiting -= 1
            self._notify()
        return self._decide(c)

    def release(self, ticket: Ticket) -> int:
        """Mark a request complete; returns the version it ended on (the applied version now)."""
        if self._in_flight.pop(ticket.id, None) is None:
            raise ValueError(f"ticket {ticket.id} is not in flight (released twice?)")
        if ticket.pinned:
            self._pinned_in_flight -= 1
        self._notify()
        return self._applied

    def _decide(self, c: VersionConstraint) -> Ticket | NotReady:
        if not c.satisfied_by(self._applied):
            return self._refusal(c)
        ticket = Ticket(next(self._ids), self._applied, c)
        self._in_flight[ticket.id] = ticket
        if ticket.pinned:
            self._pinned_in_flight += 1
        self._notify()
        return ticket

    def _refusal(self, c: VersionConstraint) -> NotReady:
        reason: NotReadyReason = "unavailable" if c.unreachable_after(self._applied) else "not_ready"
        return NotReady(reason, self._applied, self._target, self._activating, self.retry_after_s)

    def _worth_waiting(self, c: VersionConstraint) -> bool:
        """During an activation: could the outcome (commit or abort) satisfy ``c``?"""
        nxt = self._activating
        assert nxt is not None
        return c.satisfied_by(self._applied) or c.satisfied_by(nxt)

    # -- activation side

    async def begin_activation(self, mode: CommitMode, next_version: int, *, timeout_s: float | None = None) -> None:
        """Close admission and wait until the weights may be switched to ``next_version``.

        ``quiesce``: wait until no request is in flight.  ``in_place``: wait until no exact-pinned
        request is in flight; the caller then pauses the engine, and unpinned requests continue
        across the switch.  On timeout (:class:`DrainTimeoutError`, naming the requests still in
        flight) or cancellation admission reopens and the error propagates.
        """
        if mode not in COMMIT_MODES:
            raise ValueError(f"unknown commit mode {mode!r} (one of {', '.join(COMMIT_MODES)})")
        if self._activating is not None:
            raise ActivationError(f"activation of version {self._activating} already in progress")
        if next_version <= self._applied:
            raise ActivationError(f"version {next_version} does not move past the applied version {self._applied}")
        self._activating, self._mode = next_version, mode
        self.set_target(next_version)
        self._notify()
        drained: Callable[[VersionGate], bool] = (
            (lambda g: g.in_flight == 0) if mode == "quiesce" else (lambda g: g.pinned_in_flight == 0)
        )
        try:
            async with asyncio.timeout(timeout_s):
                await self.wait_until(drained)
        except TimeoutError:
            blocking = self.in_flight if mode == "quiesce" else self.pinned_in_flight
            self._reopen()
            raise DrainTimeoutError(timeout_s or 0.0, blocking) from None
        except BaseException:
            self._reopen()
            raise

    def end_activation(self, new_version: int) -> None:
        """Reopen admission at ``new_version``: the version being activated (commit) or the
        applied one (abort: the weights were not changed)."""
        if self._activating is None:
            raise ActivationError("no activation in progress")
        if new_version not in (self._applied, self._activating):
            raise ActivationError(
                f"activation of {self._activating} cannot end at version {new_version} "
                f"(commit: {self._activating}, abort: {self._applied})"
            )
        self._applied = new_version
        self._target = max(self._target, new_version)
        self._reopen()

    def _reopen(self) -> None:
        self._activating, self._mode = None, None
        self._notify()

    @contextlib.asynccontextmanager
    async def activation(
        self, mode: CommitMode, next_version: int, *, timeout_s: float | None = None
    ) -> AsyncIterator[None]:
        """``async with gate.activation(mode, v): write the weights`` — commits ``v`` when the body
        returns, aborts (keeps the applied version) when it raises."""
        await self.begin_activation(mode, next_version, timeout_s=timeout_s)
        try:
            yield
        except BaseException:
            self.end_activation(self._applied)
            raise
        self.end_activation(next_version)


# ---------------------------------------------------------------- request parsing


def parse_version_value(value: object, what: str) -> int | None:
    """A version given as a JSON integer or a decimal string; ``None`` stays ``None``."""
    if value is None:
        return None
    if type(value) is int:
        if value < 0:
            raise ConstraintError(f"{what} must be non-negative, got {value}")
        return value
    if isinstance(value, str) and _VERSION_RE.fullmatch(value.strip()):
        return int(value.strip())
    raise ConstraintError(f"{what} must be a non-negative integer, got {value!r}")


def _header_values(headers: Mapping[str, str], name: str) -> list[str]:
    if isinstance(headers, CIMultiDictProxy | CIMultiDict):
        return list(headers.getall(name, []))
    return [v for k, v in headers.items() if k.lower() == name.lower()]


def constraint_from_headers(headers: Mapping[str, str]) -> VersionConstraint:
    fields: dict[str, int | None] = {}
    for header, field_name in ((HEADER_MIN, "min_version"), (HEADER_EXACT, "exact_version")):
        values = _header_values(headers, header)
        if len(values) > 1:
            raise ConstraintError(f"header {header} given {len(values)} times")
        fields[field_name] = parse_version_value(values[0], header) if values else None
    return VersionConstraint(**fields)


def constraint_from_json(value: object) -> VersionConstraint:
    """The body form: ``{"min_version": m, "exact_version": e}`` (either may be absent or null)."""
    if value is None:
        return VersionConstraint()
    if not isinstance(value, dict):
        raise ConstraintError(f"{BODY_KEY} must be an object with min_version and/or exact_version")
    unknown = sorted(set(value) - {"min_version", "exact_version"})
    if unknown:
        raise ConstraintError(f"{BODY_KEY} has unknown keys {unknown} (allowed: min_version, exact_version)")
    return VersionConstraint(
        parse_version_value(value.get("min_version"), f"{BODY_KEY}.min_version"),
        parse_version_value(value.get("exact_version"), f"{BODY_KEY}.exact_version"),
    )


def split_body_constraint(body: bytes, content_type: str) -> tuple[bytes, VersionConstraint]:
    """Take ``weight_version`` out of a JSON object body; other bodies are returned untouched."""
    if not body or not (_is_json(content_type) or content_type == ""):
        return body, VersionConstraint()
    obj = _loads(body)
    if not isinstance(obj, dict) or BODY_KEY not in obj:
        return body, VersionConstraint()
    constraint = constraint_from_json(obj.pop(BODY_KEY))
    return _dumps(obj), constraint


def _loads(data: bytes) -> object:
    """The JSON value of ``data``, or None when it is not JSON this process can hold (the body is then
    passed on untouched): ValueError covers bad UTF-8, bad JSON and integers of over 4300 digits."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _dumps(obj: object) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (an escaped \ud800 in the input): keep it as an escape
        return json.dumps(obj, separators=(",", ":")).encode()


def _is_json(mimetype: str) -> bool:
    return mimetype == "application/json" or mimetype.endswith("+json")


# ---------------------------------------------------------------- the proxy


_SESSION = web.AppKey("patchswarm.sidecar.session", aiohttp.ClientSession)


@dataclass(frozen=True, slots=True)
class _Settings:
    upstream: str
    gate: VersionGate
    max_body_bytes: int
    max_buffered_response_bytes: int
    sse_version_event: bool


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
) -> web.Application:
    """The proxy as an aiohttp application (serve it with :func:`start_sidecar` or any runner).

    ``max_body_bytes`` bounds request bodies (413 beyond).  Responses with a ``Content-Length`` up
    to ``max_buffered_response_bytes`` are buffered (so they get the end version in headers and
    JSON body); every other response streams through chunk by chunk.  ``read_timeout_s`` bounds
    the wait for each read from the engine (not the whole response).
    """
    upstream = upstream_url.rstrip("/")
    if not upstream.startswith(("http://", "https://")):
        raise ValueError(f"upstream must be an http(s) URL, got {upstream_url!r}")
    app = web.Application(client_max_size=max_body_bytes)
    app[_SETTINGS] = _Settings(upstream, gate, max_body_bytes, max_buffered_response_bytes, sse_version_event)

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
    return web.json_response(request.app[_SETTINGS].gate.snapshot())


def _error(status: int, error: str, detail: str, **extra: Any) -> web.Response:
    return web.json_response({"error": error, "detail": detail, **extra}, status=status)


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
    return web.json_response(body, status=refusal.status, headers=headers)


async def _proxy(request: web.Request) -> web.StreamResponse:
    settings = request.app[_SETTINGS]
    try:
        header_constraint = constraint_from_headers(request.headers)
        body = await read_body(request, settings.max_body_bytes)
        content_type = request.content_type if "Content-Type" in request.headers else ""
        body, body_constraint = split_body_constraint(body, content_type)
        constraint = header_constraint.merged(body_constraint)
    except ConstraintError as e:
        return _error(400, "InvalidWeightVersion", str(e))
    except web.HTTPRequestEntityTooLarge:
        return _error(413, "RequestTooLarge", f"request body larger than {settings.max_body_bytes} bytes")
    if request.method in _SAFE_METHODS and constraint.unconstrained:
        return await _forward(request, body, None)
    outcome = await settings.gate.admit(constraint)
    if isinstance(outcome, NotReady):
        return _refusal_response(outcome, constraint)
    lease = _Lease(settings.gate, outcome)
    try:
        return await _forward(request, body, lease)
    finally:
        lease.finish()


def _forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    listed = {t.strip().lower() for v in _header_values(headers, "Connection") for t in v.split(",")}
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


async def _forward(request: web.Request, body: bytes, lease: _Lease | None) -> web.StreamResponse:
    settings = request.app[_SETTINGS]
    session = request.app[_SESSION]
    url = settings.upstream + str(request.rel_url)
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
        if _is_json(upstream.content_type) and not encoded:
            data = _with_versions(data, lease.ticket.start_version, end)
    return web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=data)


def _with_versions(data: bytes, start: int, end: int) -> bytes:
    obj = _loads(data)
    if not isinstance(obj, dict):
        return data
    obj[BODY_KEY] = {"start": start, "end": end}
    return _dumps(obj)


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
    data = json.dumps({BODY_KEY: {"start": start, "end": end}}, separators=(",", ":"))
    return sep + f"event: {SSE_EVENT}\ndata: {data}\n\n".encode()


# ---------------------------------------------------------------- serving


@dataclass(slots=True)
class RunningServer:
    """An application served on a TCP port; ``url`` is where to reach it."""

    runner: web.AppRunner
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
    requests in flight ``shutdown_grace_s`` to finish, then cuts them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    runner = HardenedRunner(app, limits, ssl_context, shutdown_timeout=shutdown_grace_s)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
    except BaseException:
        await runner.cleanup()
        sock.close()
        raise
    return RunningServer(runner, host, sock.getsockname()[1], "https" if ssl_context else "http")


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
