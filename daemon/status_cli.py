"""``patchswarm status``: the local daemon's state from its unix socket, once or live (``--watch``).

Every value shown may carry strings a client or a peer chose (engine names, error reasons quoting a
refused head's run id): each is shown as plain text, never as rich markup, with control characters
escaped and its length capped, and a status of any shape renders (a missing or mistyped field
shows as "?") rather than crashing the command.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json
from patchswarm.swarm.client_errors import reason

DEFAULT_SOCKET = "/run/patchswarm/api.sock"
MAX_STATUS_BYTES = 4 << 20  # a status is a few KB; anything far larger is not one
MAX_SHOWN = 160  # characters of one value shown (the JSON output has them all)
MAX_ENGINES_SHOWN = 16


class StatusError(Exception):
    pass


async def fetch_status(socket_path: str, timeout: float = 10.0) -> dict[str, Any]:
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as s,
            s.get("http://daemon/v1/status", timeout=aiohttp.ClientTimeout(total=timeout)) as r,
        ):
            body = await r.content.read(MAX_STATUS_BYTES + 1)
            status = r.status
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise StatusError(f"cannot reach the daemon at {socket_path}: {reason(e)}") from None
    if len(body) > MAX_STATUS_BYTES:
        raise StatusError(f"the daemon at {socket_path} sent a status over {MAX_STATUS_BYTES} bytes")
    try:
        data = load_json(body, max_bytes=MAX_STATUS_BYTES)
    except UntrustedJSONError:
        data = None
    if status != 200 or not isinstance(data, dict):
        raise StatusError(f"the daemon at {socket_path} did not send a status (HTTP {status})")
    return data


def plain(value: Any, limit: int = MAX_SHOWN) -> str:
    """``value`` as one line of text: control characters escaped, at most ``limit`` characters."""
    s = value if isinstance(value, str) else "?" if value is None else str(value)
    if len(s) > 4 * limit:
        s = s[: 4 * limit]  # (escaping below never needs more than this)
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: Any) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "?"


def render(st: dict[str, Any]) -> Table:
    raw = st.get("progress")
    prog: dict[str, Any] = raw if isinstance(raw, dict) else {}
    t = Table(title=Text(f"patchswarm on {plain(st.get('node'))} (run {plain(st.get('run_id'))!r})"), show_header=False)
    t.add_column(style="bold")
    t.add_column()

    def row(name: str, value: str) -> None:
        t.add_row(name, Text(value))  # Text: a value is never read as markup ("[/]", "[bold]")

    reason = st.get("reason")
    row("state", plain(st.get("state")) + (f" ({plain(reason)})" if reason else ""))
    row("version", f"{_count(st.get('version'))}  (target {_count(st.get('target'))})")
    done, total = prog.get("chunks_done"), prog.get("chunks_total")
    if isinstance(total, int) and total > 0 and isinstance(done, int):
        row("progress", f"{done}/{total} chunks ({100 * done / total:.0f}%)")
    row("peers", _count(st.get("peers")))
    acks = st.get("acks")
    if isinstance(acks, dict) and acks:
        recent = list(acks.items())[-MAX_ENGINES_SHOWN:]  # (the daemon keeps the most recently heard last)
        shown = [f"{plain(k, 64)}@{_count(v)}" for k, v in recent]
        more = len(acks) - len(shown)
        row("engines", ", ".join(shown) + (f" (+{more} more)" if more > 0 else ""))
    pause = _number(st.get("last_activation_pause_s"))
    if pause is not None:
        row("last pause", f"{1000 * pause:.2f} ms")
    uptime = _number(st.get("uptime_s"))
    row("uptime", f"{uptime:.0f} s" if uptime is not None else "?")
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
        print(json.dumps(st, indent=2))  # (ASCII: control characters and the rest are escaped)
    else:
        console.print(render(st))
    return 0
