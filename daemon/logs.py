"""Logging for the daemon: one JSON object per line (or plain text), with version and peer fields."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_EXTRA = ("version", "peer", "run_id", "chunk", "reason", "pause_s")
_BARE = re.compile(r"[^\s\"'=\\]+")  # a value that needs no quotes in key=value text


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {key: getattr(record, key) for key in _EXTRA if hasattr(record, key)}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``LEVEL logger: message key=value ...``: the JSON format's fields, quoted where they need it."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        pairs = [f"{key}={_text_value(value)}" for key, value in _fields(record).items()]
        return " ".join([line, *pairs])


def _text_value(value: object) -> str:
    s = str(value)
    return s if _BARE.fullmatch(s) else json.dumps(s)  # JSON quoting escapes newlines: one record, one line


def setup_logging(fmt: str = "json", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
