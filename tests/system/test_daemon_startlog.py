"""The daemon says where it listens, what store it serves from and what version it holds when it
starts, and why it stopped and what it held when it stops: one log line each, with fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.boards import free_port
from tests.support.daemonkit import Daemon, make_daemon
from tests.support.swarmkit import Swarm


def lines(d: Daemon, prefix: str) -> list[dict[str, Any]]:
    out = []
    for line in d.log.read_text().splitlines():
        if line.startswith("{") and (rec := json.loads(line))["msg"].startswith(prefix):
            rec["fields"] = dict(kv.split("=", 1) for kv in rec["msg"].removeprefix(prefix).split())
            out.append(rec)
    return out


@pytest.mark.asyncio
async def test_start_and_stop_are_logged_with_addresses_store_and_version(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    port = free_port()
    d = make_daemon(sw, "host", tmp_path, listen=f'"127.0.0.1:{port}"')
    try:
        d.start()
        await d.wait_version(1)
        assert await d.stop() == 0
        d.start()
        await d.wait_version(1)
        assert await d.stop() == 0
        started, stopped = lines(d, "started: "), lines(d, "stopped: ")
        assert len(started) == 2 and len(stopped) == 2, d.log.read_text()[-3000:]
        first, second = (s["fields"] for s in started)
        assert first["listen"] == f"127.0.0.1:{port}" and first["api_socket"] == d.socket
        assert first["store"] == f"/dev/shm/{d.store}" and first["store_kind"] == "shm"
        assert first["sidecar"] == "off" and first["metrics"] == "off" and first["data_dir"] == str(d.dir / "data")
        assert started[0]["version"] is None and first["version"] == "None"  # nothing held yet
        assert started[1]["version"] == 1 and second["version"] == "1"  # re-attached to its store
        assert int(second["store_bytes"]) > 0
        for rec in stopped:
            assert rec["reason"] == "SIGTERM" and rec["version"] == 1, rec
    finally:
        d.cleanup()
        await sw.close()
