"""The publishing rank's side of a collective publish (daemon/publish_dist.py): what every rank hands
it (``Part``), and putting one version together from those parts (``Joiner``): whole tensors as they
came, sliced tensors rebuilt from the previous version's bytes and the ranks' changes, then committed
through the rank's ``Publisher``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from patchswarm.daemon.publish_work import Buffers, Prepared, Stages, work_pool
from patchswarm.daemon.publisher import Publisher, PublishInfo
from patchswarm.protocol.codec import TensorDelta, diff_tensor
from patchswarm.protocol.diffscan import Changes
from patchswarm.protocol.served import ServedModel, TensorSpec, bytes_digest, word_view


@dataclass(frozen=True, slots=True)
class Plan:
    version: int
    base_version: int | None
    anchor: bool
    full_base: bool  # the publishing rank holds the sliced tensors of base_version: slices may send changes


@dataclass(slots=True)
class SlicePart:
    """One rank's rows of a tensor sharded on dim 0: the changes since its slice of the base, or its bytes."""

    spec: TensorSpec  # the canonical (whole) tensor, served dtype
    start: int  # first element of the slice in the canonical tensor
    numel: int
    gaps: torch.Tensor | None = None  # changed elements: gaps between positions from start (zstd likes them)
    new: torch.Tensor | None = None  # their new words
    data: torch.Tensor | None = None  # the slice's served bytes, when there are no changes to send

    def positions(self) -> torch.Tensor:
        """Changed elements, relative to ``start`` (int64)."""
        if self.gaps is None:
            return torch.empty(0, dtype=torch.int64)
        return torch.cumsum(self.gaps.to(torch.int64), 0)


@dataclass(slots=True)
class Part:
    """What one rank hands the publishing rank: small, whatever the size of its tensors."""

    rank: int
    error: str | None = None
    specs: list[TensorSpec] = field(default_factory=list)  # whole tensors, sorted by name
    digests: list[bytes] = field(default_factory=list)
    deltas: list[TensorDelta] | None = None  # against the base version; None: no base
    data: list[torch.Tensor] | None = None  # served bytes of the whole tensors (anchors only)
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # fp8 scales' bytes, every version (tiny)
    refreshed: int = 0
    slices: list[SlicePart] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)


