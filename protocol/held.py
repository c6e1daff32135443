"""``Held``: the served version a host holds, the core's unit of "what I have"."""

from __future__ import annotations

from dataclasses import dataclass

from patchswarm.protocol.served import ServedModel


@dataclass(slots=True)
class Held:
    """A served version a host holds, with its digests (so they are not recomputed per step)."""

    version: int
    model: ServedModel
    digests: list[bytes]
