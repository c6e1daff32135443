"""Mutual TLS between peers on real loopback sockets: a swarm converges with cluster certificates; a
client without one, with another CA's or with an expired one learns nothing; rotation without restart."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization

from patchswarm.daemon.certs import CA_CERT, issue, make_ca
from patchswarm.protocol.keys import TrustedKeys
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.swarm.board_sources import HttpSource
from patchswarm.swarm.http import HttpTransport
from patchswarm.swarm.server import start_http_node
from patchswarm.swarm.serving import ServerLimits, serve_tcp
from patchswarm.swarm.tls import TlsError, TlsFiles, TlsReloader
from patchswarm.swarm.transport import TransportError
from tests.support.swarmkit import RUN, SECRET, Swarm
from tests.support.tlskit import Pki, get_status, raw_exchange, serial_of, server_serial

REFUSED = ("none", "foreign", "expired")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def chunk_of(s: Swarm) -> tuple[str, bytes]:
    path = next(p for p in sorted((s.tmp / "board" / "chunks").rglob("*")) if p.is_file())
    return path.name, path.read_bytes()


@pytest.mark.asyncio
async def test_peers_with_cluster_certificates_converge_and_others_learn_nothing(pki: Pki, tmp_path: Path) -> None:
    s = Swarm(tmp_path)
    names = iter(["h1", "h2", "h3"])
    s.tls_for = lambda _name: pki.reloader(next(names))
    s.publish()
    await s.start_seed()
    try:
        await s.start_node("a")
        await s.start_node("b")
        await s.wait_all(1)
        s.assert_bitwise()
        v = s.publish(scale=3e-4)
        await s.wait_all(v)
        s.assert_bitwise()
        assert s.seed is not None and s.seed.url.startswith("https://")
        assert all(r.url.startswith("https://") for r in s.nodes.values())
        # Whatever a peer holds: a chunk on the seed's swarm endpoint and on its board, and a node's chunk.
        name, data = chunk_of(s)
        urls = [
            f"{s.seed.url}/chunks/{name}",  # the seed's board (served beside its swarm endpoints)
            f"{s.seed.url}/swarm/v1/chunks/{name}",
            f"{s.nodes['a'].url}/swarm/v1/chunks/{name}",
        ]
        for url in urls:
            got = await get_status(url, pki.client("client"))
            assert isinstance(got, tuple) and got[0] in (200, 404, 503), (url, got)
        ok = await get_status(urls[0], pki.client("client"))
        assert ok == (200, data)
        port = int(s.seed.url.rsplit(":", 1)[1])
        request = f"GET /chunks/{name} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        assert (await raw_exchange(port, pki.client("client"), request)).startswith(b"HTTP/1.1 200")
        for who in REFUSED:
            for url in urls:
                got = await get_status(url, pki.client(None if who == "none" else who))
                assert isinstance(got, str), (who, url, got)  # a connection error: no status, no body
            leaked = await raw_exchange(port, pki.client(None if who == "none" else who), request)
            assert b"HTTP" not in leaked and data[:64] not in leaked, who
        assert b"HTTP/1.1 200" not in await raw_exchange(port, None, request)  # plain HTTP to the TLS port
    finally:
        await s.close()


@pytest.mark.asyncio
async def test_a_tls_client_refuses_plain_http_peers_and_seeds(pki: Pki) -> None:
    transport = HttpTransport(tls=pki.reloader("h1"))
    try:
        with pytest.raises(TransportError, match="https://"):
            await transport.get_chunk("http://127.0.0.1:9", b"\0" * 32, 10, 1.0, "me")
        with pytest.raises(TransportError, match="https://"):
            await transport.send("http://127.0.0.1:9", b"x")
    finally:
        await transport.close()
    with pytest.raises(TlsError, match="https://"):
        HttpSource("http://127.0.0.1:9/board", tls=pki.reloader("h1"))
    for urls in ({"bootstrap": ["http://127.0.0.1:9"]}, {"seed_urls": ["https://a:1", "http://127.0.0.1:9"]}):
        config = NodeConfig("x", RUN, SECRET, **urls)  # type: ignore[arg-type]
        with pytest.raises(TlsError, match=r"^bootstrap or seed URL http://127\.0\.0\.1:9: TLS is configured"):
            await start_http_node(config, TrustedKeys(frozenset()), tls=pki.reloader("h1"))
    with pytest.raises(TlsError, match=r"^advertised URL"):
        config = NodeConfig("x", RUN, SECRET)
        await start_http_node(config, TrustedKeys(frozenset()), advertise="http://h:1", tls=pki.reloader("h1"))


@pytest.mark.asyncio
async def test_a_tls_node_reads_a_board_in_an_object_store(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    """An s3:// board is read through the SDK over the provider's own HTTPS: with the cluster's TLS on,
    it was refused as "plain HTTP" (config and node start), so a TLS fleet could not use a store board."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "example")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    config = NodeConfig("x", RUN, SECRET, seed_urls=["s3://my-board/prefix"])
    running = await start_http_node(config, TrustedKeys(frozenset()), host="127.0.0.1", port=0, tls=pki.reloader("h1"))
    await running.stop()


