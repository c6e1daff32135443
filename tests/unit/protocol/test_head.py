from __future__ import annotations

import dataclasses

import pytest

from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.errors import EquivocationError, ExpiredError, FormatError, RollbackError, UntrustedKeyError
from patchswarm.protocol.head import Head, HeadTracker, verify_head
from patchswarm.protocol.keys import SigningKey, TrustedKeys
from patchswarm.protocol.manifest import Kind

KEY = SigningKey.generate()
POLICY = TrustedKeys(frozenset([KEY.key_id]))
MID = b"\x01" * 32


def head(version: int = 2, counter: int = 5, expires: int = 10_000, run: str = "r1") -> Head:
    catalog = (
        CatalogEntry(1, Kind.ANCHOR, None, 100, b"\x00" * 32),
        CatalogEntry(version, Kind.PATCH, version - 1, 10, MID),
    )
    return Head(run, version, MID, counter, 0, expires, catalog)


def test_round_trip_and_verify() -> None:
    h = head()
    got, env = verify_head(h.sign(KEY).to_bytes(), POLICY, now_ms=5_000, skew_ms=0)
    assert got == h and env.key_id == KEY.key_id


def test_expired_head_means_frozen_board() -> None:
    with pytest.raises(ExpiredError, match="frozen"):
        verify_head(head(expires=1_000).sign(KEY).to_bytes(), POLICY, now_ms=5_000, skew_ms=1_000)


def test_untrusted_signer() -> None:
    with pytest.raises(UntrustedKeyError):
        verify_head(head().sign(SigningKey.generate()).to_bytes(), POLICY, now_ms=0, skew_ms=0)


def test_inconsistent_head_is_refused() -> None:
    bad = dataclasses.replace(head(), manifest_id=b"\x09" * 32)
    with pytest.raises(FormatError):
        Head.from_bytes(bad.to_bytes())


def test_tracker_refuses_rewind_replay_and_equivocation() -> None:
    t = HeadTracker("r1")
    h5 = head(version=3, counter=5)
    assert t.accept(h5, h5.sign(KEY))
    assert not t.accept(h5, h5.sign(KEY))  # same document again: not new, not an error
    old = head(version=2, counter=4)
    with pytest.raises(RollbackError):
        t.accept(old, old.sign(KEY))
    rewound = head(version=2, counter=6)
    with pytest.raises(RollbackError, match="rewinds"):
        t.accept(rewound, rewound.sign(KEY))
    fork = head(version=4, counter=5)
    with pytest.raises(EquivocationError):
        t.accept(fork, fork.sign(KEY))
    assert t.evidence and t.version == 3
    restored = HeadTracker.restore(t.state())
    with pytest.raises(RollbackError):
        restored.accept(old, old.sign(KEY))
    other_run = head(run="r2", counter=9)
    with pytest.raises(FormatError):
        t.accept(other_run, other_run.sign(KEY))
