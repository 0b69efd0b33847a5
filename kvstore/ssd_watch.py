"""A check of the SSD tier's directory on a timer: removed or replaced under the running
daemon (an operator cleaning a disk, a tmpfiles or cleanup job), the tier's writes would
go to files nobody can find and a restart would find none of its blocks, while ``stats``
still counted them and the lock file, gone with the directory, no longer kept a second
daemon off the path.  Once the check finds it, the mover turns the tier off
(``SsdMover.lose``) until the daemon restarts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.tiering")

CHECK_SECONDS = 1.0
"""How often the directory is looked at: a few stats off the loop, in its executor."""


class SsdDirectoryWatch:
    """Looks every ``period`` seconds whether the directory is still where it was opened
    (``missing``, run off the loop) and calls ``lost`` with what changed, once."""

    def __init__(self, missing: Callable[[], str | None], lost: Callable[[str], None],
                 period: float = CHECK_SECONDS) -> None:
        self._missing = missing
        self._lost = lost
        self._period = period
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def start(self) -> None:
        """Begin the checks (on the running loop)."""
        if self._timer is None and not self._closed:
            self._schedule()

    def _schedule(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._period, self._due)

    def _due(self) -> None:
        if self._closed:
            return
        # off the loop: a stat on a disk that stopped answering must not stall it (the
        # next check waits for this one)
        check = asyncio.get_running_loop().run_in_executor(None, self._missing)
        check.add_done_callback(self._checked)

    def _checked(self, check: asyncio.Future[str | None]) -> None:
        if self._closed or check.cancelled():
            return
        try:
            what = check.result()
        except KVStoreError:  # (the store closed meanwhile)
            return
        except OSError as exc:  # (not a finding: looked at again next time)
            log.warning("checking the ssd tier's directory failed: %s", exc)
            what = None
        if what is None:
            self._schedule()
        else:
            self._lost(what)

    def close(self) -> None:
        """No more checks."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
