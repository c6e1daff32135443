"""An engine-allocated buffer behind a weight store: its registration (``POST /v1/store``) checked,
its handle imported and kept in the control segment, re-imported by a restarted daemon, and let go
unwritten once the engine that registered it dies.

``WeightStore`` (daemon/weightstore.py) is a ``StoreBuffer``; a host store has its own data region
and takes none of these calls.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from patchswarm.daemon.engine import SharedSegment, import_buffer
from patchswarm.daemon.exporter import Exporter
from patchswarm.daemon.store_format import (
    KIND_ENGINE_BUFFER,
    OFF_HANDLE,
    ZERO_ROOT,
    ControlBlock,
    StoreError,
    StoreLayout,
    StoreState,
    StoreStateError,
    StoreTooSmallError,
)

__all__ = ["ENGINE_BUFFER_KINDS", "RegistrationError", "StoreBuffer", "check_registration"]

log = logging.getLogger("patchswarm.store")


class RegistrationError(StoreError):
    """An engine's buffer registration (POST /v1/store) that does not fit the store; ``code`` names why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# store.kind of an engine-allocated store -> the kind of buffer handle its engine registers
ENGINE_BUFFER_KINDS = {"cuda": "cuda_ipc", "engine-shm": "shm_buffer"}


def _gpu_id(uuid: str) -> str:
    """nvidia-smi writes GPU-<uuid>, torch the bare uuid."""
    return uuid.lower().removeprefix("gpu-")


def check_registration(
    store_name: str, layout: StoreLayout, body: Any, *, kind: str, device_uuid: str | None
) -> tuple[str, dict[str, Any]]:
    """(engine name, buffer handle) from a registration body, checked against the store and its config.

    ``kind`` is store.kind; ``device_uuid`` the GPU a CUDA buffer must be on (None: any).  Only the
    claims are checked here; mapping the buffer (``attach_buffer``) checks what is really there.
    """
    if not isinstance(body, dict):
        raise RegistrationError("BadRequest", "body must be a JSON object")
    engine, lay_hash, handle = body.get("engine"), body.get("layout_hash"), body.get("buffer")
    if not isinstance(engine, str) or not 1 <= len(engine) <= 128:
        raise RegistrationError("BadRequest", "engine must be a name of 1 to 128 characters")
    if not isinstance(lay_hash, str) or not isinstance(handle, dict):
        raise RegistrationError("BadRequest", "body needs layout_hash (hex) and buffer (engine.allocate's handle)")
    got, want = handle.get("kind"), ENGINE_BUFFER_KINDS[kind]
    if got not in ENGINE_BUFFER_KINDS.values():
        raise RegistrationError("BadRequest", f"buffer.kind must be cuda_ipc or shm_buffer, got {got!r}")
    if got != want:
        raise RegistrationError("KindMismatch", f"store.kind is {kind!r}: register a {want} buffer, not {got}")
    nbytes, buffer_id = handle.get("nbytes"), handle.get("buffer_id")
    for field, v in (("nbytes", nbytes), ("buffer_id", buffer_id)):
        if type(v) is not int or not 0 <= v < 1 << 63:
            raise RegistrationError("BadRequest", f"buffer.{field} must be a non-negative 63-bit integer")
    if lay_hash != layout.layout_hash.hex():
        raise RegistrationError(
            "LayoutMismatch",
            f"the buffer was laid out for layout {lay_hash[:16]}..., the store serves "
            f"{layout.layout_hash.hex()[:16]}...: allocate from the current GET /v1/layout",
        )
    assert isinstance(nbytes, int)
    if nbytes < layout.nbytes:
        raise RegistrationError("BufferTooSmall", f"the buffer holds {nbytes} bytes, the layout needs {layout.nbytes}")
    if got == "shm_buffer":
        name = handle.get("name")
        if not isinstance(name, str) or not name.startswith(f"{store_name}.buf."):
            raise RegistrationError("BadHandle", f"a CPU engine buffer must be named {store_name}.buf.<id> (allocate)")
    else:
        uuid = handle.get("device_uuid")
        if not isinstance(uuid, str) or not isinstance(handle.get("args"), dict):
            raise RegistrationError("BadRequest", "a cuda_ipc buffer needs args and device_uuid (export_buffer)")
        if device_uuid is not None and _gpu_id(uuid) != _gpu_id(device_uuid):
            raise RegistrationError("DeviceMismatch", f"store.device is GPU {device_uuid}; the buffer is on {uuid}")
    return engine, handle


