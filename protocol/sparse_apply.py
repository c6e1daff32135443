"""Decode a patch against the held base without copying the model: the changes, verified, before anything is written.

``apply_version`` (protocol/patchfile.py) patches a model in place, so its callers apply to a
clone: a second full model for every version.  ``decode_changes`` reads the base and writes
nothing: each tensor's changes are decoded (positions, new words, and the old words there), the
tensor's target digest is computed over the base with the changes laid in, a slice at a time in a
small scratch buffer, and checked against the manifest's digest for that tensor; then the state
root.  The result is the list of changes a weight store writes in place (the same list, word for
word, as scanning the old model against the new one) and the new digests.  ``commit`` writes them
into a model once the version is accepted, so a failure never leaves a half-applied base.

Extra memory: the decoded changes (about 12 bytes per changed bf16 value), one scratch slice
(``HASH_SLICE`` bytes), and whole tensors only for records that change more than
``dense_fraction`` of a tensor (written whole, as the weight store does).
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import numpy as np
import torch

from patchswarm.protocol.codec import _decode
from patchswarm.protocol.diffscan import scan
from patchswarm.protocol.errors import FormatError, TargetMismatchError
from patchswarm.protocol.manifest import Kind, Manifest
from patchswarm.protocol.patch_format import TensorUpdate
from patchswarm.protocol.patchfile import check_base
from patchswarm.protocol.served import ServedModel, TensorSpec, bytes_digest, state_root, word_view
from patchswarm.protocol.value_coding import _ulp_update, _UlpSteps

# Above this fraction of changed elements a tensor's change is given whole (a copy beats a scatter).
DENSE_FRACTION = 0.125
# Bytes of the base copied, patched and hashed at a time (the scratch buffer).
HASH_SLICE = 1 << 22
# Tensors above this many bytes are hashed with BLAKE3's threads (as protocol.served.bytes_digest).
_THREADED_HASH = 1 << 22


@dataclass(frozen=True, slots=True)
class WordChange:
    """One tensor's change: ``new`` words at ``positions`` (int64, ascending), or the whole tensor when
    ``positions`` is None; ``old`` the base's words there (absolute values: writing either is idempotent)."""

    index: int
    positions: torch.Tensor | None
    new: torch.Tensor
    old: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.new.numel())


def decode_changes(
    base: ServedModel,
    manifest: Manifest,
    payload: bytes | memoryview,
    *,
    base_digests: list[bytes] | None = None,
    dense_fraction: float = DENSE_FRACTION,
) -> tuple[list[WordChange], list[bytes]]:
    """The verified changes that turn ``base`` into the patch's target, and the target's digests.

    ``base`` is only read.  Raises before returning anything if the base is not the patch's base
    (``BaseMismatchError``), the payload is malformed (``FormatError``) or a tensor or the state root
    does not come out as the manifest says (``TargetMismatchError``).
    """
    specs = list(manifest.specs)
    if manifest.kind != Kind.PATCH:
        raise FormatError(f"version {manifest.version} is an anchor: decode_changes needs a patch")
    digests = check_base(manifest, base, base_digests)
    changes: list[WordChange] = []
    for u in _decode(payload, specs, base):
        spec = specs[u.index]
        words = word_view(base.data[u.index], spec)
        if isinstance(u, _UlpSteps):
            u = _ulp_update(u, spec, base.data[u.index])
        if u.positions is None:
            change, digest = _dense_change(u, spec, words, dense_fraction)
        else:
            change, digest = _sparse_change(u, spec, words, dense_fraction)
        want = manifest.digests[u.index]
        if digest != want:
            raise TargetMismatchError(f"{spec.name} of version {manifest.version}", want, digest)
        digests[u.index] = digest
        if change is not None:
            changes.append(change)
    root = state_root(specs, digests)
    if root != manifest.target_root:
        raise TargetMismatchError(f"target of version {manifest.version}", manifest.target_root, root)
    return changes, digests


def _dense_change(
    u: TensorUpdate, spec: TensorSpec, words: torch.Tensor, dense_fraction: float
) -> tuple[WordChange | None, bytes]:
    """A record decoded whole (XOR, FULL): hashed as it is, then given as the elements that differ."""
    digest = bytes_digest(u.values)
    new = word_view(u.values, spec)
    ch = scan(words, new)
    if len(ch) == 0:
        return None, digest
    if len(ch) > dense_fraction * spec.numel:
        return WordChange(u.index, None, new, words.clone()), digest
    return WordChange(u.index, ch.positions, ch.new, ch.old), digest


def _sparse_change(
    u: TensorUpdate, spec: TensorSpec, words: torch.Tensor, dense_fraction: float
) -> tuple[WordChange | None, bytes]:
    """New words at ascending positions: the no-op ones dropped, the digest computed slice by slice."""
    assert u.positions is not None
    pos, new = u.positions, u.values
    old = words[pos]
    differ = old != new
    if not bool(differ.all()):
        pos, new, old = pos[differ], new[differ], old[differ]
    if words.device.type == "cpu":
        digest = _patched_digest(words.numpy(), pos.numpy(), new.numpy())
    else:  # (a device base: the tensor is patched in a copy there)
        patched = words.clone()
        patched[pos] = new
        digest = bytes_digest(patched.view(torch.uint8))
    if pos.numel() == 0:
        return None, digest
    if pos.numel() > dense_fraction * spec.numel:
        whole = words.clone()
        whole[pos] = new
        return WordChange(u.index, None, whole, words.clone()), digest
    return WordChange(u.index, pos, new, old), digest


def _patched_digest(base: np.ndarray, positions: np.ndarray, new: np.ndarray, slice_bytes: int = HASH_SLICE) -> bytes:
    """BLAKE3 of ``base`` with ``new`` at ``positions`` (ascending), never copying more than a slice."""
    n = base.size
    step = max(1, slice_bytes // base.itemsize)
    h = blake3.blake3(max_threads=blake3.blake3.AUTO) if n * base.itemsize > _THREADED_HASH else blake3.blake3()
    scratch = np.empty(min(step, n), dtype=base.dtype)
    cut = np.searchsorted(positions, np.arange(step, n, step)) if n > step else np.empty(0, dtype=np.int64)
    lo = 0
    for j, s in enumerate(range(0, n, step)):
        e = min(s + step, n)
        hi = int(cut[j]) if j < cut.size else positions.size
        part = scratch[: e - s]
        np.copyto(part, base[s:e])
        part[positions[lo:hi] - s] = new[lo:hi]
        h.update(part.view(np.uint8).data)
        lo = hi
    return h.digest()


def commit(model: ServedModel, changes: list[WordChange]) -> None:
    """Write accepted changes into ``model`` in place (the base ``decode_changes`` read)."""
    for c in changes:
        words = word_view(model.data[c.index], model.specs[c.index])
        if c.positions is None:
            words.copy_(c.new)
        else:
            words.index_copy_(0, c.positions, c.new)
