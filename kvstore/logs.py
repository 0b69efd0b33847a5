"""Log set-up: plain text or one JSON object per line, with request context when known;
and ``Repeats``, which writes a message repeated many times over once in a while."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
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


class Repeats:
    """Log a message the first time its kind comes, then at most once every ``window``
    seconds, saying how many more of that kind were held back since the last one: a
    failure repeated at every request or step (a daemon refusing them all) is one line
    in ``window`` seconds, not a line each, and each kind is still seen once at once.
    Kinds are the caller's (a verb and an error type); at most ``max_kinds`` are kept,
    the oldest forgotten first.  Thread-safe."""

    def __init__(self, logger: logging.Logger, window: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic, max_kinds: int = 256) -> None:
        self.logger = logger
        self.window = window
        self.max_kinds = max_kinds
        self._clock = clock
        self._lock = threading.Lock()
        # kind -> (when its last line was written, the messages held back since)
        self._kinds: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()

    def __repr__(self) -> str:
        held = sum(count for _, count in self._kinds.values())
        return f"Repeats(kinds={len(self._kinds)}, held={held}, window={self.window:g}s)"

    def log(self, level: int, kind: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level``, unless a message of ``kind`` was logged less
        than ``window`` seconds ago (then it is counted, for the next line); whether it
        was logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            last = self._kinds.pop(kind, None)
            if last is not None and now - last[0] < self.window:
                self._kinds[kind] = (last[0], last[1] + 1)
                return False
            held = last[1] if last is not None else 0
            self._kinds[kind] = (now, 0)
            if len(self._kinds) > self.max_kinds:
                self._kinds.popitem(last=False)
        if held:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, held, now - last[0] if last is not None else 0.0)
        self.logger.log(level, msg, *args)
        return True
