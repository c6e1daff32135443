"""Fuzz targets: every parser that takes untrusted bytes or text, its valid seed inputs, and the
only errors it may raise.

Shared by tests/unit/protocol/test_fuzz.py (hypothesis, CI-sized), tests/vectors/generate.py (negative vectors)
and benchmarks/fuzz.py (a million mutated inputs).  Everything here is deterministic: keys come
from fixed seeds (Ed25519 signatures are deterministic), models from a seeded generator.

A signed document is fuzzed at two depths: as the raw envelope (what a peer sends; nearly every
mutation dies at the signature) and as a body that the harness signs with the trusted key before
parsing (what a compromised or buggy trainer could send; mutations reach every field check).
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import json
import math
import os
import random
import shutil
import struct
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from multidict import CIMultiDict

from patchswarm.daemon.config import SCHEMA, ConfigError, load_config
from patchswarm.daemon.sidecar import (
    HEADER_EXACT,
    HEADER_MIN,
    ConstraintError,
    constraint_from_headers,
    split_body_constraint,
)
from patchswarm.protocol.bitfield import Bitfield
from patchswarm.protocol.board_names import CERT_TAG, HEAD_TAG, MANIFEST_TAG, ROOT_TAG
from patchswarm.protocol.catalog import CatalogEntry
from patchswarm.protocol.chunks import ChunkRef, verify_chunk
from patchswarm.protocol.codec import apply_patch, encode_patch
from patchswarm.protocol.dtypes import BY_NAME
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.head import Head, HeadTracker, verify_head
from patchswarm.protocol.keys import SigningKey, load_public_key
from patchswarm.protocol.manifest import Kind, SignedManifest
from patchswarm.protocol.membership_messages import Ack, Gossip, MemberState, NodeInfo, Ping, PingReq, Sync, Update
from patchswarm.protocol.patchfile import Version, apply_version, build_version, open_file, pack_file
from patchswarm.protocol.safetensors_io import load_safetensors, save_safetensors
from patchswarm.protocol.served import ServedModel, TensorSpec
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import Certificate, RootDocument, TrustState
from patchswarm.protocol.wire import FRAME_TAG, Announcement, GossipFrame, decode_frame, encode_frame, mac

RUN = "run-fuzz"
CREATED_MS = 1_000_000
NOW_MS = 2_000_000
SKEW_MS = 1_000
SECRET = b"patchswarm-fuzz-cluster-secret!!"
REPO = Path(__file__).resolve().parents[2]


def det_key(name: str) -> SigningKey:
    """A fixed Ed25519 key per name: vectors and fuzz runs are reproducible byte for byte."""
    seed = hashlib.sha256(b"patchswarm-vectors/" + name.encode()).digest()
    return SigningKey(Ed25519PrivateKey.from_private_bytes(seed))


TRAINER = det_key("trainer")
ROOT = det_key("root")
OTHER = det_key("other")


def trainer_cert(key: SigningKey = TRAINER, run: str = RUN, lo: int = 0, hi: int = 10 * NOW_MS) -> bytes:
    return Certificate(key.key_id, run, lo, hi).sign(ROOT).to_bytes()


def trust_state(certs: tuple[bytes, ...] | None = None) -> TrustState:
    """What a host installed with ROOT trusts: the trainer key, certified for RUN."""
    ts = TrustState(ROOT.key_id, skew_ms=SKEW_MS)
    for c in certs if certs is not None else (trainer_cert(),):
        ts.add_certificate(c)
    return ts


# ---------------------------------------------------------------- a small model and its versions

SPECS = [
    TensorSpec("a.ulp", "BF16", (512,)),
    TensorSpec("b.raw", "I32", (256,)),
    TensorSpec("c.fp8", "F8_E4M3", (16, 32)),
    TensorSpec("d.same", "F16", (10,)),
]


@cache
def models() -> tuple[ServedModel, ServedModel]:
    """(base, target): a few sparse changes in each tensor but the last, and one far jump."""
    rng = np.random.default_rng(7)
    data = [torch.from_numpy(rng.integers(0, 256, s.nbytes, dtype=np.uint8)) for s in SPECS]
    base = ServedModel(list(SPECS), data, {"step": "1"})
    target = base.clone()
    target.metadata = {"step": "2"}
    for i in range(3):
        raw = target.data[i].numpy()
        for pos in rng.choice(raw.size, 6, replace=False):
            raw[pos] ^= 1 << int(rng.integers(0, 3))
    target.data[0].numpy()[-1] ^= 0x40
    return base, target


@cache
def ctx_payload() -> bytes:
    """A payload-format-2 patch of ``models()``'s base: changes in the BF16 elements of smallest
    magnitude, so its positions are coded under base contexts (a SPARSE_CTX record)."""
    base = models()[0]
    target = base.clone()
    words = target.data[0].numpy().view(np.int16)
    small = np.argsort(words & 0x7FFF, kind="stable")[:64]  # the 64 smallest magnitudes: a context of their own
    words[small] ^= 1
    payload = encode_patch(base, target, payload_format=2).payload
    assert payload[4] == 2, "the seed must hold a SPARSE_CTX record"
    return payload


@cache
def versions() -> tuple[Version, Version]:
    """(patch 1 -> 2, anchor 2), signed by TRAINER, chunked at the 1 KiB minimum."""
    base, target = models()
    common: dict[str, Any] = {"run_id": RUN, "now_ms": CREATED_MS, "key": TRAINER, "chunk_size": 1024}
    patch = build_version(base, target, version=2, base_version=1, ttl_ms=NOW_MS, **common)
    anchor = build_version(None, target, version=2, ttl_ms=NOW_MS, **common)
    return patch, anchor


def head_of(version: int = 2, counter: int = 5, expires_ms: int = 2 * NOW_MS, run: str = RUN) -> Head:
    patch, anchor = versions()
    catalog = (
        CatalogEntry(1, Kind.ANCHOR, None, 4096, b"\x01" * 32),
        CatalogEntry(2, Kind.PATCH, 1, len(patch.payload), patch.manifest.manifest_id),
        CatalogEntry(2, Kind.ANCHOR, None, len(anchor.payload), anchor.manifest.manifest_id),
    )
    return Head(run, version, patch.manifest.manifest_id, counter, CREATED_MS, expires_ms, catalog)


def node(i: int) -> NodeInfo:
    return NodeInfo(f"node-{i}", f"http://10.0.0.{i}:8701", f"zone-{i % 2}", "region-a")


def gossip_frames() -> list[GossipFrame]:
    pb = (Update(node(3), 4, MemberState.SUSPECT, "node-2"), Update(node(4), 0, MemberState.ALIVE, ""))
    mid = versions()[0].manifest.manifest_id
    ann = Announcement(RUN, 5, 1, (mid,), ((b"\x02" * 32, b"\x05\x01"),), False)
    messages = [
        None,
        Gossip(pb),
        Ping(7, "node-2", pb),
        Ack(7, "node-2", ()),
        PingReq(8, node(5), pb),
        Sync(pb, True, ()),
    ]
    return [GossipFrame(node(1), ann, m, 12345) for m in messages]


# ---------------------------------------------------------------- running parsers on bytes

_SCRATCH: dict[int, Path] = {}


def scratch_file(data: bytes, suffix: str) -> Path:
    """One reusable file per process for parsers that read a path: under $PSW_FUZZ_SCRATCH (a fuzz
    run's own folder, removed by the run) or on tmpfs when there is one, removed at exit."""
    pid = os.getpid()
    if pid not in _SCRATCH:
        where = os.environ.get("PSW_FUZZ_SCRATCH") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        _SCRATCH[pid] = Path(tempfile.mkdtemp(prefix="psw-fuzz-", dir=where))
        atexit.register(shutil.rmtree, _SCRATCH[pid], True)
    path = _SCRATCH[pid] / f"input{suffix}"
    path.write_bytes(data)
    return path


def signed(tag: str, body: bytes, key: SigningKey = TRAINER) -> bytes:
    return Envelope.sign(tag, body, key).to_bytes()


def run_envelope(data: bytes) -> object:
    return SignedManifest.from_bytes(data).verify(trust_state(), now_ms=NOW_MS, skew_ms=SKEW_MS)


def run_manifest(body: bytes) -> object:
    return run_envelope(signed(MANIFEST_TAG, body))


def run_patchfile(data: bytes) -> object:
    """No key policy: mutations of the manifest get past the signature to every later check."""
    v = open_file(data, None, now_ms=NOW_MS)
    base = models()[0].clone() if v.manifest.kind == Kind.PATCH else None
    return apply_version(base, v.manifest, v.payload)


def run_payload(data: bytes) -> object:
    return apply_patch(models()[0].clone(), data, list(SPECS))


def run_head(body: bytes) -> object:
    head, env = verify_head(signed(HEAD_TAG, body), trust_state(), now_ms=NOW_MS, skew_ms=SKEW_MS)
    return HeadTracker(RUN).accept(head, env)


def run_signed_head(data: bytes) -> object:
    head, env = verify_head(data, trust_state(), now_ms=NOW_MS, skew_ms=SKEW_MS)
    return HeadTracker(RUN).accept(head, env)


def run_root(body: bytes) -> object:
    return TrustState(ROOT.key_id).update_root(signed(ROOT_TAG, body, ROOT))


def run_cert(body: bytes) -> object:
    ts = TrustState(ROOT.key_id, skew_ms=SKEW_MS)
    cert = ts.add_certificate(signed(CERT_TAG, body, ROOT))
    ts.check(cert.key, run_id=cert.run_id, now_ms=NOW_MS)
    return cert


def run_gossip(body: bytes) -> object:
    """The body behind a valid MAC (a member of the cluster sending garbage)."""
    frame = msgpack.packb([FRAME_TAG, body, mac(SECRET, body)], use_bin_type=True)
    return decode_frame(SECRET, frame)


def run_frame(data: bytes) -> object:
    return decode_frame(SECRET, data)


def run_bitfield(data: bytes) -> object:
    """Two bytes of chunk count, then the wire bitfield; a decoded bitfield re-encodes identically."""
    n = int.from_bytes(data[:2], "little")
    bf = Bitfield.from_bytes(n, data[2:])
    assert bf.to_bytes() == data[2:] and bf.count() == sum(1 for _ in bf.held())
    return bf


@cache
def first_chunk() -> tuple[bytes, ChunkRef]:
    v = versions()[1]
    ref = v.manifest.chunks[0]
    return bytes(v.payload[: ref.size]), ref


def run_chunk(data: bytes) -> object:
    verify_chunk(0, data, first_chunk()[1])
    return None


def run_safetensors(data: bytes) -> object:
    return load_safetensors(scratch_file(data, ".safetensors"))


def run_public_key(data: bytes) -> object:
    return load_public_key(scratch_file(data, ".pub"))


def run_private_key(data: bytes) -> object:
    return SigningKey.load(scratch_file(data, ".key"))


def run_config(data: bytes) -> object:
    return load_config(scratch_file(data, ".toml"), env={})


def run_sidecar_body(data: bytes) -> object:
    return split_body_constraint(data, "application/json")


def run_sidecar_headers(data: bytes) -> object:
    """Lines ``m:<value>`` / ``e:<value>`` become X-Weight-Version-Min / -Exact headers."""
    headers: CIMultiDict[str] = CIMultiDict()
    for line in data.decode("latin-1").split("\n"):
        name = HEADER_MIN if line.startswith("m:") else HEADER_EXACT if line.startswith("e:") else None
        if name:
            headers.add(name, line[2:])
    return constraint_from_headers(headers)


# ---------------------------------------------------------------- seeds


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], object]
    seeds: Callable[[], list[bytes]]
    allowed: tuple[type[Exception], ...] = (PatchswarmError,)
    is_msgpack: bool = False  # seeds are msgpack documents: structure-aware mutation applies
    mutator: Callable[[random.Random, bytes], bytes | None] | None = None  # other structure-aware mutation
    tokens: tuple[bytes, ...] = ()  # dictionary entries spliced into inputs
    weight: int = 1  # share of a fuzz run (cheap parsers get more)
    notes: str = field(default="", compare=False)


