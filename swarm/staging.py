"""Applying a downloaded version: the production apply, and the same with its memory work done while the
chunks are still arriving (``StagedApply``).

Applying a version needs a copy of the held model (the patch is applied to the copy, so a failure
leaves the held version intact) and the payload as one buffer.  Both are as large as what they
hold, and fresh memory costs a page fault per page: for a 100 MB version about 0.1 CPU-s, mostly
in the kernel.  The nodes of a swarm finish a version at about the same moment, so on a shared host
that work landed on every node at once and stalled them all (measured on loopback: the event loops
of 16 nodes blocked for 3-5 s together, holders stopped answering, requests timed out).

``StagedApply.prepare`` starts that work in a worker thread when the download starts (the node is
mostly waiting then); the apply itself then copies the chunks into the ready buffer and patches the
ready copy.  Without a prepared stage (another held version, no ``prepare`` call) it does what
``apply_chunks`` does.  The memory is the same as ``apply_chunks`` needs at its peak, held from the
start of the download instead of its end.  (The rollout daemon decodes each patch against the copy it
holds instead, without a clone: daemon/shadow.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from patchswarm.protocol.held import Held
from patchswarm.protocol.manifest import Manifest
from patchswarm.protocol.patchfile import apply_version
from patchswarm.protocol.served import ServedModel

PAGE = 4096

# Injection points (the simulator passes size-only checks and a no-op apply for sized placeholders).
ApplyVersion = Callable[[Held | None, Manifest, list[bytes | memoryview]], Held | Awaitable[Held]]


def apply_chunks(held: Held | None, manifest: Manifest, parts: list[bytes | memoryview]) -> Held:
    """The production apply: join the verified chunks and apply them to a copy of the held model."""
    base = held if held is not None and manifest.base_version is not None else None
    model, digests = apply_version(
        base.model.clone() if base else None, manifest, b"".join(parts), base_digests=base.digests if base else None
    )
    return Held(manifest.version, model, digests)


@dataclass
class _Stage:
    held: Held | None
    task: asyncio.Future[tuple[ServedModel | None, np.ndarray]]


def _stage(held: Held | None, manifest: Manifest) -> tuple[ServedModel | None, np.ndarray]:
    base = held.model.clone() if held is not None and manifest.base_version is not None else None
    payload = np.empty(manifest.payload_size, dtype=np.uint8)
    payload[::PAGE] = 0  # touch every page now, not when the chunks are copied in
    return base, payload


class StagedApply:
    """An ``ApplyVersion`` for ``SwarmNode`` with a ``prepare(held, manifest)`` the node calls before
    downloading, and ``discard(manifest)`` when that download is abandoned."""

    def __init__(self) -> None:
        self._stages: dict[bytes, _Stage] = {}

    def prepare(self, held: Held | None, manifest: Manifest) -> None:
        if manifest.manifest_id not in self._stages:
            task = asyncio.ensure_future(asyncio.to_thread(_stage, held, manifest))
            self._stages[manifest.manifest_id] = _Stage(held, task)

    def discard(self, manifest: Manifest) -> None:
        stage = self._stages.pop(manifest.manifest_id, None)
        if stage is not None:
            stage.task.cancel()  # the thread finishes its copy; the result is dropped

    async def __call__(self, held: Held | None, manifest: Manifest, parts: list[bytes | memoryview]) -> Held:
        stage = self._stages.pop(manifest.manifest_id, None)
        if stage is None or stage.held is not held:
            if stage is not None:
                stage.task.cancel()
            return apply_chunks(held, manifest, parts)
        model, payload = await stage.task
        offset = 0
        for part in parts:
            payload[offset : offset + len(part)] = np.frombuffer(part, dtype=np.uint8)
            offset += len(part)
        if offset != payload.size:
            return apply_chunks(held, manifest, parts)  # not this manifest's chunks: let it fail there
        base = held if model is not None else None
        model, digests = apply_version(
            model, manifest, payload.data, base_digests=base.digests if base is not None else None
        )
        return Held(manifest.version, model, digests)
