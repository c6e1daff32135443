"""Sharded trainers (each rank holds only some tensors) publishing one version together:

    shard = pub.begin_sharded(world_size)        # reserves the version number
    shard.add(rank, rank_state_dict)             # on each rank's thread: cast, diff, hash
    info = shard.finalize()                      # once: one payload, one manifest, head moves

Each rank keeps its own previous served shard and hands ``finalize`` only what it computed
from it (per-tensor deltas, digests, specs); see docs/board.md, "Sharded trainers".  The version
commits through the publisher's chain (daemon/publish_chain.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from patchswarm.daemon.publish_chain import PublishInfo
from patchswarm.daemon.publish_work import Buffers, Prepared, Stages, cast_served, prepare_all, state_dict_of
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.codec import TensorDelta
from patchswarm.protocol.served import ServedModel, TensorSpec


class _Rank:
    """What one rank keeps between versions: its previous served shard, the base of its next deltas."""

    def __init__(self, fmt: ServedFormat) -> None:
        self.format = fmt
        self.buffers = Buffers()
        self.version: int | None = None
        self.served: ServedModel | None = None
        self.owned = False  # served's buffers are the rank's own: reusable once it is replaced
        self.digests: list[bytes] | None = None


class ShardHost(Protocol):
    """What a sharded version uses of its publisher (daemon/publisher.py ``Publisher``)."""

    format: ServedFormat
    payload_format: int
    served_on_host: bool
    _lock: threading.Lock
    _counter_lock: threading.Lock
    _ranks: dict[int, _Rank]
    _prev: ServedModel | None
    _prev_digests: list[bytes] | None
    _prev_version: int | None
    _version: int
    _sharded: ShardedPublish | None

    def _commit(
        self,
        version: int,
        served: ServedModel,
        owned: bool,
        prepared: Prepared,
        anchor: bool,
        start: float,
        stages: Stages,
        *,
        refreshed: int,
    ) -> PublishInfo: ...


@dataclass(frozen=True, slots=True)
class ShardPart:
    """What one rank hands to ``finalize``: small, whatever the size of its tensors.

    ``deltas`` and ``digests`` are what the payload and manifest need; ``served`` is the rank's
    new shard, by reference (no copy), read only when the version carries an anchor (a rank in
    another process would send it only then: ``ShardedPublish.anchor`` is known before ``add``).
    """

    rank: int
    version: int
    base_version: int | None
    specs: list[TensorSpec]  # sorted by name
    digests: list[bytes]
    deltas: list[TensorDelta] | None  # against base_version's tensors; None: no base or new layout
    served: ServedModel
    owned: bool
    refreshed: int
    stages: dict[str, float]

    @property
    def delta_bytes(self) -> int:
        return sum(d.nbytes for d in self.deltas or [])


class ShardedPublish:
    """One version published by several ranks: ``add`` once per rank (any thread), then ``finalize``."""

    def __init__(
        self,
        publisher: ShardHost,
        version: int,
        world_size: int,
        anchor: bool,
        base_version: int | None,
        start: float,
    ) -> None:
        self._pub = publisher
        self.version = version
        self.world_size = world_size
        self.anchor = anchor  # decided up front, so ranks know whether finalize will need their bytes
        self.base_version = base_version
        self._start = start
        self._lock = threading.Lock()
        self._parts: dict[int, ShardPart] = {}
        self._adding: set[int] = set()
        self._closed: str | None = None  # "finalized" or "aborted"

    def __enter__(self) -> ShardedPublish:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._closed is None:
            self.abort()

    def add(
        self, rank: int, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor], *, version: int | None = None
    ) -> ShardPart:
        """Rank ``rank``'s shard: cast to the served format, diff against the rank's previous shard, hash.

        Ranks may call this concurrently from their own threads.  ``version``, when given, must be
        this handle's version (a rank's own idea of which version it is contributing to).
        """
        if version is not None and version != self.version:
            raise ValueError(
                f"rank {rank} adds to version {version}, but this sharded publish is version {self.version}"
            )
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        with self._lock:
            self._check_open()
            if rank in self._parts or rank in self._adding:
                raise ValueError(f"rank {rank} already added its shard to version {self.version}")
            self._adding.add(rank)
        try:
            part = self._make_part(rank, state_dict_of(model_or_state))
        finally:
            with self._lock:
                self._adding.discard(rank)
        with self._lock:
            self._check_open()
            self._parts[rank] = part
        return part

    def _check_open(self) -> None:
        if self._closed is not None:
            raise RuntimeError(f"sharded version {self.version} was already {self._closed}")

    def _make_part(self, rank: int, state: Mapping[str, torch.Tensor]) -> ShardPart:
        pub = self._pub
        with pub._counter_lock:
            r = pub._ranks.get(rank)
            if r is None:
                fmt = dataclasses.replace(pub.format, scales={}, refreshed=[], basis=None, converted=frozenset())
                r = pub._ranks[rank] = _Rank(fmt)
        stages = Stages()
        with stages.time("cast"):
            # fp8 scales: the rank's own when it made the base from these tensors, else the base's.
            r.format.follow(self.base_version, pub._prev, state.keys())
            if self.anchor and r.format.refresh_at_anchor:
                r.format.reset()
            r.format.basis = None  # until this shard is cast
            target = cast_served(r.format, state, r.buffers, pub.served_on_host)
            r.format.basis = self.version
        served = target.model
        base, base_digests = self._base(r, served.specs)
        deltas, digests = prepare_all(base, base_digests, target, stages, pub.payload_format)
        return ShardPart(
            rank=rank,
            version=self.version,
            base_version=self.base_version if deltas is not None else None,
            specs=served.specs,
            digests=digests,
            deltas=deltas,
            served=served,
            owned=target.owned,
            refreshed=len(r.format.refreshed),
            stages=dict(stages.seconds),
        )

    def _base(self, r: _Rank, specs: list[TensorSpec]) -> tuple[ServedModel | None, list[bytes] | None]:
        """The rank's base for ``specs``: its own previous shard, else (new rank, moved tensors, a
        version published unsharded, a resumed run) those tensors of the publisher's previous version."""
        if self.base_version is None:
            return None, None
        if r.version == self.base_version and r.served is not None and r.served.specs == specs:
            return r.served, r.digests
        prev, prev_digests = self._pub._prev, self._pub._prev_digests
        if prev is None or prev_digests is None:
            return None, None
        index = {s.name: i for i, s in enumerate(prev.specs)}
        idx = [index.get(s.name) for s in specs]
        if any(i is None or prev.specs[i] != s for i, s in zip(idx, specs, strict=True)):
            return None, None  # new or reshaped tensors: only an anchor reaches this layout
        sel = [i for i in idx if i is not None]
        return ServedModel(specs, [prev.data[i] for i in sel]), [prev_digests[i] for i in sel]

    def abort(self) -> None:
        """Give the version number back; nothing was written."""
        pub = self._pub
        with self._lock:
            self._check_open()
            self._closed = "aborted"
        with pub._counter_lock:
            if pub._version == self.version:
                pub._version -= 1
            pub._sharded = None

    def finalize(self) -> PublishInfo:
        """Assemble one payload and one manifest over the union of the shards; sign, write, move the head.

        Refuses (and stays open, nothing written) while a rank is missing, when two ranks hold a
        tensor of the same name, or when a shard was made for another version or base.
        """
        with self._lock:
            self._check_open()
            missing = [r for r in range(self.world_size) if r not in self._parts]
            if missing:
                raise ValueError(f"version {self.version}: rank(s) {missing} have not added their shard")
            parts = [self._parts[r] for r in range(self.world_size)]
            owner: dict[str, int] = {}
            for p in parts:
                if p.version != self.version:
                    raise ValueError(f"rank {p.rank}'s shard was made for version {p.version}, not {self.version}")
                if p.deltas is not None and p.base_version != self.base_version:
                    raise ValueError(
                        f"rank {p.rank}'s deltas are against version {p.base_version}, "
                        f"but version {self.version} patches version {self.base_version}"
                    )
                for s in p.specs:
                    if s.name in owner:
                        raise ValueError(f"tensor {s.name!r} is in the shards of ranks {owner[s.name]} and {p.rank}")
                    owner[s.name] = p.rank
            self._closed = "finalized"
        try:
            return self._finalize(parts)
        except BaseException:
            with self._lock:
                self._closed = None  # nothing moved: the caller may retry or abort
            raise

    def _finalize(self, parts: list[ShardPart]) -> PublishInfo:
        pub = self._pub
        stages = Stages()
        for p in parts:
            for k, v in p.stages.items():
                stages.add(k, v)
        # Merge the shards into name order: (name, part, index in part).
        order = sorted((s.name, pi, i) for pi, p in enumerate(parts) for i, s in enumerate(p.specs))
        specs = [parts[pi].specs[i] for _, pi, i in order]
        data = [parts[pi].served.data[i] for _, pi, i in order]
        digests = [parts[pi].digests[i] for _, pi, i in order]
        deltas: list[TensorDelta] | None = None
        if all(p.deltas is not None for p in parts):
            deltas = [parts[pi].deltas[i] for _, pi, i in order]  # type: ignore[index]
        metadata: dict[str, str] = {}  # the format's keys are added at commit, as for a one-process publish
        served = ServedModel(specs, data, metadata)
        with pub._lock:
            if pub._prev_version != self.base_version:
                raise RuntimeError(
                    f"the chain moved to version {pub._prev_version} since version {self.version} was opened"
                )
            info = pub._commit(
                self.version,
                served,
                False,  # the union references the ranks' buffers: they recycle them, not the publisher
                Prepared.ready(deltas, digests),
                self.anchor,
                self._start,
                stages,
                refreshed=sum(p.refreshed for p in parts),
            )
            with pub._counter_lock:
                for p in parts:
                    r = pub._ranks[p.rank]
                    if r.served is not None and r.owned:
                        r.buffers.give(r.served)  # neither the chain nor any rank reads it any more
                    r.served, r.owned, r.digests, r.version = p.served, p.owned, p.digests, self.version
                pub._sharded = None
        return info
