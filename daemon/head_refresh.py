"""Re-signing a run's head: the one write every signer of a run (publisher, seed, cron) shares.

A head expires (a host notices a frozen board), so the run's signer re-signs it while the trainer
is idle, and a trainer that comes back after any pause continues the run from it.  Whoever writes:

- holds ``runs/<run>/.lock`` (flock) and re-reads the board's head under it, so two signers on one
  host never fork the head: a new head's counter is always above the board's (never reused), and
  its version never below the board's (never rewound);
- trusts the board's head through the signer's own trust chain (its key, or keys certified for the
  run by the root that certified it, revocations applied), but tolerates its expiry: an expired
  head is still the run's latest word (``verify_head(allow_expired=True)``, used only here and by a
  resuming publisher, never by hosts).

Across hosts (a board on a network file system) flock may not hold: run one refresher per board.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from patchswarm.daemon.board import Board
from patchswarm.daemon.run_rules import DEFAULT_HEAD_TTL_S, check_head_ttl
from patchswarm.protocol.board_names import (
    CERT_TAG,
    HEAD_TAG,
    MAX_DOC_BYTES,
    MAX_HEAD_BYTES,
    cert_rel,
    head_rel,
    root_rel,
)
from patchswarm.protocol.errors import ExpiredError, PatchswarmError, UntrustedKeyError
from patchswarm.protocol.files import read_file
from patchswarm.protocol.head import Head, verify_head
from patchswarm.protocol.keys import KeyPolicy, SigningKey, TrustedKeys
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import TrustState


class HeadWriteError(PatchswarmError):
    """The board's head cannot be re-signed by this signer (none yet, another history, untrusted)."""


@contextmanager
def head_lock(board: Board, run_id: str) -> Iterator[None]:
    """Exclusive, per run, across the processes of this host (released when the holder dies)."""
    run_dir = board.path(head_rel(run_id)).parent
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def board_head_bytes(board: Board, run_id: str) -> bytes | None:
    path = board.path(head_rel(run_id))
    if not path.exists():
        return None
    return read_file(path, MAX_HEAD_BYTES)


def board_head(board: Board, run_id: str) -> Head | None:
    """The board's head as written (parsed, not verified: for a signer checking its own board)."""
    data = board_head_bytes(board, run_id)
    return None if data is None else Head.from_bytes(Envelope.from_bytes(data, HEAD_TAG).body)


def signer_policy(board: Board, key: SigningKey, certificate: bytes | None = None) -> KeyPolicy:
    """What a signer of a run trusts its board's head from.

    Without a certificate (a run trusted by key, not through a root): its own key only.  With one
    (given, or on the board under the key's id): every key the same root certified for the run,
    after the board's root documents from that root on (so a revoked key is refused), and its own.
    A newly certified key thus continues a run an earlier key signed (key rotation).
    """
    cert = certificate
    if cert is None:
        path = board.path(cert_rel(key.key_id))
        cert = read_file(path, MAX_DOC_BYTES) if path.exists() else None
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


def verify_board_head(board: Board, data: bytes, policy: KeyPolicy, run_id: str, *, now_ms: int) -> Head:
    """The board's head, checked as its signer does: signature and trust chain, expiry tolerated."""
    env = Envelope.from_bytes(data, HEAD_TAG)
    if isinstance(policy, TrustState) and env.key_id not in policy.certificates:
        path = board.path(cert_rel(env.key_id))
        if path.exists():
            policy.add_certificate(read_file(path, MAX_DOC_BYTES))
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
    board: Board,
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
    if not board.path(head_rel(run_id)).exists():
        raise missing  # before the lock, which would create the run's folder
    if certificate is not None and board.read(cert_rel(key.key_id)) != certificate:
        board.put_certificate(key.key_id, certificate)
    policy = signer_policy(board, key, certificate)
    with head_lock(board, run_id):
        data = board_head_bytes(board, run_id)
        if data is None:
            raise missing
        now_ms = int(clock() * 1000)
        head = verify_board_head(board, data, policy, run_id, now_ms=now_ms)
        if only_after is not None and now_ms - head.created_ms < only_after * 1000:
            return None
        check_own_key(policy, key, run_id, now_ms=now_ms)
        out = resign(head, key, counter=head.counter + 1, now_ms=now_ms, ttl_ms=ttl_ms)
        board.put_head(run_id, out)
        return Head.from_bytes(Envelope.from_bytes(out, HEAD_TAG).body)
