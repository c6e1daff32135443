"""A seed of a board in an object store: what the run's head names, copied into a local directory the
seed serves (``patchswarm seed --board s3://... --cache DIR --run RUN``).

A seed serves chunks from files (confined reads, sendfile); an object store answers each request in
tens of milliseconds and bills it, and hosts ask a seed for every chunk nobody else holds yet.  So
the seed keeps a local copy, made in the publisher's order: root documents, then for each version
the head lists its chunks (each checked against its name: BLAKE3 and size), the certificate of the
key that signed its manifest and the manifest (its id is the hash of its body), and the head (with
its signer's certificate) last; then what the head no longer lists
goes (``Board.collect_garbage``).  A copy cut off anywhere (a crash, a store error) leaves the local
head naming only complete versions, like the store's.  A head whose counter is not above the copy's
(an older head put back) is not followed: hosts refuse it, and they still fetch the newer versions.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from patchswarm.daemon.board import Board
from patchswarm.daemon.board_store import UPLOADS, StoreBoard
from patchswarm.daemon.head_refresh import parse_head
from patchswarm.protocol.board_names import (
    HEAD_TAG,
    cert_rel,
    chunk_rel,
    head_rel,
    manifest_rel,
    root_rel,
)
from patchswarm.protocol.chunks import ChunkRef, chunk_hash
from patchswarm.protocol.errors import FormatError, PatchswarmError
from patchswarm.protocol.files import fsync_dir, write_atomic
from patchswarm.protocol.manifest import SignedManifest
from patchswarm.protocol.signed import Envelope

MIRROR_INTERVAL_S = 1.0  # how often a seed reads the store's head (one GET; a new head costs the copy)


class StaleHeadError(PatchswarmError):
    """The store's head is older than the copy's (logged by the seed once; the copy keeps serving)."""


class BoardMirror:
    """Copies one run of ``src`` (an object store) into ``dst`` (the seed's directory)."""

    def __init__(self, src: StoreBoard, dst: Board, run_id: str) -> None:
        self.src = src
        self.dst = dst
        self.run_id = run_id

    def sync(self) -> bool:
        """Bring the local copy to the store's head; True if the local head changed."""
        rel = head_rel(self.run_id)
        data = self.src.read(rel)
        local = self.dst.read(rel)
        if data is None or data == local:
            return False
        head = parse_head(data)
        if local is not None and head.counter <= (mine := parse_head(local).counter):
            # An older head put back (a replayed or restored object): hosts refuse it by its counter, and
            # following it would delete the newer versions from the copy that hosts still fetch.
            raise StaleHeadError(
                f"{self.src.location}/{rel}: the store's head (counter {head.counter}) is not newer than the "
                f"copy's ({mine}): not followed"
            )
        for version in self.src.root_versions():
            if self.dst.read(root_rel(version)) is None:
                doc = self.src.read(root_rel(version))
                if doc is not None:
                    self.dst.put_root(version, doc)
        self._copy_certificate(Envelope.from_bytes(data, HEAD_TAG).key_id)
        for entry in head.catalog:
            if self.dst.read(manifest_rel(entry.manifest_id)) is None:
                self._copy_version(entry.manifest_id)
        self.dst.put_head(self.run_id, data)
        self.dst.collect_garbage(head.catalog)
        return True

    def _copy_version(self, manifest_id: bytes) -> None:
        rel = manifest_rel(manifest_id)
        envelope = self.src.read(rel)
        if envelope is None:
            raise FileNotFoundError(f"{self.src.location}/{rel}: named by the head, not in the store")
        signed = SignedManifest.from_bytes(envelope)
        manifest = signed.verify(None)
        if manifest.manifest_id != manifest_id:
            raise FormatError(f"{self.src.location}/{rel} holds another manifest")
        missing = [ref for ref in manifest.chunks if not self.dst.path(chunk_rel(ref.hash)).exists()]
        with ThreadPoolExecutor(min(UPLOADS, max(len(missing), 1)), thread_name_prefix="mirror") as pool:
            for f in [pool.submit(self._copy_chunk, ref) for ref in missing]:
                f.result()
        if missing:
            fsync_dir(self.dst.path("chunks"))
        self._copy_certificate(signed.key_id)
        write_atomic(self.dst.path(rel), envelope)  # after its chunks, as the publisher wrote them

    def _copy_certificate(self, key_id: bytes) -> None:
        """The certificate of a key that signed the head or a manifest (what hosts ask for; the store's
        certs/ is not listed: a stray object there would stop the copy)."""
        rel = cert_rel(key_id)
        if self.dst.read(rel) is None and (cert := self.src.read(rel)) is not None:
            self.dst.put_certificate(key_id, cert)

    def _copy_chunk(self, ref: ChunkRef) -> None:
        rel = chunk_rel(ref.hash)
        data = self.src.read(rel, ref.size)
        if data is None:
            raise FileNotFoundError(f"{self.src.location}/{rel}: named by a manifest, not in the store")
        if len(data) != ref.size or chunk_hash(data) != ref.hash:
            raise FormatError(f"{self.src.location}/{rel} does not hold the chunk its name says")
        write_atomic(self.dst.path(rel), data, sync_dir=False)
