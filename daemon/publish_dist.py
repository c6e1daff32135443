"""Sharded trainers across processes: the ranks of a torch.distributed process group publish one
version together, without gathering the model.

    pub = Publisher(board, key, run_id="run-7", served_format="bf16") if rank == 0 else None
    dp = DistPublisher(pub)                  # on every rank, collectively (one rank holds the Publisher)
    for step in training:
        ...
        info = dp.publish(model)              # every rank, collectively; every rank gets the PublishInfo

A rank's state dict holds whole tensors (tensor-partitioned ranks: disjoint names, as with the
thread-based ``ShardedPublish``), DTensors sharded on dim 0 (FSDP2's ``fully_shard``, uneven last
shard included) or replicated DTensors, on a 1-D device mesh.  Each rank casts its part to the
served format and diffs it against its own previous served part; only small results travel to
the publishing rank (docs/board.md, "Sharded trainers"):

- whole tensors: per-tensor deltas, digests and specs (hashed on the rank); their served bytes
  only for a version that carries an anchor;
- slices of DTensors: the changed elements (positions in the slice and new values), or the
  slice's served bytes when that is smaller.  A manifest digest covers a WHOLE tensor, so the
  publishing rank keeps the served bytes of every sliced tensor of the previous version, applies
  the changes, hashes the tensors that changed and makes their deltas.

Versions, anchors and failures are agreed collectively: a rank that raises makes every rank
raise, with nothing written; the board moves only once every rank's part has arrived.  fp8 scales
of sliced tensors are fixed from the amax of the whole tensor (an all-reduce of each rank's
contribution), so every rank makes the same refresh decision.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch
import torch.distributed as dist
import zstandard

from patchswarm.daemon import fp8
from patchswarm.daemon.dist_join import Joined, Joiner, Part, Plan, SlicePart
from patchswarm.daemon.dtensor_slices import (
    RowSlice,
    amax_part,
    describe,
    fp8_rows,
    grid_shape,
    quantized_rows,
    split_state,
)
from patchswarm.daemon.publish_work import (
    Buffers,
    Served,
    Stages,
    cast_served,
    prepare_all,
    state_dict_of,
)
from patchswarm.daemon.publisher import Publisher, PublishInfo
from patchswarm.daemon.served_format import ServedFormat, scales_of
from patchswarm.protocol.diffscan import scan
from patchswarm.protocol.dtypes import from_torch
from patchswarm.protocol.served import ServedModel, TensorSpec, raw_bytes, word_view

_ZSTD = zstandard.ZstdCompressor(level=1)


class DistPublishError(RuntimeError):
    """A collective publish failed on some rank (or on the publishing rank's commit): nothing was written."""


@dataclass(slots=True)
class _Mine:
    """A rank's previous served parts: the bases of its next deltas."""

    version: int | None = None
    whole: ServedModel | None = None
    digests: list[bytes] | None = None
    slices: dict[str, tuple[int, TensorSpec, torch.Tensor]] = field(
        default_factory=dict
    )  # name -> (start, spec, bytes)
    owned: bool = False  # whole's buffers came from this rank's Buffers: reusable once replaced


class DistPublisher:
    """One version per collective ``publish`` call over the ranks of ``group`` (default: the world).

    Construct it on every rank, collectively; exactly one rank passes its :class:`Publisher`
    (board, key, served format, anchor policy) and writes.  That Publisher is then used only
    through this object: whole tensors of the other ranks are not kept in its process, so its
    own ``publish`` cannot diff against them.
    """

    def __init__(self, publisher: Publisher | None, *, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistPublisher needs an initialized torch.distributed process group")
        if publisher is not None and not isinstance(publisher, Publisher):
            raise ValueError(f"publisher must be a Publisher or None, not {type(publisher).__name__}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # The publishing rank's served format, its fixed scales left behind (each rank keeps its own,
        # following them from the chain when it does not hold those of the version it builds on).
        fmt = (
            None
            if publisher is None
            else dataclasses.replace(publisher.format, scales={}, refreshed=[], basis=None, converted=frozenset())
        )
        # The publishing rank's payload format travels with it: every rank codes its deltas for it.
        said = self._all_gather(None if fmt is None or publisher is None else (fmt, publisher.payload_format))
        holders = [r for r, f in enumerate(said) if f is not None]
        if len(holders) != 1:
            raise ValueError(f"exactly one rank must hold the Publisher, not ranks {holders}")
        self.publisher_rank = holders[0]
        self._src = self.publisher_rank if group is None else dist.get_global_rank(group, self.publisher_rank)
        self._pub = publisher
        # fp8 scales of this rank's whole tensors and of every sliced tensor (the same on every rank)
        self._fmt: ServedFormat = said[self.publisher_rank][0]
        self._payload_format: int = said[self.publisher_rank][1]
        self._buffers = Buffers()
        self._mine = _Mine()
        # Publishing rank only: the served bytes of every sliced tensor of the last version written.
        self._joiner = Joiner(publisher) if publisher is not None else None
        self._requested = False
        self.last_gathered_bytes = 0  # bytes the publishing rank received for the last version
        self.last_sent_bytes = 0  # bytes this rank sent for the last version (its parts, pickled)

    # ------------------------------------------------------------ collectives

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def _gather(self, part: Part | None, data: list[torch.Tensor] | None) -> list[Part | list[torch.Tensor]] | None:
        """A part (zstd-compressed: stream pieces are uncompressed, about 12 bytes per changed element)
        or served bytes (raw: compressing them would cost more time than the wire saves), gathered on
        the publishing rank (None elsewhere)."""
        if part is not None:
            blob = _ZSTD.compress(pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            blob = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
        self.last_sent_bytes += len(blob)
        out: list[Any] | None = [None] * self.world_size if self.rank == self.publisher_rank else None
        dist.gather_object(blob, out, dst=self._src, group=self.group)
        if out is None:
            return None
        self.last_gathered_bytes += sum(len(b) for b in out)
        if part is not None:
            return [pickle.loads(zstandard.ZstdDecompressor().decompress(b)) for b in out]
        return [pickle.loads(b) for b in out]

    def _device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------ the collective publish

    def publish(
        self, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor], *, anchor: bool = False
    ) -> PublishInfo:
        """Publish the next version; every rank of the group calls this with its own part.

        ``anchor=True`` on any rank makes the version an anchor.  Raises DistPublishError on
        every rank, with nothing written, if any rank fails.
        """
        if not isinstance(anchor, bool):
            raise ValueError(f"anchor must be True or False, not {anchor!r}")
        self.last_gathered_bytes = self.last_sent_bytes = 0
        start = self._pub.clock() if self._pub is not None else time.time()
        error: BaseException | None = None
        whole: dict[str, torch.Tensor] = {}
        slices: list[RowSlice] = []
        try:
            if not isinstance(model_or_state, torch.nn.Module | Mapping):
                raise ValueError(
                    f"model_or_state must be a module or a state dict, not {type(model_or_state).__name__}"
                )
            whole, slices = split_state(state_dict_of(model_or_state))
        except Exception as e:
            error = e
        mine = describe(slices)
        said = self._all_gather((anchor, blake3.blake3(pickle.dumps(mine)).digest(), _text(error)))
        plan = self._broadcast(self._plan(said) if self._pub is not None else None)
        if isinstance(plan, str):
            raise DistPublishError(plan) from error
        try:
            return self._run(plan, self._described(said, mine), whole, slices, error, start)
        except BaseException:
            self._fmt.basis = None  # scales half updated: the next version follows them from the chain
            pub, joiner = self._pub, self._joiner
            if pub is not None and joiner is not None and joiner.full_version != plan.version:
                with pub._counter_lock:  # not written: give the number back
                    if pub._version == plan.version:
                        pub._version -= 1
                pub._anchor_requested |= self._requested
            raise

    def _described(
        self, said: list[tuple[bool, bytes, str | None]], mine: list[tuple[str, tuple[int, ...], str]]
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every sliced tensor's canonical shape and source dtype, the same on every rank (fp8 only: the
        amax all-reduce needs one layout).  Ranks said only a digest of theirs: under FSDP every rank
        holds rows of the same tensors, so nothing more travels; otherwise the lists are gathered."""
        if self._fmt.name != "fp8_e4m3":
            return {}
        lists = [mine] if len({d for _, d, _ in said}) == 1 else self._all_gather(mine)
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for listed in lists:
            for name, shape, dtype in listed:
                out.setdefault(name, (tuple(shape), dtype))
        return out

    def _plan(self, said: list[tuple[bool, bytes, str | None]]) -> Plan | str:
        """Publishing rank: the version every rank works on, or why none is published."""
        errors = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(said) if e is not None]
        if errors:
            return "version not published: " + "; ".join(errors)
        pub = self._pub
        assert pub is not None
        try:
            pub.flush()
            with pub._counter_lock:
                if pub._sharded is not None:
                    raise RuntimeError(f"sharded version {pub._sharded.version} is open: finalize or abort it first")
                pub._version += 1
                version, base = pub._version, pub._prev_version
            self._requested = pub._anchor_requested  # given back with the version number if nothing is written
            wanted = pub._wants_anchor(version, any(a for a, _, _ in said))
        except Exception as e:
            return f"version not published: rank {self.rank}: {_text(e)}"
        return Plan(
            version, base, wanted, base is not None and self._joiner is not None and self._joiner.full_version == base
        )

    def _run(
        self,
        plan: Plan,
        described: dict[str, tuple[tuple[int, ...], str]],
        whole: dict[str, torch.Tensor],
        slices: list[RowSlice],
        error: BaseException | None,
        start: float,
    ) -> PublishInfo:
        stages = Stages()
        quantized = quantized_rows(self._fmt, described)  # the same on every rank: it depends only on what all said
        amax: dict[str, torch.Tensor] = {}
        names = frozenset(whole) | frozenset(described)
        if self._fmt.is_fp8:
            amax, error = self._follow(plan, names, quantized, described, slices)
        part = Part(self.rank)
        target: Served | None = None
        mine: _Mine | None = None
        if error is None:
            try:
                part, target, mine = self._make_part(plan, whole, slices, quantized, amax, stages)
            except Exception as e:
                error = e
        if error is not None:
            part = Part(self.rank, error=_text(error))
        data, part.data = part.data, None
        t = time.perf_counter()
        gathered = self._gather(part, None)
        if plan.anchor:  # every rank, a failed one too (with nothing): the whole tensors' bytes, as they are
            sent = self._gather(None, data or [])
            if gathered is not None and sent is not None:
                for p, d in zip(gathered, sent, strict=True):
                    assert isinstance(p, Part) and isinstance(d, list)
                    p.data = d
        outcome: Any = None
        joined: Joined | None = None
        parts: list[Part] = []
        if gathered is not None:  # the publishing rank
            parts = [p for p in gathered if isinstance(p, Part)]
            stages.add("gather", time.perf_counter() - t)
            bad = [f"rank {p.rank}: {p.error}" for p in parts if p.error is not None]
            outcome = _failed(plan, bad) if bad else None
            if outcome is None:
                try:
                    with stages.time("join"):
                        assert self._joiner is not None
                        joined = self._joiner.join(plan, parts)
                    outcome = "bytes" if joined.missing else None
                except Exception as e:
                    outcome = _failed(plan, [f"rank {self.rank}: {_text(e)}"])
        outcome = self._broadcast(outcome)
        if outcome == "bytes":  # an anchor decided after the ranks worked (a new layout, most fp8 scales moved)
            got = self._gather(None, target.model.data if target is not None else [])
            outcome = None
            if got is not None:
                assert joined is not None
                try:
                    joined.fill(parts, [d for d in got if isinstance(d, list)])
                except Exception as e:
                    outcome = _failed(plan, [f"rank {self.rank}: {_text(e)}"])
        if outcome is None and joined is not None:
            try:
                assert self._joiner is not None
                outcome = self._joiner.commit(plan, joined, parts, start, stages)
            except Exception as e:
                outcome = _failed(plan, [f"rank {self.rank}: {_text(e)}"])
        outcome = self._broadcast(outcome)
        if isinstance(outcome, str):
            raise DistPublishError(outcome) from error
        if not isinstance(outcome, PublishInfo):
            raise DistPublishError(f"version {plan.version}: the publishing rank answered {type(outcome).__name__}")
        assert mine is not None
        self._fmt.basis, self._fmt.converted = plan.version, names
        old = self._mine
        self._mine = mine
        if old.whole is not None and old.owned:
            self._buffers.give(old.whole)  # the next cast reuses its buffers
        return outcome

    # ------------------------------------------------------------ every rank: its own part

    def _follow(
        self,
        plan: Plan,
        names: frozenset[str],
        quantized: Mapping[str, tuple[str, torch.dtype]],
        described: Mapping[str, tuple[tuple[int, ...], str]],
        slices: list[RowSlice],
    ) -> tuple[dict[str, torch.Tensor], BaseException | None]:
        """fp8: make this rank's scales those of the base version, as ``Publisher.publish`` does
        (``ServedFormat.follow``; every scale recomputed at an anchor with ``refresh_at_anchor``), and
        agree on the sliced tensors' amax.  A rank that did not make the base from the same tensors
        (a resumed run, a failed try, tensors that moved) says so in the all-reduce; the publishing
        rank then sends every rank the scales the base version holds."""
        reset = plan.anchor and self._fmt.refresh_at_anchor
        stale = not reset and not self._fmt.follows(plan.base_version, names)
        amax, stale_anywhere, error = self._agree_amax(quantized, described, slices, stale)
        if stale_anywhere:
            pub = self._pub
            chain: dict[str, torch.Tensor] | None = None
            if pub is not None:
                chain = {}
                try:
                    if pub._prev is not None and pub._prev_version == plan.base_version:
                        chain = scales_of(pub._prev)
                except Exception as e:  # reported with the parts: every rank still joins the broadcast
                    error = error or e
            self._fmt.scales = self._broadcast(chain)
        if reset:
            self._fmt.reset()
        self._fmt.basis = None  # until this version is written
        return amax, error

    def _agree_amax(
        self,
        quantized: Mapping[str, tuple[str, torch.dtype]],
        described: Mapping[str, tuple[tuple[int, ...], str]],
        slices: list[RowSlice],
        stale: bool,
    ) -> tuple[dict[str, torch.Tensor], bool, BaseException | None]:
        """The whole tensors' amax (a scalar, or the block grid) from every rank's rows, and whether any
        rank's scales are ``stale``: one all-reduce (MAX) over all of them.  A rank that fails here
        still takes part (with zeros) and reports later."""
        mine = {s.name: s for s in slices}
        dev = self._device()
        names = sorted(quantized)
        shapes = [grid_shape(described[n][0], self._fmt.block) for n in names]
        sizes = [math.prod(g) for g in shapes]
        flat = torch.zeros(sum(sizes) + 1, dtype=torch.float32, device=dev)
        flat[-1] = float(stale)
        error: BaseException | None = None
        at = 0
        for name, size in zip(names, sizes, strict=True):
            s = mine.get(name)
            if s is not None and error is None:
                try:
                    flat[at : at + size] = amax_part(s, self._fmt.block).reshape(-1).to(dev)
                except Exception as e:
                    error = e
            at += size
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        out: dict[str, torch.Tensor] = {}
        at = 0
        for name, grid, size in zip(names, shapes, sizes, strict=True):
            out[name] = flat[at : at + size].reshape(grid).clone()
            at += size
        return out, bool(flat[-1] > 0), error

    def _make_part(
        self,
        plan: Plan,
        whole: dict[str, torch.Tensor],
        slices: list[RowSlice],
        quantized: Mapping[str, tuple[str, torch.dtype]],
        amax: Mapping[str, torch.Tensor],
        stages: Stages,
    ) -> tuple[Part, Served, _Mine]:
        mine = self._mine
        extras: dict[str, torch.Tensor] = {}  # served already: fp8 scales of sliced tensors
        refreshed = 0
        out_slices: list[SlicePart] = []
        new_slices: dict[str, tuple[int, TensorSpec, torch.Tensor]] = {}
        with stages.time("cast"):
            # Every rank decides every sliced tensor's scale, from the same amax: they stay the same.
            moved = {name: self._fmt.scale_for(name, amax[name])[1] for name in sorted(quantized)}
            typed: dict[str, tuple[RowSlice, torch.Tensor, TensorSpec]] = {}
            elementwise = dataclasses.replace(self._fmt, scales={}, refreshed=[])
            for s in slices:
                if s.name in quantized:
                    scale_name, dtype = quantized[s.name]
                    q = fp8_rows(self._fmt, s)
                    if s.start_row == 0 and s.local.shape[0] > 0:  # the first rows' rank ships the scale
                        extras[scale_name] = self._fmt.scales[s.name].clone()
                        refreshed += moved[s.name]
                else:
                    q = elementwise.convert({s.name: s.local})[s.name]
                    dtype = q.dtype
                spec = TensorSpec(s.name, from_torch(dtype).name, s.shape)
                typed[s.name] = (s, q, spec)
        for name, (s, q, spec) in typed.items():
            row = math.prod(s.shape[1:])
            start, numel = s.start_row * row, q.numel()
            data = raw_bytes(q.detach().to("cpu"))
            if data.untyped_storage().data_ptr() == s.local.untyped_storage().data_ptr():
                data = data.clone()  # already in the served dtype: the copy is taken, as publish() does
            local_spec = TensorSpec(name, spec.dtype, (numel,))
            new_slices[name] = (start, local_spec, data)
            sp = SlicePart(spec, start, numel)
            prev = mine.slices.get(name)
            if (
                plan.full_base
                and mine.version == plan.base_version
                and prev is not None
                and prev[:2] == (start, local_spec)
            ):
                with stages.time("diff"):
                    ch = scan(word_view(prev[2], local_spec), word_view(data, local_spec))
                width = local_spec.dt.width
                if len(ch) * (8 + width) <= numel * width:  # an empty slice too: nothing to send
                    gaps = torch.diff(ch.positions, prepend=ch.positions.new_zeros(1))
                    sp.gaps = gaps.to(torch.int32) if numel < (1 << 31) else gaps
                    sp.new = ch.new.clone()
            if sp.gaps is None:
                sp.data = data
            out_slices.append(sp)
        with stages.time("cast"):
            target = cast_served(self._fmt, whole, self._buffers, on_host=True)
            refreshed += len(self._fmt.refreshed)
            if extras:
                target.fill_all()
                merged = dict(zip((x.name for x in target.model.specs), target.model.data, strict=True))
                add = ServedModel.from_tensors({k: v.detach().to("cpu").clone() for k, v in extras.items()})
                merged.update(zip((x.name for x in add.specs), add.data, strict=True))
                specs = sorted([*target.model.specs, *add.specs], key=lambda x: x.name)
                target = Served(ServedModel(specs, [merged[x.name] for x in specs]), False, [None] * len(specs))
        served = target.model
        base = digests = None
        if mine.version == plan.base_version and mine.whole is not None and mine.whole.specs == served.specs:
            base, digests = mine.whole, mine.digests
        deltas, final = prepare_all(base, digests, target, stages, self._payload_format)
        fp8_weights = {x.name for x in served.specs if x.dtype == "F8_E4M3"}
        part = Part(
            self.rank,
            specs=served.specs,
            digests=final,
            deltas=deltas,
            data=served.data if plan.anchor else None,
            scales={  # the publishing rank keeps them: a rank that lost its scales follows them from there
                x.name: d
                for x, d in zip(served.specs, served.data, strict=True)
                if x.dtype == "F32" and fp8.weight_of_scale(x.name) in fp8_weights
            },
            refreshed=refreshed,
            slices=out_slices,
            stages=dict(stages.seconds),
        )
        return part, target, _Mine(plan.version, served, final, new_slices, target.owned)


def _failed(plan: Plan, why: list[str]) -> str:
    return f"version {plan.version} not published: " + "; ".join(why)


def _text(e: BaseException | None) -> str | None:
    if e is None:
        return None
    return f"{type(e).__name__}: {e}"[:2000]
