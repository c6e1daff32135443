"""Hostile strings in what ``patchswarm status`` shows: engine names any client of the socket
chooses, reasons quoting what a peer sent.  Rendering never crashes or reads them as markup, control
characters are escaped, lengths are capped; the daemon's tables of such names stay bounded."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from patchswarm.daemon.status import MAX_ACKS, MAX_REASON, Status
from patchswarm.daemon.status_cli import MAX_SHOWN, plain, render
from tests.support.daemonkit import ROOT, Daemon, make_daemon
from tests.support.swarmkit import Swarm

HOSTILE = [
    "[/]",
    "[bold red]boom",
    "[link=file:///etc/passwd]x[/link]",
    "a\x1b[31mred",
    "\r\n\t\x00",
    "\u202e",
    "]" * 500,
]
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.sampled_from(HOSTILE),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
KEYS = ["node", "run_id", "state", "reason", "version", "target", "progress", "peers", "acks",
        "last_activation_pause_s", "uptime_s"]  # fmt: skip


def shown(st_: dict[str, Any]) -> str:
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(render(st_))
    return out.getvalue()


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), values) | st.dictionaries(st.text(max_size=8), values, max_size=4))
def test_any_status_renders_as_plain_text(status: dict[str, Any]) -> None:
    text = shown(status)
    assert all(c.isprintable() or c == "\n" for c in text)


@given(st.text() | st.sampled_from(HOSTILE))
def test_plain_is_one_printable_line_and_capped(s: str) -> None:
    p = plain(s)
    assert p.isprintable() and len(p) <= MAX_SHOWN


def test_markup_is_shown_as_written() -> None:
    text = shown({"node": "[bold]n", "state": "idle", "acks": {"[/]": 1, "[red]e": 2}, "reason": "[/bold]"})
    assert "[bold]n" in text and "[/]@1" in text and "[red]e@2" in text and "[/bold]" in text


@pytest.mark.asyncio
async def test_status_tables_stay_bounded() -> None:
    s = Status("n", "r")
    for i in range(10 * MAX_ACKS):
        s.ack(f"engine-{i}", i)
    s.ack("engine-0", 7)  # heard again: it stays, the oldest others go
    assert len(s.acks) == MAX_ACKS and s.acks["engine-0"] == 7 and "engine-1" not in s.acks
    s.update(reason="x" * (100 * MAX_REASON))
    assert s.reason is not None and len(s.reason) == MAX_REASON


async def post_ack(d: Daemon, engine: str, version: int) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=d.socket)) as s,
        s.post("http://d/v1/ack", json={"engine": engine, "version": version}) as r,
    ):
        return r.status, await r.json()


def patchswarm_status(d: Daemon, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", "status", "--socket", d.socket, *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


@pytest.mark.asyncio
async def test_hostile_engine_names_through_a_real_daemon(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "host", tmp_path)
    try:
        d.start()
        await d.wait_version(1)
        for name in ["a\x1b[31mred", "new\nline", "x" * 129, ""]:
            assert (await post_ack(d, name, 1))[0] == 400, name
        for i in range(2 * MAX_ACKS):  # many names: the table stays bounded
            assert (await post_ack(d, f"flood-{i}", 1))[0] == 200
        for name in ["[/]", "[bold]loud", "[link=file:///etc/passwd]x"]:
            assert (await post_ack(d, name, 1))[0] == 200
        text = patchswarm_status(d)
        assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
        assert "[/]@1" in text.stdout and "[bold]loud@1" in text.stdout, text.stdout
        raw = patchswarm_status(d, "--json")
        assert raw.returncode == 0, raw.stderr
        acks = json.loads(raw.stdout)["acks"]
        assert len(acks) == MAX_ACKS and "[/]" in acks and "flood-0" not in acks
        assert (await d.status()) is not None  # and the daemon still answers
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()
