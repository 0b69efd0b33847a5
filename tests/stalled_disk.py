"""``python tests/stalled_disk.py serve ...``: the daemon, its SSD writes stalled while the
file ``$STALL_FLAG`` exists, as a write to a disk that stopped answering hangs in the
kernel (the writing thread never returns until the flag goes)."""

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

if __name__ == "__main__":
    from kvstore.cli import main

    sys.exit(main(sys.argv[1:]))
