"""A request's version constraint, read where it enters the sidecar: the ``X-Weight-Version-Min`` /
``X-Weight-Version-Exact`` headers, or ``weight_version`` in a JSON object body (taken out before
the request is forwarded, so the engine never sees it)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

from patchswarm.daemon.sidecar_gate import ConstraintError, VersionConstraint
from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json

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


def split_body_constraint(
    body: bytes, content_type: str, content_encoding: str = "identity"
) -> tuple[bytes, VersionConstraint]:
    """Take ``weight_version`` out of a JSON object body; other bodies are returned untouched."""
    if not body or not (is_json(content_type) or content_type == ""):
        return body, VersionConstraint()
    if content_encoding.strip().lower() not in ("", "identity"):
        # The sidecar does not inflate bodies (a bomb); compressed, a pin would pass unseen to an engine
        # that inflates it, and be dropped there: served from any version.
        raise ConstraintError("a JSON body must be sent uncompressed (Content-Encoding: identity)")
    obj = loads_json(body)
    if obj is None:
        # Not JSON this process writes back strictly: passed on untouched, unless it names a
        # constraint, which must then not be dropped silently (served from any version).
        try:
            lenient = _loads_lenient(body)
        except RecursionError:
            if not body.lstrip().startswith(b"["):
                # Nested past what any parser here reads, it may still carry weight_version at its top:
                # forwarded, the engine would drop the key and serve the request from any version.
                raise ConstraintError("a JSON object body must be nested at most 64 levels deep") from None
            lenient = None  # (an array cannot carry weight_version)
        if isinstance(lenient, dict) and BODY_KEY in lenient:
            constraint_from_json(lenient[BODY_KEY])  # (a bad constraint gets its own message)
            raise ConstraintError(
                f"a body with {BODY_KEY} must be strict JSON (no NaN or Infinity, numbers a double holds, "
                "no key given twice, at most 64 levels deep)"
            )
        return body, VersionConstraint()
    if not isinstance(obj, dict) or BODY_KEY not in obj:
        return body, VersionConstraint()
    constraint = constraint_from_json(obj.pop(BODY_KEY))
    return dumps_json(obj), constraint


def loads_json(data: bytes) -> object:
    """The JSON value of ``data``, or None when it is not JSON this process reads strictly
    (protocol/untrusted_json.py: bad UTF-8, a bare NaN or Infinity, a number past a double, a key
    given twice, nesting past 64 levels, integers of over 4300 digits): the body is then passed on
    untouched.  A lone surrogate escape is kept (``dumps_json`` writes it back as an escape)."""
    try:
        return load_json(data, max_bytes=len(data), allow_surrogates=True)  # (the caller bounded data)
    except UntrustedJSONError:
        return None


def _loads_lenient(data: bytes) -> object:
    """``data`` as Python's json reads it (bare NaN and Infinity, 1e999 as an infinity, the last of a
    duplicate key), else None; RecursionError for nesting past Python's limit."""
    try:
        return json.loads(data)
    except ValueError:
        return None


def dumps_json(obj: object) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (an escaped \ud800 in the input): keep it as an escape
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def is_json(mimetype: str) -> bool:
    return mimetype == "application/json" or mimetype.endswith("+json")
