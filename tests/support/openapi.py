"""The daemon's unix-socket API spec (docs/api/openapi.yaml) and a check of one answer against it, shared
by tests/unit/daemon/test_api.py and tests/system/test_daemon_engine_store.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml

SPEC = yaml.safe_load((Path(__file__).parents[2] / "docs/api/openapi.yaml").read_text())


def to_json_schema(node: Any) -> Any:
    """OpenAPI 3.0 schema -> JSON Schema: resolve local $refs and turn `nullable` into a null type."""
    if isinstance(node, dict):
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            return to_json_schema(SPEC["components"]["schemas"][name])
        out = {k: to_json_schema(v) for k, v in node.items() if k not in ("nullable", "description")}
        if node.get("nullable"):
            out = {"anyOf": [out, {"type": "null"}]}
        return out
    if isinstance(node, list):
        return [to_json_schema(x) for x in node]
    return node


def check(path: str, method: str, status: int, body: Any, content_type: str = "application/json") -> None:
    responses = SPEC["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} answered {status}, not in the spec"
    schema = responses[str(status)]["content"][content_type]["schema"]
    jsonschema.validate(body, to_json_schema(schema))
