"""The reference consumer: follow a board's signed head from what a host holds to the head.

``Puller`` refreshes the trust root (root documents N+1, N+2, ... until one is missing),
verifies the head (signature, certified key, expiry, no rewind), plans the fewest-bytes path
through the head's catalog, and for each step fetches and verifies the manifest, then every
chunk, then applies and checks base and target digests.  The rollout daemon reuses it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import blake3

from patchswarm.daemon.board import MAX_DOC_BYTES, MAX_HEAD_BYTES, Board
from patchswarm.daemon.sources import BoardSource
from patchswarm.protocol.catalog import CatalogEntry, plan
from patchswarm.protocol.chunks import verify_chunk
from patchswarm.protocol.errors import (
    ChunkError,
    ExpiredError,
    FormatError,
    MissingError,
    PatchswarmError,
    UntrustedKeyError,
)
from patchswarm.protocol.head import HEAD_TAG, Head, HeadTracker, head_expired, verify_head
from patchswarm.protocol.keys import KeyPolicy
from patchswarm.protocol.manifest import Manifest, SignedManifest
from patchswarm.protocol.patchfile import apply_version
from patchswarm.protocol.served import ServedModel, state_root
from patchswarm.protocol.signed import MAX_ENVELOPE_BYTES, Envelope
from patchswarm.protocol.trust import DEFAULT_SKEW_MS, TrustState

log = logging.getLogger("patchswarm.pull")


@dataclass(slots=True)
class Held:
    """A served version a host holds, with its digests (so they are not recomputed per step)."""

    version: int
    model: ServedModel
    digests: list[bytes]


@dataclass(slots=True)
class PullStats:
    steps: list[CatalogEntry] = field(default_factory=list)
    bytes_fetched: int = 0
    refused: collections.Counter[str] = field(default_factory=collections.Counter)  # heads, by error class
    last_refusal: str | None = None
    head_expires_ms: int | None = None  # of the newest head accepted (a frozen board lets it pass)
    head_created_ms: int | None = None  # of the newest head seen, accepted or refused as expired (its age)
    frozen_since_ms: int | None = None  # expiry of the head this host last found expired; None once a fresh one came
    marks_dropped: int = 0  # high-water marks forgotten because their signer was revoked


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
    ) -> None:
        """``allow_expired``: only for the run's own signer resuming it (daemon/publisher.py): an
        expired head or manifest is still the run's latest word to it.  Never for a host."""
        self.source = source
        self.trust = trust
        self.run_id = run_id
        self.clock = clock
        self.tracker = tracker or HeadTracker(run_id)
        self.concurrency = concurrency
        self.stats = PullStats()
        self.allow_expired = allow_expired

    @property
    def _skew_ms(self) -> int:
        return self.trust.skew_ms if isinstance(self.trust, TrustState) else DEFAULT_SKEW_MS

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def is_fresh(self, head: Head) -> bool:
        """``head`` has not expired (beyond the trust's clock skew), by this puller's clock."""
        return not head_expired(head, now_ms=self._now_ms(), skew_ms=self._skew_ms)

    async def refresh_trust(self) -> None:
        if not isinstance(self.trust, TrustState):
            return
        while True:
            data = await self.source.get(Board.root_rel(self.trust.root_version + 1), MAX_DOC_BYTES)
            if data is None:
                return
            self.trust.update_root(data)

    async def _ensure_certified(self, key_id: bytes) -> None:
        if not isinstance(self.trust, TrustState) or key_id in self.trust.certificates:
            return
        data = await self.source.get(Board.cert_rel(key_id), MAX_DOC_BYTES)
        if data is None:
            raise UntrustedKeyError(f"no certificate on the board for key {key_id.hex()[:16]}…")
        self.trust.add_certificate(data)

    async def fetch_head(self) -> Head:
        """The verified head; raises on an untrusted, expired, rewound or equivocating head."""
        await self.refresh_trust()
        data = await self.source.get(Board.head_rel(self.run_id), MAX_HEAD_BYTES)
        if data is None:
            raise MissingError(f"the board has no head for run {self.run_id!r}")
        head = await self.accept_head(data)
        assert head is not None  # any head's counter is above -1
        return head

    async def accept_head(self, data: bytes, *, newer_than: int = -1) -> Head | None:
        """Verify a head from any source and move the high-water mark past it.

        Returns the head if its counter is above ``newer_than`` (what the caller follows now),
        None for one that is not (a lagging source: nothing to do).  Anything refused (forged,
        untrusted or revoked signer, expired, another run, a rewind, equivocation) raises and is
        counted in ``stats.refused`` by error class.
        """
        try:
            await self._ensure_certified(Envelope.from_bytes(data, HEAD_TAG).key_id)
            head, env = verify_head(
                data, self.trust, now_ms=self._now_ms(), skew_ms=self._skew_ms, allow_expired=self.allow_expired
            )
            if head.run_id != self.run_id:  # before the counter: another run's head is never "just old"
                raise FormatError(f"head is for run {head.run_id!r}, this host follows {self.run_id!r}")
            if self._mark_signer_revoked():
                newer_than = -1  # the caller's counter came from the same void head
            if head.counter < newer_than:
                return None
            self.tracker.accept(head, env)
        except PatchswarmError as e:
            self.stats.refused[type(e).__name__] += 1
            self.stats.last_refusal = str(e)
            if isinstance(e, ExpiredError):
                self._note_expired(data)
            raise
        self.stats.frozen_since_ms = None
        if head.counter == self.tracker.counter:
            self.stats.head_expires_ms = head.expires_ms
            self.stats.head_created_ms = head.created_ms
        return head if head.counter > newer_than else None

    def _note_expired(self, data: bytes) -> None:
        """A head refused for its age (not its signer's certificate): the board looks frozen since it expired."""
        try:
            head = Head.from_bytes(Envelope.from_bytes(data, HEAD_TAG).body)  # its signature was checked
        except PatchswarmError:
            return
        if head.run_id == self.run_id and head_expired(head, now_ms=self._now_ms(), skew_ms=self._skew_ms):
            self.stats.frozen_since_ms = head.expires_ms
            self.stats.head_created_ms = max(head.created_ms, self.stats.head_created_ms or 0)

    def _mark_signer_revoked(self) -> bool:
        """Forget the high-water mark if the root has since revoked the key that signed it (True).

        A leaked key can sign a head with a huge counter before it is revoked ("fast-forward");
        were the mark kept, every later head of the honest signer would look like a rewind.  As
        TUF does on key rotation, marks set by a revoked key are dropped.  Only an explicit
        revocation counts: a certificate merely not fetched yet (after a restart) keeps the mark.
        """
        if not (isinstance(self.trust, TrustState) and self.trust.root and self.tracker.envelope):
            return False
        signer = Envelope.from_bytes(self.tracker.envelope, HEAD_TAG).key_id
        if signer not in self.trust.root.revoked:
            return False
        log.warning(
            "run %r: the head at counter %d was signed by a key revoked since; its mark is dropped",
            self.run_id,
            self.tracker.counter,
        )
        self.tracker.forget()
        self.stats.marks_dropped += 1
        return True

    async def fetch_manifest(self, entry: CatalogEntry) -> Manifest:
        return (await self.fetch_signed_manifest(entry))[0]

    async def fetch_signed_manifest(self, entry: CatalogEntry) -> tuple[Manifest, bytes]:
        """The manifest the head names, verified, with the exact bytes that verified (what a node
        may re-serve: nothing else it fetched or cached is served in their place)."""
        data = await self.source.get(Board.manifest_rel(entry.manifest_id), MAX_ENVELOPE_BYTES)
        if data is None:
            raise MissingError(f"manifest of version {entry.version} is not on the board")
        signed = SignedManifest.from_bytes(data)
        # The signed head names the manifest by hash: anything else is refused before parsing.
        if blake3.blake3(signed.body).digest() != entry.manifest_id:
            raise FormatError(f"manifest of version {entry.version} is not the one the head names")
        await self._ensure_certified(signed.key_id)
        m = signed.verify(self.trust, now_ms=None if self.allow_expired else self._now_ms(), skew_ms=self._skew_ms)
        if m.run_id != self.run_id or m.version != entry.version or m.kind != entry.kind:
            raise FormatError(f"manifest says run {m.run_id!r} version {m.version}, the head said otherwise")
        self.stats.bytes_fetched += len(data)
        return m, data

    async def fetch_payload(self, manifest: Manifest) -> bytes:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(i: int) -> bytes:
            ref = manifest.chunks[i]
            async with sem:
                data = await self.source.get(Board.chunk_rel(ref.hash), ref.size)
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
        steps = plan(head.catalog, held.version if held else None, head.version)
        self.stats.steps = steps
        cur = held
        if held is not None and steps and steps[0].base_version is not None and not in_place:
            cur = Held(held.version, held.model.clone(), list(held.digests))
        for entry in steps:
            m = await self.fetch_manifest(entry)
            payload = await self.fetch_payload(m)
            base = None if cur is None or entry.base_version is None else cur
            model, digests = apply_version(
                base.model if base else None, m, payload, base_digests=base.digests if base else None
            )
            cur = Held(m.version, model, digests)
        if cur is None:
            raise MissingError("nothing to pull: the head's catalog is empty")
        return cur
