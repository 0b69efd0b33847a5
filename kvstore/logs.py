"""Log set-up: plain text or one JSON object per line, with request context when known."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_CONTEXT_FIELDS = ("rid", "session", "tenant", "verb")


class JsonFormatter(logging.Formatter):
    """``{"time": ..., "level": ..., "logger": ..., "message": ..., "rid": ...}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in _CONTEXT_FIELDS:
            value = record.__dict__.get(field)
            if value is not None:
                out[field] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str, fmt: str) -> None:
    """Set the root logger's level and format (``text`` or ``json``); may run again."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def in_effect() -> tuple[str, str]:
    """The root logger's level and format (``text`` or ``json``), as ``configure`` set them."""
    root = logging.getLogger()
    json_format = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return logging.getLevelName(root.level).lower(), "json" if json_format else "text"
