"""One hardened way to serve an aiohttp application, for every server of the project: a peer's (and a
seed's) HTTP endpoints, the plain board server, the sidecar and the daemon's unix-socket API.

aiohttp bounds the request line and header sizes, but on its own it has no deadline for a request's
headers (a client sending a byte a second holds a connection forever), no cap on connections, no
deadline on a response the client never reads, and it logs a traceback for every malformed request.
:class:`HardenedRunner` adds them at the protocol level:

- at most ``max_connections`` connections, and at most ``max_connections_per_address`` from one
  address (:func:`address_key`: an IPv6 client counts by its /64; loopback exempt unless
  ``exempt_loopback`` is off): one past either cap is answered 503 and closed at once, established
  ones are untouched (over TLS a connection counts from its accept, its handshake included, and one
  past a cap is closed without an answer);
- a connection's first request must complete its request line and headers within
  ``header_timeout_s`` of connecting (half-open connections and slowloris); between requests a
  connection may stay idle ``idle_timeout_s``, and the next request's headers must complete in that
  time too (aiohttp's keep-alive timer only counts complete requests);
- a response the client stops reading (the socket's send buffer stays full for ``send_timeout_s``)
  aborts the connection, which cancels its handler;
- a client that goes away cancels its handler, so abandoned long polls leave nothing behind;
- a malformed request gets its 400 and one log line (rate-limited), never a traceback;
- a request that is not HTTP/1.x gets a 400 before the application sees it: aiohttp's parser takes a
  request line without a version (``GET /``) as HTTP/0.9, and ``HTTP/0.9`` or ``HTTP/2.0`` as written,
  and would answer them (:func:`_http1_only`).

Handlers read request bodies with :func:`read_body`: in a loop until complete, within a size limit
(413) and ``body_timeout_s`` (408), never assuming a body arrives in one piece.

Tests set small deadlines through ``PATCHSWARM_HTTP_*`` variables (:meth:`ServerLimits.from_env`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import resource
import signal
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion10
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger(__name__)

ENV_PREFIX = "PATCHSWARM_HTTP_"
# After answering a request whose body it did not read (a 413, a 408), how long the server reads and
# drops the rest so the answer is not lost to a reset (aiohttp's default, 10 s, holds a slot longer).
LINGER_S = 2.0
_REFUSAL = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_connections: int = 1024  # well under the daemon's LimitNOFILE (65536)
    # One client's share of them (by address_key): one host cannot lock every honest peer out.
    max_connections_per_address: int = 64
    # This machine's own processes (a sidecar's rollout clients, a test swarm) share 127.0.0.1.
    exempt_loopback: bool = True
    header_timeout_s: float = 10.0  # connect -> the first request's headers complete
    idle_timeout_s: float = 60.0  # keep-alive: the end of a response -> the next request's headers
    body_timeout_s: float = 60.0  # the request line -> its whole body read (read_body)
    send_timeout_s: float = 60.0  # a response's send buffer stays full this long: the client is gone
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 64
    log_interval_s: float = 10.0  # at most one line per kind of client misbehaviour per interval

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type != "bool" and not value > 0:
                raise ValueError(f"{ENV_PREFIX}{f.name.removesuffix('_s').upper()}: must be positive, got {value}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServerLimits:
        """The defaults, each overridable by ``PATCHSWARM_HTTP_<NAME>`` (``_s`` dropped: HEADER_TIMEOUT);
        ValueError naming the variable for a value that is not a positive number."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.name.removesuffix("_s").upper()
            text = env.get(name)
            if text is None:
                continue
            if f.type == "bool":
                if text.strip().lower() not in _BOOLS:
                    raise ValueError(f"{name}: expected 1 or 0, got {text!r}")
                values[f.name] = _BOOLS[text.strip().lower()]
                continue
            convert = int if f.type == "int" else float
            try:
                values[f.name] = convert(text)
            except ValueError:
                raise ValueError(f"{name}: expected a positive {convert.__name__}, got {text!r}") from None
        return cls(**values)


_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def address_key(ip: str) -> str:
    """Who a connection or request from ``ip`` counts as, for per-address limits: an IPv4 address as
    itself (also when IPv4-mapped in IPv6), an IPv6 address by its /64 (a host is handed a whole /64,
    so one attacker cannot multiply itself by its addresses); anything else (a unix socket) as is."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return f"{ipaddress.IPv6Address(int(addr) >> 64 << 64)}/64"  # (int: drops a %scope too)
    return str(addr)


def is_loopback(key: str) -> bool:
    """Whether an :func:`address_key` is this machine's (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(key).is_loopback
    except ValueError:
        return key == "::/64"  # (::1's /64; no real client has another address in it)


class _LineLimiter:
    """At most one log line per kind per interval; the next one says how many were left out."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self._interval) < self._interval:
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
            return
        self._last[kind] = now
        dropped = self._dropped.pop(kind, 0)
        suffix = f" ({dropped} more like it since the last line)" if dropped else ""
        log.log(level, msg + suffix, *args, exc_info=exc_info)


_AIOHTTP_QUIET = logging.getLogger("patchswarm.http.aiohttp")
_AIOHTTP_QUIET.disabled = True


class _GuardedServer(web.Server):
    """aiohttp's connection manager, counting connections and making :class:`_GuardedHandler`s."""

    def __init__(self, inner: web.Server, limits: ServerLimits, ssl_context: ssl.SSLContext | None) -> None:
        # The application's handler, request factory and handler arguments, as AppRunner built them.
        kwargs: dict[str, Any] = dict(inner._kwargs)
        kwargs.update(
            keepalive_timeout=limits.idle_timeout_s,
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
            lingering_time=LINGER_S,
            # Bodies as sent: none of our clients compresses one, and a decompressor is a bomb's
            # way in (the sidecar passes an engine's client's compressed body on untouched).
            auto_decompress=False,
            logger=_AIOHTTP_QUIET,  # every line goes through _GuardedHandler's rate-limited ones
        )
        super().__init__(
            _refusing_other_versions(inner.request_handler),
            request_factory=_http1_only(inner.request_factory),
            handler_cancellation=True,  # a client gone: its handler ends (no abandoned long polls pile up)
            loop=inner._loop,
            **kwargs,
        )
        self.limits = limits
        self.open = 0
        self.by_address: dict[str, int] = {}  # open connections per address_key (loopback left out when exempt)
        self.lines = _LineLimiter(limits.log_interval_s)
        self.ssl_context = ssl_context  # TLS: each connection's handshake runs in _GuardedHandler
        self.handshakes: set[asyncio.Task[None]] = set()  # (cancelled at shutdown)

    def __call__(self) -> _GuardedHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)

    async def shutdown(self, timeout: float | None = None) -> None:
        for task in list(self.handshakes):
            task.cancel()
        await super().shutdown(timeout)


# The request mapping's key marking a request that came as another HTTP than 1.x (its version as sent).
_NOT_HTTP1 = web.RequestKey("patchswarm.not_http1", str)


def _http1_only(factory: Any) -> Any:
    """``factory`` (aiohttp's request factory), but a request whose version is not 1.x is made as an
    HTTP/1.0 one that closes, marked with the version it came with: its refusal's status line and
    headers are then ones an HTTP/1 client reads (an HTTP/0.9 answer has neither)."""

    def make(message: Any, *args: Any) -> web.BaseRequest:
        version = message.version
        if version.major == 1:
            request: web.BaseRequest = factory(message, *args)
            return request
        request = factory(message._replace(version=HttpVersion10, should_close=True), *args)
        request[_NOT_HTTP1] = f"HTTP/{version.major}.{version.minor}"
        return request

    return make


