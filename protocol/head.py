"""The signed head of a run: the one mutable document on a board.

It names the latest version and carries the catalog of retained versions (so a host can plan
its catch-up before fetching any manifest), with a short expiry (a host notices a frozen
board) and a counter that increases with every re-signing.  :class:`HeadTracker` holds a
host's high-water mark and refuses rewinds, replays of older heads and equivocation (two
different heads with the same counter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from patchswarm.protocol.board_names import HEAD_TAG
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.docfields import as_digest, as_list, as_map, as_str, as_uint
from patchswarm.protocol.docfields import field as get
from patchswarm.protocol.errors import (
    EquivocationError,
    ExpiredError,
    FormatError,
    RollbackError,
    UnsupportedFormatError,
)
from patchswarm.protocol.keys import KeyPolicy, SigningKey
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.signed import Envelope

FORMAT = 1
MAX_CATALOG = 100_000


@dataclass(frozen=True, slots=True)
class Head:
    run_id: str
    version: int
    manifest_id: bytes
    counter: int
    created_ms: int
    expires_ms: int
    catalog: tuple[CatalogEntry, ...]

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "catalog": [e.to_wire() for e in self.catalog],
            "counter": self.counter,
            "created_ms": self.created_ms,
            "expires_ms": self.expires_ms,
            "format": FORMAT,
            "manifest": self.manifest_id,
            "run": self.run_id,
            "version": self.version,
        }
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed

    @classmethod
    def from_bytes(cls, body: bytes) -> Head:
        try:
            d = as_map(msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True), "head")
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise FormatError(f"head is malformed ({type(exc).__name__})") from None
        if get(d, "format", "head") != FORMAT:
            raise UnsupportedFormatError(f"head format {d['format']!r} (this build reads {FORMAT})")
        raw_catalog = as_list(get(d, "catalog", "head"), "catalog")
        if len(raw_catalog) > MAX_CATALOG:
            raise FormatError("head catalog too long")
        catalog = []
        for e in raw_catalog:
            if not (isinstance(e, list) and len(e) == 5):
                raise FormatError("catalog entry must be [version, kind, base, size, manifest]")
            try:
                kind = Kind(e[1])
            except ValueError:
                raise FormatError(f"catalog entry has unknown kind {e[1]!r}") from None
            catalog.append(
                CatalogEntry(
                    version=as_uint(e[0], "catalog version"),
                    kind=kind,
                    base_version=None if e[2] is None else as_uint(e[2], "catalog base"),
                    size=as_uint(e[3], "catalog size"),
                    manifest_id=as_digest(e[4], "catalog manifest id"),
                )
            )
        head = cls(
            run_id=as_str(get(d, "run", "head"), "head run"),
            version=as_uint(get(d, "version", "head"), "head version"),
            manifest_id=as_digest(get(d, "manifest", "head"), "head manifest"),
            counter=as_uint(get(d, "counter", "head"), "head counter"),
            created_ms=as_uint(get(d, "created_ms", "head"), "head created_ms"),
            expires_ms=as_uint(get(d, "expires_ms", "head"), "head expires_ms"),
            catalog=tuple(catalog),
        )
        if head.to_bytes() != body:
            raise FormatError("head is not canonical")
        head.check()
        return head

    def check(self) -> None:
        if not any(e.version == self.version and e.manifest_id == self.manifest_id for e in self.catalog):
            raise FormatError("head's version is not in its own catalog")
        if any(e.version > self.version for e in self.catalog):
            raise FormatError("head's catalog lists versions past the head")
        for e in self.catalog:
            if (e.kind == Kind.ANCHOR) != (e.base_version is None) or (
                e.base_version is not None and e.base_version >= e.version
            ):
                raise FormatError(f"catalog entry for version {e.version} has an impossible base")

    def sign(self, key: SigningKey) -> Envelope:
        return Envelope.sign(HEAD_TAG, self.to_bytes(), key)


def verify_head(
    data: bytes, policy: KeyPolicy, *, now_ms: int, skew_ms: int, allow_expired: bool = False
) -> tuple[Head, Envelope]:
    """Signature -> parse -> key policy for the head's run -> expiry (with skew).

    ``allow_expired`` is for the run's own signer only (a publisher resuming, ``patchswarm head
    refresh``): an expired head is still the board's latest word for the run, which it re-signs
    with a fresh expiry.  Hosts never pass it: to them an expired head means a frozen board.
    """
    env = Envelope.from_bytes(data, HEAD_TAG)
    env.check_signature()
    head = Head.from_bytes(env.body)
    policy.check(env.key_id, run_id=head.run_id, now_ms=None if allow_expired else now_ms)
    if not allow_expired and head_expired(head, now_ms=now_ms, skew_ms=skew_ms):
        raise ExpiredError(
            f"head of run {head.run_id!r} (counter {head.counter}) expired at {utc_text(head.expires_ms)}: "
            "the board may be frozen",
            document="head",
        )
    return head, env


def head_expired(head: Head, *, now_ms: int, skew_ms: int) -> bool:
    """Past its expiry by more than the allowed clock skew."""
    return now_ms - skew_ms > head.expires_ms


def utc_text(ms: int) -> str:
    """A time in milliseconds, as hosts and operators read it in messages."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


