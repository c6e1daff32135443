"""How each parser's negative vectors (tests/vectors/<parser>/<case>/) are run, and whether a case
got what it expects; shared by tests/unit/protocol/test_vectors.py, which runs every case, and
tests/vectors/generate.py, which checks each case as it writes it."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from multidict import CIMultiDict

from patchswarm.daemon.config import load_config
from patchswarm.daemon.sidecar import HEADER_EXACT, HEADER_MIN, constraint_from_headers, split_body_constraint
from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.chunks import ChunkRef, verify_chunk
from patchswarm.protocol.head import HeadTracker, verify_head
from patchswarm.protocol.keys import SigningKey, load_public_key
from patchswarm.protocol.manifest import Kind, SignedManifest
from patchswarm.protocol.patchfile import apply_version, open_file
from patchswarm.protocol.safetensors_io import load_safetensors
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.trust import TrustState
from patchswarm.protocol.wire import decode_frame

VECTORS = Path(__file__).parents[1] / "vectors"
FIXTURES = VECTORS / "_fixtures"
RUN = "run-fuzz"
NOW_MS = 2_000_000
SKEW_MS = 1_000


@cache
def root_key() -> bytes:
    return load_public_key(FIXTURES / "root.key.pub")


@cache
def fixture_model(name: str) -> ServedModel:
    return load_safetensors(FIXTURES / f"{name}.safetensors")


def trust(case: Path, ctx: dict[str, Any]) -> TrustState:
    """The pinned root, the root documents of the case (previous-root*.bin) and the certificates in
    ``ctx["certs"]`` (default: the trainer's, for RUN)."""
    ts = TrustState(root_key(), skew_ms=int(ctx.get("skew_ms", SKEW_MS)))
    for doc in sorted(case.glob("previous-root*.bin")):
        ts.update_root(doc.read_bytes())
    for cert in ctx.get("certs", ["trainer.cert"]):
        ts.add_certificate((FIXTURES / cert).read_bytes())
    return ts


def _input(case: Path) -> Path:
    (path,) = case.glob("input.*")
    return path


def run_manifest(case: Path, ctx: dict[str, Any]) -> object:
    signed = SignedManifest.from_bytes(_input(case).read_bytes())
    return signed.verify(trust(case, ctx), now_ms=int(ctx.get("now_ms", NOW_MS)), skew_ms=SKEW_MS)


def run_patchfile(case: Path, ctx: dict[str, Any]) -> object:
    version = open_file(_input(case).read_bytes(), trust(case, ctx), now_ms=int(ctx.get("now_ms", NOW_MS)))
    base = fixture_model(ctx.get("base", "base")).clone() if version.manifest.kind == Kind.PATCH else None
    return apply_version(base, version.manifest, version.payload)


def run_head(case: Path, ctx: dict[str, Any]) -> object:
    ts, now = trust(case, ctx), int(ctx.get("now_ms", NOW_MS))
    tracker = HeadTracker(ctx.get("follow", RUN))
    for prev in sorted(case.glob("previous-head*.bin")):
        tracker.accept(*verify_head(prev.read_bytes(), ts, now_ms=now, skew_ms=SKEW_MS))
    return tracker.accept(*verify_head(_input(case).read_bytes(), ts, now_ms=now, skew_ms=SKEW_MS))


def run_trust_root(case: Path, ctx: dict[str, Any]) -> object:
    return trust(case, {"certs": []}).update_root(_input(case).read_bytes())


def run_certificate(case: Path, ctx: dict[str, Any]) -> object:
    ts = trust(case, {"certs": []})
    cert = ts.add_certificate(_input(case).read_bytes())
    ts.check(cert.key, run_id=ctx.get("run", cert.run_id), now_ms=int(ctx.get("now_ms", NOW_MS)))
    return cert


def run_keys(case: Path, ctx: dict[str, Any]) -> object:
    path = _input(case)
    return SigningKey.load(path) if ctx.get("kind") == "private" else load_public_key(path)


def run_gossip(case: Path, ctx: dict[str, Any]) -> object:
    return decode_frame(ctx["secret"].encode(), _input(case).read_bytes())


def run_bitfield(case: Path, ctx: dict[str, Any]) -> object:
    return Bitfield.from_bytes(int(ctx["n"]), _input(case).read_bytes())


def run_chunk(case: Path, ctx: dict[str, Any]) -> object:
    verify_chunk(int(ctx.get("index", 0)), _input(case).read_bytes(), ChunkRef(ctx["size"], bytes.fromhex(ctx["hash"])))
    return None


def run_safetensors(case: Path, ctx: dict[str, Any]) -> object:
    return load_safetensors(_input(case))


def run_config(case: Path, ctx: dict[str, Any]) -> object:
    return load_config(_input(case), env=ctx.get("env", {}))


def run_sidecar(case: Path, ctx: dict[str, Any]) -> object:
    headers: CIMultiDict[str] = CIMultiDict()
    for value in ctx.get("min_headers", []):
        headers.add(HEADER_MIN, value)
    for value in ctx.get("exact_headers", []):
        headers.add(HEADER_EXACT, value)
    from_headers = constraint_from_headers(headers)
    body, from_body = split_body_constraint(_input(case).read_bytes(), ctx.get("content_type", "application/json"))
    return body, from_headers.merged(from_body)


RUNNERS: dict[str, Callable[[Path, dict[str, Any]], object]] = {
    "manifest": run_manifest,
    "patchfile": run_patchfile,
    "head": run_head,
    "trust_root": run_trust_root,
    "certificate": run_certificate,
    "keys": run_keys,
    "gossip": run_gossip,
    "bitfield": run_bitfield,
    "chunk": run_chunk,
    "safetensors": run_safetensors,
    "config": run_config,
    "sidecar": run_sidecar,
}


def expected_of(case: Path) -> dict[str, Any]:
    with open(case / "expected.toml", "rb") as fh:
        return tomllib.load(fh)


def run_case(case: Path) -> BaseException | None:
    """Run one case; returns the exception it raised (None when it was accepted)."""
    expected = expected_of(case)
    try:
        RUNNERS[case.parent.name](case, expected.get("context", {}))
    except Exception as e:
        return e
    return None


def mismatch(case: Path, got: BaseException | None) -> str | None:
    """Why ``got`` is not what the case expects (None when it is)."""
    expected = expected_of(case)
    want, message = expected["error"], expected.get("message", "")
    if want == "none":
        return None if got is None else f"expected acceptance, got {type(got).__name__}: {got}"
    if got is None:
        return f"expected {want}, but the input was accepted"
    if type(got).__name__ != want or message not in str(got):
        return f"expected {want} containing {message!r}, got {type(got).__name__}: {got}"
    return None
