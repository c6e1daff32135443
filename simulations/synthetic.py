"""A synthetic run for placeholder studies: real signed manifests and heads over chunks that do not exist.

``synthetic_setup`` builds, in memory, what a trainer's board would hold for a run of
``versions`` patches of ``patch_bytes`` each (plus the anchor, version 0, of ``anchor_bytes``):
a root key and a certified trainer key, one signed manifest per version whose chunk refs name
synthetic hashes, and one signed head per version (head ``k`` names version ``k`` and catalogs
versions 0..k, counter ``k``).  ``SyntheticBoard.publish(k)`` moves the head, as a publisher
would; the seed's board watcher picks it up.  The seed serves the chunks from a
``PlaceholderChunkStore``; nodes verify sizes only and apply nothing (simulations.placeholder).

Nothing of patch size is materialised: a manifest of 500 MB in 4 MiB chunks is ~6 KB.  Keys
derive from ``key_seed``, so the same arguments give the same bytes in every process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from patchswarm.protocol.board_names import HEAD_TAG, cert_rel, head_rel, manifest_rel
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.chunks import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, ChunkRef
from patchswarm.protocol.head import Head
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.manifest import Kind, Manifest, SignedManifest
from patchswarm.protocol.served import TensorSpec, layout_hash, state_root
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import Certificate, TrustState
from patchswarm.simulations.placeholder import PlaceholderChunkStore, apply_nothing, verify_size
from patchswarm.simulations.runner import SwarmSetup

SYNTHETIC_EPOCH = 1_700_000_000.0  # the Unix time virtual 0 stands for (fixed: reproducible signatures' checks)
VALIDITY_S = 365 * 86_400.0  # certificates, manifests and heads stay valid this long after the epoch


class SyntheticBoard:
    """A board held in memory (no files), a ``BoardReader`` (swarm/board_files.py): objects by board
    path, plus the heads ready to publish."""

    def __init__(
        self, run_id: str, files: dict[str, bytes], heads: dict[int, bytes], manifest_ids: dict[int, bytes]
    ) -> None:
        self.run_id = run_id
        self.files = files
        self.heads = heads  # version -> signed head envelope naming it
        self.manifest_ids = manifest_ids  # version -> manifest id
        self.published = -1
        self._manifests: dict[bytes, Manifest] = {}

    def publish(self, version: int) -> None:
        """Move the head to ``version`` (a head signed in advance)."""
        if version not in self.heads:
            raise KeyError(f"no synthetic head for version {version}")
        self.files[head_rel(self.run_id)] = self.heads[version]
        self.published = version

    def read(self, rel: str) -> bytes | None:
        return self.files.get(rel)

    def read_served(self, rel: str) -> bytes | None:
        return self.files.get(rel)

    def open(self, rel: str) -> int | None:
        return None  # no files (the seed's chunks come from a PlaceholderChunkStore)

    def manifest(self, manifest_id: bytes) -> Manifest:
        m = self._manifests.get(manifest_id)
        if m is None:
            data = self.files.get(manifest_rel(manifest_id))
            if data is None:
                raise FileNotFoundError(manifest_rel(manifest_id))
            m = self._manifests[manifest_id] = SignedManifest.from_bytes(data).verify(None)
        return m


@dataclass(frozen=True)
class SyntheticRun:
    setup: SwarmSetup
    board: SyntheticBoard
    versions: tuple[int, ...]  # the patch versions, in publication order (1..N)
    patch_bytes: int
    anchor_bytes: int
    chunk_bytes: int


def _key(seed: str) -> SigningKey:
    return SigningKey(Ed25519PrivateKey.from_private_bytes(blake3.blake3(seed.encode()).digest()))


def _chunks(tag: str, nbytes: int, chunk_bytes: int) -> tuple[ChunkRef, ...]:
    n = max(1, math.ceil(nbytes / chunk_bytes))
    sizes = [chunk_bytes] * (n - 1) + [nbytes - chunk_bytes * (n - 1)]
    return tuple(ChunkRef(s, blake3.blake3(f"{tag}:{i}".encode()).digest()) for i, s in enumerate(sizes))


def synthetic_setup(
    *,
    patch_bytes: int,
    chunk_bytes: int = 4 << 20,
    versions: int = 1,
    anchor_bytes: int | None = None,
    run_id: str = "sim-run",
    cluster_secret: bytes = b"simulated-cluster-secret-0123456",
    epoch: float = SYNTHETIC_EPOCH,
    key_seed: str = "patchswarm-simulation",
) -> SyntheticRun:
    """A run of an anchor (version 0) and ``versions`` patches, each over the one before (see module doc).

    The head starts at version 0; publish version k with ``run.board.publish(k)`` (the stream
    runner does it every T virtual seconds).  Hosts normally start holding version 0
    (``simulations.placeholder.placeholder_held(0)``)."""
    if patch_bytes < 1 or versions < 0:
        raise ValueError("need patch_bytes >= 1 and versions >= 0")
    if not MIN_CHUNK_SIZE <= chunk_bytes <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk size must be within [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    anchor = patch_bytes if anchor_bytes is None else anchor_bytes
    if anchor < 1:
        raise ValueError("anchor_bytes must be >= 1")
    root, trainer = _key(f"{key_seed}:root"), _key(f"{key_seed}:trainer")
    epoch_ms = int(epoch * 1000)
    until_ms = epoch_ms + int(VALIDITY_S * 1000)
    cert = Certificate(trainer.key_id, run_id, epoch_ms - 86_400_000, until_ms).sign(root).to_bytes()
    files: dict[str, bytes] = {cert_rel(trainer.key_id): cert}
    # One bf16 tensor big enough for the anchor's raw bytes (a manifest checks raw_size against its layout).
    specs = (TensorSpec("weights", "BF16", (max(1, math.ceil(anchor / 2)),)),)
    layout = layout_hash(list(specs))
    catalog: list[CatalogEntry] = []
    heads: dict[int, bytes] = {}
    mids: dict[int, bytes] = {}
    sizes: dict[bytes, int] = {}
    prev_root: bytes | None = None
    prev_mid: bytes | None = None
    for v in range(versions + 1):
        digests = (blake3.blake3(f"{key_seed}:{run_id}:digest:{v}".encode()).digest(),)
        target = state_root(list(specs), list(digests))
        nbytes = anchor if v == 0 else patch_bytes
        chunks = _chunks(f"{key_seed}:{run_id}:{v}", nbytes, chunk_bytes)
        m = Manifest(
            run_id=run_id,
            version=v,
            kind=Kind.ANCHOR if v == 0 else Kind.PATCH,
            base_version=None if v == 0 else v - 1,
            base_root=prev_root,
            specs=specs,
            digests=digests,
            target_root=target,
            layout_hash=layout,
            payload_size=nbytes,
            raw_size=nbytes,
            chunk_size=chunk_bytes,
            chunks=chunks,
            created_ms=epoch_ms,
            expires_ms=until_ms,
            prev_manifest=prev_mid,
        )
        m.check()
        mid = mids[v] = m.manifest_id
        files[manifest_rel(mid)] = SignedManifest.sign(m, trainer).to_bytes()
        sizes.update((ref.hash, ref.size) for ref in chunks)
        catalog.append(CatalogEntry(v, m.kind, m.base_version, nbytes, mid))
        head = Head(run_id, v, mid, v, epoch_ms, until_ms, tuple(catalog))
        heads[v] = head.sign(trainer).to_bytes()
        prev_root, prev_mid = target, mid
    board = SyntheticBoard(run_id, files, heads, mids)
    board.publish(0)
    setup = SwarmSetup(
        board=board,
        run_id=run_id,
        cluster_secret=cluster_secret,
        policy=lambda: TrustState(root.key_id),
        epoch=epoch,
        seed_chunks=lambda: PlaceholderChunkStore(sizes),
        verify_chunk=verify_size,
        apply=apply_nothing,
        publish=board.publish,
    )
    return SyntheticRun(setup, board, tuple(range(1, versions + 1)), patch_bytes, anchor, chunk_bytes)


def head_envelope(board: SyntheticBoard) -> Envelope:
    """The envelope of the head now published (for checks)."""
    return Envelope.from_bytes(board.read(head_rel(board.run_id)) or b"", HEAD_TAG)
