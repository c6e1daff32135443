"""JSON from outside (checkpoint index and config files, manifest metadata, plan files), parsed strictly.

``json.loads`` alone accepts what no honest writer produces and later code trips on: a key given twice
(the last silently wins), ``NaN`` / ``Infinity`` (not JSON: RFC 8259 section 6), lone UTF-16 surrogates
(``"\\ud800"``: a str that cannot be encoded back), numbers past a float's range (``1e999``
parses as inf), and nesting deep enough to raise RecursionError,
which is not a ValueError and so escaped every ``except ValueError`` around a parse.  ``load_json``
refuses all of these, and a document over its byte bound, with one short reason (``UntrustedJSONError``,
a ValueError); the caller adds which file or key it was.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64  # config.json nests 3-4 levels; a plan file 4
_MAX_REASON = 160


class UntrustedJSONError(ValueError):
    """Why a JSON document was refused, in one short line (without the document's name)."""


def _refuse_constant(name: str) -> Any:
    raise UntrustedJSONError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e999 parses as inf: a number no writer meant
        raise UntrustedJSONError(f"{text[:40]} is beyond a float's range")
    return x


def _unique(items: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in items:
        if k in out:
            raise UntrustedJSONError(f"key {k[:80]!r} appears twice")
        out[k] = v
    return out


def _check_shape(doc: Any, max_depth: int, escapes: bool) -> None:
    """Depth bound and (when the text had \\u escapes) no lone surrogates; iterative, no recursion."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, dict):
            if depth > max_depth:
                raise UntrustedJSONError(f"nested deeper than {max_depth} levels")
            if escapes:
                for k in x:
                    _encodable(k)
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            if depth > max_depth:
                raise UntrustedJSONError(f"nested deeper than {max_depth} levels")
            stack.extend((v, depth + 1) for v in x)
        elif escapes and isinstance(x, str):
            _encodable(x)


def _encodable(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise UntrustedJSONError(f"{s[:40]!r} holds a lone UTF-16 surrogate") from None


def load_json(
    data: bytes | str,
    *,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    allow_nan: bool = False,
    allow_surrogates: bool = False,
) -> Any:
    """The document in ``data`` (UTF-8), or UntrustedJSONError: too large, not UTF-8, not strict JSON,
    a duplicate key, NaN/Infinity, a lone surrogate, or nested deeper than ``max_depth``.

    ``allow_nan``: for a model's config.json, which Python's ``json.dumps`` (transformers'
    ``save_pretrained``) may write with ``Infinity`` in it; values are checked where they are used.
    ``allow_surrogates``: for a body passed on as it came (the sidecar's requests), whose writer escapes
    a lone surrogate back (``json.dumps`` with ``ensure_ascii``)."""
    if len(data) > max_bytes:
        raise UntrustedJSONError(f"{len(data):,} bytes, more than the {max_bytes:,} allowed")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    except UnicodeDecodeError as e:
        raise UntrustedJSONError(f"not JSON (not UTF-8 at byte {e.start})") from None
    try:
        if allow_nan:
            doc = json.loads(text, object_pairs_hook=_unique)
        else:
            doc = json.loads(
                text, object_pairs_hook=_unique, parse_constant=_refuse_constant, parse_float=_finite_float
            )
    except UntrustedJSONError:
        raise
    except RecursionError:
        raise UntrustedJSONError(f"nested deeper than {max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, and ints past Python's 4300-digit conversion limit
        raise UntrustedJSONError(f"not JSON ({(str(e).splitlines() or [''])[0][:_MAX_REASON]})") from None
    _check_shape(doc, max_depth, not allow_surrogates and "\\u" in text)
    return doc
