"""A board over HTTP (``patchswarm seed``, a seed node), with the caching rules a CDN would need.

Immutable files (chunks, manifests, certificates, root documents) are cacheable forever; the
head is never cached without revalidation.  Range requests, ETag and If-None-Match come from
aiohttp's FileResponse.

Paths follow the board's layout (protocol/board_names.py ``board_limit``) and files are opened through
``BoardFiles.open`` (swarm/board_files.py, over protocol/files.py ``open_confined``): no name leaves
the board, and only a regular file within its kind's size bound is served.  FileResponse is handed
that open file (by its /proc/self/fd name, the very inode checked), never the requested name, so a
name swapped for a FIFO, a device or a symlink after the check serves nothing new.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from patchswarm.protocol.files import FileTooLargeError
from patchswarm.swarm.board_files import BoardFiles

log = logging.getLogger(__name__)

IMMUTABLE = "public, max-age=31536000, immutable"
MUTABLE = "no-cache"
BOARD_KEY: web.AppKey[BoardFiles] = web.AppKey("board", BoardFiles)
_FD_DIR = Path("/proc/self/fd")


class _CheckedFile(web.FileResponse):
    """A FileResponse sent inside the handler, while the checked descriptor is open.

    aiohttp calls ``prepare`` again once the handler returns, and FileResponse would open and send
    its path a second time: by then ``/proc/self/fd/N`` is closed, or names whatever file reused the
    number.  Once prepared, there is nothing more to send.
    """

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self.prepared:
            return None
        return await super().prepare(request)


def _open(board: BoardFiles, rel: str) -> int | None:
    try:
        return board.open(rel)
    except FileTooLargeError as e:
        log.warning("seed: not serving %s", e)
        return None


async def _serve(request: web.Request) -> web.StreamResponse:
    rel = request.match_info["path"]
    fd = _open(request.app[BOARD_KEY], rel)
    if fd is None:
        raise web.HTTPNotFound(text="not on this board\n")
    try:
        mutable = rel.startswith("runs/")
        resp = _CheckedFile(
            _FD_DIR / str(fd),
            headers={"Cache-Control": MUTABLE if mutable else IMMUTABLE, "Content-Type": "application/octet-stream"},
        )
        # Prepared (the file opened and sent) while ``fd`` keeps the checked inode's name valid.
        await resp.prepare(request)
        return resp
    finally:
        os.close(fd)


def board_app(board: str | Path) -> web.Application:
    app = web.Application()
    app[BOARD_KEY] = BoardFiles(Path(board).resolve())
    app.router.add_get("/{path:.+}", _serve)
    return app
