from __future__ import annotations

import dataclasses

import msgpack
import pytest

from patchswarm.protocol.errors import (
    ChunkError,
    ExpiredError,
    FormatError,
    SignatureError,
    TruncatedError,
    UnsupportedFormatError,
    UntrustedKeyError,
)
from patchswarm.protocol.keys import SigningKey, TrustedKeys
from patchswarm.protocol.manifest import FORMAT_VERSION, Manifest, SignedManifest
from patchswarm.protocol.patchfile import build_version, open_file, pack_file
from tests.support.helpers import adam_like_pair

KEY = SigningKey.generate()
TRUST = TrustedKeys(frozenset([KEY.key_id]))


@pytest.fixture(scope="module")
def version():  # type: ignore[no-untyped-def]
    base, target = adam_like_pair()
    return build_version(
        base, target, run_id="run-a", version=5, base_version=4, now_ms=1_000, key=KEY, chunk_size=4096
    )


def test_manifest_round_trips_canonically(version) -> None:  # type: ignore[no-untyped-def]
    m = version.manifest
    assert Manifest.from_bytes(m.to_bytes()) == m
    env = SignedManifest.from_bytes(version.signed.to_bytes())
    assert env.verify(TRUST, now_ms=2_000) == m
    assert len(m.chunks) > 1 and sum(c.size for c in m.chunks) == m.payload_size


def test_non_canonical_bytes_are_rejected(version) -> None:  # type: ignore[no-untyped-def]
    obj = msgpack.unpackb(version.manifest.to_bytes(), raw=False)
    reordered = msgpack.packb(dict(reversed(list(obj.items()))), use_bin_type=True)
    with pytest.raises(FormatError, match="canonical"):
        Manifest.from_bytes(reordered)


