"""Reading the files that settings name (the configuration, secrets, tokens) without
hanging on a FIFO or a device put where a file was expected."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvstore.errors import ConfigError


def read_regular_file(path: str | Path, setting: str,
                      most: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at ``path`` and its status; ConfigError, naming
    ``setting``, if it cannot be opened or read, is something else (a directory, a FIFO,
    a device) or holds more than ``most`` bytes.  It is opened without blocking: a FIFO
    with no writer would otherwise hold the caller, the daemon's event loop on a reload,
    for ever, and a device such as /dev/zero would never end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{setting}: {path} is not a regular file")
        chunks: list[bytes] = []
        held = 0
        while held <= most:
            chunk = os.read(fd, most + 1 - held)
            if not chunk:
                break
            chunks.append(chunk)
            held += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if held > most:
        raise ConfigError(f"{setting}: {path} holds more than {most} bytes")
    return b"".join(chunks), st
