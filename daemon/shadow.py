"""The daemon's verified copy of the served version, and decoding each version once against it.

The swarm node applies every downloaded version through the daemon's hook (``decode_once``): an
anchor is decoded into a new model, a patch into verified changes against the held model
(``protocol.sparse_apply.decode_changes``: no clone of the model, no second decode, no diff scan
afterwards).  A patch comes back as a ``StagedVersion``: a ``Held`` whose ``model`` is still its
base, carrying the changes that turn it into the new version.  The activation writes those
changes into the store (``store_updates``), and only then is the held model brought to the new
version (``settle``), so a refused version leaves the held one intact.

Where the verified copy lives (docs/weightstore.md, "Where every copy lives"):

- ``store.kind = "shm"``: the store itself.  The held model is a set of zero-copy views of the
  store's segment (``store_model``); only the daemon means to write the segment (engines map it
  read-write), and every patch checks the digest of each tensor it touches over the bytes there,
  so an engine that wrote into it is caught at the next patch (the daemon then reloads from an
  anchor).
- engine-allocated stores (``cuda``, ``engine-shm``): a private host copy (the engine may
  re-allocate its buffer, which is then loaded from this copy), changed in place after each
  activation (``commit``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass, field

import numpy as np

from patchswarm.daemon.store_format import StoreError, TensorUpdate
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.held import Held
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.patchfile import apply_version
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.sparse_apply import WordChange, commit, decode_changes

log = logging.getLogger("patchswarm.daemon")

# glibc's mallopt parameters, and the values the daemon sets (see tune_malloc).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 256 << 10
ARENA_MAX = 2


def tune_malloc(threshold: int = MMAP_THRESHOLD, arenas: int = ARENA_MAX) -> bool:
    """Give freed model-sized memory back to the system (glibc's malloc; measured with
    benchmarks/memory_bench.py, docs/weightstore.md).

    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after
    which blocks of that size come from the heap and stay there once freed: a daemon that freed a
    version's tensors and chunks kept 100-140 MB more per 100 MB model after a few versions.  A
    fixed threshold turns that adjustment off.  Each thread that allocates (decoding, hashing, the
    scan's pool) otherwise gets an arena of its own whose freed pages stay mapped: two arenas
    saved another 7 MB a version.  False where the C library has no mallopt (not glibc)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(fn(M_MMAP_THRESHOLD, threshold)) and bool(fn(M_ARENA_MAX, arenas))
    if not ok:
        log.warning("mallopt failed: freed model memory may stay in the heap")
    return ok


@dataclass(slots=True)
class StagedVersion(Held):
    """A verified version not written yet: ``model`` is its base until ``settle`` lays ``changes`` in."""

    changes: list[WordChange] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)


def join_payload(parts: list[bytes | memoryview], size: int) -> memoryview:
    """The chunks as one buffer, written once; the list's references are dropped as they are copied,
    so a chunk nobody else holds (the chunk cache may) is freed before the next is copied.  One part
    that is the whole payload (a spooled download's mapping, swarm/spool.py) is used as it is."""
    if len(parts) == 1 and len(parts[0]) == size:
        return memoryview(parts[0])
    buf = np.empty(size, dtype=np.uint8)
    at = 0
    for i, part in enumerate(parts):
        n = len(part)
        if at + n > size:
            raise FormatError(f"the chunks hold more than the manifest's {size} payload bytes")
        buf[at : at + n] = np.frombuffer(part, dtype=np.uint8)
        at += n
        parts[i] = b""
    if at != size:
        raise FormatError(f"the chunks hold {at} of the manifest's {size} payload bytes")
    return buf.data


def decode_once(
    held: Held | None, manifest: Manifest, parts: list[bytes | memoryview], *, into: ServedModel | None = None
) -> Held:
    """The swarm node's apply hook: an anchor into a new model (or into ``into``: the buffers of a
    store that serves nothing yet), a patch into a ``StagedVersion``."""
    payload = join_payload(parts, manifest.payload_size)
    if held is None or manifest.base_version is None:
        model, digests = apply_version(None, manifest, payload, into=into)
        return Held(manifest.version, model, digests)
    changes, digests = decode_changes(held.model, manifest, payload, base_digests=held.digests)
    return StagedVersion(manifest.version, held.model, digests, changes, dict(manifest.metadata))


def store_updates(shadow: Held | None, held: Held) -> list[TensorUpdate]:
    """The store writes that take ``shadow`` (what the store holds) to ``held``: a staged version's
    decoded changes, or (another model, e.g. an anchor) the difference of the two models."""
    if shadow is None:
        raise StoreError("no version held to activate against")
    if isinstance(held, StagedVersion):
        if held.model is not shadow.model:
            raise StoreError(f"version {held.version} was decoded against another base than the store holds")
        return [TensorUpdate(c.index, c.positions, c.new, c.old) for c in held.changes]
    return diff_updates(shadow.model, held.model)


def materialized(held: Held) -> Held:
    """A version ready to load whole: a staged version's changes laid into a copy of its base (rare:
    a store that must be reloaded while a patch waits); any other ``Held`` as it is."""
    if not isinstance(held, StagedVersion):
        return held
    model = held.model.clone()
    commit(model, held.changes)
    model.metadata = dict(held.metadata)
    return Held(held.version, model, list(held.digests))


class StoreModel(ServedModel):
    """A model whose tensors are zero-copy views of a weight store's data."""

    __slots__ = ()


def store_model(store: WeightStore, metadata: dict[str, str] | None = None) -> StoreModel:
    """The store's tensors as a model of zero-copy views (host stores: the held copy is the store)."""
    return StoreModel(store.layout.specs, [store.slot_bytes(i) for i in range(len(store))], dict(metadata or {}))


def settle(held: Held, store: WeightStore | None, *, store_is_copy: bool) -> None:
    """``held`` was activated (or is kept for a buffer to come): make its model hold its version.

    A staged version's changes are written into the private copy (when the store is the copy, the
    activation already wrote them there); with ``store_is_copy`` a model of its own is replaced by
    views of the store, which frees it.
    """
    metadata = held.metadata if isinstance(held, StagedVersion) else held.model.metadata
    if isinstance(held, StagedVersion):
        if not store_is_copy:
            commit(held.model, held.changes)
        held.changes = []
        held.model.metadata = dict(metadata)
    if store_is_copy and store is not None and store.data is not None and not isinstance(held.model, StoreModel):
        held.model = store_model(store, metadata)
