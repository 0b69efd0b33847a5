"""``python tests/stalled_disk.py serve ...``: the daemon, its SSD writes stalled while the
file ``$STALL_FLAG`` exists, as a write to a disk that stopped answering hangs in the
kernel (the writing thread never returns until the flag goes); and its SSD reads while
``$STALL_READS_FLAG`` exists, if set (``$STALL_READS_REACHED`` is created when one is
held).  ``$ROOM_COMING_SECONDS``, if set, is how long a request waits for room that
writes under way are to free (``kvstore.later.ROOM_COMING_SECONDS``), and
``$ROOM_COMING_WAIT`` how long one wait for it lasts unless woken
(``kvstore.moves._ROOM_COMING_WAIT``)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

FLAG = os.environ["STALL_FLAG"]
_pwritev = os.pwritev


def _stalled_pwritev(fd: int, buffers: Any, offset: int, *flags: int) -> int:
    while os.path.exists(FLAG):
        time.sleep(0.05)
    return _pwritev(fd, buffers, offset, *flags)


os.pwritev = _stalled_pwritev

READS_FLAG = os.environ.get("STALL_READS_FLAG")
READS_REACHED = os.environ.get("STALL_READS_REACHED")
_preadv = os.preadv


def _stalled_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
    while READS_FLAG is not None and os.path.exists(READS_FLAG):
        if READS_REACHED is not None:
            open(READS_REACHED, "a").close()
        time.sleep(0.02)
    return _preadv(fd, buffers, offset, *flags)


os.preadv = _stalled_preadv

if "ROOM_COMING_SECONDS" in os.environ:
    import kvstore.later

    kvstore.later.ROOM_COMING_SECONDS = float(os.environ["ROOM_COMING_SECONDS"])
if "ROOM_COMING_WAIT" in os.environ:
    import kvstore.moves

    kvstore.moves._ROOM_COMING_WAIT = float(os.environ["ROOM_COMING_WAIT"])

if __name__ == "__main__":
    from kvstore.cli import main

    sys.exit(main(sys.argv[1:]))
