from __future__ import annotations

import pytest

from patchswarm.protocol.errors import EquivocationError, ExpiredError, FormatError, RollbackError, UntrustedKeyError
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.trust import Certificate, RootDocument, TrustState

ROOT = SigningKey.generate()
TRAINER = SigningKey.generate()
DAY = 86_400_000


def cert(
    key: SigningKey = TRAINER, run: str = "r1", start: int = 0, end: int = DAY, signer: SigningKey = ROOT
) -> bytes:
    return Certificate(key.key_id, run, start, end).sign(signer).to_bytes()


def test_certified_key_is_trusted_only_for_its_run_and_window() -> None:
    t = TrustState(ROOT.key_id, skew_ms=1000)
    t.add_certificate(cert())
    t.check(TRAINER.key_id, run_id="r1", now_ms=DAY // 2)
    t.check(TRAINER.key_id, run_id="r1", now_ms=DAY + 999)  # within skew
    with pytest.raises(ExpiredError):
        t.check(TRAINER.key_id, run_id="r1", now_ms=DAY + 5000)
    with pytest.raises(UntrustedKeyError, match="not certified for run 'r2'"):
        t.check(TRAINER.key_id, run_id="r2", now_ms=0)
    with pytest.raises(UntrustedKeyError):
        t.check(SigningKey.generate().key_id, run_id="r1", now_ms=0)


def test_certificate_from_a_non_root_key_is_refused() -> None:
    t = TrustState(ROOT.key_id)
    with pytest.raises(UntrustedKeyError):
        t.add_certificate(cert(signer=TRAINER))


def test_root_chain_revocation_and_rotation() -> None:
    t = TrustState(ROOT.key_id)
    t.add_certificate(cert())
    new_root = SigningKey.generate()
    r1 = RootDocument(1, (ROOT.key_id,), (TRAINER.key_id,)).sign(ROOT).to_bytes()
    t.update_root(r1)
    with pytest.raises(UntrustedKeyError, match="revoked"):
        t.check(TRAINER.key_id, run_id="r1", now_ms=0)
    r2 = RootDocument(2, (new_root.key_id,), (TRAINER.key_id,)).sign(ROOT).to_bytes()
    t.update_root(r2)
    # The old root can no longer sign anything, and its certificates stop counting.
    t.update_root(RootDocument(3, (new_root.key_id,)).sign(new_root).to_bytes())
    with pytest.raises(UntrustedKeyError, match="not certified"):
        t.check(TRAINER.key_id, run_id="r1", now_ms=0)
    t.add_certificate(cert(signer=new_root))
    t.check(TRAINER.key_id, run_id="r1", now_ms=0)
    with pytest.raises(UntrustedKeyError):
        t.add_certificate(cert(key=SigningKey.generate()))
    with pytest.raises(UntrustedKeyError):
        t.update_root(RootDocument(4, (ROOT.key_id,)).sign(ROOT).to_bytes())
    t.update_root(RootDocument(4, (new_root.key_id,)).sign(new_root).to_bytes())
    assert t.root_version == 4


def test_root_rollback_skip_and_equivocation() -> None:
    t = TrustState(ROOT.key_id)
    r1 = RootDocument(1, (ROOT.key_id,)).sign(ROOT).to_bytes()
    t.update_root(r1)
    with pytest.raises(EquivocationError):
        t.update_root(RootDocument(1, (ROOT.key_id,), (TRAINER.key_id,)).sign(ROOT).to_bytes())
    with pytest.raises(RollbackError):
        t.update_root(r1)
    with pytest.raises(FormatError, match="skips"):
        t.update_root(RootDocument(3, (ROOT.key_id,)).sign(ROOT).to_bytes())


def test_documents_cannot_be_replayed_as_another_kind() -> None:
    t = TrustState(ROOT.key_id)
    with pytest.raises(FormatError):
        t.update_root(cert())
