"""A grammar of hostile raw HTTP/1.x requests, shared by tests/system/test_http_fuzz.py (hypothesis, CI-sized)
and benchmarks/http_fuzz.py (100k requests): methods, paths with every encoding of ``/`` and ``..``,
header names, values and repeats the servers look at, bodies plain or chunked, right and wrong lengths.

The grammar draws through a ``Pick`` (``choice(options)``, ``blob(max)``): hypothesis's ``data.draw``
in the test (so it shrinks), a seeded ``random.Random`` in the benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")


class Pick(Protocol):
    def choice(self, options: Sequence[T]) -> T: ...
    def blob(self, max_size: int) -> bytes: ...


class RandomPick:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def blob(self, max_size: int) -> bytes:
        return self.rng.randbytes(self.rng.randrange(max_size + 1))


METHODS = ["GET", "GET", "POST", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT",
           "get", "G\x00T", "GETT", "BREW", "", "\x16\x03\x01"]  # fmt: skip
PREFIXES = ["/", "/swarm/v1/board/", "/swarm/v1/board/runs/serve-run/", "/swarm/v1/chunks/", "/swarm/v1/gossip",
            "/runs/", "/chunks/", "/manifests/", "/trust/", "/certs/", "/v1/status", "/v1/wait", "/v1/ack",
            "/v1/store", "/v1/events", "/metrics", "/generate", "/_patchswarm/version", "", "*",
            "http://x/", "//", "/swarm/v1/board/trust/"]  # fmt: skip
SEGMENTS = ["..", ".", "%2e%2e", "%2E%2E", "%2e", ".%2e", "%2e.", "%2f", "%2F", "%5c", "%5C", "\\", "..%2f",
            "..%2F", "%2e%2e%2f", "..%5c", "%252e%252e%252f", "%252F", "%c0%af", "%c0%ae%c0%ae", "%e0%80%af",
            "%00", "%", "%zz", "etc", "passwd", "runs", "chunks", "manifests", "head", "serve-run",
            "etc%2Fpasswd", "%2Fetc%2Fpasswd", "..%2F..%2F..%2Fetc%2Fpasswd", "dev", "zero", "proc", "self",
            "environ", "0" * 64, "ff" * 32, "a" * 300, ";", "?", "#", "~", "\u00e9", "%ff", "+", " "]  # fmt: skip
QUERIES = ["", "", "?version=1", "?version=-1&timeout=0", "?version=99&timeout=0.01", "?version=1e400",
           "?timeout=nan&version=0", "?a=%zz", "?" + "a" * 2000]  # fmt: skip
VERSIONS = ["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.x", "HTTP/9.9", "http/1.1", "HTTP/1.1 x", ""]
NAMES = ["Host", "Content-Length", "Transfer-Encoding", "Connection", "Expect", "Content-Type",
         "Content-Encoding", "X-Patchswarm-Node", "X-Patchswarm-Held", "X-Patchswarm-Insist",
         "X-Weight-Version-Min", "X-Weight-Version", "Range", "If-None-Match", "Upgrade", "Accept-Encoding",
         "Bad Name", "X-\x00", ":", "", "X-Long"]  # fmt: skip
VALUES = ["", "x", "0", "1", "-1", "+5", "18446744073709551616", "9" * 40, "1, 2", "chunked", "gzip, chunked",
          "chunked, gzip", " chunked", "xchunked", "identity", "close", "keep-alive", "upgrade", "100-continue",
          "application/json", "text/plain", "deflate", "bytes=0-10", "bytes=-1", "bytes=99999999-",
          "bytes=0-0,0-0,0-0", "websocket", "h2c", "1", "\u00e9\u00e9", "a" * 9000, "\x7f", "\r", "\t x"]  # fmt: skip
BODIES = [b"", b"{}", b'{"engine": "e", "version": 1}', b'{"engine": 1}', b"[" * 5000, b"\x00" * 64,
          b'{"a": 1e400}', b"\xff\xfe", b"\x81\xa1a\x01"]  # fmt: skip
EOLS = ["\r\n", "\r\n", "\r\n", "\n", "\r"]


def _legal(text: str) -> bool:
    return text.isascii() and text.isprintable() and " " not in text.strip() and len(text) < 1000


_FRAMING = ("Host", "Content-Length", "Transfer-Encoding", "Content-Encoding", "Connection", "Upgrade")

# Most requests are well-formed HTTP (so they reach the handlers: routing, confinement, bodies); the
# rest draw from everything above, and mostly die in the parser with a 400.
CLEAN = {
    "methods": [m for m in METHODS if m.isalpha() and m.isupper()],
    "prefixes": [p for p in PREFIXES if p.startswith("/")],
    "segments": [g for g in SEGMENTS if _legal(g) and g not in ("#", "?", "%", "%zz")],
    "versions": ["HTTP/1.1", "HTTP/1.0"],
    "names": [n for n in NAMES if n.replace("-", "").isalnum() and n not in _FRAMING],
    "values": [v for v in VALUES if _legal(v) and v.strip() == v],
    "eols": ["\r\n"],
}
DIRTY = {
    "methods": METHODS, "prefixes": PREFIXES, "segments": SEGMENTS, "versions": VERSIONS, "names": NAMES,
    "values": VALUES, "eols": EOLS,
}  # fmt: skip


def raw_request(pick: Pick) -> bytes:
    """One request: a request line, up to 6 headers (framing headers right, wrong or repeated) and a
    body sent plain or chunked (well-formed or not)."""
    g = pick.choice([CLEAN, CLEAN, CLEAN, DIRTY])
    eol = pick.choice(g["eols"])
    path = pick.choice(g["prefixes"]) + "/".join(pick.choice(g["segments"]) for _ in range(pick.choice([0, 1, 2, 3])))
    line = f"{pick.choice(g['methods'])} {path}{pick.choice(QUERIES)} {pick.choice(g['versions'])}"
    body = pick.choice(BODIES) if pick.choice([True, False]) else pick.blob(512)
    framing = pick.choice(["length", "length", "length", "none", "chunked", "chunked", "chunked-bad",
                           "length-short", "length-long", "both", "twice"])  # fmt: skip
    headers = ["Host: x"] if g is CLEAN or pick.choice([True, True, False]) else []
    encoded = body
    if framing in ("length", "length-short", "length-long", "both"):
        delta = {"length-short": -1, "length-long": 7}.get(framing, 0)
        headers.append(f"Content-Length: {max(0, len(body) + delta)}")
    if framing == "twice":
        headers += [f"Content-Length: {len(body)}", f"Content-Length: {len(body) + 1}"]
    if framing in ("chunked", "chunked-bad", "both"):
        headers.append("Transfer-Encoding: chunked")
        encoded = _chunked(body, pick, bad=framing == "chunked-bad")
    for _ in range(pick.choice([0, 1, 2, 4, 6])):
        headers.append(f"{pick.choice(g['names'])}:{pick.choice([' ', '', '  '])}{pick.choice(g['values'])}")
    if pick.choice([True, False]):
        headers.append("Connection: close")
    return (line + eol + "".join(h + eol for h in headers) + eol).encode("utf-8", "surrogateescape") + encoded


def _chunked(body: bytes, pick: Pick, *, bad: bool) -> bytes:
    out = b""
    rest = body
    while rest:
        n = min(len(rest), pick.choice([1, 7, 100, 4096]))
        size = f"{n:x}"
        if bad:
            size = pick.choice([size, "-1", "zz", f"{n + 3:x}", "ffffffffffffffffff", f"{n:x};ext=1", f" {n:x}"])
        out += size.encode() + b"\r\n" + rest[:n] + b"\r\n"
        rest = rest[n:]
    end = (
        pick.choice([b"0\r\n\r\n", b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n", b"", b"0\r\n"]) if bad else b"0\r\n\r\n"
    )
    return out + end
