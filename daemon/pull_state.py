"""A host's persisted high-water marks: the head it last accepted and the root documents it trusts.

Kept so that a restarted puller refuses a rewound head or an older trust root, as TUF clients do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from daemon.board import write_atomic
from protocol.errors import FormatError
from protocol.head import HeadTracker
from protocol.trust import RootDocument, TrustState


@dataclass(slots=True)
class PullState:
    tracker: HeadTracker
    roots: dict[int, bytes] | None = None

    @classmethod
    def load(cls, path: Path, run_id: str) -> PullState:
        if not path.exists():
            return cls(HeadTracker(run_id), {})
        try:
            obj: dict[str, Any] = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
            tracker = HeadTracker.restore(obj["head"])
            roots = {int(k): bytes(v) for k, v in obj["roots"].items()}
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            raise FormatError(
                f"{path}: state file is corrupt ({type(e).__name__}); move it away to start over"
            ) from None
        if tracker.run_id != run_id:
            raise FormatError(f"{path}: state belongs to run {tracker.run_id!r}, not {run_id!r}")
        return cls(tracker, roots)

    def restore_into(self, trust: TrustState) -> None:
        """Re-trust the root documents accepted before (their chain was verified when first seen)."""
        for v in sorted(self.roots or {}):
            trust.root = RootDocument.from_bytes((self.roots or {})[v])
            trust.root_bodies[v] = (self.roots or {})[v]

    def save(self, path: Path, trust: TrustState) -> None:
        obj = {"head": self.tracker.state(), "roots": dict(trust.root_bodies)}
        write_atomic(path, msgpack.packb(obj, use_bin_type=True))