class StoreBuffer:
    """The data buffer side of a weight store: the host region, or an engine's registered buffer."""

    segment: SharedSegment
    layout: StoreLayout
    shm_dir: Path
    control: ControlBlock
    kind: int
    data: torch.Tensor | None
    buffer: dict[str, Any] | None
    _buffer_seg: SharedSegment | None
    exporter: Exporter | None  # the engine process that registered the buffer
    released_because: str | None  # why the last engine buffer was let go (its engine died)

    def _reimport(self, stored: dict[str, Any]) -> None:
        """A restarted daemon maps the buffer its predecessor wrote into, if its engine still lives."""
        recorded = Exporter.from_json(stored.pop("exporter", None))
        exporter = None
        if recorded is not None:
            exporter = Exporter.of_pid(recorded.pid)
            if exporter is None or exporter.start != recorded.start:
                if exporter is not None:
                    exporter.close()
                self._let_go(stored, f"the engine (pid {recorded.pid}) that registered the buffer died")
                return
        try:
            self.attach_buffer(stored, keep_contents=True, exporter=exporter)
        except StoreError:  # the engine is gone: wait for it to register a new buffer
            if exporter is not None:
                exporter.close()

    def attach_buffer(
        self, handle: dict[str, Any], *, keep_contents: bool = False, exporter: Exporter | None = None
    ) -> None:
        """Use the engine's buffer (its handle from engine.allocate); a new buffer makes the store EMPTY.

        The handle is kept in the control segment, so a restarted daemon re-imports it (``open``).
        ``exporter``: the engine process that registered it (the API's peer); the store lets the
        buffer go, unwritten, once that process is gone (``check_exporter``).
        """
        if self.kind != KIND_ENGINE_BUFFER:
            raise StoreStateError("a host store has its own data region")
        stored = handle if exporter is None else {**handle, "exporter": exporter.to_json()}
        text = json.dumps(stored, separators=(",", ":")).encode()
        if len(text) > self.control.get(OFF_HANDLE + 8):
            raise StoreError("engine buffer handle too large")
        data, seg = import_buffer(handle, self.shm_dir)
        try:
            self.bind_buffer(data, int(handle["buffer_id"]), keep_contents=keep_contents)
        except StoreError:
            if seg is not None:
                del data
                seg.close()
            raise
        if self._buffer_seg is not None and self._buffer_seg is not seg:
            self._buffer_seg.close()  # the previous engine's buffer
        if self.exporter is not None and self.exporter is not exporter:
            self.exporter.close()
        self._buffer_seg, self.buffer, self.exporter, self.released_because = seg, handle, exporter, None
        off = self.control.get(OFF_HANDLE)
        self.segment.mm[off : off + len(text)] = text
        self.control.set(OFF_HANDLE + 16, len(text))

    def bind_buffer(self, data: torch.Tensor, buffer_id: int, *, keep_contents: bool = False) -> None:
        """Use a flat uint8 buffer of this process (engine and daemon in one process; benchmarks)."""
        if self.kind != KIND_ENGINE_BUFFER:
            raise StoreStateError("a host store has its own data region")
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < self.layout.nbytes:
            raise StoreTooSmallError(self.layout.nbytes, data.numel() if data.dtype == torch.uint8 else 0)
        self.data, self.buffer = data, None
        self.control.set(OFF_HANDLE + 16, 0)
        if not (keep_contents and self.control.raw().buffer_id == buffer_id):
            self.control.begin(StoreState.EMPTY, gated=False)  # (nothing written: no reader to wait for)
            self.control.publish(0, ZERO_ROOT, StoreState.EMPTY, buffer_id=buffer_id)

    def check_exporter(self) -> str | None:
        """Let the buffer go if the engine that registered it died; why, or None while it lives.

        Nothing is written into the buffer (its memory may be freed or reused): the mapping is
        dropped, the stored handle forgotten, the store EMPTY until an engine registers again."""
        if self.exporter is None or self.exporter.alive():
            return self.released_because
        why = f"the engine (pid {self.exporter.pid}) that registered buffer {self.buffer_id or 0:x} died"
        self._let_go(self.buffer, why)
        return why

    def _let_go(self, handle: dict[str, Any] | None, why: str) -> None:
        log.warning("%s: its buffer is released, nothing more is written into it", why)
        self.data, self.buffer = None, None
        if self._buffer_seg is not None:
            self._buffer_seg.close()
            self._buffer_seg = None
        if handle is not None and handle.get("kind") == "shm_buffer":
            # The CPU twin's segment outlives a killed engine: the daemon removes the orphan
            # (its name was checked to be <store>.buf.<id> at registration).
            with contextlib.suppress(ValueError, OSError):
                SharedSegment.path_for(str(handle.get("name")), self.shm_dir).unlink(missing_ok=True)
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        self.control.set(OFF_HANDLE + 16, 0)
        self.control.begin(StoreState.EMPTY, gated=False)
        self.control.publish(0, ZERO_ROOT, StoreState.EMPTY, buffer_id=0)
        self.released_because = why

    def _require_live_buffer(self) -> torch.Tensor:
        why = self.check_exporter()
        if self.data is None and why is not None:
            raise StoreStateError(f"{why}: waiting for an engine to register a buffer")
        return self._require_data()

    @property
    def buffer_id(self) -> int | None:
        """Id of the engine buffer the store writes into (None: host store, or none attached)."""
        return None if self.buffer is None else int(self.buffer["buffer_id"])

    def _require_data(self) -> torch.Tensor:
        if self.data is None:
            raise StoreStateError("no engine buffer is attached to the store")
        return self.data
