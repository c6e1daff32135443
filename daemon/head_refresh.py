"""Re-signing a run's head: the one write every signer of a run (publisher, seed, cron) shares.

A head expires (a host notices a frozen board), so the run's signer re-signs it while the trainer
is idle, and a trainer that comes back after any pause continues the run from it.  Whoever writes:

- replaces the head through the board's ``head_slot``: on a directory, under ``runs/<run>/.lock``
  (flock) with the head re-read under it; in an object store, with a write conditional on the ETag
  of the head it read (daemon/board_store.py).  So two signers never fork the head: a new head's
  counter is always above the board's (never reused), and its version never below the board's
  (never rewound);
- trusts the board's head through the signer's own trust chain (its key, or keys certified for the
  run by the root that certified it, revocations applied), but tolerates its expiry: an expired
  head is still the run's latest word (``verify_head(allow_expired=True)``, used only here and by a
  resuming publisher, never by hosts).

Across hosts a directory board's flock may not hold (a network file system): run one refresher
per such board, or use an object store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from patchswarm.daemon.board_store import AnyBoard
from patchswarm.daemon.run_rules import DEFAULT_HEAD_TTL_S, check_head_ttl
from patchswarm.protocol.board_names import (
    CERT_TAG,
    HEAD_TAG,
    cert_rel,
    head_rel,
    root_rel,
)
from patchswarm.protocol.errors import ExpiredError, PatchswarmError, UntrustedKeyError
from patchswarm.protocol.head import Head, verify_head
from patchswarm.protocol.keys import KeyPolicy, SigningKey, TrustedKeys
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import TrustState


class HeadWriteError(PatchswarmError):
    """The board's head cannot be re-signed by this signer (none yet, another history, untrusted)."""


def board_head_bytes(board: AnyBoard, run_id: str) -> bytes | None:
    return board.read(head_rel(run_id))


def board_head(board: AnyBoard, run_id: str) -> Head | None:
    """The board's head as written (parsed, not verified: for a signer checking its own board)."""
    data = board_head_bytes(board, run_id)
    return None if data is None else parse_head(data)


def parse_head(data: bytes) -> Head:
    return Head.from_bytes(Envelope.from_bytes(data, HEAD_TAG).body)


def signer_policy(board: AnyBoard, key: SigningKey, certificate: bytes | None = None) -> KeyPolicy:
    """What a signer of a run trusts its board's head from.

    Without a certificate (a run trusted by key, not through a root): its own key only.  With one
    (given, or on the board under the key's id): every key the same root certified for the run,
    after the board's root documents from that root on (so a revoked key is refused), and its own.
    A newly certified key thus continues a run an earlier key signed (key rotation).
    """
    cert = certificate if certificate is not None else board.read(cert_rel(key.key_id))
    if cert is None:
        return TrustedKeys(frozenset([key.key_id]))
    trust = TrustState(Envelope.from_bytes(cert, CERT_TAG).key_id)
    for version in board.root_versions():
        data = board.read(root_rel(version))
        try:
            if data is None:
                break
            trust.update_root(data)
        except PatchswarmError:
            break  # a chain from another root: the certificate's signer alone is trusted
    trust.add_certificate(cert)
    return trust


def verify_board_head(board: AnyBoard, data: bytes, policy: KeyPolicy, run_id: str, *, now_ms: int) -> Head:
    """The board's head, checked as its signer does: signature and trust chain, expiry tolerated."""
    env = Envelope.from_bytes(data, HEAD_TAG)
    if isinstance(policy, TrustState) and env.key_id not in policy.certificates:
        cert = board.read(cert_rel(env.key_id))
        if cert is not None:
            policy.add_certificate(cert)
    try:
        head, _ = verify_head(data, policy, now_ms=now_ms, skew_ms=0, allow_expired=True)
    except UntrustedKeyError as e:
        raise UntrustedKeyError(
            f"the head of run {run_id!r} on this board was signed by key {env.key_id.hex()[:16]}…, which this "
            f"signer does not trust ({e}): certify this key for the run with the same root, or use a new run id"
        ) from None
    if head.run_id != run_id:
        raise HeadWriteError(f"runs/{run_id}/head is a head of run {head.run_id!r}")
    return head


def check_own_key(policy: KeyPolicy, key: SigningKey, run_id: str, *, now_ms: int) -> None:
    """Refuse to sign with a key hosts would refuse now (uncertified, revoked, certificate expired)."""
    try:
        policy.check(key.key_id, run_id=run_id, now_ms=now_ms)
    except (UntrustedKeyError, ExpiredError) as e:
        raise UntrustedKeyError(f"this key cannot sign run {run_id!r}: {e}") from None


def resign(head: Head, key: SigningKey, *, counter: int, now_ms: int, ttl_ms: int) -> bytes:
    fresh = replace(head, counter=counter, created_ms=now_ms, expires_ms=now_ms + ttl_ms)
    return fresh.sign(key).to_bytes()


def refresh_board_head(
    board: AnyBoard,
    key: SigningKey,
    run_id: str,
    *,
    head_ttl: float = DEFAULT_HEAD_TTL_S,
    certificate: bytes | None = None,
    only_after: float | None = None,
    clock: Callable[[], float] = time.time,
) -> Head | None:
    """Re-sign the board's head once: same version and catalog, counter + 1, a fresh expiry.

    ``only_after``: seconds; re-sign only if the board's head is at least that old (a background
    refresher: another signer may have just done it).  Returns the new head, or None when none was due.
    """
    ttl_ms = int(check_head_ttl(head_ttl) * 1000)
    missing = HeadWriteError(f"the board has no head for run {run_id!r} yet: publish a version first")
    if board.read(head_rel(run_id)) is None:
        raise missing  # before the lock, which would create the run's folder
    if certificate is not None and board.read(cert_rel(key.key_id)) != certificate:
        board.put_certificate(key.key_id, certificate)
    policy = signer_policy(board, key, certificate)
    with board.head_slot(run_id) as slot:
        data = slot.data
        if data is None:
            raise missing
        now_ms = int(clock() * 1000)
        head = verify_board_head(board, data, policy, run_id, now_ms=now_ms)
        if only_after is not None and now_ms - head.created_ms < only_after * 1000:
            return None
        check_own_key(policy, key, run_id, now_ms=now_ms)
        out = resign(head, key, counter=head.counter + 1, now_ms=now_ms, ttl_ms=ttl_ms)
        slot.write(out)
        return Head.from_bytes(Envelope.from_bytes(out, HEAD_TAG).body)
