"""Mutual TLS across real processes: `patchswarm certs` makes the cluster's certificates, a seed and
nodes started with --tls-* converge over https, and a client without a cluster certificate learns
nothing from the seed; a plain board seed (`patchswarm seed` without --run) over TLS too."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509

from patchswarm.daemon.certs import issue
from tests.support.boards import free_port
from tests.support.cli_procs import Proc
from tests.support.daemonkit import make_daemon
from tests.support.swarmkit import RUN, SECRET, Swarm
from tests.support.tlskit import Pki, client_context, get_status, raw_exchange, serial_of, server_serial


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def tls_args(ca: Path, root: Path, name: str) -> list[str]:
    return ["--tls-ca", str(ca), "--tls-cert", str(root / f"{name}.pem"), "--tls-key", str(root / f"{name}.key")]


def add_refused_clients(d: Path) -> None:
    """Another CA and its host, and an expired certificate of the cluster CA, next to what `certs` wrote."""
    assert cli("certs", "ca", "--out", str(d / "other"), cwd=d).returncode == 0
    issue(d / "other", d, "foreign", ips=["127.0.0.1"])
    now = dt.datetime.now(dt.UTC)
    issue(d / "ca", d, "expired", not_before=now - dt.timedelta(days=3), not_after=now - dt.timedelta(days=1))


@pytest.mark.slow
def test_seed_and_nodes_converge_over_mutual_tls(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    assert cli("certs", "ca", "--out", str(d / "ca"), cwd=tmp_path).returncode == 0
    for name in ("seed", "p0", "p1", "client"):
        r = cli(
            "certs", "issue", "--ca", str(d / "ca"), "--name", name, "--ip", "127.0.0.1", "--out", str(d), cwd=tmp_path
        )
        assert r.returncode == 0, r.stderr
    add_refused_clients(d)
    ca = d / "ca" / "ca.pem"
    s = Swarm(tmp_path)
    s.publish()
    (tmp_path / "secret").write_bytes(SECRET)
    s.root.save(tmp_path / "root.key")
    common = ["--run", RUN, "--secret-file", "secret"]
    seed = Proc(
        ["seed", "--board", str(s.board.root), "--listen", f"127.0.0.1:{free_port()}", "--name", "seed", *common]
        + tls_args(ca, d, "seed"),
        tmp_path,
    )
    procs: list[Proc] = []
    try:
        seed_url = str(seed.wait_event("listening", 60)["url"])
        assert seed_url.startswith("https://")
        for i in range(2):
            procs.append(
                Proc(
                    ["node", "--listen", f"127.0.0.1:{free_port()}", "--name", f"p{i}", "--trust", "root.key.pub"]
                    + ["--bootstrap", seed_url, "--seed-url", seed_url, "--print-root", *common]
                    + tls_args(ca, d, f"p{i}"),
                    tmp_path,
                )
            )
        for v in (1, 2):
            if v > 1:
                s.publish(scale=5e-4)
            for p in procs:
                assert p.wait_version(v, 90) == s.served[v].root().hex()
        chunk = next(p for p in sorted((s.board.root / "chunks").iterdir()) if p.is_file())
        url = f"{seed_url}/chunks/{chunk.name}"
        assert asyncio.run(get_status(url, client_context(d, "client", ca))) == (200, chunk.read_bytes())
        port = int(seed_url.rsplit(":", 1)[1])
        request = f"GET /chunks/{chunk.name} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        for who in (None, "foreign", "expired"):
            ctx = client_context(d, who, ca)
            assert isinstance(asyncio.run(get_status(url, ctx)), str), who
            leaked = asyncio.run(raw_exchange(port, ctx, request))
            assert b"HTTP" not in leaked and chunk.read_bytes()[:64] not in leaked, who
        # `patchswarm pull` from the seed's board: with the host's certificate, and refused without one.
        pull = ["pull", "--from", seed_url, "--run", RUN, "--trust", "root.key.pub", "--to", "pulled.safetensors"]
        r = cli(*pull, *tls_args(ca, d, "client"), cwd=tmp_path)
        assert r.returncode == 0 and "version 2" in r.stdout + r.stderr, r.stderr
        r = cli(*pull[:-1], "plain.safetensors", cwd=tmp_path)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and not (tmp_path / "plain.safetensors").exists()
    finally:
        rcs = [p.stop() for p in procs] + [seed.stop()]
    assert rcs == [0] * 3


def test_plain_board_seed_over_tls_and_half_flags_refused(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    pki = Pki(d)
    board = tmp_path / "board"
    (board / "chunks").mkdir(parents=True)
    (board / "chunks" / ("ab" * 32)).write_bytes(b"weights only members may read")
    r = cli("seed", "--board", str(board), "--tls-ca", str(pki.ca), cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--tls-cert and --tls-key together" in r.stderr
    r = cli("node", "--listen", "127.0.0.1:0", "--run", RUN, "--trust", "x.pub", "--tls-ca", str(pki.ca), cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "patchswarm.daemon.cli", "seed", "--board", str(board)]
        + ["--listen", f"127.0.0.1:{port}", *tls_args(pki.ca, pki.root, "h1")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        assert line.startswith("serving board") and "https://" in line, line
        url = f"https://127.0.0.1:{port}/chunks/{'ab' * 32}"
        deadline = time.monotonic() + 30
        got = asyncio.run(get_status(url, pki.client("client")))
        while not isinstance(got, tuple) and time.monotonic() < deadline:
            got = asyncio.run(get_status(url, pki.client("client")))
        assert got == (200, b"weights only members may read")  # (TLS: no sendfile, the fallback path)
        for who in (None, "foreign", "expired"):
            assert isinstance(asyncio.run(get_status(url, pki.client(who))), str), who
        # SIGHUP reloads the certificate files (as on the daemon and `seed --run`); it never ends the seed.
        for ext in ("key", "pem"):
            (pki.root / f"new.{ext}").write_bytes((pki.root / f"h3.{ext}").read_bytes())
            os.replace(pki.root / f"new.{ext}", pki.root / f"h1.{ext}")
        p.send_signal(signal.SIGHUP)
        while asyncio.run(_serial_or_none(port, pki)) != serial_of(pki.root / "h3.pem"):
            assert p.poll() is None, f"SIGHUP ended the seed: {p.stderr.read()}"
            assert time.monotonic() < deadline + 30, "SIGHUP did not bring in the new certificate"
            time.sleep(0.2)
    finally:
        p.terminate()
        p.wait(timeout=20)
        if p.stderr:
            p.stderr.close()


async def _serial_or_none(port: int, pki: Pki) -> int | None:
    try:
        return await server_serial(port, pki.client("client"))
    except OSError:
        return None


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_daemon_with_tls_enabled_follows_a_tls_seed_and_guards_its_metrics(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    sw = Swarm(tmp_path)
    sw.tls_for = lambda _name: pki.reloader("h1")
    sw.publish()
    await sw.start_seed()
    port = free_port()
    files = f'ca = "{pki.ca}"\ncert = "{pki.root / "h2.pem"}"\nkey = "{pki.root / "h2.key"}"\n'
    extra = f'[metrics]\nlisten = "127.0.0.1:{port}"\n[tls]\nenabled = true\nreload_interval = "1h"\n{files}'
    d = make_daemon(sw, "d1", tmp_path, extra=extra)
    d.start()
    try:
        await d.wait_version(1)
        await d.wait_version(sw.publish(scale=5e-4))
        url = f"https://127.0.0.1:{port}/metrics"
        got = await get_status(url, pki.client("client"))
        assert isinstance(got, tuple) and got[0] == 200 and b"patchswarm_version_applied 2.0" in got[1]
        expiry = x509.load_pem_x509_certificate((pki.root / "h2.pem").read_bytes()).not_valid_after_utc.timestamp()
        [line] = [x for x in got[1].decode().splitlines() if x.startswith("patchswarm_tls_cert_expiry_timestamp")]
        assert line.startswith(f'patchswarm_tls_cert_expiry_timestamp_seconds{{file="{pki.root / "h2.pem"}"}}')
        assert float(line.split()[-1]) == expiry
        for who in (None, "foreign", "expired"):
            assert isinstance(await get_status(url, pki.client(who)), str), who
        # Rotation on SIGHUP (the interval is an hour): new handshakes see the new certificate.
        assert await server_serial(port, pki.client("client")) == serial_of(pki.root / "h2.pem")
        for ext in ("key", "pem"):
            (pki.root / f"new.{ext}").write_bytes((pki.root / f"h3.{ext}").read_bytes())
            os.replace(pki.root / f"new.{ext}", pki.root / f"h2.{ext}")
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while await server_serial(port, pki.client("client")) != serial_of(pki.root / "h3.pem"):
            assert time.monotonic() < deadline, "SIGHUP did not bring in the new certificate"
            await asyncio.sleep(0.2)
        assert d.alive
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()
    # A plain seed URL with tls.enabled: the daemon refuses to start, in one line naming the key.
    bad = make_daemon(sw, "d2", tmp_path, extra=f"[tls]\nenabled = true\n{files}")
    text = bad.config.read_text().replace("https://", "http://")
    bad.config.write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", "daemon", "--config", str(bad.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "swarm.bootstrap" in r.stderr and "plain HTTP" in r.stderr, r.stderr
    # A certificate of another CA: the daemon refuses to start, in one line naming tls.cert.
    foreign = files.replace("h2.pem", "foreign.pem").replace("h2.key", "foreign.key")
    worse = make_daemon(sw, "d3", tmp_path, extra=f"[tls]\nenabled = true\n{foreign}")
    r = subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", "daemon", "--config", str(worse.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "tls.cert" in r.stderr and "not issued by a CA" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
