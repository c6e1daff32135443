"""Making, packing, opening and applying one version: manifest + payload, verified end to end.

Verification order (docs/format.md): signature -> manifest fields -> each chunk's size and
hash -> decode with output bounded by the manifest -> base digest before apply -> target
digest after.  A self-contained patch file is a fixed prefix, the signed manifest envelope,
then the payload (its chunks back to back).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from patchswarm.protocol.chunks import DEFAULT_CHUNK_SIZE, split, verify_payload
from patchswarm.protocol.codec import Progress, apply_update, encode_patch, iter_updates
from patchswarm.protocol.docfields import read_prefix
from patchswarm.protocol.errors import (
    BaseMismatchError,
    FormatError,
    LayoutMismatchError,
    LimitExceededError,
    TargetMismatchError,
    TruncatedError,
    UnsupportedFormatError,
)
from patchswarm.protocol.files import open_regular, write_atomic
from patchswarm.protocol.keys import KeyPolicy, SigningKey
from patchswarm.protocol.manifest import MAX_MANIFEST_BYTES, NEED_PAYLOAD_FORMAT, Kind, Manifest, SignedManifest
from patchswarm.protocol.patch_format import EncodedPatch, anchor_header, declared_format
from patchswarm.protocol.payload_formats import DEFAULT_FORMAT
from patchswarm.protocol.served import ServedModel, TensorSpec, bytes_digest, layout_hash, state_root

FILE_MAGIC = b"PSWPATCH"
FILE_FORMAT = 1
_FILE_PREFIX = struct.Struct("<8sB3sI")  # magic, file format, reserved (zero), envelope length
DEFAULT_TTL_MS = 30 * 24 * 3600 * 1000
MAX_PATCH_FILE_BYTES = 1 << 38  # 256 GiB: a 70B-parameter model's bf16 anchor fits; a larger file is not read


@dataclass(frozen=True, slots=True)
class Version:
    """One published version: its signed manifest, the parsed manifest and the payload bytes."""

    signed: SignedManifest
    manifest: Manifest
    payload: bytes | memoryview
    encoded: EncodedPatch | None = None  # encoder statistics, when this process made it


def build_version(
    base: ServedModel | None,
    target: ServedModel,
    *,
    run_id: str,
    version: int,
    now_ms: int,
    base_version: int | None = None,
    base_digests: list[bytes] | None = None,
    target_digests: list[bytes] | None = None,
    key: SigningKey | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ttl_ms: int = DEFAULT_TTL_MS,
    prev_manifest: bytes | None = None,
    level: int = 3,
    progress: Progress | None = None,
    payload_format: int = DEFAULT_FORMAT,
) -> Version:
    """Encode ``target`` against ``base`` (an anchor when base is None), chunk it and sign the manifest
    (``payload_format``: see :func:`protocol.codec.diff_tensor`)."""
    if (base is None) != (base_version is None):
        raise ValueError("give both base and base_version, or neither (anchor)")
    encoded = encode_patch(base, target, level=level, progress=progress, payload_format=payload_format)
    digests = target_digests if target_digests is not None else target.digests()
    base_root = None
    if base is not None:
        base_root = state_root(base.specs, base_digests if base_digests is not None else base.digests())
    return sign_version(
        encoded,
        target.specs,
        digests,
        run_id=run_id,
        version=version,
        now_ms=now_ms,
        base_version=base_version,
        base_root=base_root,
        key=key,
        chunk_size=chunk_size,
        ttl_ms=ttl_ms,
        prev_manifest=prev_manifest,
        metadata=target.metadata,
    )


def sign_version(
    encoded: EncodedPatch,
    specs: list[TensorSpec],
    digests: list[bytes],
    *,
    run_id: str,
    version: int,
    now_ms: int,
    base_version: int | None = None,
    base_root: bytes | None = None,
    key: SigningKey | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ttl_ms: int = DEFAULT_TTL_MS,
    prev_manifest: bytes | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Version:
    """Chunk an already encoded payload and sign its manifest (the second half of :func:`build_version`).

    ``specs`` and ``digests`` describe the target (layout order); a patch gives its base's version
    and state root (:func:`protocol.served.state_root`), an anchor neither.
    """
    if (base_version is None) != (base_root is None):
        raise ValueError("give both base_version and base_root (patch), or neither (anchor)")
    fmt = declared_format(encoded.payload)
    manifest = Manifest(
        run_id=run_id,
        version=version,
        kind=Kind.ANCHOR if base_version is None else Kind.PATCH,
        base_version=base_version,
        base_root=base_root,
        specs=tuple(specs),
        digests=tuple(digests),
        target_root=state_root(specs, digests),
        layout_hash=layout_hash(specs),
        payload_size=len(encoded.payload),
        raw_size=encoded.raw_size,
        chunk_size=chunk_size,
        chunks=tuple(split(encoded.payload, chunk_size)),
        created_ms=now_ms,
        expires_ms=now_ms + ttl_ms,
        prev_manifest=prev_manifest,
        metadata=dict(metadata or {}),
        needs={NEED_PAYLOAD_FORMAT: fmt} if fmt > 1 else {},  # (a host that cannot read it skips it unfetched)
    )
    manifest.check()
    return Version(SignedManifest.sign(manifest, key), manifest, encoded.payload, encoded)


def pack_file(version: Version) -> bytes:
    envelope = version.signed.to_bytes()
    prefix = _FILE_PREFIX.pack(FILE_MAGIC, FILE_FORMAT, bytes(3), len(envelope))
    return b"".join([prefix, envelope, bytes(version.payload)])


def write_file(path: str | os.PathLike[str], version: Version) -> None:
    """Atomic write: the path holds the old file or the complete new one."""
    write_atomic(path, pack_file(version))


def read_patch_file(path: str | os.PathLike[str], limit: int = MAX_PATCH_FILE_BYTES) -> memoryview:
    """The bytes of the patch file at ``path``, for :func:`open_file`.

    A regular file of at most ``limit`` bytes, read whole only once its prefix and manifest say it
    is a patch file of exactly its size: a stray file, a huge sparse one or a truncated copy is
    refused after a few bytes, with an error naming it; a FIFO or a device is never read.
    """
    fd = open_regular(path, limit)
    try:
        size = os.fstat(fd).st_size
        try:
            env_len = _read_file_prefix(memoryview(_pread_exact(fd, min(_FILE_PREFIX.size, size), 0)))
            end = _check_envelope_length(env_len, size)
            manifest = SignedManifest.from_bytes(bytes(_pread_exact(fd, env_len, _FILE_PREFIX.size))).verify(None)
            _check_payload_length(size - end, manifest.payload_size)
            data = _pread_exact(fd, size, 0)
        except (FormatError, OSError) as e:
            raise _naming(path, e) from None
    finally:
        os.close(fd)
    return memoryview(data)


def _pread_exact(fd: int, n: int, offset: int) -> bytearray:
    """``n`` bytes at ``offset``, in one buffer (pread returns at most ~2 GiB per call)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got : got + (1 << 30)]], offset + got)
        if k == 0:
            raise TruncatedError("patch file shrank while it was read")
        got += k
    return buf


