"""Equivocation by a run's signer: detected by the head tracker, proved with both signed heads,
kept on disk by the pull state, and the run halted (also across a restart)."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchswarm.daemon.pull_state import PullState, evidence_dir
from patchswarm.protocol.board_names import HEAD_TAG
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.errors import EquivocationError, RollbackError, UntrustedKeyError
from patchswarm.protocol.head import Head, HeadTracker
from patchswarm.protocol.keys import SigningKey, TrustedKeys
from patchswarm.protocol.manifest import Kind
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import Certificate, RootDocument, TrustState
from patchswarm.swarm.board_sources import DirSource
from patchswarm.swarm.puller import Puller

KEY = SigningKey.generate()
RUN = "r1"


def entry(version: int, tag: int, kind: Kind = Kind.PATCH) -> CatalogEntry:
    base = None if kind == Kind.ANCHOR else version - 1
    return CatalogEntry(version, kind, base, 10, bytes([tag]) * 32)


def head(counter: int, *entries: CatalogEntry) -> Head:
    top = max(entries, key=lambda e: e.version)
    return Head(RUN, top.version, top.manifest_id, counter, 0, 10_000, (entry(1, 1, Kind.ANCHOR), *entries))


def signed(h: Head, key: SigningKey = KEY) -> tuple[Head, Envelope]:
    return h, h.sign(key)


def test_a_newer_head_naming_another_manifest_for_a_known_version_halts_the_run() -> None:
    t = HeadTracker(RUN)
    first = signed(head(5, entry(2, 2), entry(3, 3)))
    assert t.accept(*first)
    fork = signed(head(6, entry(2, 2), entry(3, 9), entry(4, 4)))  # version 3 rewritten
    with pytest.raises(EquivocationError, match="version 3") as info:
        t.accept(*fork)
    # The proof is both complete signed envelopes, each verifiable on its own.
    a, b = (Envelope.from_bytes(x, HEAD_TAG) for x in (info.value.first, info.value.second))
    a.check_signature()
    b.check_signature()
    assert Head.from_bytes(a.body) == first[0] and Head.from_bytes(b.body) == fork[0]
    assert t.evidence == [(info.value.first, info.value.second)]
    # Halted: even an honest successor is refused, and the mark did not move.
    honest = signed(head(7, entry(2, 2), entry(3, 3), entry(4, 5)))
    with pytest.raises(EquivocationError, match="halted"):
        t.accept(*honest)
    assert (t.counter, t.version) == (5, 3)


def test_retention_and_new_versions_are_not_equivocation() -> None:
    t = HeadTracker(RUN)
    assert t.accept(*signed(head(5, entry(2, 2), entry(3, 3), entry(3, 30, Kind.ANCHOR))))
    # Older entries dropped, the patch of version 3 dropped, new versions added: an honest publisher.
    assert t.accept(*signed(head(6, entry(3, 30, Kind.ANCHOR), entry(4, 4), entry(4, 40, Kind.ANCHOR))))
    assert t.halted is None and (t.counter, t.version) == (6, 4)


def test_same_counter_different_head_is_equivocation_with_envelopes_as_proof() -> None:
    t = HeadTracker(RUN)
    h, env = signed(head(5, entry(2, 2)))
    t.accept(h, env)
    other = signed(head(5, entry(2, 7)))
    with pytest.raises(EquivocationError) as info:
        t.accept(*other)
    assert info.value.first == env.to_bytes() and info.value.second == other[1].to_bytes()


def test_envelope_survives_state_round_trip() -> None:
    t = HeadTracker(RUN)
    t.accept(*signed(head(5, entry(2, 2))))
    r = HeadTracker.restore(t.state())
    assert r.envelope == t.envelope and r.body == t.body
    with pytest.raises(EquivocationError):
        r.accept(*signed(head(6, entry(2, 8), entry(3, 3))))


def test_pull_state_writes_the_proof_at_once_and_stays_halted_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "pull-state.msgpack"
    state = PullState.load(path, RUN)
    state.tracker.accept(*signed(head(5, entry(2, 2))))
    with pytest.raises(EquivocationError):
        state.tracker.accept(*signed(head(5, entry(2, 6))))
    files = list(evidence_dir(path).iterdir())
    assert len(files) == 1  # written when found, before any save() (a crash must not lose it)
    again = PullState.load(path, RUN)  # no state file was saved: only the proof survives
    assert again.tracker.halted is not None and "two different signed documents" in again.tracker.halted
    with pytest.raises(EquivocationError, match="halted"):
        again.tracker.accept(*signed(head(9, entry(2, 2), entry(3, 3))))
    assert PullState.load(path, "another-run").tracker.halted is None


@pytest.mark.asyncio
async def test_accept_head_counts_refusals_by_reason(tmp_path: Path) -> None:
    puller = Puller(DirSource(tmp_path), TrustedKeys(frozenset([KEY.key_id])), RUN, clock=lambda: 1.0)
    assert await puller.accept_head(signed(head(5, entry(2, 2)))[1].to_bytes()) is not None
    assert await puller.accept_head(signed(head(4, entry(2, 2)))[1].to_bytes(), newer_than=5) is None  # lagging
    with pytest.raises(RollbackError):
        await puller.accept_head(signed(head(4, entry(2, 2)))[1].to_bytes())
    with pytest.raises(UntrustedKeyError):
        await puller.accept_head(signed(head(6, entry(2, 2)), SigningKey.generate())[1].to_bytes())
    assert puller.stats.refused == {"RollbackError": 1, "UntrustedKeyError": 1}
    assert puller.stats.head_expires_ms == 10_000


@pytest.mark.asyncio
async def test_accept_head_with_a_trust_root_needs_a_certificate(tmp_path: Path) -> None:
    root = SigningKey.generate()
    puller = Puller(DirSource(tmp_path), TrustState(root.key_id), RUN, clock=lambda: 1.0)
    with pytest.raises(UntrustedKeyError, match="no certificate"):
        await puller.accept_head(signed(head(5, entry(2, 2)))[1].to_bytes())
    assert puller.stats.last_refusal is not None and "no certificate" in puller.stats.last_refusal


@pytest.mark.asyncio
async def test_a_fast_forward_by_a_leaked_key_does_not_outlive_its_revocation(tmp_path: Path) -> None:
    root, successor = SigningKey.generate(), SigningKey.generate()
    trust = TrustState(root.key_id)
    for k in (KEY, successor):
        trust.add_certificate(Certificate(k.key_id, RUN, 0, 10**13).sign(root).to_bytes())
    puller = Puller(DirSource(tmp_path), trust, RUN, clock=lambda: 1.0)
    fast = signed(head(1 << 40, entry(2, 2)))[1].to_bytes()  # the leaked key (still trusted) jumps ahead
    assert await puller.accept_head(fast) is not None
    honest = signed(head(6, entry(2, 2), entry(3, 3)), successor)[1].to_bytes()
    assert await puller.accept_head(honest, newer_than=1 << 40) is None  # looks like a lagging source
    with pytest.raises(RollbackError):
        await puller.accept_head(honest)
    root1 = RootDocument(1, (root.key_id,), (KEY.key_id,)).sign(root).to_bytes()
    trust.update_root(root1)
    got = await puller.accept_head(honest, newer_than=1 << 40)
    assert got is not None and (puller.tracker.counter, puller.tracker.version) == (6, 3)
    assert puller.stats.marks_dropped == 1
    with pytest.raises(UntrustedKeyError, match="revoked"):
        await puller.accept_head(fast)
    # After a restart (root documents restored, certificates not yet fetched) the successor's mark
    # stands: only an explicit revocation drops a mark, so replays are still refused.
    restarted = TrustState(root.key_id)
    restarted.update_root(root1)
    cert = tmp_path / "certs" / successor.key_id.hex()
    cert.parent.mkdir()
    cert.write_bytes(Certificate(successor.key_id, RUN, 0, 10**13).sign(root).to_bytes())
    fresh = Puller(DirSource(tmp_path), restarted, RUN, clock=lambda: 1.0, tracker=puller.tracker)
    with pytest.raises(RollbackError):
        await fresh.accept_head(signed(head(5, entry(2, 2)), successor)[1].to_bytes())
    assert fresh.stats.marks_dropped == 0
