"""Listen addresses: IPv6 in brackets everywhere, and a failure to bind names the config key or flag."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.daemon.cli import build_parser
from patchswarm.daemon.config import split_listen, url_host
from patchswarm.daemon.swarm_cli import _config
from tests.support.daemonkit import ROOT, Daemon, make_daemon
from tests.support.swarmkit import SECRET, Swarm

HAS_IPV6 = socket.has_ipv6 and os.path.exists("/proc/net/if_inet6")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:8701", ("127.0.0.1", 8701)),
        (":8701", ("0.0.0.0", 8701)),
        ("[::1]:7000", ("::1", 7000)),
        ("[::]:0", ("::", 0)),
        ("seed.internal:80", ("seed.internal", 80)),
    ],
)
def test_listen_addresses_parse(text: str, want: tuple[str, int]) -> None:
    assert split_listen(text) == want


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("::1:7000", r"an IPv6 host goes in brackets \(\[::1\]:7000\)"),
        ("[nope]:7000", "expected an IPv6 address in brackets"),
        ("127.0.0.1:65536", "expected HOST:PORT"),
        ("127.0.0.1", "expected HOST:PORT"),
        ("a b:1", "expected HOST:PORT with a host name"),
    ],
)
def test_bad_listen_addresses_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        split_listen(text)


@given(st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)), st.integers(0, 65535))
def test_every_address_round_trips(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> None:
    assert split_listen(f"{url_host(str(addr))}:{port}") == (str(addr), port)


@given(st.text(max_size=64))
def test_any_text_parses_or_is_refused_with_a_value_error(text: str) -> None:
    try:
        host, port = split_listen(text)
    except ValueError:
        return
    assert 0 <= port < 65536 and host


def test_upload_rate_zero_means_unlimited_as_in_the_config_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def node_args(*extra: str) -> list[str]:
        return ["node", "--listen", "127.0.0.1:0", "--run", "r", "--trust", "t.pub", *extra]

    args = build_parser().parse_args(node_args("--upload-rate", "0", "--download-rate", "100MB"))
    assert args.upload_rate == math.inf and args.download_rate == 100e6
    monkeypatch.setenv("PATCHSWARM_CLUSTER_SECRET", SECRET.decode())
    cfg = _config(args, is_seed=False, listen=args.listen)
    assert cfg.upload_rate == math.inf
    assert build_parser().parse_args(node_args()).upload_rate == math.inf  # the default


def run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("rate", ["-5", "-1MB", "fast", "nan", "inf", "1e400"])
def test_a_bad_upload_rate_is_refused_naming_the_flag(rate: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["node", "--listen", ":0", "--run", "r", "--trust", "t", f"--upload-rate={rate}"])
    assert e.value.code == 2
    assert "argument --upload-rate: expected a rate like '100MB'" in capsys.readouterr().err


def test_a_negative_upload_rate_is_one_line_and_status_2_from_the_cli() -> None:
    r = run_cli("node", "--listen", "127.0.0.1:0", "--run", "r", "--trust", "t.pub", "--upload-rate=-5")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        "patchswarm node: error: argument --upload-rate: expected a rate like '100MB' (bytes per second), got '-5' "
        "(see patchswarm node --help)"
    )


def test_node_on_a_taken_port_names_the_flag(tmp_path: Path) -> None:
    Swarm(tmp_path).root.save(tmp_path / "root.key")
    (tmp_path / "secret").write_bytes(SECRET)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_cli(
            "node", "--listen", f"127.0.0.1:{port}", "--run", "r", "--trust", str(tmp_path / "root.key.pub"),
            "--secret-file", str(tmp_path / "secret"),
        )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert f"--listen = 127.0.0.1:{port}: address already in use" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_board_seed_on_a_taken_port_names_the_flag(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_cli("seed", "--board", str(tmp_path), "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == f"patchswarm seed: error: --listen = 127.0.0.1:{port}: address already in use"


def test_status_of_a_daemon_that_is_not_there_is_one_plain_line(tmp_path: Path) -> None:
    sock = tmp_path / "api.sock"
    r = run_cli("status", "--socket", str(sock))
    assert r.returncode == 1
    assert r.stderr.strip() == f"patchswarm status: error: cannot reach the daemon at {sock}: no such socket"


async def exits_with(d: Daemon, line: str) -> None:
    assert d.proc is not None
    rc = await asyncio.to_thread(d.proc.wait, 60)
    log = d.log.read_text()
    assert rc == 1, log
    assert line in log, log
    assert "Traceback" not in log


@pytest.mark.asyncio
@pytest.mark.parametrize("key", ["node.listen", "sidecar.listen"])
async def test_a_daemon_on_a_taken_port_names_the_key(tmp_path: Path, key: str) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        if key == "node.listen":
            d = make_daemon(sw, "d1", tmp_path, listen=f'"{addr}"')
        else:
            d = make_daemon(sw, "d1", tmp_path, extra=f'[sidecar]\nenabled = true\nlisten = "{addr}"\n')
        d.start()
        try:
            await exits_with(d, f"{key} = {addr}: address already in use")
        finally:
            d.cleanup()
            await sw.close()


@pytest.mark.asyncio
@pytest.mark.skipif(not HAS_IPV6, reason="no IPv6 on this host")
async def test_a_daemon_listens_on_ipv6_loopback(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        mport = probe.getsockname()[1]
    d = make_daemon(sw, "d1", tmp_path, listen='"[::1]:0"', extra=f'[metrics]\nlisten = "[::1]:{mport}"\n')
    d.start()
    try:
        await d.wait_version(1)
        async with aiohttp.ClientSession() as s, s.get(f"http://[::1]:{mport}/metrics") as r:
            assert r.status == 200 and "patchswarm_version_applied 1.0" in await r.text()
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()