def test_files_that_do_not_load_give_one_line(pki: Pki, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a certificate\n")
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo)
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key((pki.root / "h1.key").read_bytes(), None)
    pem = serialization.BestAvailableEncryption(b"secret")
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, pem))
    cases = [
        (TlsFiles(pki.ca, tmp_path / "missing.pem", pki.root / "h1.key"), "missing.pem"),
        (TlsFiles(junk, pki.root / "h1.pem", pki.root / "h1.key"), "tls.ca"),
        (TlsFiles(pki.ca, junk, pki.root / "h1.key"), "tls.cert"),
        (TlsFiles(pki.ca, pki.root / "h1.pem", pki.root / "h2.key"), "tls.key"),  # another host's key
        (TlsFiles(pki.ca, pki.root / "h1.pem", encrypted), "encrypted"),  # (never a password prompt)
        (TlsFiles(pki.ca, pki.root / "h1.pem", fifo), "not a regular file"),  # (never a wait)
        (TlsFiles(pki.ca, pki.root / "foreign.pem", pki.root / "foreign.key"), "not issued by a CA"),
        (TlsFiles(pki.ca, pki.root / "expired.pem", pki.root / "expired.key"), "not now"),
    ]
    for files, expect in cases:
        with pytest.raises(TlsError, match=expect) as e:
            TlsReloader(files)
        assert "\n" not in str(e.value)


def _install(src: Path, dst: Path) -> None:
    """Replace ``dst`` as an operator's tooling would: written aside, renamed over."""
    tmp = dst.with_name(dst.name + ".new")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


async def _until(check: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.asyncio
async def test_rotation_without_restart(pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The server's files live in their own folder, replaced there as a rotation would.
    live = tmp_path / "live"
    live.mkdir()
    files = TlsFiles(live / "ca.pem", live / "host.pem", live / "host.key")
    _install(pki.ca, files.ca)
    _install(pki.root / "h1.pem", files.cert)
    _install(pki.root / "h1.key", files.key)
    reloader = TlsReloader(files, interval_s=0.05)

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="member")

    app = web.Application()
    app.router.add_get("/", hello)
    runner, port = await serve_tcp(app, "127.0.0.1", 0, ssl_context=reloader.server_context())
    url = f"https://127.0.0.1:{port}/"
    try:
        trusting_old = pki.client("client")
        assert await server_serial(port, trusting_old) == serial_of(pki.root / "h1.pem")
        # 1. A new certificate: new handshakes see its serial.
        _install(pki.root / "h3.pem", files.cert)
        _install(pki.root / "h3.key", files.key)
        h3 = serial_of(pki.root / "h3.pem")

        async def sees_h3() -> bool:
            return await server_serial(port, trusting_old) == h3

        await _until(sees_h3, "the new certificate")
        # 2. A broken file keeps the previous contexts, with one line.
        caplog.set_level(logging.WARNING, logger="patchswarm.swarm.tls")
        files.cert.write_bytes(b"-----BEGIN CERTIFICATE-----\ngarbage\n")
        for _ in range(5):
            await asyncio.sleep(0.06)
            assert await server_serial(port, trusting_old) == h3
        assert len([r for r in caplog.records if "keeping the previous" in r.getMessage()]) == 1
        # 3. CA rotation: trust both CAs, serve a certificate of the new one; then drop the old CA.
        make_ca(tmp_path / "ca2")
        issue(tmp_path / "ca2", tmp_path, "srv2", ips=["127.0.0.1"])
        issue(tmp_path / "ca2", tmp_path, "cli2", ips=["127.0.0.1"])
        both = tmp_path / "both.pem"
        both.write_bytes(pki.ca.read_bytes() + (tmp_path / "ca2" / CA_CERT).read_bytes())
        _install(both, files.ca)
        _install(tmp_path / "srv2.pem", files.cert)
        _install(tmp_path / "srv2.key", files.key)
        new_client = pki.client(None, ca=both)
        new_client.load_cert_chain(tmp_path / "cli2.pem", tmp_path / "cli2.key")
        old_client = pki.client("client", ca=both)

        async def serves_srv2() -> bool:
            return await server_serial(port, new_client) == serial_of(tmp_path / "srv2.pem")

        await _until(serves_srv2, "the new CA's certificate")
        assert await get_status(url, old_client) == (200, b"member")
        assert await get_status(url, new_client) == (200, b"member")
        _install(tmp_path / "ca2" / CA_CERT, files.ca)

        async def old_ca_refused() -> bool:
            return isinstance(await get_status(url, old_client), str)

        await _until(old_ca_refused, "the removed CA to be refused")
        assert await get_status(url, new_client) == (200, b"member")
        assert reloader.reloads >= 3
    finally:
        await runner.cleanup()


def _server_only_cert(pki: Pki, out: Path, name: str = "server-only", role: str = "server") -> None:
    """A certificate of the cluster CA whose extended key usage is serverAuth (or clientAuth) only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key((pki.root / "ca" / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = ca.not_valid_before_utc
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if role == "server" else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]  # (an EC key: cryptography's union)
    )
    (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = serialization.NoEncryption()
    (out / f"{name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, pem)
    )


@pytest.mark.asyncio
async def test_a_certificate_for_servers_only_is_refused_as_a_client(pki: Pki, tmp_path: Path) -> None:
    # The check policy (docs/security.md): the cluster CA, plus the extended key usage for the role.
    _server_only_cert(pki, tmp_path)

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="member")

    app = web.Application()
    app.router.add_get("/", hello)
    runner, port = await serve_tcp(app, "127.0.0.1", 0, ssl_context=pki.reloader("h1").server_context())
    try:
        url = f"https://127.0.0.1:{port}/"
        assert await get_status(url, pki.client("client")) == (200, b"member")
        server_only = pki.client(None)
        server_only.load_cert_chain(tmp_path / "server-only.pem", tmp_path / "server-only.key")
        assert isinstance(await get_status(url, server_only), str)
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_a_handshake_that_never_comes_is_cut_at_the_header_deadline(pki: Pki) -> None:
    # A client that connects and sends nothing holds a socket until the handshake deadline, which is
    # the header deadline (1 s here), not asyncio's 60 s.
    limits = ServerLimits(header_timeout_s=1.0)
    runner, port = await serve_tcp(web.Application(), "127.0.0.1", 0, limits, pki.reloader("h1").server_context())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            got = await asyncio.wait_for(reader.read(), timeout=30)  # the server closes: EOF
        except ConnectionResetError:
            got = b""
        finally:
            writer.close()
        assert got == b""
        assert await get_status(f"https://127.0.0.1:{port}/", pki.client("client")) == (404, b"404: Not Found")
    finally:
        await runner.cleanup()


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    """The server closed this connection (EOF or reset) well before any deadline of the test's limits."""
    try:
        return await asyncio.wait_for(reader.read(), timeout=30) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "limits",
    [
        ServerLimits(max_connections=4, header_timeout_s=300.0),
        ServerLimits(max_connections_per_address=4, exempt_loopback=False, header_timeout_s=300.0),
    ],
    ids=["cap", "per-address-cap"],
)
async def test_handshakes_in_progress_count_against_the_connection_caps(pki: Pki, limits: ServerLimits) -> None:
    # Connections that never finish their handshake hold a socket each: they count against the caps as
    # plain connections do, so one past a cap is closed at once (not after the handshake deadline),
    # and once they go the server serves a cluster client again.
    runner, port = await serve_tcp(web.Application(), "127.0.0.1", 0, limits, pki.reloader("h1").server_context())
    hogs = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            assert await _closed_by_server(reader)
        finally:
            writer.close()
        for _, w in hogs:
            w.close()
            await w.wait_closed()
        for _ in range(100):  # (the server sees the hogs' FINs asynchronously)
            if await get_status(f"https://127.0.0.1:{port}/", pki.client("client")) == (404, b"404: Not Found"):
                break
            await asyncio.sleep(0.1)
        assert await get_status(f"https://127.0.0.1:{port}/", pki.client("client")) == (404, b"404: Not Found")
    finally:
        for _, w in hogs:
            w.close()
        await runner.cleanup()


def test_a_host_certificate_peers_would_refuse_stops_the_start(pki: Pki, tmp_path: Path) -> None:
    # Every host both serves peers and fetches from them: a certificate OpenSSL refuses in either role
    # (a serverAuth-only or clientAuth-only one, the CA's own) would start, then fail every exchange.
    _server_only_cert(pki, tmp_path)
    _server_only_cert(pki, tmp_path, "client-only", role="client")
    cases = [
        (TlsFiles(pki.ca, tmp_path / "server-only.pem", tmp_path / "server-only.key"), "as a client"),
        (TlsFiles(pki.ca, tmp_path / "client-only.pem", tmp_path / "client-only.key"), "as a server"),
        (TlsFiles(pki.ca, pki.ca, pki.root / "ca" / "ca.key"), "a CA certificate"),
    ]
    for files, expect in cases:
        with pytest.raises(TlsError, match=f"tls.cert {files.cert}: .*{expect}") as e:
            TlsReloader(files)
        assert "\n" not in str(e.value)
    TlsReloader(pki.files("h1"))  # (the check passes what `patchswarm certs` issues)


def test_a_key_other_users_can_read_is_warned_about(pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Not refused (a Kubernetes secret volume's files are 0644 unless defaultMode says otherwise), but
    # named, once per load; 0640 (a group such as ssl-cert) is an operator's choice, left alone.
    for mode, warned in ((0o644, True), (0o640, False), (0o600, False)):
        key = tmp_path / f"h1-{mode:o}.key"
        shutil.copyfile(pki.root / "h1.key", key)
        key.chmod(mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="patchswarm.swarm.tls"):
            TlsReloader(TlsFiles(pki.ca, pki.root / "h1.pem", key))
        lines = [r.getMessage() for r in caplog.records if "readable" in r.getMessage()]
        assert lines == ([f"tls.key {key}: readable by every user (mode {mode:o}): chmod 600 it"] if warned else [])


@pytest.mark.asyncio
async def test_a_refused_handshake_is_one_line_for_the_operator(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    # A peer whose certificate is refused hears why on its side; the server's operator gets one line
    # too (which address, why), rate-limited like the server's other lines about clients.
    runner, port = await serve_tcp(web.Application(), "127.0.0.1", 0, ssl_context=pki.reloader("h1").server_context())
    try:
        with caplog.at_level(logging.INFO, logger="patchswarm.swarm.serving"):
            assert isinstance(await get_status(f"https://127.0.0.1:{port}/", pki.client("foreign")), str)
            await _until(lambda: _async_true(any("TLS" in r.getMessage() for r in caplog.records)), "a log line")
        [line] = [r.getMessage() for r in caplog.records if "TLS" in r.getMessage()]
        assert line.startswith("TLS handshake from 127.0.0.1 refused:") and "certificate" in line, line
        assert "\n" not in line
    finally:
        await runner.cleanup()


async def _async_true(value: bool) -> bool:
    return value


def test_the_certificate_in_use_says_when_it_expires(pki: Pki, tmp_path: Path) -> None:
    # (the daemon exports it: patchswarm_tls_cert_expiry_timestamp_seconds, for an alert before peers refuse)
    from cryptography import x509

    def not_after(pem: Path) -> float:
        return x509.load_pem_x509_certificate(pem.read_bytes()).not_valid_after_utc.timestamp()

    for ext in ("pem", "key"):
        shutil.copyfile(pki.root / f"h1.{ext}", tmp_path / f"host.{ext}")
    tls = TlsReloader(TlsFiles(pki.ca, tmp_path / "host.pem", tmp_path / "host.key"))
    assert tls.not_after == not_after(pki.root / "h1.pem")
    issue(pki.root / "ca", tmp_path / "short", "host", days=3)
    for ext in ("key", "pem"):
        _install(tmp_path / "short" / f"host.{ext}", tmp_path / f"host.{ext}")
    assert tls.reload()
    assert tls.not_after == not_after(tmp_path / "short" / "host.pem") < not_after(pki.root / "h1.pem")