def test_unknown_format_version(version) -> None:  # type: ignore[no-untyped-def]
    obj = msgpack.unpackb(version.manifest.to_bytes(), raw=False)
    obj["format"] = FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError):
        Manifest.from_bytes(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize(
    "change",
    [
        {"payload_size": 1},
        {"target_root": b"\0" * 32},
        {"layout_hash": b"\1" * 32},
        {"base_version": 9},
        {"expires_ms": 0},
        {"chunk_size": 12},
    ],
)
def test_inconsistent_fields_are_rejected(version, change) -> None:  # type: ignore[no-untyped-def]
    bad = dataclasses.replace(version.manifest, **change)
    with pytest.raises(FormatError):
        Manifest.from_bytes(bad.to_bytes())


def test_signature_checks(version) -> None:  # type: ignore[no-untyped-def]
    env = version.signed
    with pytest.raises(UntrustedKeyError):
        env.verify(TrustedKeys(frozenset([SigningKey.generate().key_id])))
    e = env.envelope
    forged = SignedManifest(dataclasses.replace(e, body=e.body[:-1] + bytes([e.body[-1] ^ 1])))
    with pytest.raises(SignatureError):
        forged.verify(TRUST)
    with pytest.raises(SignatureError, match="not signed"):
        SignedManifest(dataclasses.replace(e, key_id=b"", signature=b"")).verify(TRUST)
    other = SigningKey.generate()
    swapped = SignedManifest(dataclasses.replace(e, key_id=other.key_id))
    with pytest.raises(SignatureError):
        swapped.verify(TrustedKeys(frozenset([other.key_id])))


def test_expiry_with_skew(version) -> None:  # type: ignore[no-untyped-def]
    exp = version.manifest.expires_ms
    version.signed.verify(TRUST, now_ms=exp + 500, skew_ms=1_000)
    with pytest.raises(ExpiredError):
        version.signed.verify(TRUST, now_ms=exp + 5_000, skew_ms=1_000)


def test_patch_file_checks(version) -> None:  # type: ignore[no-untyped-def]
    data = pack_file(version)
    assert open_file(data, TRUST).manifest == version.manifest
    with pytest.raises(TruncatedError):
        open_file(data[:-1], TRUST)
    with pytest.raises(FormatError):
        open_file(data + b"x", TRUST)
    with pytest.raises(FormatError):
        open_file(b"NOTAPATCH" + data[9:], TRUST)
    flipped = bytearray(data)
    flipped[-10] ^= 0x40
    with pytest.raises(ChunkError):
        open_file(bytes(flipped), TRUST)


# ---------------------------------------------------------------- needs (manifest format 2)


@pytest.fixture(scope="module")
def format2():  # type: ignore[no-untyped-def]
    base, target = adam_like_pair(seed=11)
    return build_version(
        base, target, run_id="run-a", version=5, base_version=4, now_ms=1_000, key=KEY, payload_format=2
    )


def test_a_format_2_payload_is_declared_in_a_format_2_manifest_and_round_trips(format2) -> None:  # type: ignore[no-untyped-def]
    m = format2.manifest
    assert format2.payload[4] == 2 and m.needs == {"payload_format": 2} and m.payload_format == 2
    obj = msgpack.unpackb(m.to_bytes(), raw=False)
    assert obj["format"] == 2 and obj["needs"] == {"payload_format": 2}
    assert list(obj) == sorted(obj)  # canonical: keys in byte order, "needs" between "kind" and "payload"
    assert Manifest.from_bytes(m.to_bytes()) == m
    assert SignedManifest.from_bytes(format2.signed.to_bytes()).verify(TRUST, now_ms=2_000) == m


def test_the_needs_field_is_covered_by_the_signature(format2) -> None:  # type: ignore[no-untyped-def]
    e = format2.signed.envelope
    obj = msgpack.unpackb(e.body, raw=False)
    obj["needs"] = {"payload_format": 3}  # a relay rewriting what hosts decide their download by
    forged = SignedManifest(dataclasses.replace(e, body=msgpack.packb(obj, use_bin_type=True)))
    assert forged.verify(None).payload_format == 3  # it parses: only the signature stands in the way
    with pytest.raises(SignatureError):
        forged.verify(TRUST)
    obj["needs"] = {}
    obj["format"] = 1
    del obj["needs"]
    dropped = SignedManifest(dataclasses.replace(e, body=msgpack.packb(obj, use_bin_type=True)))
    assert dropped.verify(None).payload_format == 1
    with pytest.raises(SignatureError):
        dropped.verify(TRUST)


def test_a_manifest_without_needs_is_format_1_byte_for_byte() -> None:
    base, target = adam_like_pair(seed=11)
    v1 = build_version(base, target, run_id="run-a", version=5, base_version=4, now_ms=1_000, payload_format=1)
    m = v1.manifest
    assert v1.payload[4] == 1 and m.needs == {} and m.payload_format == 1
    obj = msgpack.unpackb(m.to_bytes(), raw=False)
    assert obj["format"] == 1 and "needs" not in obj  # what builds before manifest format 2 read
    assert m.unmet_need((1,)) is None


def test_unmet_needs_say_why_in_one_line(format2) -> None:  # type: ignore[no-untyped-def]
    m = format2.manifest
    assert m.unmet_need((1, 2)) is None
    assert m.unmet_need((1,)) == "version 5: patch payload format 2 (this build reads 1)"
    later = dataclasses.replace(m, needs={"history": 2, "payload_format": 2})
    assert Manifest.from_bytes(later.to_bytes()) == later  # a need this build does not know still parses
    assert later.unmet_need((1, 2)) == "version 5 needs 'history', which this build does not know"


def test_a_payload_its_manifest_misdeclares_is_refused_before_decoding(format2) -> None:  # type: ignore[no-untyped-def]
    from patchswarm.protocol.patchfile import apply_version

    base, _ = adam_like_pair(seed=11)
    low = dataclasses.replace(format2.manifest, needs={})
    before = base.clone()
    with pytest.raises(FormatError, match="declares format 2; its manifest says 1"):
        apply_version(base, low, format2.payload)
    assert base.bitwise_equal(before)
    anchor = build_version(None, base, run_id="run-a", version=4, now_ms=1_000)
    assert anchor.payload[4] == 1  # FULL records: format 1 whatever the publisher allows
    high = dataclasses.replace(anchor.manifest, needs={"payload_format": 2})
    with pytest.raises(FormatError, match="declares format 1; its manifest says 2"):
        apply_version(None, high, anchor.payload)
