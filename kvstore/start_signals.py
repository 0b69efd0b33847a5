"""SIGHUP while the daemon starts: noted, and answered by one reload once it serves.

The daemon's event loop takes SIGHUP (a reload) only once it runs, after every import
and the arena's population (a second or more); until then the signal's default action
ended the process, so a configuration tool's reload sent right after a start killed
the daemon.  ``hold_if_daemon`` is called as the ``kvstore`` package is first imported
(before its heavy imports), and again by ``kvstore serve``: from then on a SIGHUP is
only counted, and the server runs one reload once it serves if any came.  Nothing here
imports beyond the standard library, and nothing changes in a process that is not the
daemon (an engine that imports the client keeps its own SIGHUP).
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

_came: list[int] = []  # a SIGHUP noted while the daemon started (one entry is enough)


def _note(signum: int, frame: FrameType | None) -> None:
    if not _came:
        _came.append(signum)


def daemon_command(argv: list[str]) -> bool:
    """Whether ``argv`` is the daemon's: ``kvstore serve ...`` or ``python -m kvstore
    serve ...`` (``-m`` while the package is imported, the module's path after)."""
    if len(argv) < 2 or argv[1] != "serve":
        return False
    name = os.path.basename(argv[0])
    return argv[0] == "-m" or name in ("kvstore", "__main__.py")


def hold() -> None:
    """Count a SIGHUP instead of dying of it, until the loop takes the signal; where
    SIGHUP is not at its default (ignored, say, under nohup) it stays as it is."""
    try:
        if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
            signal.signal(signal.SIGHUP, _note)
    except ValueError:  # (not the main thread: it cannot take signals)
        pass


def hold_if_daemon() -> None:
    """``hold`` in the daemon's process (by its command line), else nothing."""
    if daemon_command(sys.argv):
        hold()


def came() -> bool:
    """Whether a SIGHUP came while held (and no reload answered it yet); forgets it."""
    if _came:
        _came.clear()
        return True
    return False