def _refusing_other_versions(handler: Any) -> Any:
    """``handler`` (the application's), but a request marked by :func:`_http1_only` gets its one-line
    400 instead, before any route, middleware or body read."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        version = request.get(_NOT_HTTP1)
        if version is None:
            response: web.StreamResponse = await handler(request)
            return response
        why = f"{version} (a request line without a version)" if version == "HTTP/0.9" else version
        refusal = web.Response(status=400, text=f"{why} is not served: send HTTP/1.0 or HTTP/1.1\n")
        refusal.force_close()  # (what follows on the connection was not framed as HTTP/1 either)
        return refusal

    return handle


class _GuardedHandler(web.RequestHandler):
    __slots__ = ("_address", "_counted", "_guard", "_handshaking", "_header_timer", "_send_timer")

    def __init__(self, manager: _GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._header_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._address: str | None = None  # the address_key counted against its cap, if any
        self._handshaking: asyncio.Transport | None = None  # TLS: the TCP transport until its handshake ends

    @property
    def limits(self) -> ServerLimits:
        return self._guard.limits

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        address = _counted_address(transport, guard.limits)
        if guard.open >= guard.limits.max_connections:
            guard.lines.log(logging.WARNING, "cap", "HTTP connection cap (%d) reached: refusing", guard.open)
            self._refuse(transport)
            return
        if address is not None and guard.by_address.get(address, 0) >= guard.limits.max_connections_per_address:
            guard.lines.log(
                logging.WARNING,
                "address-cap",
                "HTTP connections from %s past its cap (%d): refusing",
                address,
                guard.limits.max_connections_per_address,
            )
            self._refuse(transport)
            return
        guard.open += 1
        self._counted = True
        if address is not None:
            guard.by_address[address] = guard.by_address.get(address, 0) + 1
            self._address = address
        _set_user_timeout(transport, guard.limits.send_timeout_s)
        self._header_timer = self._loop.call_later(guard.limits.header_timeout_s, self._headers_late)
        if guard.ssl_context is not None and isinstance(transport, asyncio.Transport):
            # TLS inside the counted connection and under its header deadline: a client that never
            # finishes its handshake holds a slot like any half-open connection (asyncio's own TLS
            # server would hand us the connection only after the handshake, uncounted until then).
            transport.pause_reading()  # (start_tls resumes it, with its TLS protocol in place)
            self._handshaking = transport
            task = self._loop.create_task(self._handshake(transport, guard.ssl_context))
            guard.handshakes.add(task)
            task.add_done_callback(guard.handshakes.discard)
            return
        super().connection_made(transport)

    async def _handshake(self, transport: asyncio.Transport, ctx: ssl.SSLContext) -> None:
        try:
            tls = await self._loop.start_tls(
                transport, self, ctx, server_side=True, ssl_handshake_timeout=self.limits.header_timeout_s
            )
        except BaseException as e:  # (start_tls closed the connection; aiohttp never saw it)
            self._handshaking = None
            self._release()
            self._manager = None
            if isinstance(e, ssl.SSLError):  # (no certificate, another CA's, expired, TLS 1.2, not TLS)
                peer = transport.get_extra_info("peername")
                who = peer[0] if isinstance(peer, tuple) and peer else "?"
                why = getattr(e, "verify_message", None) or (e.reason or "").lower().replace("_", " ") or _one_line(e)
                self._guard.lines.log(logging.INFO, "handshake", "TLS handshake from %s refused: %s", who, why)
                return
            if isinstance(e, OSError | TimeoutError):  # (gone, or cut at the header deadline: logged there)
                return
            raise
        self._handshaking = None
        if tls is None:  # (the connection was lost mid-handshake without an error: EOF, or cut at the deadline)
            self._manager = None
            self._release()
            return
        super().connection_made(tls)  # (its connection_lost now comes through the TLS protocol)

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        # Refused before aiohttp sees it: no handler task, no parser state, the established
        # connections untouched.  The short answer tells an honest client to come back (over TLS
        # there is no answer before the handshake: the connection just closes).
        self._manager = None  # (connection_lost then does nothing)
        self._force_close = True
        if isinstance(transport, asyncio.WriteTransport) and self._guard.ssl_context is None:
            transport.write(_REFUSAL)
        transport.close()

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._request_count == 0 and (self.transport is not None or self._handshaking is not None):
            self._guard.lines.log(logging.INFO, "slow", "HTTP client sent no complete request in time: closed")
            if self._handshaking is not None:
                self._handshaking.abort()  # (start_tls then raises: _handshake releases the slot)
            else:
                self.force_close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self._request_count > 0:
            self._header_timer.cancel()
            self._header_timer = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self._loop.call_later(self._guard.limits.send_timeout_s, self._send_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_stalled(self) -> None:
        self._send_timer = None
        if self.transport is not None:
            self._guard.lines.log(logging.INFO, "stall", "HTTP client stopped reading its response: closed")
            self.transport.abort()  # close() would wait for the buffer to drain, which it never will

    def connection_lost(self, exc: BaseException | None) -> None:
        self._release()
        super().connection_lost(exc)

    def _release(self) -> None:
        """This connection's timers and its place under the caps (at most once)."""
        for timer in (self._header_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._send_timer = None
        if self._counted:
            self._counted = False
            self._guard.open -= 1
        if self._address is not None:
            by_address = self._guard.by_address
            left = by_address.pop(self._address) - 1
            if left > 0:
                by_address[self._address] = left
            self._address = None

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if isinstance(exc, BadHttpMethod) and self._request_count == 1:
            # (aiohttp logs this one, not-HTTP-at-all traffic, itself: to the quiet logger)
            self._guard.lines.log(logging.INFO, "malformed", "malformed HTTP request: %s", _one_line(exc))
        return super().handle_error(request, status, exc, message)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            # A malformed request (bad request line, header, length, chunk): the client's fault, one line.
            self._guard.lines.log(logging.INFO, "malformed", "malformed HTTP request: %s", _one_line(exc))
        elif isinstance(exc, ConnectionError):
            self._guard.lines.log(logging.DEBUG, "gone", "HTTP client went away: %s", type(exc).__name__)
        else:
            # A handler's own failure (a 500): a bug, worth its traceback, but not once per request.
            self._guard.lines.log(logging.ERROR, "bug", "HTTP handler failed", exc_info=exc)


def _counted_address(transport: asyncio.BaseTransport, limits: ServerLimits) -> str | None:
    """The address_key a TCP connection counts against, or None (a unix socket; exempt loopback)."""
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return None
    key = address_key(peer[0])
    if limits.exempt_loopback and is_loopback(key):
        return None
    return key


def _set_user_timeout(transport: asyncio.BaseTransport, seconds: float) -> None:
    """TCP: the kernel drops a connection whose sent data stays unacknowledged, or unsent behind a
    zero window, this long: the deadline for a client that stops reading a file sent with sendfile
    (which bypasses the transport's buffer, so pause_writing never sees it) or that vanished."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6) or not hasattr(socket, "TCP_USER_TIMEOUT"):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(seconds * 1000)))


def _one_line(exc: BaseException) -> str:
    message = getattr(exc, "message", None) or str(exc)
    text = message if isinstance(message, str) and message else type(exc).__name__
    return text.splitlines()[0][:200] if text else type(exc).__name__


class HardenedRunner(web.AppRunner):
    """An AppRunner whose connections get :class:`ServerLimits` (use with TCPSite, UnixSite, SockSite, never
    given an ``ssl_context``: with ``ssl_context`` here, every connection is TLS, its handshake counted
    against the caps and bounded by the header deadline)."""

    def __init__(
        self,
        app: web.Application,
        limits: ServerLimits | None = None,
        ssl_context: ssl.SSLContext | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("access_log", None)
        kwargs.setdefault("handle_signals", False)
        super().__init__(app, **kwargs)
        self.limits = limits if limits is not None else ServerLimits.from_env()
        self.ssl_context = ssl_context

    async def _make_server(self) -> web.Server:
        server = _GuardedServer(await super()._make_server(), self.limits, self.ssl_context)
        loop = asyncio.get_running_loop()
        if loop.get_exception_handler() is None:
            loop.set_exception_handler(_AcceptErrors(server.lines))
        return server


class _AcceptErrors:
    """The loop's exception handler: asyncio's accept loop, out of descriptors (EMFILE), pauses a
    second and says so with a traceback each time; here it is one line at most every interval."""

    def __init__(self, lines: _LineLimiter) -> None:
        self.lines = lines

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            exc = context.get("exception")
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "out of resources"
            self.lines.log(logging.WARNING, "accept", "HTTP server cannot accept connections: %s", why)
            return
        loop.default_exception_handler(context)


def limits_of(request: web.BaseRequest) -> ServerLimits:
    """The limits the request's server runs under (the defaults for a plain aiohttp server)."""
    proto = request.protocol
    return proto.limits if isinstance(proto, _GuardedHandler) else _DEFAULTS


_DEFAULTS = ServerLimits()


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The whole request body, read piece by piece as it arrives: 413 past ``limit`` bytes (checked
    against Content-Length first), 408 when it has not all come within the server's body deadline."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    cached: bytes | None = getattr(request, "_read_bytes", None)  # (a middleware's request.read() took it)
    if cached is not None:
        if len(cached) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(cached))
        return cached
    parts: list[bytes] = []
    got = 0
    try:
        async with asyncio.timeout(limits_of(request).body_timeout_s):
            while True:
                piece = await request.content.readany()
                if not piece:
                    break
                got += len(piece)
                if got > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=got)
                parts.append(piece)
    except TimeoutError:
        raise web.HTTPRequestTimeout(text="request body too slow\n") from None
    except RequestPayloadError as e:  # a malformed chunked body
        raise web.HTTPBadRequest(text=f"request body: {_one_line(e.__cause__ or e)}\n") from None
    return b"".join(parts)


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (a server holds a descriptor per
    connection, a file per chunk served); returns the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, want, e)
    return soft, hard