def _model_file(model: ServedModel) -> bytes:
    path = scratch_file(b"", ".seed.safetensors")
    save_safetensors(model, path)
    return path.read_bytes()


def _safetensors_seeds() -> list[bytes]:
    base, _ = models()
    odd = ServedModel.from_tensors(
        {"x": torch.zeros(0, 3, dtype=torch.float32), "y": torch.arange(5, dtype=torch.int64)}, {"k": "v"}
    )
    return [_model_file(base), _model_file(odd)]


def _config_seeds() -> list[bytes]:
    minimal = b'[swarm]\nrun_id = "run-1"\ncluster_secret_file = "/etc/s"\n[trust]\nroot = "/etc/root.pub"\n'
    return [(REPO / "packaging" / "daemon.toml").read_bytes(), minimal]


def _gossip_bodies() -> list[bytes]:
    out = []
    for f in gossip_frames():
        _, body, _ = msgpack.unpackb(encode_frame(SECRET, f), raw=False)
        out.append(body)
    return out


_MSGPACK_TOKENS = (
    b"\xc0",
    b"\xc3",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint64 max
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 min
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # NaN
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xdd\xff\xff\xff\xff",  # array32 of 4G items
    b"\xdf\xff\xff\xff\xff",  # map32 of 4G pairs
    b"\xd4\x01\x00",  # ext
    b"\xd6\xff\x00\x00\x00\x00",  # timestamp ext
    b"\x91" * 64,  # nesting
)
_ZSTD_TOKENS = (b"\x28\xb5\x2f\xfd", b"\x28\xb5\x2f\xfd\x00\x38", b"\x03\x00\x10\x00", b"\xff\xff\xff\x7f")
_JSON_TOKENS = (
    b'"weight_version"',
    b'{"min_version":',
    b'"exact_version":',
    b"NaN",
    b"Infinity",
    b"-1",
    b"1e400",
    b"9" * 30,
    b"null",
    b"[" * 64,
    b'"\\ud800"',
    b"\xed\xa0\x80",
    b"{}",
)
_TOML_TOKENS = (
    b"inf",
    b"nan",
    b"-1",
    b"9" * 40,
    b"true",
    b"1979-05-27T07:32:00Z",
    b"[[",
    b"[" * 64,
    b"{",
    b'"',
    b"'''",
    b"\n[store]\nsize = ",
    b"\n[trust]\nclock_skew = ",
    b"\n[swarm]\nmax_uploads = ",
    b"\xff",
    b"0x7f",
)


