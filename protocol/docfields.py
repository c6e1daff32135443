"""Checked reads of fields from decoded msgpack documents (each failure is a FormatError)."""

from __future__ import annotations

import struct
from typing import Any

from patchswarm.protocol.errors import FormatError, TruncatedError, UnsupportedFormatError

DIGEST_SIZE = 32


def as_map(x: Any, what: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise FormatError(f"{what} must be a map")
    return x


def as_list(x: Any, what: str) -> list[Any]:
    if not isinstance(x, list):
        raise FormatError(f"{what} must be a list")
    return x


def is_uint(x: Any) -> bool:
    return type(x) is int and x >= 0


def as_uint(x: Any, what: str) -> int:
    if not is_uint(x):
        raise FormatError(f"{what} must be a non-negative integer")
    return int(x)


def as_str(x: Any, what: str) -> str:
    if not isinstance(x, str) or not x:
        raise FormatError(f"{what} must be a non-empty string")
    return x


def as_digest(x: Any, what: str) -> bytes:
    if not isinstance(x, bytes) or len(x) != DIGEST_SIZE:
        raise FormatError(f"{what} must be {DIGEST_SIZE} bytes")
    return x


def field(d: dict[str, Any], key: str, what: str) -> Any:
    if key not in d:
        raise FormatError(f"{what}: missing field {key!r}")
    return d[key]


def read_prefix(
    layout: struct.Struct, data: memoryview, magic: bytes, fmt: int | tuple[int, ...], what: str
) -> tuple[Any, ...]:
    """Unpack a fixed header ``(magic, format, ...)``, checking length, magic and format version
    (``fmt``: the one version, or every version, this build reads)."""
    if len(data) < layout.size:
        raise TruncatedError(f"{what} shorter than its fixed header")
    fields = layout.unpack_from(data)
    if fields[0] != magic:
        raise FormatError(f"not a patchswarm {what} (bad magic)")
    accepted = fmt if isinstance(fmt, tuple) else (fmt,)
    if fields[1] not in accepted:
        raise UnsupportedFormatError(f"{what} format {fields[1]} (this build reads {', '.join(map(str, accepted))})")
    return tuple(fields[2:])
