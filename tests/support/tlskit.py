"""A cluster PKI for TLS tests: the cluster CA, host certificates, another CA's and an expired one,
made by ``patchswarm certs``' own functions (daemon/certs.py); and clients that report what they got."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from cryptography import x509

from patchswarm.daemon.certs import CA_CERT, issue, make_ca
from patchswarm.swarm.tls import TlsFiles, TlsReloader


@dataclass
class Pki:
    root: Path

    def __post_init__(self) -> None:
        make_ca(self.root / "ca")
        make_ca(self.root / "other")
        for name in ("h1", "h2", "h3", "client"):
            issue(self.root / "ca", self.root, name, ips=["127.0.0.1"], dns_names=["localhost"])
        issue(self.root / "other", self.root, "foreign", ips=["127.0.0.1"])
        now = dt.datetime.now(dt.UTC)
        issue(
            self.root / "ca",
            self.root,
            "expired",
            ips=["127.0.0.1"],
            not_before=now - dt.timedelta(days=10),
            not_after=now - dt.timedelta(days=1),
        )

    @property
    def ca(self) -> Path:
        return self.root / "ca" / CA_CERT

    def files(self, name: str, ca: Path | None = None) -> TlsFiles:
        return TlsFiles(ca or self.ca, self.root / f"{name}.pem", self.root / f"{name}.key")

    def reloader(self, name: str, interval_s: float = 0.05) -> TlsReloader:
        return TlsReloader(self.files(name), interval_s=interval_s)

    def client(self, name: str | None, ca: Path | None = None) -> ssl.SSLContext:
        return client_context(self.root, name, ca or self.ca)


def client_context(root: Path, name: str | None, ca: Path) -> ssl.SSLContext:
    """A client context trusting ``ca``, presenting ``root/name.pem`` (None: no certificate).  Built
    directly, not through swarm/tls.py, so an expired certificate can still be presented."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=ca)
    if name is not None:
        ctx.load_cert_chain(root / f"{name}.pem", root / f"{name}.key")
    return ctx


def serial_of(pem: Path) -> int:
    return x509.load_pem_x509_certificate(pem.read_bytes()).serial_number


async def server_serial(port: int, ctx: ssl.SSLContext) -> int:
    """The serial of the certificate the server on ``port`` presents to a new handshake."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()


async def raw_exchange(port: int, ctx: ssl.SSLContext | None, request: bytes) -> bytes:
    """Every byte a client gets back for ``request`` (sent over TLS with ``ctx``, or plain), until the
    server closes or refuses: a refused client must get no HTTP status line, no body.  (A blocking
    socket in a thread: whatever the server sends, with no client library in between.)"""
    return await asyncio.to_thread(_raw_exchange, port, ctx, request)


def _raw_exchange(port: int, ctx: ssl.SSLContext | None, request: bytes) -> bytes:
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        sock: socket.socket = raw
        try:
            if ctx is not None:
                sock = ctx.wrap_socket(raw)
            sock.sendall(request)
            while piece := sock.recv(65536):
                got += piece
        except (ssl.SSLError, ConnectionError, TimeoutError):
            pass
        finally:
            sock.close()
    return got


async def get_status(url: str, ctx: ssl.SSLContext) -> tuple[int, bytes] | str:
    """(status, body) of a GET, or the client error's class name when no response came at all."""
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.get(url, ssl=ctx, timeout=aiohttp.ClientTimeout(total=20)) as r,
        ):
            return r.status, await r.read()
    except aiohttp.ClientError as e:
        return type(e).__name__
