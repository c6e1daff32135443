"""How the rollout daemon drives the inference engine it serves: the contract every engine driver keeps.

The daemon writes each version into its store(s) (daemon/weightstore.py, daemon/rank_stores.py);
an engine driver then makes the engine *serve* that version and says which version the engine
acknowledged.  Only an acknowledged version is reported as served (status, sidecar start/end
versions, 409s): a version the engine did not confirm is never attributed to a response.

One activation, in the daemon's order (docs/engines.md):

0. the daemon stages the version and writes its journal (daemon/prepared.py) while the engine
   serves on, then drains the sidecar.
1. ``await driver.pause()`` (sidecar.commit_mode in_place only): the engine holds its requests
   between steps.
2. the daemon writes the version into the store (fenced);
3. ``ack = await driver.commit(activation)``: the engine takes the new weights (zero-copy
   engines: they already read the store, they only confirm the fence shows the version; copy
   engines such as vLLM and SGLang copy ``activation.regions`` into their runtime parameters),
   drops cached prefixes of older versions when ``flush_cache``, records the version and returns
   the version it now serves.  Raising ``EngineError`` means the engine did not take the version:
   a copy engine (``copies``) whose ``torn`` is false still serves ``activation.previous`` (the
   gate reopens there); a zero-copy engine (it reads the store, which holds the new version) or a
   torn copy engine serves no known version, so the daemon keeps the sidecar's admission closed
   (and an in-place pause on) until a retried commit is acknowledged (daemon/rollout_engine.py).
4. the sidecar's gate is committed at ``ack``; then ``await driver.resume()``.

Drivers: ``none`` (no engine under control: the store's version is reported, as before),
``zero-copy`` (the transformers engine and the reference engine: HTTP routes below),
``vllm`` and ``sglang`` (their HTTP routes; vLLM workers through a worker extension).

Zero-copy engine control routes (served by daemon/refengine.py and the transformers engine):

- ``POST /pause_generation {"mode": "in_place"}`` / ``POST /continue_generation``: as SGLang's.
- ``POST /patchswarm/v1/commit {"version": v, "flush_cache": bool}``: wait (bounded) until the
  store's fence reads version ``v`` ready, drop cached KV/prefixes of other versions if asked,
  record ``v`` as served; ``200 {"version": v}``; ``409 {"error": "VersionMismatch", ...}`` when
  the store holds another version.
- ``GET /patchswarm/v1/version``: ``{"version": v | null}``, the version the engine serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


class EngineError(Exception):
    """The engine refused or failed a control call; it still serves the version it served before."""


@dataclass(frozen=True, slots=True)
class Region:
    """Bytes ``[start, end)`` of store entry ``name`` (a runtime parameter of one rank) that changed."""

    name: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Activation:
    """One version to make the engine serve.

    ``regions`` maps a rank (0 for a single store) to the changed byte ranges of its entries,
    coalesced and bounded by the daemon; ``full`` means the whole model was written (first load,
    an anchor, a new buffer): copy engines reload every parameter.
    """

    version: int
    previous: int | None
    full: bool
    regions: Mapping[int, tuple[Region, ...]] = field(default_factory=dict)
    flush_cache: bool = True


class EngineDriver(Protocol):
    """What the rollout daemon needs of an engine; one instance per daemon, used from its event loop."""

    name: str

    async def served_version(self) -> int | None:
        """The version the engine says it serves now (None: none yet, or no engine under control)."""
        ...

    async def pause(self) -> None:
        """Hold requests between steps until ``resume`` (in_place activations)."""
        ...

    async def commit(self, activation: Activation) -> int:
        """Make the engine serve ``activation.version`` (the store already holds it); the acknowledged version."""
        ...

    async def resume(self) -> None:
        """Let held requests go on (after the gate committed the acknowledged version)."""
        ...

    async def close(self) -> None: ...
