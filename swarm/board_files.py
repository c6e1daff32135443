"""Reading a board: what a seed node and its chunk store need of one, and the confined directory reader.

``BoardReader`` is the small interface swarm/ needs of a board (daemon/board.py's ``Board`` and the
simulator's in-memory board implement it).  ``BoardFiles`` reads a board directory with the layout's
path rules (protocol/board_names.py ``TOP_LEVEL``, ``board_limit``) through protocol/files.py's
``open_confined``: no ``..``, absolute path, hidden name or symlink leads out of the board; FIFOs and
devices are not files; each kind of file has its size bound.  It is the one implementation of those
reads: the daemon's ``Board`` adds the writes on top of it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

from patchswarm.protocol.board_names import TOP_LEVEL, board_limit, manifest_rel
from patchswarm.protocol.files import FileTooLargeError, open_confined, read_confined
from patchswarm.protocol.manifest import Manifest, SignedManifest

log = logging.getLogger(__name__)


class BoardReader(Protocol):
    """A board as a seed node serves it: files by board path, and the manifests it publishes."""

    def read(self, rel: str) -> bytes | None: ...

    def open(self, rel: str) -> int | None: ...

    def read_served(self, rel: str) -> bytes | None: ...

    def manifest(self, manifest_id: bytes) -> Manifest: ...


class BoardFiles:
    """A board directory, read confined to its layout."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, rel: str) -> Path:
        return self.root / rel

    def open(self, rel: str) -> int | None:
        """An open descriptor of the board file at ``rel`` (a name a peer may have sent), or None.

        None for a name outside the layout and for anything but a regular file inside the board;
        FileTooLargeError for a file over its kind's bound.  The caller closes the descriptor.
        """
        limit = board_limit(rel)
        return None if limit is None else open_confined(self.root, rel, TOP_LEVEL, limit)

    def read(self, rel: str, limit: int | None = None) -> bytes | None:
        """The board file at ``rel``, or None (see ``open``); FileTooLargeError over its kind's bound
        (or over ``limit``, a reader's own bound, if lower)."""
        bound = board_limit(rel)
        if bound is None:
            return None
        return read_confined(self.root, rel, TOP_LEVEL, bound if limit is None else min(bound, limit))

    def read_served(self, rel: str) -> bytes | None:
        """``read`` for a server: a file over its bound is not served (None), with a warning, not an error."""
        try:
            return self.read(rel)
        except FileTooLargeError as e:
            log.warning("board: not serving %s", e)
            return None

    def manifest(self, manifest_id: bytes) -> Manifest:
        data = self.read(manifest_rel(manifest_id))
        if data is None:
            raise FileNotFoundError(manifest_rel(manifest_id))
        return SignedManifest.from_bytes(data).verify(None)
