"""Accepting a head: every rule a host applies before it follows a signed head, with no IO.

``HeadAcceptance`` verifies a head's bytes (signature, certified key, expiry, the run it is for),
drops a high-water mark whose signer the root has since revoked, and moves the mark past the head
(``HeadTracker``: no rewind, no equivocation), counting each refusal in ``PullStats`` by error
class.  Fetching what it needs (a signer's certificate, a newer root) is the caller's IO: it asks
``uncertified_signer`` first, fetches, then calls ``accept``.  Time comes in as ``now_ms``.
swarm/puller.py's ``Puller`` drives it for a host, the node through the puller.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from patchswarm.protocol.board_names import HEAD_TAG
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.errors import ExpiredError, FormatError, PatchswarmError
from patchswarm.protocol.head import Head, HeadTracker, head_expired, verify_head
from patchswarm.protocol.keys import KeyPolicy
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import DEFAULT_SKEW_MS, TrustState

log = logging.getLogger("patchswarm.pull")


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
    unreadable: int = 0  # versions skipped unfetched: their manifest needs what this build cannot read


class HeadAcceptance:
    """The head rules of one run for one host: its trust, its high-water mark and its statistics."""

    def __init__(
        self,
        trust: KeyPolicy,
        run_id: str,
        *,
        tracker: HeadTracker | None = None,
        allow_expired: bool = False,
        stats: PullStats | None = None,
    ) -> None:
        """``allow_expired``: only for the run's own signer resuming it (daemon/publisher.py): an
        expired head is still the run's latest word to it.  Never for a host."""
        self.trust = trust
        self.run_id = run_id
        self.tracker = tracker or HeadTracker(run_id)
        self.allow_expired = allow_expired
        self.stats = stats if stats is not None else PullStats()

    @property
    def skew_ms(self) -> int:
        return self.trust.skew_ms if isinstance(self.trust, TrustState) else DEFAULT_SKEW_MS

    def is_fresh(self, head: Head, now_ms: int) -> bool:
        """``head`` has not expired (beyond the trust's clock skew) at ``now_ms``."""
        return not head_expired(head, now_ms=now_ms, skew_ms=self.skew_ms)

    def uncertified_signer(self, data: bytes) -> bytes | None:
        """The key id of the head's signer if its certificate must be fetched before ``accept``.

        A malformed envelope raises FormatError; the caller reports it (and any failure to fetch the
        certificate) with ``refuse``."""
        key_id = Envelope.from_bytes(data, HEAD_TAG).key_id
        if not isinstance(self.trust, TrustState) or key_id in self.trust.certificates:
            return None
        return key_id

    def accept(self, data: bytes, *, now_ms: int, newer_than: int = -1) -> Head | None:
        """Verify a head from any source and move the high-water mark past it.

        Returns the head if its counter is above ``newer_than`` (what the caller follows now),
        None for one that is not (a lagging source: nothing to do).  Anything refused (forged,
        untrusted or revoked signer, expired, another run, a rewind, equivocation) raises and is
        counted in ``stats.refused`` by error class.
        """
        try:
            head, env = verify_head(
                data, self.trust, now_ms=now_ms, skew_ms=self.skew_ms, allow_expired=self.allow_expired
            )
            if head.run_id != self.run_id:  # before the counter: another run's head is never "just old"
                raise FormatError(f"head is for run {head.run_id!r}, this host follows {self.run_id!r}")
            if self._mark_signer_revoked():
                newer_than = -1  # the caller's counter came from the same void head
            if head.counter < newer_than:
                return None
            self.tracker.accept(head, env)
        except PatchswarmError as e:
            self.refuse(e, data, now_ms)
            raise
        self.stats.frozen_since_ms = None
        if head.counter == self.tracker.counter:
            self.stats.head_expires_ms = head.expires_ms
            self.stats.head_created_ms = head.created_ms
        return head if head.counter > newer_than else None

    def refuse(self, error: PatchswarmError, data: bytes, now_ms: int) -> None:
        """Count a head refused with ``error``; one refused for its age marks the board frozen."""
        self.stats.refused[type(error).__name__] += 1
        self.stats.last_refusal = str(error)
        if isinstance(error, ExpiredError):
            self._note_expired(data, now_ms)

    def _note_expired(self, data: bytes, now_ms: int) -> None:
        """A head refused for its age (not its signer's certificate): the board looks frozen since it expired."""
        try:
            head = Head.from_bytes(Envelope.from_bytes(data, HEAD_TAG).body)  # its signature was checked
        except PatchswarmError:
            return
        if head.run_id == self.run_id and head_expired(head, now_ms=now_ms, skew_ms=self.skew_ms):
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
