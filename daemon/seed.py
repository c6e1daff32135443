"""``patchswarm seed``: serve a board over HTTP with the caching rules a CDN would need.

Immutable files (chunks, manifests, certificates, root documents) are cacheable forever; the
head is never cached without revalidation.  Range requests, ETag and If-None-Match come from
aiohttp's FileResponse.  Paths are confined to the board's five top-level folders.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from daemon.config import split_listen as parse_listen  # one parser for every listen address

IMMUTABLE = "public, max-age=31536000, immutable"
MUTABLE = "no-cache"
TOP_LEVEL = frozenset({"runs", "manifests", "chunks", "certs", "trust"})
BOARD_KEY: web.AppKey[Path] = web.AppKey("board", Path)


def _resolve(board: Path, rel: str) -> Path | None:
    parts = rel.split("/")
    if (
        not parts
        or parts[0] not in TOP_LEVEL
        or any(p in ("", ".", "..") or p.startswith(".") or len(p.encode()) > 255 for p in parts)  # (ENAMETOOLONG)
    ):
        return None
    path = board.joinpath(*parts)
    return path if path.is_file() else None


async def _serve(request: web.Request) -> web.StreamResponse:
    rel = request.match_info["path"]
    path = _resolve(request.app[BOARD_KEY], rel)
    if path is None:
        raise web.HTTPNotFound(text=f"not on this board: {rel}\n")
    mutable = rel.startswith("runs/") and rel.endswith("/head")
    return web.FileResponse(
        path,
        headers={"Cache-Control": MUTABLE if mutable else IMMUTABLE, "Content-Type": "application/octet-stream"},
    )


def board_app(board: str | Path) -> web.Application:
    app = web.Application()
    app[BOARD_KEY] = Path(board).resolve()
    app.router.add_get("/{path:.+}", _serve)
    return app


__all__ = ["board_app", "parse_listen"]
