"""The daemon's two local servers as processes of their own, for the slow-client and HTTP fuzz tests.

Usage: python -m tests.support.server_worker MODE ADDRESS
  api SOCKET      the unix-socket API (daemon/api.py) over a fixed Status, served by serve_unix
  sidecar PORT    the sidecar (daemon/sidecar.py) on 127.0.0.1:PORT in front of a small engine in this
                  process: GET/POST /generate answers JSON, GET /big (added to the sidecar's
                  allow list, as sidecar.allow_routes does) streams BIG_BYTES

Both print {"event": "listening"} once they answer and serve until SIGTERM.  The server limits come
from the PATCHSWARM_HTTP_* variables, as in the daemon.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from aiohttp import web

from patchswarm.daemon.api import make_api_app, serve_unix
from patchswarm.daemon.sidecar import VersionGate, start_sidecar
from patchswarm.daemon.status import Phase, Status

BIG_BYTES = 8 << 20


async def _engine() -> tuple[web.AppRunner, int]:
    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"text": "ok"})

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        piece = b"x" * (1 << 16)
        for _ in range(BIG_BYTES // len(piece)):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=1 << 20)
    app.router.add_route("*", "/generate", generate)
    app.router.add_get("/big", big)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def main(mode: str, address: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if mode == "api":
        st = Status(node="worker", run_id="run", phase=Phase.IDLE, version=3, root="00" * 32)
        app = make_api_app(st, lambda: {"layout": "none"}, lambda: b"patchswarm_up 1\n")
        runner = await serve_unix(app, address)
        print(json.dumps({"event": "listening", "socket": address}), flush=True)
        await stop.wait()
        await runner.cleanup()
    elif mode == "sidecar":
        engine, port = await _engine()
        server = await start_sidecar(
            f"http://127.0.0.1:{port}", VersionGate(3), port=int(address), allow_routes=["/big"]
        )
        print(json.dumps({"event": "listening", "url": server.url}), flush=True)
        await stop.wait()
        await server.close()
        await engine.cleanup()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
