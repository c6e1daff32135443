"""A host's persisted high-water marks: the head it last accepted and the root documents it trusts.

Kept so that a restarted puller refuses a rewound head or an older trust root, as TUF clients do.
Proof of equivocation (both signed heads) is written to ``equivocation/`` beside the state file the
moment it is found; while such a file exists for the run, the run stays halted across restarts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import msgpack

from patchswarm.protocol.errors import EquivocationError, FormatError
from patchswarm.protocol.files import InputFileError, read_file, write_atomic
from patchswarm.protocol.head import HeadTracker
from patchswarm.protocol.trust import RootDocument, TrustState

log = logging.getLogger("patchswarm.daemon")
# A state file or a proof holds at most a couple of signed heads (each at most 16 MiB) and the root
# documents: anything larger is not one.
MAX_STATE_BYTES = 64 << 20


@dataclass(slots=True)
class PullState:
    tracker: HeadTracker
    roots: dict[int, bytes] | None = None

    @classmethod
    def load(cls, path: Path, run_id: str) -> PullState:
        state = cls._read(path, run_id)
        evidence = evidence_dir(path)
        for f in sorted(evidence.glob(f"{run_id}.*.msgpack")):
            try:
                proof = msgpack.unpackb(read_file(f, MAX_STATE_BYTES), raw=False)
                state.tracker.evidence.append((bytes(proof["first"]), bytes(proof["second"])))
                state.tracker.halted = str(proof["what"])
            except (ValueError, TypeError, KeyError, msgpack.UnpackException, InputFileError):
                raise FormatError(f"{f}: equivocation proof is corrupt; inspect it before removing it") from None
        state.tracker.on_equivocation = lambda err: write_evidence(evidence, run_id, err)
        return state

    @classmethod
    def _read(cls, path: Path, run_id: str) -> PullState:
        if not path.exists():
            return cls(HeadTracker(run_id), {})
        try:
            data = read_file(path, MAX_STATE_BYTES)
        except InputFileError as e:
            raise FormatError(f"{path}: state file cannot be read ({e.reason}); move it away to start over") from None
        try:
            obj: dict[str, Any] = msgpack.unpackb(data, raw=False, strict_map_key=False)
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


def evidence_dir(state_path: Path) -> Path:
    return state_path.parent / "equivocation"


def write_evidence(directory: Path, run_id: str, err: EquivocationError) -> None:
    """Both signed documents, durably, before the error goes any further (a crash must not lose them)."""
    proof = {"run": run_id, "what": str(err), "first": err.first, "second": err.second}
    name = f"{run_id}.{blake3.blake3(err.first + err.second).hexdigest()[:16]}.msgpack"
    try:
        write_atomic(directory / name, msgpack.packb(proof, use_bin_type=True))
    except OSError as e:  # the run is halted in memory anyway; say loudly that the proof is not on disk
        log.error("equivocation proof could not be written to %s: %s (%s)", directory, e, err)
        return
    log.error("equivocation: %s; run %r halted, proof in %s", err, run_id, directory / name)
