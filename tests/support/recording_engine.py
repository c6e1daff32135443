"""A catch-all engine for sidecar tests: answers every path 200 and records exactly what each request
brought, so "the engine never got it" is checked, not assumed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from aiohttp import web


class Seen(NamedTuple):
    method: str
    path: str  # as the engine's router decoded it
    raw_path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class RecordingEngine:
    seen: list[Seen] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path, request.raw_path, dict(request.headers), body))
        return web.json_response({"engine_saw": request.path})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app