def _naming(path: str | os.PathLike[str], e: FormatError | OSError) -> Exception:
    """The same error, its message naming the file (where its class takes a message alone)."""
    if isinstance(e, OSError):
        return FormatError(f"{os.fspath(path)}: {e.strerror or type(e).__name__}")
    if type(e) in (FormatError, UnsupportedFormatError, TruncatedError, LimitExceededError):
        return type(e)(f"{os.fspath(path)}: {e}")
    return e


def _read_file_prefix(mv: memoryview) -> int:
    """The envelope length, once magic, format and the reserved bytes (zero) are checked."""
    reserved, env_len = read_prefix(_FILE_PREFIX, mv, FILE_MAGIC, FILE_FORMAT, "patch file")
    if any(reserved):
        raise FormatError("patch file reserved bytes are not zero")
    return int(env_len)


def _check_envelope_length(env_len: int, size: int) -> int:
    if env_len > MAX_MANIFEST_BYTES + 256:
        raise LimitExceededError("manifest envelope larger than allowed")
    end = _FILE_PREFIX.size + env_len
    if end > size:
        raise TruncatedError("patch file ends inside its manifest")
    return end


def _check_payload_length(have: int, declared: int) -> None:
    if have < declared:
        raise TruncatedError(f"patch file holds {have} of {declared} payload bytes")
    if have > declared:
        raise FormatError(f"patch file has {have - declared} bytes past its payload")


