"""An engine process's serve loop: its HTTP application on ``HOST:PORT`` until SIGINT or SIGTERM,
with the task that follows the daemon beside it; on the way out the task is cancelled, then the
server closed (its requests in flight given their grace).  ``patchswarm engine transformers``
(daemon/engine_cli.py) and the reference engine (daemon/refengine.py) both run it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from patchswarm.daemon.sidecar import RunningServer, serve_app

__all__ = ["serve_until_signal"]


async def serve_until_signal(
    app: web.Application,
    listen: str,
    *,
    default_host: str,
    follow: Callable[[], Coroutine[Any, Any, None]] | None = None,
    started: Callable[[RunningServer], None] | None = None,
) -> None:
    """Serve ``app`` on ``listen`` (HOST:PORT, an IPv6 HOST in brackets; none: ``default_host``), run
    ``follow()`` beside it, call ``started`` with the server once it listens, and return after
    SIGINT or SIGTERM with the follower cancelled and the server closed."""
    host, _, port = listen.rpartition(":")
    server = await serve_app(app, host.strip("[]") or default_host, int(port))
    follower = asyncio.create_task(follow()) if follow is not None else None
    try:
        if started is not None:
            started(server)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if follower is not None:
            follower.cancel()
        await server.close()
