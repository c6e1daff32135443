"""A request's version constraint, read where it enters the sidecar: the ``X-Weight-Version-Min`` /
``X-Weight-Version-Exact`` headers, or ``weight_version`` in a JSON object body (taken out before
the request is forwarded, so the engine never sees it)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

from patchswarm.daemon.sidecar_gate import ConstraintError, VersionConstraint

HEADER_MIN = "X-Weight-Version-Min"
HEADER_EXACT = "X-Weight-Version-Exact"
BODY_KEY = "weight_version"
_VERSION_RE = re.compile(r"[0-9]{1,18}")


def parse_version_value(value: object, what: str) -> int | None:
    """A version given as a JSON integer or a decimal string; ``None`` stays ``None``."""
    if value is None:
        return None
    if type(value) is int:
        if value < 0:
            raise ConstraintError(f"{what} must be non-negative, got {value}")
        return value
    if isinstance(value, str) and _VERSION_RE.fullmatch(value.strip()):
        return int(value.strip())
    raise ConstraintError(f"{what} must be a non-negative integer, got {value!r}")


def header_values(headers: Mapping[str, str], name: str) -> list[str]:
    if isinstance(headers, CIMultiDictProxy | CIMultiDict):
        return list(headers.getall(name, []))
    return [v for k, v in headers.items() if k.lower() == name.lower()]


def constraint_from_headers(headers: Mapping[str, str]) -> VersionConstraint:
    fields: dict[str, int | None] = {}
    for header, field_name in ((HEADER_MIN, "min_version"), (HEADER_EXACT, "exact_version")):
        values = header_values(headers, header)
        if len(values) > 1:
            raise ConstraintError(f"header {header} given {len(values)} times")
        fields[field_name] = parse_version_value(values[0], header) if values else None
    return VersionConstraint(**fields)


def constraint_from_json(value: object) -> VersionConstraint:
    """The body form: ``{"min_version": m, "exact_version": e}`` (either may be absent or null)."""
    if value is None:
        return VersionConstraint()
    if not isinstance(value, dict):
        raise ConstraintError(f"{BODY_KEY} must be an object with min_version and/or exact_version")
    unknown = sorted(set(value) - {"min_version", "exact_version"})
    if unknown:
        raise ConstraintError(f"{BODY_KEY} has unknown keys {unknown} (allowed: min_version, exact_version)")
    return VersionConstraint(
        parse_version_value(value.get("min_version"), f"{BODY_KEY}.min_version"),
        parse_version_value(value.get("exact_version"), f"{BODY_KEY}.exact_version"),
    )


def split_body_constraint(body: bytes, content_type: str) -> tuple[bytes, VersionConstraint]:
    """Take ``weight_version`` out of a JSON object body; other bodies are returned untouched."""
    if not body or not (is_json(content_type) or content_type == ""):
        return body, VersionConstraint()
    obj = loads_json(body)
    if obj is None:
        # Not JSON this process writes back strictly: passed on untouched, unless it names a
        # constraint, which must then not be dropped silently (served from any version).
        lenient = _loads_lenient(body)
        if isinstance(lenient, dict) and BODY_KEY in lenient:
            constraint_from_json(lenient[BODY_KEY])  # (a bad constraint gets its own message)
            raise ConstraintError(
                f"a body with {BODY_KEY} must be strict JSON (no NaN or Infinity, numbers a double holds)"
            )
        return body, VersionConstraint()
    if not isinstance(obj, dict) or BODY_KEY not in obj:
        return body, VersionConstraint()
    constraint = constraint_from_json(obj.pop(BODY_KEY))
    return dumps_json(obj), constraint


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # (1e999: a number no double holds, read as an infinity)
        raise ValueError(f"{text} is out of a double's range")
    return value


def loads_json(data: bytes) -> object:
    """The JSON value of ``data``, or None when it is not JSON this process can hold (the body is then
    passed on untouched): ValueError covers bad UTF-8, bad JSON (a bare NaN or Infinity too: the
    sidecar re-encodes only what it can write back as strict JSON) and integers of over 4300 digits."""
    try:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError):
        return None


def _loads_lenient(data: bytes) -> object:
    """``data`` as Python's json reads it (bare NaN and Infinity, 1e999 as an infinity), else None."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def dumps_json(obj: object) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (an escaped \ud800 in the input): keep it as an escape
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def is_json(mimetype: str) -> bool:
    return mimetype == "application/json" or mimetype.endswith("+json")
