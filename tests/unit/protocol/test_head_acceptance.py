"""Head acceptance without IO: the caller fetches certificates and passes the time in."""

from __future__ import annotations

import dataclasses

import pytest

from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.errors import (
    EquivocationError,
    ExpiredError,
    FormatError,
    MissingError,
    RollbackError,
    SignatureError,
    UntrustedKeyError,
)
from patchswarm.protocol.head import Head
from patchswarm.protocol.head_acceptance import HeadAcceptance
from patchswarm.protocol.keys import SigningKey, TrustedKeys
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.trust import Certificate, RootDocument, TrustState

RUN = "r1"
KEY = SigningKey.generate()
MID = b"\x01" * 32
NOW = 50_000


def head(counter: int, *, version: int = 2, expires: int = 100_000, run: str = RUN, created: int = 0) -> Head:
    catalog = (
        CatalogEntry(1, Kind.ANCHOR, None, 100, b"\x00" * 32),
        CatalogEntry(version, Kind.PATCH, version - 1, 10, MID),
    )
    return Head(run, version, MID, counter, created, expires, catalog)


def signed(h: Head, key: SigningKey = KEY) -> bytes:
    return h.sign(key).to_bytes()


def pinned() -> HeadAcceptance:
    return HeadAcceptance(TrustedKeys(frozenset([KEY.key_id])), RUN)


def test_a_head_is_accepted_and_moves_the_mark() -> None:
    a = pinned()
    assert a.uncertified_signer(signed(head(5))) is None  # pinned keys need no certificate
    assert a.accept(signed(head(5)), now_ms=NOW) == head(5)
    assert a.tracker.counter == 5
    assert (a.stats.head_expires_ms, a.stats.head_created_ms) == (100_000, 0)
    assert a.accept(signed(head(5)), now_ms=NOW, newer_than=5) is None  # not newer: nothing to follow
    assert a.accept(signed(head(6, version=3)), now_ms=NOW, newer_than=5) == head(6, version=3)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (signed(head(5), SigningKey.generate()), UntrustedKeyError),
        (signed(head(5, run="other")), FormatError),
        (signed(head(5)).replace(b"r1", b"r2"), SignatureError),
    ],
)
def test_a_refused_head_raises_and_is_counted(data: bytes, error: type[Exception]) -> None:
    a = pinned()
    with pytest.raises(error):
        a.accept(data, now_ms=NOW)
    assert a.stats.refused == {error.__name__: 1}
    assert a.stats.last_refusal is not None
    assert a.tracker.counter == -1


def test_rewind_and_equivocation_are_refused() -> None:
    a = pinned()
    a.accept(signed(head(5, version=3)), now_ms=NOW)
    with pytest.raises(RollbackError):
        a.accept(signed(head(4)), now_ms=NOW)
    with pytest.raises(EquivocationError):
        a.accept(signed(head(5, version=4)), now_ms=NOW)
    assert a.stats.refused == {"RollbackError": 1, "EquivocationError": 1}


def test_an_expired_head_marks_the_board_frozen_until_a_fresh_one_comes() -> None:
    a = pinned()
    old = head(5, expires=1_000, created=500)
    assert not a.is_fresh(old, NOW + a.skew_ms)
    with pytest.raises(ExpiredError):
        a.accept(signed(old), now_ms=NOW + a.skew_ms)
    assert (a.stats.frozen_since_ms, a.stats.head_created_ms) == (1_000, 500)
    a.accept(signed(head(6)), now_ms=NOW)
    assert a.stats.frozen_since_ms is None


def test_allow_expired_is_for_the_runs_own_signer() -> None:
    a = HeadAcceptance(TrustedKeys(frozenset([KEY.key_id])), RUN, allow_expired=True)
    assert a.accept(signed(head(5, expires=1_000)), now_ms=NOW + 10**9) is not None


def test_an_io_failure_reported_by_the_caller_is_counted() -> None:
    a = pinned()
    a.refuse(MissingError("no certificate"), signed(head(5)), NOW)
    assert a.stats.refused == {"MissingError": 1}
    assert a.stats.last_refusal == "no certificate"
    assert a.stats.frozen_since_ms is None


def test_a_mark_set_by_a_revoked_signer_is_dropped() -> None:
    root, old, new = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    trust = TrustState(root.key_id)
    a = HeadAcceptance(trust, RUN)
    # The signer's certificate comes first: the caller fetches it for the key ``uncertified_signer`` names.
    ahead = signed(head(1 << 40), old)
    assert a.uncertified_signer(ahead) == old.key_id
    trust.add_certificate(Certificate(old.key_id, RUN, 0, 10**9).sign(root).to_bytes())
    assert a.uncertified_signer(ahead) is None
    a.accept(ahead, now_ms=NOW)
    assert a.tracker.counter == 1 << 40
    # Root 1 revokes the old key and the root certifies a new one: the new signer's lower counter lands.
    trust.update_root(RootDocument(1, (root.key_id,), (old.key_id,)).sign(root).to_bytes())
    trust.add_certificate(Certificate(new.key_id, RUN, 0, 10**9).sign(root).to_bytes())
    assert a.accept(signed(head(7), new), now_ms=NOW, newer_than=1 << 40) == head(7)
    assert a.stats.marks_dropped == 1
    assert a.tracker.counter == 7


def test_a_malformed_envelope_is_a_format_error() -> None:
    with pytest.raises(FormatError):
        pinned().uncertified_signer(b"not an envelope")


def test_head_fields_are_checked_before_the_counter() -> None:
    a = pinned()
    a.accept(signed(head(5)), now_ms=NOW)
    other = dataclasses.replace(head(9), run_id="other")
    with pytest.raises(FormatError):
        a.accept(signed(other), now_ms=NOW, newer_than=10)
