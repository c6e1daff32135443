"""Mutual TLS between cluster members: SSL contexts built from a cluster CA and a host certificate,
rebuilt when the files change, without a restart.

Policy (docs/security.md, "Confidentiality"): both ends present a certificate and both verify the other's
chain against the cluster CA bundle (``tls.ca``); TLS 1.3 only.  Host names are not checked by default:
peers find each other by the URLs they announce (often bare IP addresses, chosen by the peer itself), so
a name check would prove only that the announcer picked a name its own certificate holds.  What a cluster
member needs to know is "the other end holds a key the cluster CA certified", which the chain check
gives; OpenSSL also checks the extended key usage for the role (serverAuth for a server, clientAuth for
a client) when a certificate carries one, so a host's own certificate must pass both: a handshake with
itself, in memory, checks that at start and on every reload.  ``check_hostname`` turns the name check on for deployments
that address peers by names in their certificates.

Rotation: :class:`TlsReloader` watches the three files (inode, size, mtime; at most once per
``interval_s``, on a handshake or a client request, and whenever :meth:`TlsReloader.reload` is called:
the daemon, seed and node call it on SIGHUP) and builds fresh contexts when they change.  The
server socket keeps one *front* context whose ``sni_callback`` hands each new handshake the newest
server context, the CA bundle included: ``load_verify_locations`` can only add a CA, so removing one
needs a new context.  A file that does not load (half written, wrong key, a certificate a handshake
with itself refuses in either role) keeps the old contexts and logs one line; the next change is
tried again.  No session tickets are issued, so a removed CA or certificate cannot come back through
a resumed session.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.files import InputFileError, read_file

log = logging.getLogger(__name__)

MAX_PEM_BYTES = 1 << 20  # a CA bundle of a few hundred certificates; a key or chain is a few KiB
MAX_CAS = 256
DEFAULT_INTERVAL_S = 5.0


class TlsError(PatchswarmError):
    """TLS files that cannot be used (one line naming the file and why)."""


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # PEM bundle of the cluster CA(s) peers' certificates must chain to
    cert: Path  # PEM: this host's certificate (then any intermediates)
    key: Path  # PEM: its private key, unencrypted

    def paths(self) -> tuple[Path, Path, Path]:
        return (self.ca, self.cert, self.key)


def _read(path: Path, what: str) -> bytes:
    try:
        return read_file(path, MAX_PEM_BYTES)
    except InputFileError as e:
        raise TlsError(f"{what} {e}") from None


def _check_cert(files: TlsFiles, ca_pem: bytes, cert_pem: bytes, now: dt.datetime) -> float:
    """The host certificate is current and issued by a CA of the bundle: a mistake the operator should
    hear about at start (or on a reload) rather than as every peer's refusal.  Returns when it expires
    (Unix time)."""
    try:
        cas = x509.load_pem_x509_certificates(ca_pem)
    except ValueError:
        raise TlsError(f"tls.ca {files.ca}: not a PEM certificate bundle") from None
    if len(cas) > MAX_CAS:
        raise TlsError(f"tls.ca {files.ca}: {len(cas)} certificates, more than {MAX_CAS}")
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise TlsError(f"tls.cert {files.cert}: not a PEM certificate") from None
    cert = chain[0]
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if is_ca:  # (its key would sign anything: it belongs offline, never on a host)
        raise TlsError(f"tls.cert {files.cert}: a CA certificate, not a host's (patchswarm certs issue makes one)")
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise TlsError(
            f"tls.cert {files.cert}: valid from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now"
        )
    not_after = cert.not_valid_after_utc.timestamp()
    if len(chain) > 1:
        return not_after  # (a chain with intermediates: the handshake with itself checks the path)
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return not_after
        except (InvalidSignature, ValueError, TypeError):  # another CA's certificate, or another key type
            continue
    raise TlsError(f"tls.cert {files.cert}: not issued by a CA in tls.ca {files.ca}")


def _contexts(files: TlsFiles, check_hostname: bool) -> tuple[ssl.SSLContext, ssl.SSLContext, float]:
    """(server, client) contexts from the files as they are now, and when the certificate expires;
    TlsError for any problem."""
    ca_pem = _read(files.ca, "tls.ca")
    cert_pem = _read(files.cert, "tls.cert")
    _read(files.key, "tls.key")  # (bounded and a regular file: load_cert_chain then reads it by name)
    not_after = _check_cert(files, ca_pem, cert_pem, dt.datetime.now(dt.UTC))
    out = []
    for protocol in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        if protocol == ssl.PROTOCOL_TLS_CLIENT:
            ctx.check_hostname = check_hostname
        else:
            ctx.num_tickets = 0  # no resumption: every connection is checked against the current CA
        try:
            ctx.load_verify_locations(cadata=ca_pem.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError):
            raise TlsError(f"tls.ca {files.ca}: not a PEM certificate bundle") from None
        try:
            # (an empty password: an encrypted key fails here instead of prompting on a terminal)
            ctx.load_cert_chain(files.cert, files.key, password=lambda: b"")
        except ssl.SSLError as e:
            why = e.reason or "an encrypted key, or not a PEM key"
            raise TlsError(f"tls.key {files.key}: does not load with tls.cert {files.cert} ({why})") from None
        except OSError as e:
            raise TlsError(f"tls.key {files.key}: {e.strerror or e}") from None
        out.append(ctx)
    _handshake_with_self(files, out[0], out[1])
    return out[0], out[1], not_after


def _handshake_with_self(files: TlsFiles, server: ssl.SSLContext, client: ssl.SSLContext) -> None:
    """A handshake in memory between the two contexts, so whatever OpenSSL's policy refuses (a key usage
    or extended key usage missing for a role, a broken intermediate chain) stops the start or the
    reload here, instead of every peer's connection later.  (A host plays both roles, with one
    certificate.)  The name check is left out: peers' names are not known here."""
    check_hostname, client.check_hostname = client.check_hostname, False
    try:
        to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()  # (one end's output is the other's input)
        ends = [  # (the role our certificate plays for the other end, the end)
            ("as a server", client.wrap_bio(to_client, to_server, server_side=False)),
            ("as a client", server.wrap_bio(to_server, to_client, server_side=True)),
        ]
        done = [False, False]
        for _ in range(8):  # (TLS 1.3 takes two round trips; more means something else is wrong)
            for i, (role, end) in enumerate(ends):
                if done[i]:
                    continue
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLCertVerificationError as e:
                    # (the client end refusing means the certificate fails as a server's, and back)
                    why = e.verify_message
                    raise TlsError(f"tls.cert {files.cert}: peers would refuse it {role} ({why})") from None
                except ssl.SSLError as e:
                    raise TlsError(f"tls.cert {files.cert}: a handshake with itself fails ({e.reason or e})") from None
            if all(done):
                return
        raise TlsError(f"tls.cert {files.cert}: a handshake with itself does not complete")
    finally:
        client.check_hostname = check_hostname


