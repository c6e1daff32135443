"""Copy engines' side of the store: a rank store's changed bytes copied into the engine's own parameters.

vLLM and SGLang keep their weights in their own ``nn.Parameter`` s (the kernels read those), so an
engine worker attaches once to its rank's store (daemon/engine.py: one mapping, one CUDA IPC
handle per GPU for the whole buffer) and, per version, copies the changed byte ranges
(``engine_driver.Region``) of each store entry into the parameter of the same name, in place.
Entries whose parameter differs from the store entry (name missing, shape, dtype or layout: what
an engine transforms after loading, e.g. some fp8 scales and packed formats) go through the
engine's loader, whole, for those entries only.

Engine-agnostic (plain torch modules in the tests); the engine glue is daemon/vllm_worker.py and
daemon/sglang_loader.py.  The wire form of one apply is JSON text (vLLM's ``/collective_rpc``
passes only strings): ``{"version": v, "full": bool, "ranks": {"<rank>": [[name, start, end], ...]}}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from patchswarm.daemon.engine import SHM_DIR, EngineView, SharedSegment, attach
from patchswarm.daemon.engine_client import DaemonClient
from patchswarm.daemon.engine_driver import Activation, Region
from patchswarm.daemon.store_format import StoreError
from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_inverse import Routing, rebuild, routing_from_json
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.untrusted_json import load_json

MAX_WIRE_CHARS = 64 << 20
MAX_REGIONS = 1 << 20

Loader = Callable[[list[tuple[str, torch.Tensor]]], object]


class SyncError(Exception):
    """An apply was refused or failed; the message is one line.  ``copied`` False: nothing was written."""

    def __init__(self, message: str, *, copied: bool = False) -> None:
        super().__init__(message)
        self.copied = copied


class NotAtVersion(SyncError):
    """The mapped store does not hold the version to apply: a race with the daemon's write, or a store
    the daemon made again since it was mapped (``StoreIdentity`` tells them apart)."""


@dataclass(frozen=True, slots=True)
class Applied:
    """What one rank applied: the engine driver checks every rank reports the version."""

    rank: int
    version: int
    regions: int
    bytes: int
    loaded: tuple[str, ...]  # entries that went through the engine's loader

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "rank": self.rank, "version": self.version, "regions": self.regions,
                "bytes": self.bytes, "loaded": list(self.loaded)}  # fmt: skip


def param_matches(spec: TensorSpec, p: torch.Tensor | None) -> bool:
    """Whether the store entry can be copied byte for byte into ``p`` (same dtype, shape, dense)."""
    return (
        p is not None and p.dtype == spec.dt.torch_dtype and tuple(p.shape) == tuple(spec.shape) and p.is_contiguous()
    )


class ParamSync:
    """One rank's store mapped onto an engine's parameters by name; ``apply`` copies regions in place."""

    def __init__(
        self,
        view: EngineView,
        params: Mapping[str, torch.Tensor],
        loader: Loader | None = None,
        rank: int = 0,
        routing: Routing | None = None,
    ) -> None:
        self.view, self.loader, self.rank, self.routing = view, loader, rank, routing
        self.slots = {s.name: s for s in view.layout.slots}
        self.direct: dict[str, torch.Tensor] = {}
        self.fallback: list[str] = []
        for s in view.layout.slots:
            p = params.get(s.name)
            if p is not None and param_matches(s.spec, p):
                self.direct[s.name] = p.detach().view(-1).view(torch.uint8)
            else:
                self.fallback.append(s.name)
        # With the plan's routing of those entries, the loader is given the canonical tensors they come
        # from (protocol/layout_inverse.py): what an engine's load_weights takes at any TP size.
        self.routed = routing is not None and routing.rank == rank and set(self.fallback) <= set(routing.params)
        if self.fallback and loader is None:
            raise SyncError(
                f"rank {rank}: {len(self.fallback)} store entries have no parameter of the same name, shape and "
                f"dtype (first: {self.fallback[0]}) and this engine has no loader for them"
            )

    def _check(self, regions: Sequence[Region]) -> None:
        for r in regions:
            s = self.slots.get(r.name)
            if s is None:
                raise SyncError(f"rank {self.rank}: region names {r.name[:200]!r}, which the store does not hold")
            if not 0 <= r.start < r.end <= s.nbytes:
                raise SyncError(
                    f"rank {self.rank}: region [{r.start}, {r.end}) of {r.name} lies outside {s.nbytes} bytes"
                )

    def _entry_bytes(self, name: str) -> torch.Tensor:
        s = self.slots[name]
        return self.view.data[s.offset : s.offset + s.nbytes]

    def _loader_items(self, loads: list[str]) -> list[tuple[str, torch.Tensor]]:
        """The store entries under their runtime names, or (routed) the canonical tensors they come from."""
        if not self.routed:
            return [(n, self.view.tensor(n)) for n in loads]
        assert self.routing is not None
        try:
            return rebuild(self.routing, self._entry_bytes, loads)
        except (PlanError, KeyError) as e:  # (a routing that names another layout's entries)
            raise SyncError(f"rank {self.rank}: the routing does not fit the store: {e}"[:500]) from None

    def apply(self, version: int, regions: Sequence[Region] | None) -> Applied:
        """Copy ``regions`` (None: every entry whole) of the store, which must hold ``version``, into the
        parameters.  Everything is checked before the first byte moves (SyncError, ``copied`` False);
        a write of the daemon while copying is reported with ``copied`` True (reload the whole rank)."""
        if regions is None:
            regions = [Region(s.name, 0, s.nbytes) for s in self.view.layout.slots if s.nbytes]
        self._check(regions)
        h = self.view.fence.header()
        got = None if h is None else self.view.fence.read_version()
        if h is None or got is None or got[0] != version:
            held = None if got is None else got[0]
            raise NotAtVersion(f"rank {self.rank}: the store does not hold version {version} ready (it holds {held})")
        data = self.view.data
        nbytes = 0
        loads: list[str] = []
        with torch.no_grad():
            for r in regions:
                dst = self.direct.get(r.name)
                if dst is None:
                    if r.name not in loads:
                        loads.append(r.name)
                    continue
                off = self.slots[r.name].offset
                dst[r.start : r.end].copy_(data[off + r.start : off + r.end])
                nbytes += r.end - r.start
            if loads:
                assert self.loader is not None
                self.loader(self._loader_items(loads))
                nbytes += sum(self.slots[n].nbytes for n in loads)
            for t in (data, *self.direct.values()):
                if t.is_cuda:
                    torch.cuda.synchronize(t.device)
        if self.view.fence.seq() != h.seq:
            raise SyncError(f"rank {self.rank}: the store changed while version {version} was copied", copied=True)
        return Applied(self.rank, version, len(regions), nbytes, tuple(loads))


# ---------------------------------------------------------------- the wire form of one apply


def apply_wire(activation: Activation) -> str:
    """``activation`` as JSON text for every rank (``full``: no regions, each rank copies everything)."""
    regions = {} if activation.full else activation.regions
    ranks = {str(k): [[r.name, r.start, r.end] for r in rs] for k, rs in regions.items()}
    return json.dumps({"version": activation.version, "full": activation.full, "ranks": ranks}, separators=(",", ":"))


def parse_apply(text: object, rank: int) -> tuple[int, list[Region] | None]:
    """(version, rank ``rank``'s regions or None for all) from :func:`apply_wire` text; SyncError otherwise."""
    if not isinstance(text, str) or len(text) > MAX_WIRE_CHARS:
        raise SyncError("the apply payload must be JSON text of at most 64 MiB")
    try:
        obj = load_json(text, max_bytes=MAX_WIRE_CHARS)
    except ValueError:
        raise SyncError("the apply payload is not JSON") from None
    if not isinstance(obj, dict) or set(obj) != {"version", "full", "ranks"}:
        raise SyncError("the apply payload must be {version, full, ranks}")
    version, full, ranks = obj["version"], obj["full"], obj["ranks"]
    if type(version) is not int or not 0 <= version < 1 << 63 or type(full) is not bool or not isinstance(ranks, dict):
        raise SyncError("the apply payload has a bad version, full or ranks")
    if full:
        return version, None
    items = ranks.get(str(rank), [])
    if not isinstance(items, list) or len(items) > MAX_REGIONS:
        raise SyncError(f"rank {rank}: regions must be a list of at most {MAX_REGIONS}")
    out = []
    for it in items:
        if (
            not isinstance(it, list)
            or len(it) != 3
            or not isinstance(it[0], str)
            or not all(type(x) is int for x in it[1:])
        ):
            raise SyncError(f"rank {rank}: a region must be [name, start, end]")
        out.append(Region(it[0], it[1], it[2]))
    return version, out


# ---------------------------------------------------------------- attaching a worker to its rank's store


@dataclass(frozen=True, slots=True)
class _Spec:
    info: dict[str, Any] | None  # the rank's attach info, named in the spec
    socket: str = ""
    ranks: int = 1
    engine: str = "engine"
    wait_s: float = 60.0


def _parse_spec(spec_text: object, rank: int) -> _Spec:
    if not isinstance(spec_text, str) or len(spec_text) > MAX_WIRE_CHARS:
        raise SyncError("the attach spec must be JSON text")
    try:
        spec = load_json(spec_text, max_bytes=MAX_WIRE_CHARS)
    except ValueError:
        raise SyncError("the attach spec is not JSON") from None
    if not isinstance(spec, dict):
        raise SyncError("the attach spec must be a JSON object")
    if "attach" in spec:
        infos = spec["attach"]
        if not isinstance(infos, list) or not 0 <= rank < len(infos) or not isinstance(infos[rank], dict):
            raise SyncError(f"the attach spec has no attach info for rank {rank}")
        return _Spec(infos[rank])
    sock, ranks, engine = spec.get("socket"), spec.get("ranks", 1), spec.get("engine", "engine")
    wait_s = spec.get("wait_s", 60)
    if not isinstance(sock, str) or type(ranks) is not int or not 0 <= rank < ranks or not isinstance(engine, str):
        raise SyncError(f"the attach spec needs socket, and ranks > {rank}")
    if not isinstance(wait_s, int | float) or not 0 <= wait_s <= 3600:
        raise SyncError("the attach spec's wait_s must be 0..3600 seconds")
    return _Spec(None, sock, ranks, engine, float(wait_s))


def open_rank_store(spec_text: object, rank: int, device: torch.device | str) -> EngineView:
    """Map rank ``rank``'s store, once per worker, from JSON text: ``{"socket": <daemon API socket>,
    "ranks": N, "engine": name, "wait_s": s}`` (a host store is attached, an engine store allocated on
    ``device`` and registered: one CUDA IPC handle for the whole buffer) or ``{"attach": [<attach_info
    of each rank>]}`` (host stores named directly)."""
    return open_rank_store_routed(spec_text, rank, device)[0]


def open_rank_store_routed(
    spec_text: object, rank: int, device: torch.device | str
) -> tuple[EngineView, Routing | None]:
    """``open_rank_store`` and the plan's routing of the rank's entries where the daemon's layout answer
    carries it (``routing``: daemon/rank_rollout.py ``rank_layout``); None for a spec naming its stores."""
    spec = _parse_spec(spec_text, rank)
    if spec.info is not None:
        return attach(spec.info), None
    client = DaemonClient(spec.socket)
    view, answer = client.open_store_answer(
        device, engine=spec.engine, wait_s=spec.wait_s, rank=rank if spec.ranks > 1 else None
    )
    raw = answer.get("routing")
    if raw is None:
        return view, None
    try:
        routing = routing_from_json(raw)
    except PlanError as e:
        view.close()
        raise SyncError(f"rank {rank}: the daemon's routing is malformed: {e}"[:500]) from None
    return view, routing if routing.rank == rank else None


# ---------------------------------------------------------------- which store a mapping is of

REASK_S = 5.0  # how long a worker waits for the daemon's layout when it asks again


@dataclass(frozen=True, slots=True)
class StoreIdentity:
    """Which store a mapping is of: a store the daemon made again (restarted: another segment file under
    the name, another layout, another engine buffer) differs in one of these."""

    segment: str
    file: tuple[int, int] | None  # (st_dev, st_ino) of the segment's file; None: no file by that name
    layout_hash: str
    buffer_id: int  # 0: a host store; -1: an engine store without a buffer

    @classmethod
    def of_view(cls, view: EngineView) -> StoreIdentity:
        seg = view.control_segment
        return cls(seg.name, seg.file_id, view.layout.layout_hash.hex(), view.fence.buffer_id)

    @classmethod
    def of_answer(cls, info: object) -> StoreIdentity:
        """From a layout answer's attach info (daemon/weightstore.py ``attach_info``); SyncError if malformed."""
        bad = SyncError("the daemon's layout answer has no well-formed attach info")
        control = info.get("control") if isinstance(info, dict) else None
        if not isinstance(info, dict) or not isinstance(control, dict):
            raise bad
        name, shm_dir, lay = control.get("name"), info.get("shm_dir", str(SHM_DIR)), info.get("layout_hash")
        kind, buf = info.get("kind"), info.get("buffer")
        if not (isinstance(name, str) and isinstance(shm_dir, str) and isinstance(lay, str)):
            raise bad
        if kind == "shm":
            buffer_id = 0
        elif kind == "engine_buffer" and not buf:
            buffer_id = -1
        elif kind == "engine_buffer" and isinstance(buf, dict) and type(buf.get("buffer_id")) is int:
            buffer_id = buf["buffer_id"]
        else:
            raise bad
        try:
            st = SharedSegment.path_for(name, shm_dir).stat()
            file: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except ValueError:  # (not a segment name)
            raise bad from None
        except OSError:
            file = None
        return cls(name, file, lay, buffer_id)


def current_identity(spec_text: object, rank: int) -> StoreIdentity | None:
    """The identity of the store rank ``rank`` should map now (the daemon's layout answer, asked again for
    at most ``REASK_S``; or the info the spec names); None when the daemon does not answer."""
    spec = _parse_spec(spec_text, rank)
    if spec.info is not None:
        return StoreIdentity.of_answer(spec.info)
    try:
        answer = DaemonClient(spec.socket, timeout=REASK_S).layout(0.0, rank=rank if spec.ranks > 1 else None)
    except (StoreError, OSError, ValueError):  # (down, restarting, or an answer that is not JSON)
        return None
    return StoreIdentity.of_answer(answer.get("attach"))