class Joiner:
    """The publishing rank's state across versions: its Publisher, and the served bytes of every
    sliced tensor of ``full_version`` (the base the ranks' changes apply to)."""

    def __init__(self, pub: Publisher) -> None:
        self.pub = pub
        self.full: dict[str, tuple[TensorSpec, torch.Tensor, bytes]] = {}
        self.full_version: int | None = None
        self.spare = Buffers()

    def join(self, plan: Plan, parts: list[Part]) -> Joined:
        """Merge the ranks' parts: whole tensors as they came, sliced tensors rebuilt from the previous
        version's bytes and the changes (hashed and diffed here, where the whole tensor is)."""
        pub = self.pub
        owner: dict[str, int] = {}
        entries: dict[str, tuple[TensorSpec, bytes, TensorDelta | None, torch.Tensor | None]] = {}
        for p in parts:
            if len(p.digests) != len(p.specs) or (p.deltas is not None and len(p.deltas) != len(p.specs)):
                raise ValueError(f"rank {p.rank}'s part is malformed")
            for i, s in enumerate(p.specs):
                if s.name in owner:
                    raise ValueError(f"tensor {s.name!r} is in the parts of ranks {owner[s.name]} and {p.rank}")
                owner[s.name] = p.rank
                delta = p.deltas[i] if p.deltas is not None else None
                entries[s.name] = (s, p.digests[i], delta, p.data[i] if p.data is not None else p.scales.get(s.name))
        rows: dict[str, list[tuple[int, SlicePart]]] = {}
        for p in parts:
            for sp in p.slices:
                if sp.spec.name in owner:
                    raise ValueError(
                        f"tensor {sp.spec.name!r} is whole on rank {owner[sp.spec.name]} and sliced on rank {p.rank}"
                    )
                rows.setdefault(sp.spec.name, []).append((p.rank, sp))
        jobs = {name: work_pool().submit(self._join_tensor, plan, name, got) for name, got in rows.items()}
        full: dict[str, tuple[TensorSpec, torch.Tensor, bytes]] = {}
        for name, job in jobs.items():
            spec, data, delta, digest = job.result()
            entries[name] = (spec, digest, delta, data)
            full[name] = (spec, data, digest)
        names = sorted(entries)
        specs = [entries[n][0] for n in names]
        sent = [entries[n][3] for n in names]
        # Whole tensors a rank could not diff (it did not make the base: a resumed run, tensors that
        # moved) are diffed here against the chain's bytes; their bytes travel for it, once.
        pending: dict[int, torch.Tensor] = {}
        deltas: list[TensorDelta | None] | None = []
        for i, n in enumerate(names):
            d = entries[n][2]
            if d is None and deltas is not None:
                old = self._from_chain(plan, specs[i])
                if old is None:
                    deltas = None
                elif (arrived := sent[i]) is not None:
                    d = diff_tensor(specs[i], old[1], arrived, payload_format=pub.payload_format)
                else:
                    pending[i] = old[1]
            if deltas is not None:
                deltas.append(d)
        if deltas is None:
            pending.clear()
        refreshed = sum(p.refreshed for p in parts)
        patchable = deltas is not None and pub._prev is not None and pub._prev.specs == specs
        anchor = plan.anchor or refreshed * 2 > len(specs) or not patchable
        missing = bool(pending) or (anchor and any(d is None for d in sent))
        placeholder = [
            d if d is not None else torch.empty(s.nbytes, dtype=torch.uint8, device="meta")
            for s, d in zip(specs, sent, strict=True)
        ]
        digests = [entries[n][1] for n in names]
        return Joined(
            specs, placeholder, digests, deltas, anchor, refreshed, missing, full, pending, pub.payload_format
        )

    def _join_tensor(
        self, plan: Plan, name: str, got: list[tuple[int, SlicePart]]
    ) -> tuple[TensorSpec, torch.Tensor, TensorDelta | None, bytes]:
        specs = {sp.spec for _, sp in got}
        if len(specs) != 1:
            raise ValueError(f"tensor {name!r}: ranks disagree on its shape or dtype: {sorted(map(str, specs))}")
        (spec,) = specs
        got = sorted(got, key=lambda rs: rs[1].start)
        at = 0
        for rank, sp in got:
            if sp.start != at or sp.numel < 0:
                raise ValueError(f"tensor {name!r}: rank {rank}'s rows start at element {sp.start}, expected {at}")
            at += sp.numel
        if at != spec.numel:
            raise ValueError(f"tensor {name!r}: the ranks' rows cover {at} of its {spec.numel} elements")
        old = self.full.get(name) if plan.full_base else None
        if old is None:  # a resumed run: the publisher rebuilt the previous version from the board
            old = self._from_chain(plan, spec)
        base = old[1] if old is not None and old[0] == spec else None
        w = spec.dt.width
        if all(sp.data is None for _, sp in got):  # changes only: the common case
            if base is None:
                raise RuntimeError(f"tensor {name!r}: ranks sent changes, but there is no base to apply them to")
            assert old is not None
            pos = torch.cat([sp.positions() + sp.start for _, sp in got])
            new = torch.cat([sp.new for _, sp in got if sp.new is not None])
            if pos.numel() == 0:
                same = diff_tensor(spec, base, base, changes=Changes(pos, new, new))  # SAME, without a scan
                return spec, base, same, old[2]
            data = self.spare.take(name, torch.uint8, base.shape, base.device)
            data.copy_(base)
            word_view(data, spec)[pos] = new
            delta = diff_tensor(
                spec,
                base,
                data,
                changes=Changes(pos, word_view(base, spec)[pos], new),
                payload_format=self.pub.payload_format,
            )
            return spec, data, delta, bytes_digest(data)
        data = torch.empty(spec.nbytes, dtype=torch.uint8)
        for rank, sp in got:
            region = data[sp.start * w : (sp.start + sp.numel) * w]
            if sp.data is not None:
                region.copy_(sp.data)
                continue
            if base is None or sp.gaps is None or sp.new is None:
                raise RuntimeError(f"tensor {name!r}: rank {rank} sent changes, but there is no base to apply them to")
            region.copy_(base[sp.start * w : (sp.start + sp.numel) * w])
            word_view(data, spec)[sp.positions() + sp.start] = sp.new
        made = diff_tensor(spec, base, data, payload_format=self.pub.payload_format) if base is not None else None
        return spec, data, made, bytes_digest(data)

    def _from_chain(self, plan: Plan, spec: TensorSpec) -> tuple[TensorSpec, torch.Tensor, bytes] | None:
        """``spec``'s tensor of the publisher's previous version, when it holds its bytes (not a placeholder)."""
        pub = self.pub
        prev, digests = pub._prev, pub._prev_digests
        if prev is None or digests is None or pub._prev_version != plan.base_version or plan.base_version is None:
            return None
        i = next((i for i, s in enumerate(prev.specs) if s.name == spec.name), None)
        if i is None or prev.specs[i] != spec or prev.data[i].device.type == "meta":
            return None
        return spec, prev.data[i], digests[i]

    def commit(self, plan: Plan, joined: Joined, parts: list[Part], start: float, mine: Stages) -> PublishInfo:
        pub = self.pub
        stages = Stages()
        for k in ("gather", "join"):  # the publishing rank's own: waiting for the parts, rebuilding sliced tensors
            stages.add(k, mine.seconds.get(k, 0.0))
        for p in parts:
            for k, v in p.stages.items():
                stages.add(k, v)
        served = ServedModel(joined.specs, joined.data)
        prepared = Prepared.ready(joined.final_deltas(), joined.digests)
        with pub._lock:
            if pub._prev_version != plan.base_version:
                raise RuntimeError(f"the chain moved to version {pub._prev_version} since version {plan.version} began")
            # owned=False: the whole tensors' bytes are copies that arrived, or placeholders
            info = pub._commit(
                plan.version, served, False, prepared, joined.anchor, start, stages, refreshed=joined.refreshed
            )
        kept = {id(new[1]) for new in joined.full.values()}  # unchanged tensors carry on as they are
        replaced = [self.full[n] for n in sorted(self.full) if id(self.full[n][1]) not in kept]
        if replaced:  # the bytes of the version before, no longer read: the next version's copies go there
            self.spare.give(ServedModel([old[0] for old in replaced], [old[1] for old in replaced]))
        self.full, self.full_version = joined.full, plan.version
        return info


