"""The bulletin board: a directory of immutable, content-addressed files plus one signed head
per run, laid out so that any static HTTP server (nginx, an object store, a CDN) can host it.

    runs/<run>/head          the only mutable file; replaced atomically, after everything it names
    manifests/<id hex>       manifest envelopes, named by BLAKE3 of the manifest body
    chunks/<hash hex>        payload chunks, named by their BLAKE3 hash (deduplicated across versions)
    certs/<key id hex>       certificates of trainer keys (signed by a root key)
    trust/root.<N>           root documents, version N (a host fetches N+1 until it gets a 404)

Durability: every file is written to a temporary name, fsynced, renamed and its directory
fsynced, and a version's chunks and manifest are durable before the head moves.

Reading: the layout above is the only thing a board serves.  ``TOP_LEVEL`` and ``board_limit``
are the path rules every server of a board (``patchswarm seed``, a seed node, its chunk store, a
local board source) shares; ``Board.open``/``Board.read`` apply them through
protocol/files.py's ``open_confined`` (no ``..``, absolute path, hidden name or symlink leads out
of the board; FIFOs and devices are not files; each kind of file has its size bound).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.chunks import MAX_CHUNK_SIZE, chunk_views
from patchswarm.protocol.files import FileTooLargeError, fsync_dir, open_confined, read_confined, write_atomic
from patchswarm.protocol.manifest import Manifest, SignedManifest
from patchswarm.protocol.patchfile import Version
from patchswarm.protocol.signed import MAX_ENVELOPE_BYTES

log = logging.getLogger(__name__)

TOP_LEVEL = frozenset({"runs", "manifests", "chunks", "certs", "trust"})
MAX_HEAD_BYTES = 16 << 20  # a signed head (a catalog of up to 100,000 versions); what a host fetches at most
MAX_DOC_BYTES = 1 << 16  # a certificate or a root document
_LIMITS = {"manifests": MAX_ENVELOPE_BYTES, "chunks": MAX_CHUNK_SIZE, "certs": MAX_DOC_BYTES, "trust": MAX_DOC_BYTES}


def board_limit(rel: str) -> int | None:
    """The size bound of the board file at ``rel``, or None if the layout has no such file.

    ``runs/<run>/head`` and ``<folder>/<name>`` only: nothing deeper, nothing else under runs/.
    """
    parts = rel.split("/")
    if parts[0] == "runs":
        return MAX_HEAD_BYTES if len(parts) == 3 and parts[2] == "head" else None
    return _LIMITS.get(parts[0]) if len(parts) == 2 else None


class Board:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    # ------------------------------------------------------------ paths (also the URL paths)

    @staticmethod
    def head_rel(run_id: str) -> str:
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"run id {run_id!r} cannot name a directory")
        return f"runs/{run_id}/head"

    @staticmethod
    def manifest_rel(manifest_id: bytes) -> str:
        return f"manifests/{manifest_id.hex()}"

    @staticmethod
    def chunk_rel(chunk_hash: bytes) -> str:
        return f"chunks/{chunk_hash.hex()}"

    @staticmethod
    def cert_rel(key_id: bytes) -> str:
        return f"certs/{key_id.hex()}"

    @staticmethod
    def root_rel(version: int) -> str:
        return f"trust/root.{version}"

    def path(self, rel: str) -> Path:
        return self.root / rel

    # ------------------------------------------------------------ writing

    def put_version(self, version: Version) -> bytes:
        """Write chunks then the manifest, durably; returns the manifest id."""
        dirs: set[Path] = set()
        for ref, data in chunk_views(version.payload, version.manifest.chunks):
            p = self.path(self.chunk_rel(ref.hash))
            if not p.exists():
                write_atomic(p, data, sync_dir=False)
                dirs.add(p.parent)
        for d in dirs:
            fsync_dir(d)
        mid = version.manifest.manifest_id
        write_atomic(self.path(self.manifest_rel(mid)), version.signed.to_bytes())
        return mid

    def put_head(self, run_id: str, envelope_bytes: bytes) -> None:
        write_atomic(self.path(self.head_rel(run_id)), envelope_bytes)

    def put_certificate(self, key_id: bytes, envelope_bytes: bytes) -> None:
        write_atomic(self.path(self.cert_rel(key_id)), envelope_bytes)

    def put_root(self, version: int, envelope_bytes: bytes) -> None:
        p = self.path(self.root_rel(version))
        if p.exists() and self.read(self.root_rel(version)) != envelope_bytes:
            raise FileExistsError(f"{p} already holds a different root document version {version}")
        write_atomic(p, envelope_bytes)

    # ------------------------------------------------------------ reading

    def open(self, rel: str) -> int | None:
        """An open descriptor of the board file at ``rel`` (a name a peer may have sent), or None.

        None for a name outside the layout and for anything but a regular file inside the board;
        FileTooLargeError for a file over its kind's bound.  The caller closes the descriptor.
        """
        limit = board_limit(rel)
        return None if limit is None else open_confined(self.root, rel, TOP_LEVEL, limit)

    def read(self, rel: str) -> bytes | None:
        """The board file at ``rel``, or None (see ``open``); FileTooLargeError over its bound."""
        limit = board_limit(rel)
        return None if limit is None else read_confined(self.root, rel, TOP_LEVEL, limit)

    def read_served(self, rel: str) -> bytes | None:
        """``read`` for a server: a file over its bound is not served (None), with a warning, not an error."""
        try:
            return self.read(rel)
        except FileTooLargeError as e:
            log.warning("board: not serving %s", e)
            return None

    def root_versions(self) -> list[int]:
        d = self.path("trust")
        if not d.is_dir():
            return []
        return sorted(int(p.name.split(".", 1)[1]) for p in d.glob("root.*") if p.name.split(".", 1)[1].isdigit())

    def manifest(self, manifest_id: bytes) -> Manifest:
        data = self.read(self.manifest_rel(manifest_id))
        if data is None:
            raise FileNotFoundError(self.manifest_rel(manifest_id))
        return SignedManifest.from_bytes(data).verify(None)

    # ------------------------------------------------------------ retention

    def collect_garbage(self, retained: Iterable[CatalogEntry], *, keep_manifests: Iterable[bytes] = ()) -> int:
        """Delete manifests and chunks no retained version needs; returns the number of files removed.

        Call only after the head listing exactly ``retained`` is durable, so no host that
        follows the head can be sent to a file this removes.
        """
        keep_ids = {e.manifest_id for e in retained} | set(keep_manifests)
        keep_chunks: set[bytes] = set()
        for mid in keep_ids:
            m = self.manifest(mid)
            keep_chunks.update(ref.hash for ref in m.chunks)
        removed = 0
        for folder, keep in (("manifests", keep_ids), ("chunks", keep_chunks)):
            for p in self.path(folder).glob("*"):
                name = _content_name(p.name)
                if name is not None and name not in keep:  # a file the board did not name is not its to delete
                    p.unlink()
                    removed += 1
        return removed


def _content_name(name: str) -> bytes | None:
    """The hash a manifest or chunk file is named by (64 lowercase hex digits), or None."""
    if len(name) != 64 or name.strip("0123456789abcdef"):
        return None
    return bytes.fromhex(name)
