"""Failed requests read as one plain line: no `ssl:default`, no `Connect call failed (...)`."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
import pytest

from patchswarm.daemon.status_cli import StatusError, fetch_status
from patchswarm.swarm.board_sources import HttpSource, SourceError
from patchswarm.swarm.client_errors import describe

pytestmark = pytest.mark.asyncio


def closed_port(family: int = socket.AF_INET, host: str = "127.0.0.1") -> int:
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])  # nothing listens there once closed


async def failure(url: str, connector: aiohttp.BaseConnector | None = None) -> aiohttp.ClientError:
    async with aiohttp.ClientSession(connector=connector) as s:
        try:
            async with s.get(url, timeout=aiohttp.ClientTimeout(total=10)):
                pass
        except aiohttp.ClientError as e:
            return e
    raise AssertionError("the request succeeded")


async def test_connection_refused() -> None:
    port = closed_port()
    e = await failure(f"http://127.0.0.1:{port}/")
    assert describe(e) == f"cannot connect to 127.0.0.1:{port}: connection refused"


async def test_connection_refused_ipv6() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    port = closed_port(socket.AF_INET6, "::1")
    assert describe(await failure(f"http://[::1]:{port}/")) == f"cannot connect to [::1]:{port}: connection refused"


async def test_unknown_host() -> None:
    e = await failure("http://no-such-host.invalid:8701/")
    assert describe(e) == "cannot connect to no-such-host.invalid:8701: unknown host"


async def test_missing_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "api.sock"
    e = await failure("http://d/v1/status", aiohttp.UnixConnector(path=str(path)))
    assert describe(e) == f"cannot connect to {path}: no such socket"


async def test_board_source_and_status_lines_carry_no_library_noise(tmp_path: Path) -> None:
    port = closed_port()
    src = HttpSource(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(SourceError) as info:
            await src.get("runs/r/head", 1024)
    finally:
        await src.close()
    where = f"127.0.0.1:{port}"
    assert str(info.value) == f"GET http://{where}/runs/r/head: cannot connect to {where}: connection refused"
    with pytest.raises(StatusError) as st:
        await fetch_status(str(tmp_path / "api.sock"))
    assert str(st.value) == f"cannot reach the daemon at {tmp_path / 'api.sock'}: no such socket"


async def test_a_board_url_s_credentials_never_reach_its_error_line() -> None:
    """A board behind basic auth (``https://user:secret@host/board``) failed with its URL in the line
    that nodes log at every distinct failure: the secret with it."""
    secret = "s3cr3t+t0ken"
    src = HttpSource(f"http://reader:{secret}@127.0.0.1:{closed_port()}/board")
    try:
        with pytest.raises(SourceError) as e:
            await src.get("runs/r/head", 1024)
    finally:
        await src.close()
    line = str(e.value)
    assert (
        line.startswith("GET http://***@127.0.0.1:") and "/board/runs/r/head: cannot connect to 127.0.0.1:" in line
    ), line
    assert secret not in line and "reader" not in line, line