async def serve_tcp(
    app: web.Application,
    host: str,
    port: int,
    limits: ServerLimits | None = None,
    ssl_context: ssl.SSLContext | None = None,
    *,
    shutdown_grace_s: float = 60.0,
) -> tuple[HardenedRunner, int]:
    """Serve ``app`` on ``host:port`` (port 0: any free port) under ``limits`` (over TLS with
    ``ssl_context``: swarm/tls.py); returns the runner and the bound port.  The runner's ``cleanup()``
    gives the requests in flight ``shutdown_grace_s`` to finish (aiohttp's default), then cuts them."""
    runner = HardenedRunner(app, limits, ssl_context, shutdown_timeout=shutdown_grace_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


async def serve_until_signalled(on_hangup: Callable[[], object] | None = None) -> None:
    """Return on SIGINT or SIGTERM.  With ``on_hangup`` (TLS: reload the certificate files, swarm/tls.py),
    SIGHUP calls it and the process goes on; without, SIGHUP keeps its default (the process ends)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    await stop.wait()


def run_app(
    app: web.Application,
    host: str,
    port: int,
    limits: ServerLimits | None = None,
    on_ready: Callable[[], None] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    on_hangup: Callable[[], object] | None = None,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM (the plain board server's main loop); ``on_ready`` once bound;
    ``on_hangup`` on SIGHUP (see :func:`serve_until_signalled`)."""

    async def main() -> None:
        runner, _ = await serve_tcp(app, host, port, limits, ssl_context)
        if on_ready is not None:
            on_ready()  # after the bind: a port in use gives its one error line, not a "serving" line first
        try:
            await serve_until_signalled(on_hangup)
        finally:
            await runner.cleanup()

    asyncio.run(main())
