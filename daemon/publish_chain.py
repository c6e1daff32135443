"""A run's chain of versions as one publisher writes it: when a version carries an anchor, the
commit of one version (encode, sign, write the patch and/or anchor, retire old anchors), and the
signed head that moves after it, never past another publisher's.

``PublishChain`` is the part of ``Publisher`` (daemon/publisher.py, which sets every attribute
declared here in its ``__init__``) that owns the chain; a sharded version (daemon/sharded_publish.py)
commits through it too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from patchswarm.daemon.board import HeadRaceError
from patchswarm.daemon.board_store import AnyBoard
from patchswarm.daemon.head_refresh import board_head, parse_head
from patchswarm.daemon.publish_work import Buffers, Prepared, Stages
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.codec import assemble, diff_tensor
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.head import Head
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.patchfile import Version, sign_version
from patchswarm.protocol.served import ServedModel, state_root

log = logging.getLogger("patchswarm.publisher")


@dataclass(frozen=True, slots=True)
class PublishInfo:
    version: int
    changed_fraction: float  # of served elements, vs the previous version (1.0 for the first)
    patch_bytes: int  # payload bytes of the patch (0 when there is no previous version)
    anchor_bytes: int | None  # payload bytes of the anchor published with this version, if any
    served_bytes: int
    seconds: float  # wall time from the call to the head moving
    manifest_id: bytes
    # Seconds per stage.  cast (to the served format), diff (scan and sparse coding: the deltas)
    # and digests (BLAKE3) are busy time summed over the worker threads, which run them block by
    # block, interleaved; prepare is the wall time of that per-tensor phase.  encode (the patch
    # payload's shared streams, on the calling thread while workers finish), anchor (the anchor
    # payload), sign (chunk hashes, manifests, signatures) and write (board files with fsync,
    # head, garbage collection) are wall times.  A sharded version sums cast, diff, digests and
    # prepare over its ranks.
    stages: dict[str, float] = field(default_factory=dict)


class PublishChain:
    """The chain state of one publisher of a run, and the commit and head writing over it."""

    format: ServedFormat
    board: AnyBoard
    key: SigningKey
    run_id: str
    anchor_every: int
    chunk_size: int
    payload_format: int  # of patches (docs/format.md §2a); anchors are FULL records, format 1
    head_ttl_ms: int
    keep_anchors: int
    clock: Callable[[], float]
    _lock: threading.Lock
    _prev: ServedModel | None
    _prev_digests: list[bytes] | None
    _prev_version: int | None
    _prev_owned: bool
    _prev_manifest: bytes | None
    _counter: int
    _catalog: list[CatalogEntry]
    _anchor_requested: bool
    _dropped: list[CatalogEntry]
    _buffers: Buffers
    _lost: str | None

    def request_anchor(self) -> None:
        """Publish the next version as an anchor as well (e.g. before scaling up the fleet)."""
        self._anchor_requested = True

    def _anchor_due(self, version: int, anchor: bool) -> bool:
        return anchor or self._anchor_requested or version == 1 or version % self.anchor_every == 0

    def _wants_anchor(self, version: int, anchor: bool) -> bool:
        wanted = self._anchor_due(version, anchor)
        self._anchor_requested = False
        return wanted

    def refresh_head(self, *, only_after: float | None = None) -> bool:
        """Re-sign the head with a fresh expiry (the background refresher calls this while idle).

        ``only_after``: seconds; only if the board's head is at least that old (another signer of
        this host may have just re-signed it).  True if a head was written.
        """
        with self._lock:
            if not self._catalog:
                return False
            if only_after is not None:
                current = board_head(self.board, self.run_id)
                if current is not None and self.clock() * 1000 - current.created_ms < only_after * 1000:
                    return False
            self._write_head()
            return True

    def _commit(
        self,
        version: int,
        served: ServedModel,
        owned: bool,
        prepared: Prepared,
        anchor: bool,
        start: float,
        stages: Stages,
        *,
        refreshed: int,
    ) -> PublishInfo:
        """Encode, sign and write ``served`` as ``version`` (a patch when ``prepared`` has deltas against
        the previous version, and/or an anchor), then move the head.  Call with the chain lock held.
        """
        assert self._lock.locked()
        if self._lost is not None:
            raise HeadRaceError(self._lost)  # nothing more goes onto a board another publisher writes
        if refreshed * 2 > len(served):
            anchor = True  # most fp8 scales moved: the patch is dense anyway
        served.metadata.update(self.format.metadata(served.specs))  # served.format, quantization_config
        patchable = prepared.has_deltas and self._prev is not None and self._prev.specs == served.specs
        encoded_patch = None
        if patchable:  # else a new layout, which only an anchor reaches
            t = time.perf_counter()
            encoded_patch = assemble(prepared.deltas())  # while the workers finish the last tensors
            stages.add("encode", time.perf_counter() - t - prepared.waited)
        final = prepared.digests()
        stages.add("prepare", prepared.seconds)
        encoded_anchor = None
        if anchor or not patchable:
            with stages.time("anchor"):
                encoded_anchor = assemble(diff_tensor(spec, None, data) for spec, data in served)
        with stages.time("sign"):
            now_ms = int(self.clock() * 1000)
            common = {
                "run_id": self.run_id,
                "version": version,
                "now_ms": now_ms,
                "key": self.key,
                "chunk_size": self.chunk_size,
                "prev_manifest": self._prev_manifest,
                "metadata": served.metadata,
            }
            patch: Version | None = None
            anchor_v: Version | None = None
            if encoded_patch is not None:
                assert self._prev is not None and self._prev_digests is not None
                patch = sign_version(
                    encoded_patch,
                    served.specs,
                    final,
                    base_version=self._prev_version,
                    base_root=state_root(self._prev.specs, self._prev_digests),
                    **common,  # type: ignore[arg-type]
                )
            if encoded_anchor is not None:
                anchor_v = sign_version(encoded_anchor, served.specs, final, **common)  # type: ignore[arg-type]
        primary = patch or anchor_v
        assert primary is not None
        with stages.time("write"):
            for v in (anchor_v, patch):
                if v is not None:
                    mid = self.board.put_version(v)
                    self._catalog.append(
                        CatalogEntry(version, v.manifest.kind, v.manifest.base_version, v.manifest.payload_size, mid)
                    )
            if self._prev is not None and self._prev_owned:
                self._buffers.give(self._prev)
            self._prev, self._prev_digests, self._prev_owned = served, final, owned
            self._prev_version = version
            self._prev_manifest = primary.manifest.manifest_id
            self._retain()
            self._write_head()
            self._collect_garbage()
        if patch is not None and patch.encoded is not None:
            changed_fraction = patch.encoded.changed / max(patch.encoded.numel, 1)
        else:
            changed_fraction = 1.0
        return PublishInfo(
            version=version,
            changed_fraction=changed_fraction,
            patch_bytes=patch.manifest.payload_size if patch else 0,
            anchor_bytes=anchor_v.manifest.payload_size if anchor_v else None,
            served_bytes=served.nbytes,
            seconds=self.clock() - start,
            manifest_id=primary.manifest.manifest_id,
            stages=dict(stages.seconds),
        )

    def _retain(self) -> None:
        anchors = sorted(e.version for e in self._catalog if e.kind == Kind.ANCHOR)
        if len(anchors) <= self.keep_anchors:
            return
        oldest = anchors[-self.keep_anchors]
        self._dropped = [
            e for e in self._catalog if e.version < oldest or (e.version == oldest and e.kind == Kind.PATCH)
        ]
        self._catalog = [e for e in self._catalog if e not in self._dropped]

    def _write_head(self) -> None:
        """Sign and write the head for the chain's latest version (chain lock held).

        Under the board's per-run lock, the board's head is read again: another signer of this run
        on this host (a seed or cron job re-signing it) may have moved its counter, which this head
        then goes past.  A head for a version this publisher did not write is another history.
        """
        if self._lost is not None:
            raise HeadRaceError(self._lost)
        latest = max(self._catalog, key=lambda e: (e.version, e.kind == Kind.PATCH))
        with self.board.head_slot(self.run_id) as slot:
            current = None if slot.data is None else parse_head(slot.data)
            if current is not None and current.counter >= self._counter:
                known = {(e.version, e.manifest_id) for e in (*self._catalog, *self._dropped)}
                if current.version > latest.version or (current.version, current.manifest_id) not in known:
                    self._lost = (
                        f"the head of run {self.run_id!r} moved to version {current.version} (counter "
                        f"{current.counter}) under this publisher: another publisher writes this run"
                    )
                    raise HeadRaceError(self._lost)
                self._counter = current.counter
            now_ms = int(self.clock() * 1000)
            self._counter += 1
            head = Head(
                run_id=self.run_id,
                version=latest.version,
                manifest_id=latest.manifest_id,
                counter=self._counter,
                created_ms=now_ms,
                expires_ms=now_ms + self.head_ttl_ms,
                catalog=tuple(self._catalog),
            )
            try:
                slot.write(head.sign(self.key).to_bytes())
            except HeadRaceError as e:
                self._lost = str(e)  # the run is another publisher's now: nothing more is written
                raise

    def _collect_garbage(self) -> None:
        if self._dropped:
            try:
                self.board.collect_garbage(self._catalog)
            except (OSError, PatchswarmError) as e:
                # The head has moved: the version is published.  What is left costs storage only and goes at
                # the next collection; failing the publish would fail every later one (a stray object in a
                # store that cannot be listed, a delete refused).
                log.warning("publisher: old versions not deleted from %s: %s", self.board.location, e)
                return
            self._dropped = []
