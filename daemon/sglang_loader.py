"""SGLang custom weight loader: each scheduler (TP rank) maps its rank's store once and copies versions in place.

Run SGLang with ``--custom-weight-loader patchswarm.daemon.sglang_loader.load_regions``; the daemon's
driver then posts ``/update_weights_from_tensor`` with ``load_format`` set to that name.  SGLang
deserializes entry ``tp_rank`` of ``serialized_named_tensors`` on each rank and calls
``custom_loader(model, named_tensors)`` (sglang/srt/model_executor/model_runner_components/
weight_updater.py ``update_weights_from_tensor``, https://github.com/sgl-project/sglang/tree/main/
python/sglang/srt/model_executor).  Each rank's entry is one pair whose *name* is JSON text
``{"attach": <attach spec>, "apply": <apply_wire text>, "rank": r}`` and whose tensor is empty (no
memory travels: the weights are in the store).  SGLang's own ``load_weights`` expects checkpoint
names and shards them itself, which a rank store (runtime names, already sharded) is not: entries
that do not match a parameter go through the model's ``load_weights`` as the canonical tensors they
come from (full size, this rank's slice filled: protocol/layout_inverse.py) where the daemon's layout
answer carries the plan's routing, else only where the engine was started at TP=1 (refused at TP > 1).

The mapping is kept across updates; a daemon that restarted and made its store again (another
segment file, layout or engine buffer) leaves it stale, at its last version for ever.  So an update
whose store does not hold the version asks the daemon's layout again (bounded, ``REASK_S``) and maps
the store again when its identity (``StoreIdentity``) changed; the same store is a race with the
daemon's write, and that update fails (the driver retries).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from patchswarm.daemon.param_sync import (
    MAX_WIRE_CHARS,
    NotAtVersion,
    ParamSync,
    StoreIdentity,
    SyncError,
    current_identity,
    open_rank_store_routed,
    parse_apply,
)
from patchswarm.protocol.untrusted_json import load_json

# One mapping per scheduler process, by attach spec (a process serves one rank of one store).
_SYNCS: dict[str, ParamSync] = {}


def entry_name(attach_spec: str, apply_text: str, rank: int) -> str:
    return json.dumps({"attach": attach_spec, "apply": apply_text, "rank": rank}, separators=(",", ":"))


def _world(spec: str) -> int:
    obj = load_json(spec, max_bytes=MAX_WIRE_CHARS)  # (open_rank_store parsed it already)
    attach = obj.get("attach")
    return len(attach) if isinstance(attach, list) else int(obj.get("ranks", 1))


def load_regions(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom-loader hook; SyncError (one line) when the store or payload is not right."""
    if len(named_tensors) != 1 or not isinstance(named_tensors[0][0], str) or len(named_tensors[0][0]) > MAX_WIRE_CHARS:
        raise SyncError("a patchswarm update carries exactly one entry")
    try:
        obj = load_json(named_tensors[0][0], max_bytes=MAX_WIRE_CHARS)
    except ValueError:
        raise SyncError("a patchswarm update's entry name is not JSON") from None
    if not isinstance(obj, dict) or set(obj) != {"attach", "apply", "rank"} or type(obj["rank"]) is not int:
        raise SyncError("a patchswarm update's entry must be {attach, apply, rank}")
    spec, rank = obj["attach"], obj["rank"]
    if not isinstance(spec, str):
        raise SyncError("a patchswarm update's attach spec must be text")
    version, regions = parse_apply(obj["apply"], rank)
    sync = _SYNCS.get(spec)
    if sync is None:
        sync = _SYNCS[spec] = _map(model, spec, rank)
    try:
        sync.apply(version, regions)
    except NotAtVersion:
        now = current_identity(spec, rank)
        if now is None or now == StoreIdentity.of_view(sync.view):
            raise  # the daemon has not written the version yet (or does not answer): this update fails
        fresh = _map(model, spec, rank)  # (the stale mapping stays cached until a fresh one exists)
        sync.view.close()
        _SYNCS[spec] = fresh
        fresh.apply(version, regions)


def _map(model: torch.nn.Module, spec: str, rank: int) -> ParamSync:
    device = next(model.parameters()).device
    view, routing = open_rank_store_routed(spec, rank, device)
    load = getattr(model, "load_weights", None)
    try:
        sync = ParamSync(view, dict(model.named_parameters()), load, rank, routing)
    except BaseException:
        view.close()
        raise
    if sync.fallback and not sync.routed and _world(spec) > 1:
        view.close()
        raise SyncError(
            f"rank {rank}: {len(sync.fallback)} store entries do not match SGLang's parameters (first: "
            f"{sync.fallback[0]}); its load_weights takes checkpoint tensors, not a rank's shard (TP > 1)"
        )
    return sync
