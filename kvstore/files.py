"""Reading the files that settings name (the configuration, secrets, tokens) without
hanging on a FIFO or a device put where a file was expected; and the directories the
daemon keeps its sockets and files in, no other user's to change."""

from __future__ import annotations

import os
import resource
import stat
from pathlib import Path

from kvstore.errors import ConfigError


def read_regular_file(path: str | Path, setting: str, most: int,
                      streams: bool = False) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at ``path`` and its status; ConfigError, naming
    ``setting``, if it cannot be opened or read, is something else (a directory, a FIFO,
    a device) or holds more than ``most`` bytes.  It is opened without blocking: a FIFO
    with no writer would otherwise hold the caller, the daemon's event loop on a reload,
    for ever, and a device such as /dev/zero would never end.  ``streams``: a pipe or a
    character device is read too, waiting for its writer (a configuration given as
    ``--config <(...)`` or ``/dev/stdin`` at start-up, where nothing else waits), up to
    ``most`` bytes all the same."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if streams and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            os.set_blocking(fd, True)
        elif not stat.S_ISREG(st.st_mode):
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


def check_own_directory(directory: str | Path, where: str, could: str) -> None:
    """``directory``, and every one above it, as given and as its links resolve, must not
    be another user's to change: each a directory of the daemon's user or root (or a
    link of theirs), writable by others only with the sticky bit (as /tmp is).  Else
    ConfigError names the directory, ``where`` it is (what the daemon keeps there), its
    problem, and what another user ``could`` do and the remedy."""
    mine = (os.geteuid(), 0)
    given = Path(os.path.abspath(directory))
    real = Path(os.path.realpath(given))
    # each once (as given, then where links lead, if anywhere else), root first
    for path in dict.fromkeys((*given.parents[::-1], given, *real.parents[::-1], real)):
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            problem = None if info.st_uid in mine else "is a link of another user's"
        elif not stat.S_ISDIR(info.st_mode):
            problem = "is no directory"
        elif info.st_uid not in mine:
            problem = f"belongs to uid {info.st_uid}, not to the daemon's ({os.geteuid()})"
        elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            problem = f"is writable by others (mode {stat.S_IMODE(info.st_mode):o}, not sticky)"
        else:
            problem = None
        if problem is not None:
            raise ConfigError(f"{path}, {where}, {problem}: another user {could}")


def check_socket_directory(directory: Path) -> None:
    """The directory an ipc socket is bound in is no other user's to change
    (``check_own_directory``): else another user (who made /tmp/kvstore-<uid> first, say,
    or who may write in a folder above it) moves the socket or its folder aside, binds
    one of its own, and reads the next client's hello: its tenant and token."""
    check_own_directory(directory, f"where the socket {directory} is bound",
                        "could replace the socket there; bind an endpoint elsewhere (or, to "
                        "share a folder, make it sticky, chmod +t, or use server.socket_group)")


# where a daemon's file size limit comes from, as its refusals name it
FILE_SIZE_LIMIT_FROM = "ulimit -f, LimitFSIZE= in a systemd unit"


def file_size_limit() -> int | None:
    """The process's file size limit in bytes (None: unlimited).  It bounds every file
    the daemon sizes (the SSD tier's data file, a DRAM arena's memory file or file in
    /dev/shm), and the kernel's refusal says only "File too large"."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit
