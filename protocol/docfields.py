"""Checked reads of fields from decoded msgpack documents (each failure is a FormatError)."""

from __future__ import annotations

from typing import Any

from protocol.errors import FormatError

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