@dataclass(slots=True)
class HeadTracker:
    """A host's high-water mark for one run; persisted by the caller via ``state()``/``restore``.

    Equivocation (a forked or compromised signer) halts the run: two different signed heads with
    one counter, or a newer head that names a different manifest for a version an earlier head
    already listed.  Both signed heads are kept in ``evidence`` (and handed to ``on_equivocation``
    so the host can store them), and every later head is refused until an operator intervenes.
    """

    run_id: str
    counter: int = -1
    version: int = -1
    body: bytes = b""
    envelope: bytes = b""  # the signed head behind ``body``: half of the proof if equivocation shows up
    evidence: list[tuple[bytes, bytes]] = field(default_factory=list)
    halted: str | None = None
    on_equivocation: Callable[[EquivocationError], None] | None = None

    def accept(self, head: Head, env: Envelope) -> bool:
        """True if ``head`` is newer than what was seen; raises on rewind, replay or equivocation."""
        if head.run_id != self.run_id:
            raise FormatError(f"head is for run {head.run_id!r}, this host follows {self.run_id!r}")
        if self.halted is not None:
            raise EquivocationError(f"run {self.run_id!r} is halted ({self.halted})", *self.evidence[-1])
        if head.counter == self.counter:
            if env.body != self.body:
                self._equivocation(f"head counter {head.counter} of run {self.run_id!r}", env)
            return False
        if head.counter < self.counter:
            raise RollbackError(f"head counter {head.counter} is older than seen {self.counter}")
        if head.version < self.version:
            raise RollbackError(f"head rewinds run {self.run_id!r} from version {self.version} to {head.version}")
        if self.body:
            forked = _forked_version(Head.from_bytes(self.body), head)
            if forked is not None:
                self._equivocation(
                    f"version {forked} of run {self.run_id!r} (heads {self.counter} and {head.counter})", env
                )
        self.counter, self.version, self.body, self.envelope = head.counter, head.version, env.body, env.to_bytes()
        return True

    def forget(self) -> None:
        """Drop the mark (its signer was revoked since): the next valid head sets it afresh."""
        self.counter, self.version, self.body, self.envelope = -1, -1, b"", b""

    def _equivocation(self, what: str, env: Envelope) -> None:
        # Without the signed envelope of the earlier head (a state from an older build) the bodies still
        # show the conflict, but only the envelopes prove who signed it.
        first, second = self.envelope or self.body, env.to_bytes()
        err = EquivocationError(what, first, second)
        self.evidence.append((first, second))
        self.halted = str(err)
        if self.on_equivocation is not None:
            self.on_equivocation(err)
        raise err

    def state(self) -> dict[str, Any]:
        return {
            "run": self.run_id,
            "counter": self.counter,
            "version": self.version,
            "body": self.body,
            "envelope": self.envelope,
        }

    @classmethod
    def restore(cls, state: dict[str, Any]) -> HeadTracker:
        return cls(
            str(state["run"]),
            int(state["counter"]),
            int(state["version"]),
            bytes(state["body"]),
            bytes(state.get("envelope", b"")),
        )


def _forked_version(old: Head, new: Head) -> int | None:
    """A version ``old`` already covered for which ``new`` lists a manifest ``old`` did not.

    A publisher only ever adds catalog entries for versions past its previous head (retention
    only removes), so a new entry at or below the old head's version is a second history.
    """
    known: dict[int, set[bytes]] = {}
    for e in old.catalog:
        known.setdefault(e.version, set()).add(e.manifest_id)
    for e in new.catalog:
        if e.version <= old.version and e.manifest_id not in known.get(e.version, {e.manifest_id}):
            return e.version
    return None