@dataclass(slots=True)
class Joined:
    """One version put together on the publishing rank, not yet written."""

    specs: list[TensorSpec]
    data: list[torch.Tensor]  # meta placeholders for whole tensors whose bytes did not travel
    digests: list[bytes]
    deltas: list[TensorDelta | None] | None  # None entries: pending, made once the bytes arrived
    anchor: bool
    refreshed: int
    missing: bool  # bytes the ranks did not send are needed (an anchor, pending deltas)
    full: dict[str, tuple[TensorSpec, torch.Tensor, bytes]]
    pending: dict[int, torch.Tensor]  # index -> the chain's bytes to diff that tensor against
    payload_format: int  # the publisher's, for the pending deltas

    def final_deltas(self) -> list[TensorDelta] | None:
        if self.deltas is None:
            return None
        out = [d for d in self.deltas if d is not None]
        if len(out) != len(self.deltas):
            raise RuntimeError("deltas are still pending: the ranks' bytes did not arrive")
        return out

    def fill(self, parts: list[Part], sent: list[list[torch.Tensor]]) -> None:
        at = {s.name: i for i, s in enumerate(self.specs)}
        for p, data in zip(parts, sent, strict=True):
            if len(data) != len(p.specs):
                raise ValueError(f"rank {p.rank} sent {len(data)} tensors, not {len(p.specs)}")
            for s, d in zip(p.specs, data, strict=True):
                if d.dtype != torch.uint8 or d.dim() != 1 or d.numel() != s.nbytes:
                    raise ValueError(f"rank {p.rank} sent {s.name!r} with the wrong size")
                self.data[at[s.name]] = d
        if self.deltas is not None:
            for i, base in self.pending.items():
                self.deltas[i] = diff_tensor(self.specs[i], base, self.data[i], payload_format=self.payload_format)
        self.pending = {}
        self.missing = False
