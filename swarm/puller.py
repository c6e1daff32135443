"""The reference consumer: follow a board's signed head from what a host holds to the head.

``Puller`` refreshes the trust root (root documents N+1, N+2, ... until one is missing), fetches
the head and has protocol/head_acceptance.py's ``HeadAcceptance`` verify it (signature, certified
key, expiry, no rewind), plans the fewest-bytes path through the head's catalog, and for each step
fetches and verifies the manifest, then (if this build can read what it declares; else it plans
around that version) every chunk, then applies and checks base and target digests.  The swarm node
and the rollout daemon reuse it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

import blake3

from patchswarm.protocol.board_names import (
    MAX_DOC_BYTES,
    MAX_HEAD_BYTES,
    cert_rel,
    chunk_rel,
    head_rel,
    manifest_rel,
    root_rel,
)
from patchswarm.protocol.catalog import CatalogEntry, CatchUpPlanner
from patchswarm.protocol.chunks import verify_chunk
from patchswarm.protocol.errors import ChunkError, FormatError, MissingError, PatchswarmError, UntrustedKeyError
from patchswarm.protocol.head import Head, HeadTracker
from patchswarm.protocol.head_acceptance import HeadAcceptance, PullStats
from patchswarm.protocol.held import Held
from patchswarm.protocol.keys import KeyPolicy
from patchswarm.protocol.manifest import Manifest, SignedManifest
from patchswarm.protocol.patchfile import apply_version
from patchswarm.protocol.payload_formats import PAYLOAD_FORMATS
from patchswarm.protocol.served import ServedModel, state_root
from patchswarm.protocol.signed import MAX_ENVELOPE_BYTES
from patchswarm.protocol.trust import TrustState
from patchswarm.swarm.board_sources import BoardSource

log = logging.getLogger("patchswarm.pull")


class Puller:
    def __init__(
        self,
        source: BoardSource,
        trust: KeyPolicy,
        run_id: str,
        *,
        clock: Callable[[], float] = time.time,
        tracker: HeadTracker | None = None,
        concurrency: int = 8,
        allow_expired: bool = False,
        payload_formats: Collection[int] = PAYLOAD_FORMATS,
    ) -> None:
        """``allow_expired``: only for the run's own signer resuming it (daemon/publisher.py): an
        expired head or manifest is still the run's latest word to it.  Never for a host.
        ``payload_formats``: the patch payload formats this host takes (protocol/catalog.py
        ``CatchUpPlanner``); a version needing another is planned around, none of it fetched."""
        self.source = source
        self.clock = clock
        self.concurrency = concurrency
        self.acceptance = HeadAcceptance(trust, run_id, tracker=tracker, allow_expired=allow_expired)
        self.planner = CatchUpPlanner(payload_formats)

    @property
    def trust(self) -> KeyPolicy:
        return self.acceptance.trust

    @property
    def run_id(self) -> str:
        return self.acceptance.run_id

    @property
    def allow_expired(self) -> bool:
        return self.acceptance.allow_expired

    @property
    def tracker(self) -> HeadTracker:
        return self.acceptance.tracker

    @tracker.setter
    def tracker(self, tracker: HeadTracker) -> None:
        self.acceptance.tracker = tracker

    @property
    def stats(self) -> PullStats:
        return self.acceptance.stats

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def is_fresh(self, head: Head) -> bool:
        """``head`` has not expired (beyond the trust's clock skew), by this puller's clock."""
        return self.acceptance.is_fresh(head, self._now_ms())

    async def refresh_trust(self) -> None:
        if not isinstance(self.trust, TrustState):
            return
        while True:
            data = await self.source.get(root_rel(self.trust.root_version + 1), MAX_DOC_BYTES)
            if data is None:
                return
            self.trust.update_root(data)

    async def _ensure_certified(self, key_id: bytes) -> None:
        if not isinstance(self.trust, TrustState) or key_id in self.trust.certificates:
            return
        data = await self.source.get(cert_rel(key_id), MAX_DOC_BYTES)
        if data is None:
            raise UntrustedKeyError(f"no certificate on the board for key {key_id.hex()[:16]}…")
        self.trust.add_certificate(data)

    async def fetch_head(self) -> Head:
        """The verified head; raises on an untrusted, expired, rewound or equivocating head."""
        await self.refresh_trust()
        data = await self.source.get(head_rel(self.run_id), MAX_HEAD_BYTES)
        if data is None:
            # (over HTTP or S3, a 403 is "missing" too: a reader not allowed to read the head lands here)
            raise MissingError(f"the board has no head for run {self.run_id!r} (or this reader may not read it)")
        head = await self.accept_head(data)
        assert head is not None  # any head's counter is above -1
        return head

    async def accept_head(self, data: bytes, *, newer_than: int = -1) -> Head | None:
        """Verify a head from any source and move the high-water mark past it (``HeadAcceptance.accept``),
        fetching its signer's certificate first if the trust state has not got it."""
        try:
            key_id = self.acceptance.uncertified_signer(data)
            if key_id is not None:
                await self._ensure_certified(key_id)
        except PatchswarmError as e:
            self.acceptance.refuse(e, data, self._now_ms())
            raise
        return self.acceptance.accept(data, now_ms=self._now_ms(), newer_than=newer_than)

    async def fetch_manifest(self, entry: CatalogEntry) -> Manifest:
        return (await self.fetch_signed_manifest(entry))[0]

    async def fetch_signed_manifest(self, entry: CatalogEntry) -> tuple[Manifest, bytes]:
        """The manifest the head names, verified, with the exact bytes that verified (what a node
        may re-serve: nothing else it fetched or cached is served in their place)."""
        data = await self.source.get(manifest_rel(entry.manifest_id), MAX_ENVELOPE_BYTES)
        if data is None:
            raise MissingError(f"manifest of version {entry.version} is not on the board")
        signed = SignedManifest.from_bytes(data)
        # The signed head names the manifest by hash: anything else is refused before parsing.
        if blake3.blake3(signed.body).digest() != entry.manifest_id:
            raise FormatError(f"manifest of version {entry.version} is not the one the head names")
        await self._ensure_certified(signed.key_id)
        m = signed.verify(
            self.trust, now_ms=None if self.allow_expired else self._now_ms(), skew_ms=self.acceptance.skew_ms
        )
        if m.run_id != self.run_id or m.version != entry.version or m.kind != entry.kind:
            raise FormatError(f"manifest says run {m.run_id!r} version {m.version}, the head said otherwise")
        self.stats.bytes_fetched += len(data)
        return m, data

    def plan(self, head: Head, held: Held | None) -> list[CatalogEntry]:
        """The steps from ``held`` to ``head``'s version, through versions this host can read only."""
        return self.planner.plan(head.catalog, held.version if held else None, head.version)

    def readable(self, entry: CatalogEntry, manifest: Manifest) -> bool:
        """Whether this host can take a verified manifest; if not, it is counted and said in one line,
        and the next :meth:`plan` goes around it (nothing of its payload is fetched)."""
        why = self.planner.readable(entry, manifest)
        if why is None:
            return True
        self.stats.unreadable += 1
        log.warning("skipping %s; planning around it", why, extra={"version": manifest.version})
        return False

    async def fetch_payload(self, manifest: Manifest) -> bytes:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(i: int) -> bytes:
            ref = manifest.chunks[i]
            async with sem:
                data = await self.source.get(chunk_rel(ref.hash), ref.size)
            if data is None:
                raise ChunkError(i, f"missing on the board (version {manifest.version})")
            verify_chunk(i, data, ref)
            return data

        parts = await asyncio.gather(*(one(i) for i in range(len(manifest.chunks))))
        self.stats.bytes_fetched += manifest.payload_size
        return b"".join(parts)

    async def identify(self, head: Head, model: ServedModel) -> Held | None:
        """Which catalog version ``model`` is (by its state root), if any."""
        digests = model.digests()
        root = state_root(model.specs, digests)
        for entry in sorted(head.catalog, key=lambda e: -e.version):
            m = await self.fetch_manifest(entry)
            if m.target_root == root:
                return Held(m.version, model, digests)
        return None

    async def catch_up(self, held: Held | None, head: Head | None = None, *, in_place: bool = False) -> Held:
        """Reach the head (or stay) along the byte-minimal plan; every step fully verified.

        Patches are applied to a copy of ``held.model`` unless ``in_place`` (then a failed
        step leaves it unusable, which suits a caller that only writes the final result).
        """
        head = head or await self.fetch_head()
        steps = self.plan(head, held)
        self.stats.steps = []  # the steps taken, as they are
        cur = held
        while steps:
            entry = steps.pop(0)
            m = await self.fetch_manifest(entry)
            if not self.readable(entry, m):
                steps = self.plan(head, cur)
                continue
            if cur is held and held is not None and entry.base_version is not None and not in_place:
                cur = Held(held.version, held.model.clone(), list(held.digests))
            payload = await self.fetch_payload(m)
            base = None if cur is None or entry.base_version is None else cur
            model, digests = apply_version(
                base.model if base else None, m, payload, base_digests=base.digests if base else None
            )
            cur = Held(m.version, model, digests)
            self.stats.steps.append(entry)
        if cur is None:
            raise MissingError("nothing to pull: the head's catalog is empty")
        return cur