def open_file(
    data: bytes | memoryview,
    policy: KeyPolicy | None,
    *,
    now_ms: int | None = None,
    verify_chunks: bool = True,
) -> Version:
    """Parse a patch file and verify it: signature (if a policy is given), manifest, every chunk."""
    mv = memoryview(data)
    end = _check_envelope_length(_read_file_prefix(mv), len(mv))
    signed = SignedManifest.from_bytes(bytes(mv[_FILE_PREFIX.size : end]))
    manifest = signed.verify(policy, now_ms=now_ms)
    payload = mv[end:]
    _check_payload_length(len(payload), manifest.payload_size)
    if verify_chunks:
        verify_payload(payload, manifest.chunks)
    return Version(signed, manifest, payload)


def check_base(manifest: Manifest, base: ServedModel, base_digests: list[bytes] | None) -> list[bytes]:
    """The base's digests, after checking it is the patch's base (layout, then state root): before
    anything of the payload is decoded."""
    if base.specs != list(manifest.specs):
        raise LayoutMismatchError("the base does not have the patch's tensor names, dtypes and shapes")
    have = base_digests if base_digests is not None else base.digests()
    root = state_root(list(manifest.specs), have)
    assert manifest.base_root is not None
    if root != manifest.base_root:
        raise BaseMismatchError(f"base of version {manifest.version}", manifest.base_root, root)
    return list(have)


def apply_version(
    base: ServedModel | None,
    manifest: Manifest,
    payload: bytes | memoryview,
    *,
    base_digests: list[bytes] | None = None,
    into: ServedModel | None = None,
) -> tuple[ServedModel, list[bytes]]:
    """Apply a verified version: in place into ``base`` for a patch, into a new model for an anchor
    (or into ``into``'s buffers, e.g. a weight store's, when given: an anchor writes every byte).

    Returns the model and its per-tensor digests.  On any error the model passed in must be
    considered garbage: a payload may be refused at its end, after every record was written
    (docs/format.md section 6).  So callers apply to a copy they discard on failure (swarm/staging.py,
    swarm/puller.py), or to a model they write out only on success (``patchswarm apply``, ``pull``),
    and the daemon decodes patches without writing (protocol/sparse_apply.py).
    """
    specs = list(manifest.specs)
    fmt = declared_format(payload)
    if fmt != manifest.payload_format:
        # The manifest is what a host decides to download by (docs/format.md section 4): it must be exact.
        raise FormatError(
            f"payload of version {manifest.version} declares format {fmt}; its manifest says {manifest.payload_format}"
        )
    if manifest.kind == Kind.ANCHOR:
        anchor_header(payload, specs)  # its size backed by the payload before it is allocated
        if into is not None and into.specs != specs:
            raise LayoutMismatchError("the buffers given do not have the anchor's tensor names, dtypes and shapes")
        model: ServedModel = into if into is not None else ServedModel.zeros_like(specs)
        digests: list[bytes | None] = [None] * len(specs)
        source = None
    else:
        if base is None:
            raise FormatError(f"version {manifest.version} is a patch; it needs base version {manifest.base_version}")
        have = check_base(manifest, base, base_digests)
        model, digests, source = base, list(have), base
    for update in iter_updates(payload, specs, source, into=model):
        apply_update(model, update)
        digests[update.index] = None  # touched: hash again below
    final = [d if d is not None else bytes_digest(model.data[i]) for i, d in enumerate(digests)]
    root = state_root(specs, final)
    if root != manifest.target_root:
        raise TargetMismatchError(f"target of version {manifest.version}", manifest.target_root, root)
    model.metadata = dict(manifest.metadata)
    return model, final