def _warn_if_exposed(key: Path) -> None:
    """A key every user can read is named (not refused: Kubernetes secret volumes default to 0644)."""
    try:
        mode = os.stat(key).st_mode & 0o777  # (follows symlinks: the file, not the link)
    except OSError:
        return
    if mode & 0o004:
        log.warning("tls.key %s: readable by every user (mode %o): chmod 600 it", key, mode)


def _signature(files: TlsFiles) -> tuple[tuple[int, int, int, int] | None, ...]:
    sig: list[tuple[int, int, int, int] | None] = []
    for path in files.paths():
        try:
            st = os.stat(path)  # (follows symlinks: a Kubernetes secret swaps a link)
            sig.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            sig.append(None)
    return tuple(sig)


class TlsReloader:
    """The current server and client contexts for one set of files; see the module's docstring."""

    def __init__(self, files: TlsFiles, *, check_hostname: bool = False, interval_s: float = DEFAULT_INTERVAL_S):
        self.files = files
        self.check_hostname = check_hostname
        self.interval_s = interval_s
        self._lock = threading.Lock()  # (contexts are used from the loop; a reload may come from a thread)
        self._signature = _signature(files)
        # TlsError at start: refuse to run.  not_after: when the certificate in use expires (Unix time).
        self._server, self._client, self.not_after = _contexts(files, check_hostname)
        _warn_if_exposed(files.key)
        self._failed: tuple[object, ...] | None = None
        self._checked = time.monotonic()
        self.reloads = 0
        front, _, _ = _contexts(files, check_hostname)
        front.sni_callback = self._pick
        self._front = front

    def server_context(self) -> ssl.SSLContext:
        """The context to serve with: it hands each handshake the newest server context."""
        return self._front

    def client_context(self) -> ssl.SSLContext:
        """The newest client context (one per reload: a new one opens new pooled connections)."""
        self._maybe_reload()
        return self._client

    def _pick(self, sslobj: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        try:
            self._maybe_reload()
            sslobj.context = self._server
        except Exception:  # (an exception here would end the handshake with an obscure alert)
            log.exception("TLS: picking the server context failed; serving with the previous one")

    def _maybe_reload(self) -> None:
        if time.monotonic() - self._checked >= self.interval_s:
            self.reload()

    def reload(self) -> bool:
        """Rebuild the contexts if the files changed; True when new ones are in use."""
        with self._lock:
            self._checked = time.monotonic()
            sig = _signature(self.files)
            if sig == self._signature or sig == self._failed:
                return False
            try:
                server, client, not_after = _contexts(self.files, self.check_hostname)
            except TlsError as e:
                self._failed = sig
                log.warning("TLS files changed but do not load, keeping the previous ones: %s", e)
                return False
            self._server, self._client, self._signature, self._failed = server, client, sig, None
            self.not_after = not_after
            _warn_if_exposed(self.files.key)
            self.reloads += 1
            log.info("TLS: loaded new certificate files (%s)", self.files.cert)
            return True


def require_https(url: str, what: str) -> None:
    """With TLS configured, a plain http:// URL is refused, never used (no silent fallback)."""
    from patchswarm.swarm.client_errors import shown_url

    if not url.startswith("https://"):
        raise TlsError(f"{what} {shown_url(url)}: TLS is configured, so peers and seeds must be https:// URLs")
