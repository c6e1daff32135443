"""Which of a version's chunks a node holds.

The wire form is BitTorrent's with the bit order flipped to LSB-first: chunk ``i`` is bit
``i % 8`` of byte ``i // 8``; there are ``ceil(n / 8)`` bytes and the spare bits of the last
byte are zero (a decoder rejects anything else, so every bitfield has exactly one encoding).

Internally a ``bytearray`` in the same layout plus a running count: set/clear/test are O(1),
``count()`` is O(1), and the iterators skip whole bytes at C speed, so a 100k-chunk bitfield
costs 12.5 KB and no per-chunk Python objects.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from patchswarm.protocol.errors import FormatError

_NOT_FULL = re.compile(rb"[^\xff]")
_NOT_EMPTY = re.compile(rb"[^\x00]")


class BitfieldError(FormatError):
    """A wire bitfield of the wrong length for its chunk count, or with spare bits set."""

    def __init__(self, n: int, reason: str) -> None:
        super().__init__(f"bitfield of {n} chunks: {reason}")
        self.n = n
        self.reason = reason


def _nbytes(n: int) -> int:
    return (n + 7) >> 3


def _spare_mask(n: int) -> int:
    """The bits of the last byte that lie past chunk ``n - 1`` (0 when ``n`` is a multiple of 8)."""
    return (0xFF << (n & 7)) & 0xFF if n & 7 else 0


class Bitfield:
    """A mutable set of chunk indices in ``range(n)``."""

    __slots__ = ("_bits", "_count", "_n")
    __hash__ = None  # type: ignore[assignment]  # mutable

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"chunk count must be >= 0, got {n}")
        self._n = n
        self._bits = bytearray(_nbytes(n))
        self._count = 0

    # ------------------------------------------------------------------ constructors

    @classmethod
    def full(cls, n: int) -> Bitfield:
        bf = cls(n)
        if n:
            bf._bits[:] = b"\xff" * len(bf._bits)
            bf._bits[-1] &= ~_spare_mask(n) & 0xFF
        bf._count = n
        return bf

    @classmethod
    def from_bytes(cls, n: int, data: bytes | bytearray | memoryview) -> Bitfield:
        """Decode a wire bitfield of ``n`` chunks; rejects a wrong length or set spare bits."""
        if n < 0:
            raise ValueError(f"chunk count must be >= 0, got {n}")
        raw = bytes(data)
        if len(raw) != _nbytes(n):
            raise BitfieldError(n, f"{len(raw)} bytes, expected {_nbytes(n)}")
        if n and raw[-1] & _spare_mask(n):
            raise BitfieldError(n, "spare bits past the last chunk are set")
        bf = cls(n)
        bf._bits[:] = raw
        bf._count = int.from_bytes(raw, "little").bit_count()
        return bf

    @staticmethod
    def mask_from_bytes(n: int, data: bytes | bytearray | memoryview) -> int:
        """``from_bytes(n, data).to_int()`` without the Bitfield: the same checks, for a reader that
        only tests bits (the chunk scheduler takes a peer's chunks as an int)."""
        if n < 0:
            raise ValueError(f"chunk count must be >= 0, got {n}")
        if len(data) != _nbytes(n):
            raise BitfieldError(n, f"{len(data)} bytes, expected {_nbytes(n)}")
        if n and data[-1] & _spare_mask(n):
            raise BitfieldError(n, "spare bits past the last chunk are set")
        return int.from_bytes(data, "little")

    def copy(self) -> Bitfield:
        bf = Bitfield(0)  # not __new__: compiled classes have no bare allocation
        bf._n = self._n
        bf._bits = bytearray(self._bits)
        bf._count = self._count
        return bf

    # ------------------------------------------------------------------ queries

    @property
    def n(self) -> int:
        """How many chunks the bitfield describes (held or not)."""
        return self._n

    def has(self, i: int) -> bool:
        """Whether chunk ``i`` is held; an index outside ``range(n)`` is simply not held."""
        return 0 <= i < self._n and bool(self._bits[i >> 3] >> (i & 7) & 1)

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and self.has(i)

    def count(self) -> int:
        return self._count

    @property
    def complete(self) -> bool:
        return self._count == self._n

    def held(self) -> Iterator[int]:
        """Indices held, ascending (over a snapshot: mutating while iterating is safe)."""
        return self._scan(bytes(self._bits), _NOT_EMPTY, 1)

    def missing(self) -> Iterator[int]:
        """Indices not held, ascending (over a snapshot)."""
        return self._scan(bytes(self._bits), _NOT_FULL, 0)

    def difference(self, other: Bitfield) -> Iterator[int]:
        """Indices held here and not in ``other`` (same ``n``), ascending."""
        if other._n != self._n:
            raise ValueError(f"bitfields of {self._n} and {other._n} chunks")
        a = int.from_bytes(self._bits, "little")
        b = int.from_bytes(other._bits, "little")
        return self._scan((a & ~b).to_bytes(len(self._bits), "little"), _NOT_EMPTY, 1)

    def intersects(self, other: Bitfield) -> bool:
        """Whether some chunk is held in both (same ``n``); one C-speed pass over the bytes."""
        if other._n != self._n:
            raise ValueError(f"bitfields of {self._n} and {other._n} chunks")
        return int.from_bytes(self._bits, "little") & int.from_bytes(other._bits, "little") != 0

    def _scan(self, raw: bytes, interesting: re.Pattern[bytes], want: int) -> Iterator[int]:
        n = self._n
        for m in interesting.finditer(raw):
            byte_index = m.start()
            b = raw[byte_index]
            base = byte_index << 3
            for bit in range(8):
                if (b >> bit) & 1 == want and base + bit < n:
                    yield base + bit

    # ------------------------------------------------------------------ updates

    def set(self, i: int) -> bool:
        """Mark chunk ``i`` held; returns whether it was newly set."""
        self._check(i)
        mask = 1 << (i & 7)
        if self._bits[i >> 3] & mask:
            return False
        self._bits[i >> 3] |= mask
        self._count += 1
        return True

    def clear(self, i: int) -> bool:
        """Mark chunk ``i`` not held; returns whether it was set before."""
        self._check(i)
        mask = 1 << (i & 7)
        if not self._bits[i >> 3] & mask:
            return False
        self._bits[i >> 3] &= ~mask & 0xFF
        self._count -= 1
        return True

    def _check(self, i: int) -> None:
        if not 0 <= i < self._n:
            raise IndexError(f"chunk {i} outside a bitfield of {self._n} chunks")

    # ------------------------------------------------------------------ encoding

    def to_bytes(self) -> bytes:
        return bytes(self._bits)

    def to_int(self) -> int:
        """The chunks held as an int: bit ``i`` is chunk ``i``."""
        return int.from_bytes(self._bits, "little")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bitfield):
            return NotImplemented
        return self._n == other._n and self._bits == other._bits

    def __repr__(self) -> str:
        return f"Bitfield(n={self._n}, count={self._count})"
