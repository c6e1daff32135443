"""One line for a failed HTTP request, without the client library's noise.

aiohttp's own text (``Cannot connect to host 10.0.0.2:8701 ssl:default [Connect call failed ...]``)
reaches operators through status reasons and log lines; :func:`describe` says the same thing as
``cannot connect to 10.0.0.2:8701: connection refused``.
"""

from __future__ import annotations

import errno
import re
import socket

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError

from patchswarm.protocol.errors import PatchswarmError


class SourceError(PatchswarmError):
    """A board source failed (connection refused, HTTP error, timeout, an object store's refusal)."""


# Everything up to a URL's last "@": credentials (a secret may hold "/", so no narrower cut is safe).
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{0,31}://)?.*@", re.DOTALL)


def shown_url(text: str) -> str:
    """``text`` as an error line may show it: credentials (``user:secret@``) and any query (a presigned
    URL's signature, a SAS token) replaced, at most 200 characters."""
    text, query, _ = text.partition("?")
    return (_USERINFO.sub(lambda m: (m.group(1) or "") + "***@", text) + ("?***" if query else ""))[:200]


_ERRNO = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset",
    errno.ETIMEDOUT: "timed out",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.ENOENT: "no such socket",
    errno.EACCES: "permission denied",
    errno.EPIPE: "connection closed",
    errno.EMFILE: "too many open files",
}


def _os_reason(e: OSError) -> str:
    if isinstance(e, socket.gaierror):
        return "unknown host"
    if e.errno in _ERRNO:
        return _ERRNO[e.errno]
    return (e.strerror or type(e).__name__).lower()


def _endpoint(host: str, port: int | None) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port is not None else host


def describe(e: BaseException) -> str:
    """``cannot connect to HOST:PORT: connection refused``, ``timed out``, ``HTTP 503``, ..."""
    if isinstance(e, UnixClientConnectorError):
        return f"cannot connect to {e.path}: {reason(e)}"
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect to {_endpoint(e.host, e.port)}: {reason(e)}"
    return reason(e)


def reason(e: BaseException) -> str:
    """What went wrong, without the endpoint: ``connection refused``, ``timed out``, ``HTTP 503``, ..."""
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        return "TLS certificate not trusted"
    if isinstance(e, aiohttp.ClientConnectorError):
        return _os_reason(e.os_error)
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(e, aiohttp.ClientResponseError):
        return f"HTTP {e.status}"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "the response body was cut short"
    if isinstance(e, aiohttp.InvalidURL):
        return "invalid URL"
    if isinstance(e, OSError) and e.errno is not None:
        return _os_reason(e)
    return type(e).__name__