def _st_tokens() -> tuple[bytes, ...]:
    return (
        b'"dtype":"F4"',
        b'"dtype":"BF16"',
        b'"data_offsets":[0,18446744073709551615]',
        b'"shape":[4294967296,4294967296]',
        b'"__metadata__":{"a":1}',
        struct.pack("<Q", 1 << 62),
        struct.pack("<Q", 0),
    )


def _targets() -> dict[str, Target]:
    patch, anchor = versions()
    manifest_bodies = lambda: [patch.signed.body, anchor.signed.body]  # noqa: E731
    pem = TRAINER.private.public_key().public_bytes
    from cryptography.hazmat.primitives import serialization as ser

    pub_pem = pem(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo)
    priv_pem = TRAINER.private.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    head = head_of()
    targets = [
        Target("envelope", run_envelope, lambda: [patch.signed.to_bytes(), anchor.signed.to_bytes()], is_msgpack=True),
        Target("manifest", run_manifest, manifest_bodies, is_msgpack=True, tokens=_MSGPACK_TOKENS, weight=2),
        Target("patchfile", run_patchfile, lambda: [pack_file(patch), pack_file(anchor)], tokens=_ZSTD_TOKENS),
        Target(
            "payload",
            run_payload,
            lambda: [bytes(patch.payload), bytes(anchor.payload), ctx_payload()],
            tokens=_ZSTD_TOKENS,
            mutator=mutate_payload,
        ),
        Target("head", run_head, lambda: [head.to_bytes()], is_msgpack=True, tokens=_MSGPACK_TOKENS, weight=2),
        Target("signed_head", run_signed_head, lambda: [head.sign(TRAINER).to_bytes()], is_msgpack=True),
        Target(
            "root",
            run_root,
            lambda: [RootDocument(1, (ROOT.key_id, OTHER.key_id), (TRAINER.key_id,)).to_bytes()],
            is_msgpack=True,
            tokens=_MSGPACK_TOKENS,
        ),
        Target(
            "cert",
            run_cert,
            lambda: [Certificate(TRAINER.key_id, RUN, 0, 10 * NOW_MS).to_bytes()],
            is_msgpack=True,
            tokens=_MSGPACK_TOKENS,
        ),
        Target("gossip", run_gossip, _gossip_bodies, is_msgpack=True, tokens=_MSGPACK_TOKENS, weight=3),
        Target("frame", run_frame, lambda: [encode_frame(SECRET, f) for f in gossip_frames()[:2]], is_msgpack=True),
        Target("bitfield", run_bitfield, lambda: [b"\x0c\x00\xa5\x0f", b"\x10\x00\xff\xff", b"\x00\x00"], weight=2),
        Target("chunk", run_chunk, lambda: [first_chunk()[0]]),
        Target("safetensors", run_safetensors, _safetensors_seeds, tokens=_st_tokens(), mutator=mutate_safetensors),
        Target("public_key", run_public_key, lambda: [pub_pem]),
        Target("private_key", run_private_key, lambda: [priv_pem]),
        Target(
            "config",
            run_config,
            _config_seeds,
            allowed=(ConfigError,),
            tokens=_TOML_TOKENS,
            weight=2,
            mutator=mutate_config,
        ),
        Target(
            "sidecar_body",
            run_sidecar_body,
            lambda: [
                b'{"prompt":"hi","weight_version":{"min_version":3,"exact_version":4}}',
                b'{"weight_version":null}',
            ],
            allowed=(ConstraintError,),
            tokens=_JSON_TOKENS,
            weight=3,
        ),
        Target(
            "sidecar_headers",
            run_sidecar_headers,
            lambda: [b"m:3\ne:4", b"e: 17 "],
            allowed=(ConstraintError,),
            tokens=(b"\nm:", b"\ne:", b"9" * 19, b"-1", b"\xb2", b" "),
            weight=2,
        ),
    ]
    return {t.name: t for t in targets}


@cache
def seeds_of(name: str) -> tuple[bytes, ...]:
    return tuple(TARGETS[name].seeds())


class UnexpectedError(AssertionError):
    """A parser raised something other than its documented error classes."""


def check(name: str, data: bytes) -> BaseException | None:
    """Run target ``name`` on ``data``: returns the allowed error raised (or None when it parsed);
    raises UnexpectedError (chained to the original) for anything else."""
    target = TARGETS[name]
    try:
        target.run(data)
    except target.allowed as e:
        return e
    except Exception as e:
        raise UnexpectedError(f"{name}: {type(e).__name__}: {e}") from e
    return None


# ---------------------------------------------------------------- mutations


def _interesting_int(rng: random.Random) -> int:
    return rng.choice([0, 1, -1, 127, 128, 255, 256, 65535, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**64 - 1])


def mutate_bytes(rng: random.Random, data: bytes, pool: tuple[bytes, ...], tokens: tuple[bytes, ...]) -> bytes:
    """One to four byte-level edits: flips, truncation, insertion, deletion, duplication, splices
    with another seed, dictionary tokens, and big little-endian lengths written over fields."""
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        op = rng.randrange(10)
        n = len(buf)
        pos = rng.randrange(n + 1)
        if op == 0 and n:
            buf[min(pos, n - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            buf[min(pos, n - 1)] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        elif op == 2:
            del buf[pos:]
        elif op == 3:
            buf[pos:pos] = rng.randbytes(rng.choice((1, 2, 4, 8, 64)))
        elif op == 4 and n:
            del buf[pos : pos + rng.choice((1, 2, 4, 16, n))]
        elif op == 5 and n:
            end = min(n, pos + rng.choice((1, 4, 32, 256)))
            buf[pos:pos] = buf[pos:end] * rng.choice((1, 2, 16))
        elif op == 6:
            other = rng.choice(pool)
            cut = rng.randrange(len(other) + 1)
            buf = buf[:pos] + other[cut:]
        elif op == 7 and tokens:
            tok = rng.choice(tokens)
            if rng.random() < 0.5:
                buf[pos:pos] = tok
            else:
                buf[pos : pos + len(tok)] = tok
        elif op == 8 and n >= 4:
            fmt = rng.choice(("<I", "<Q", ">I", "<H"))
            p = min(pos, n - struct.calcsize(fmt))
            if p >= 0:
                struct.pack_into(fmt, buf, p, _interesting_int(rng) % (1 << (8 * struct.calcsize(fmt))))
        elif op == 9 and n:
            buf = buf[: rng.randrange(n + 1)]
    return bytes(buf)


def _replacement(rng: random.Random, old: Any) -> Any:
    """A value of another type (or a boundary value of the same type) to put where ``old`` was."""
    pool: list[Any] = [
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        2**64 - 1,
        -(2**63),
        1.5,
        math.nan,
        math.inf,
        "",
        "x",
        "é" * 300,
        b"",
        b"\x00" * 31,
        b"\x00" * 33,
        b"\xff" * 32,
        [],
        {},
        [None],
        {"x": 1},
        msgpack.ExtType(5, b"\x00"),
    ]
    if isinstance(old, bool):
        pool += [not old]
    elif isinstance(old, int):
        pool += [old + 1, old - 1, old * 2**20, -old]
    elif isinstance(old, bytes):
        pool += [old[:-1], old + b"\x00", bytes(len(old)), old[::-1]]
    elif isinstance(old, str):
        pool += [old + "x", old[:-1], old.upper(), old * 50]
    elif isinstance(old, list):
        pool += [old + old, old[:-1], old[::-1], [old]]
    return rng.choice(pool)


def _containers(obj: Any, out: list[Any]) -> None:
    if isinstance(obj, list | dict):
        out.append(obj)
        for v in obj.values() if isinstance(obj, dict) else obj:
            _containers(v, out)


def mutate_msgpack(rng: random.Random, data: bytes) -> bytes | None:
    """Decode a msgpack document, change one to three of its nodes (wrong type, boundary value,
    missing or extra field, dropped or repeated element) and encode it again; None if ``data`` is
    not msgpack.  Nested ``bin`` values that are msgpack themselves (envelope and frame bodies) are
    mutated recursively."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception:
        return None
    root = [obj]
    for _ in range(rng.choice((1, 1, 2, 3))):
        nodes: list[Any] = []
        _containers(root, nodes)
        parent = rng.choice(nodes)
        keys = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
        op = rng.randrange(6)
        if not keys or op == 0:
            if isinstance(parent, dict):
                parent[rng.choice(["extra", "format", "", "zz"])] = _replacement(rng, None)
            else:
                parent.append(_replacement(rng, None))
            continue
        k = rng.choice(keys)
        if op == 1 and parent is not root:
            del parent[k]
        elif op == 2 and isinstance(parent, list):
            parent.insert(k, parent[k])
        elif op == 3 and isinstance(parent[k], bytes) and parent[k]:
            inner = mutate_msgpack(rng, parent[k])
            parent[k] = inner if inner is not None else mutate_bytes(rng, parent[k], (parent[k],), ())
        else:
            parent[k] = _replacement(rng, parent[k])
    try:
        packed: bytes = msgpack.packb(root[0], use_bin_type=True)
    except (ValueError, TypeError, OverflowError):
        return None
    return packed


# ---------------------------------------------------------------- format-aware mutators

PAYLOAD_PREFIX = struct.Struct("<4sB3xI")  # magic, format, reserved, compressed header length


def payload_parts(payload: bytes) -> tuple[list[Any], list[Any], list[bytes]]:
    """(records, stream table, stream frames) of a well-formed patch payload (docs/format.md)."""
    (hlen,) = struct.unpack_from("<I", payload, 8)
    header = zstandard.ZstdDecompressor().decompress(payload[12 : 12 + hlen], max_output_size=1 << 20)
    records, table = msgpack.unpackb(header)
    comps, off = [], 12 + hlen
    for _, _, n in table:
        comps.append(payload[off : off + n])
        off += n
    return records, table, comps


def payload_pack(records: list[Any], table: list[Any], comps: list[bytes]) -> bytes:
    hz = zstandard.ZstdCompressor().compress(msgpack.packb([records, table]))
    return PAYLOAD_PREFIX.pack(b"PSWP", 1, len(hz)) + hz + b"".join(comps)


def mutate_payload(rng: random.Random, data: bytes) -> bytes | None:
    """Bend a payload at the level of its structure: a record, a stream table entry, the decoded
    bytes of one stream (compressed again, its declared length following or not), or a frame."""
    try:
        records, table, comps = payload_parts(data)
    except Exception:
        return None
    op = rng.randrange(5)
    if op == 0 and records:
        rec = rng.choice(records)
        j = rng.randrange(2)
        rec[j] = rng.choice([rec[j] + 1, rec[j] - 1, 0, rng.randrange(6), _interesting_int(rng)])
    elif table and op == 1:
        entry = rng.choice(table)
        j = rng.randrange(3)
        entry[j] = entry[j] + "x" if j == 0 else rng.choice([entry[j] + 1, entry[j] - 1, 0, _interesting_int(rng)])
    elif table and op == 2:
        i = rng.randrange(len(table))
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(comps[i])
        raw = mutate_bytes(rng, raw, (raw,), ())
        comps[i] = zstandard.ZstdCompressor().compress(raw)
        table[i][2] = len(comps[i])
        if rng.random() < 0.7:
            table[i][1] = len(raw)
    elif table and op == 3:
        i, j = rng.randrange(len(table)), rng.randrange(len(table))
        if rng.random() < 0.5:
            table[i][0], table[j][0] = table[j][0], table[i][0]
        else:
            del table[i], comps[i]
    elif table:
        i = rng.randrange(len(table))
        rle = (((1 << 17) << 3) | 3).to_bytes(3, "little") + b"\x00"  # one 128 KiB RLE block
        comps[i] = rng.choice([b"", b"\x28\xb5\x2f\xfd\x00\x38" + rle, comps[i][:-1], comps[i] + b"\x00"])
        table[i][2] = len(comps[i])
    try:
        return payload_pack(records, table, comps)
    except (ValueError, TypeError, OverflowError):
        return None


_DTYPES = sorted(BY_NAME) + ["C64", "F4", "F6_E2M3", "X9", ""]


def mutate_safetensors(rng: random.Random, data: bytes) -> bytes | None:
    """Edit a safetensors file's JSON header (dtype, shape, offsets, names, metadata), keep it well
    formed, and re-frame it; sometimes also cut or extend the data."""
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        body = data[8 + n :]
    except Exception:
        return None
    names = [k for k in header if k != "__metadata__"]
    op = rng.randrange(7)
    if names and op < 4:
        entry = header[rng.choice(names)]
        if op == 0:
            entry["dtype"] = rng.choice(_DTYPES)
        elif op == 1:
            entry["shape"] = rng.choice([[], [0], [1 << 40], [-1], [2**64], ["a"], [*entry["shape"], 2], [1] * 40])
        elif op == 2:
            lo, hi = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[hi, lo], [lo, hi + 1], [lo + 1, hi], [0, 2**64 - 1], [-1, hi], [lo]])
        else:
            header[rng.choice(["", "x" * 300, names[0] + "'"])] = dict(entry)
    elif op == 4:
        header["__metadata__"] = rng.choice([{"a": 1}, {"a": None}, [], "x", {"": ""}, {"k" * 500: "v"}])
    elif op == 5 and names:
        del header[rng.choice(names)]
    else:
        body = body[: rng.randrange(len(body) + 1)] if rng.random() < 0.5 else body + rng.randbytes(8)
    h = json.dumps(header).encode() + b" " * rng.choice((0, 0, 3))
    return len(h).to_bytes(8, "little") + h + body


_TOML_VALUES: list[Any] = [
    True,
    0,
    -1,
    2**63 - 1,
    -(2**63),
    1.5,
    math.inf,
    -math.inf,
    math.nan,
    "",
    "fast",
    "100MB",
    "9" * 400 + "GB",
    "1e999s",
    "0.0.0.0:99999",
    "host:",
    "http://x",
    "ftp://x",
    "in_place",
    [],
    ["http://a"],
    [1],
    {},
    {"a": 1},
    datetime.date(2024, 1, 1),
    datetime.time(1, 2),
]


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # TOML basic strings take JSON's escapes
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + "}"
    return str(v.isoformat())


def mutate_config(rng: random.Random, data: bytes) -> bytes | None:
    """Parse the TOML, set schema keys to values of other types or out of range, drop keys, add
    unknown keys and sections, and write it back as TOML: every input reaches the schema checks."""
    try:
        doc: dict[str, Any] = tomllib.loads(data.decode())
    except Exception:
        return None
    for _ in range(rng.choice((1, 1, 2, 3))):
        key = rng.choice(SCHEMA)
        op = rng.randrange(6)
        section = doc.setdefault(key.section, {})
        if not isinstance(section, dict):
            continue
        if op < 3:
            section[key.name] = rng.choice(_TOML_VALUES)
        elif op == 3:
            section.pop(key.name, None)
        elif op == 4:
            section[rng.choice(["colour", key.name + "s", ""])] = 1
        else:
            doc[rng.choice([key.section, "gpu"])] = rng.choice([1, "x", [], {}])
    lines = [f"{json.dumps(k)} = {_toml(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for name, body in doc.items():
        if isinstance(body, dict):
            lines.append(f"[{json.dumps(name)}]")
            lines += [f"{json.dumps(k)} = {_toml(v)}" for k, v in body.items()]
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def mutate(rng: random.Random, name: str) -> bytes:
    """One mutated input for target ``name``, derived from one of its seeds."""
    target = TARGETS[name]
    pool = seeds_of(name)
    data = rng.choice(pool)
    structured = mutate_msgpack if target.is_msgpack else target.mutator
    if structured is not None and rng.random() < 0.6:
        out = structured(rng, data)
        if out is not None:
            return out if rng.random() < 0.8 else mutate_bytes(rng, out, pool, target.tokens)
    return mutate_bytes(rng, data, pool, target.tokens)


TARGETS: dict[str, Target] = _targets()
