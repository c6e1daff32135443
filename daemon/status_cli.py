"""``patchswarm status``: the local daemon's state from its unix socket, once or live (``--watch``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from rich.console import Console
from rich.live import Live
from rich.table import Table

from swarm.client_errors import reason

DEFAULT_SOCKET = "/run/patchswarm/api.sock"


class StatusError(Exception):
    pass


async def fetch_status(socket_path: str) -> dict[str, Any]:
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as s,
            s.get("http://daemon/v1/status", timeout=aiohttp.ClientTimeout(total=10)) as r,
        ):
            data: dict[str, Any] = await r.json()
            return data
    except (aiohttp.ClientError, OSError) as e:
        raise StatusError(f"cannot reach the daemon at {socket_path}: {reason(e)}") from None


def render(st: dict[str, Any]) -> Table:
    prog = st.get("progress") or {}
    frac = prog.get("fraction")
    t = Table(title=f"patchswarm on {st['node']} (run {st['run_id']!r})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    state = st["state"] + (f" ({st['reason']})" if st.get("reason") else "")
    t.add_row("state", state)
    t.add_row("version", f"{st['version']}  (target {st['target']})")
    if prog.get("chunks_total"):
        t.add_row("progress", f"{prog['chunks_done']}/{prog['chunks_total']} chunks ({100 * (frac or 0):.0f}%)")
    t.add_row("peers", str(st["peers"]))
    if st.get("acks"):
        t.add_row("engines", ", ".join(f"{k}@{v}" for k, v in st["acks"].items()))
    if st.get("last_activation_pause_s") is not None:
        t.add_row("last pause", f"{1000 * st['last_activation_pause_s']:.2f} ms")
    t.add_row("uptime", f"{st['uptime_s']:.0f} s")
    return t


async def watch(socket_path: str, console: Console) -> None:
    st = await fetch_status(socket_path)
    with Live(render(st), console=console, refresh_per_second=4) as live:
        while True:
            await asyncio.sleep(0.5)
            live.update(render(await fetch_status(socket_path)))


def run_status(socket_path: str, *, as_json: bool, live: bool) -> int:
    console = Console()
    if live:
        try:
            asyncio.run(watch(socket_path, console))
        except KeyboardInterrupt:
            return 0
        return 0
    st = asyncio.run(fetch_status(socket_path))
    if as_json:
        print(json.dumps(st, indent=2))
    else:
        console.print(render(st))
    return 0
