"""A served version: an ordered set of named tensors, handled as raw bits.

Tensors are kept as flat ``uint8`` torch tensors on any device, so every dtype (including
fp8 and packed 4-bit formats stored as bytes) goes through the same code.  Tensors are
ordered by name, which makes the layout, and everything hashed over it, canonical.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import blake3
import msgpack
import torch

from patchswarm.protocol.dtypes import DType, dtype, from_torch
from patchswarm.protocol.errors import LayoutMismatchError

DIGEST_SIZE = 32


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def dt(self) -> DType:
        return dtype(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dt.width

    def to_wire(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape)]


def layout_hash(specs: list[TensorSpec]) -> bytes:
    """BLAKE3 over the canonical msgpack of ``[[name, dtype, shape], ...]``."""
    return blake3.blake3(msgpack.packb([s.to_wire() for s in specs])).digest()


def bytes_digest(data: torch.Tensor) -> bytes:
    """BLAKE3-256 of a flat uint8 tensor's bytes (copied to the host first if needed)."""
    host = data if data.device.type == "cpu" else data.cpu()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO) if host.numel() > (1 << 22) else blake3.blake3()
    if host.numel():
        h.update(host.contiguous().numpy().data)
    return h.digest()


def state_root(specs: list[TensorSpec], digests: list[bytes]) -> bytes:
    """Root digest of a whole served version: BLAKE3 over every (name, dtype, shape, digest)."""
    return blake3.blake3(msgpack.packb([[*s.to_wire(), d] for s, d in zip(specs, digests, strict=True)])).digest()


@dataclass(slots=True)
class ServedModel:
    """Ordered named tensors as flat uint8 buffers, plus free-form string metadata."""

    specs: list[TensorSpec]
    data: list[torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [s.name for s in self.specs]
        if names != sorted(names) or len(set(names)) != len(names):
            raise ValueError("tensors must be unique and sorted by name")
        for s, d in zip(self.specs, self.data, strict=True):
            if d.dtype != torch.uint8 or d.dim() != 1 or d.numel() != s.nbytes:
                raise ValueError(f"{s.name}: data must be a flat uint8 tensor of {s.nbytes} bytes")

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
    ) -> ServedModel:
        """Build from typed tensors (any supported dtype); bytes are shared, not copied, when contiguous."""
        specs: list[TensorSpec] = []
        data: list[torch.Tensor] = []
        for name in sorted(tensors):
            t = tensors[name]
            dt = from_torch(t.dtype)
            specs.append(TensorSpec(name, dt.name, tuple(t.shape)))
            data.append(raw_bytes(t))
        return cls(specs, data, dict(metadata or {}))

    @classmethod
    def zeros_like(cls, specs: list[TensorSpec], device: torch.device | str = "cpu") -> ServedModel:
        return cls(list(specs), [torch.zeros(s.nbytes, dtype=torch.uint8, device=device) for s in specs])

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
        return iter(zip(self.specs, self.data, strict=True))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def layout_hash(self) -> bytes:
        return layout_hash(self.specs)

    def digests(self) -> list[bytes]:
        return [bytes_digest(d) for d in self.data]

    def root(self) -> bytes:
        return state_root(self.specs, self.digests())

    def typed(self, i: int) -> torch.Tensor:
        """Tensor ``i`` viewed with its own dtype and shape (no copy)."""
        s = self.specs[i]
        return typed_view(self.data[i], s)

    def clone(self) -> ServedModel:
        return ServedModel(list(self.specs), [d.clone() for d in self.data], dict(self.metadata))

    def same_layout(self, other: ServedModel) -> None:
        if self.specs != other.specs:
            raise LayoutMismatchError("the two versions do not have the same tensor names, dtypes and shapes")

    def bitwise_equal(self, other: ServedModel) -> bool:
        return self.specs == other.specs and all(torch.equal(a, b) for a, b in zip(self.data, other.data, strict=True))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a typed tensor as a flat uint8 tensor (a view when contiguous)."""
    t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def typed_view(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=spec.dt.torch_dtype, device=data.device)
    return data.view(spec.dt.torch_dtype).reshape(spec.shape)


def word_view(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Flat signed-integer view of a tensor's elements, the view every bit operation uses."""
    if spec.numel == 0:
        return torch.empty(0, dtype=spec.dt.word_dtype, device=data.device)
    return data.view(spec.dt.word_dtype)
