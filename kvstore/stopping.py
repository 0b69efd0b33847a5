"""The daemon's stop, bounded in time: ``server.stop_seconds`` from the first SIGTERM or
SIGINT, or at once on a second one.

A stop finishes the requests under way, writes back what only DRAM holds (to the remote
store, to SSD), syncs the SSD index and closes the tiers; each step is bounded, but a
write stuck in the kernel (a stalled disk, a hung network mount) is not: the thread in
``pwritev`` never returns, and neither the tier's thread pool nor the interpreter's exit
waits past it.  A daemon that never exits holds its socket, its arena and its SSD
directory's lock, and systemd kills it only after ``TimeoutStopSec`` (90 s in the unit
we ship; a daemon run by hand waits forever).  So the stop runs against a deadline
kept by a thread of its own: when it passes, or a second signal comes, the daemon logs
what it was doing and exits at once (status 1).  Nothing is lost that a crash would
not lose: a block enters the SSD index only once its bytes are written, and every read
checks them against their checksum (``tiers.ssd``), so the next start restores what
was written and misses what was not.

The drain's own steps shrink their bounds to the time left (``left``), so a slow but
moving stop ends by dropping the rest of a write-back, logged, before the deadline; the
deadline is for what no bound can end.  Each step is also sent to systemd as the unit's
status (``systemctl status`` shows "stopping: writing back ..." while it runs).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from kvstore.sdnotify import Notifier

log = logging.getLogger("kvstore.server")

# What the steps after the drain's (syncing the SSD index, closing the tiers) are left
# at least, of the stop's time: the drain's bounds end that much before the deadline;
# and what the sync leaves for closing (the sync bounded as the others, it was left a
# millisecond after a write-back that used its whole bound, and cut)
CLOSE_SECONDS = 2.0
SYNC_LEAVES_SECONDS = 0.5


class StopDeadline:
    """The stop's deadline and the step it is at.  ``begin`` (the first signal) starts
    the clock on a daemon thread; ``now`` (a second signal) exits at once.  Until
    ``begin`` nothing is armed: a daemon embedded in another program and stopped by a
    call never exits that program."""

    def __init__(self, exit: Callable[[int], object] = os._exit) -> None:
        self.stage = "finishing the requests under way"
        self.seconds = 0.0   # the deadline's length (0: none)
        self.began: float | None = None  # time.monotonic() at ``begin``
        self._exit = exit
        self._notifier: Notifier | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()  # one exit, whichever thread comes first

    def __repr__(self) -> str:
        state = "not begun" if self.began is None else f"at {self.stage!r}"
        return f"StopDeadline({self.seconds:g} s, {state})"

    @property
    def begun(self) -> bool:
        return self.began is not None

    def begin(self, seconds: float, notifier: Notifier | None = None) -> None:
        """The stop begins: exit after ``seconds`` (0: never) unless the process ends
        first (the timer's thread is a daemon thread: it dies with the process)."""
        self.began = time.monotonic()
        self.seconds = seconds
        self._notifier = notifier
        if seconds > 0:
            self._timer = threading.Timer(seconds, self._expired)
            self._timer.daemon = True
            self._timer.name = "kvstore-stop-deadline"
            self._timer.start()
        self.enter(self.stage)

    def enter(self, stage: str) -> None:
        """The stop moves on to ``stage`` (logged at debug, and systemd's status)."""
        self.stage = stage
        if self.began is None:
            return
        log.debug("stopping: %s", stage)
        if self._notifier is not None:
            self._notifier.status(f"stopping: {stage}")

    def left(self, bound: float, keep: float = CLOSE_SECONDS) -> float:
        """``bound``, or less: what the stop has left before its deadline, less the time
        ``keep`` for what follows (``CLOSE_SECONDS``: the sync and closing; less in a
        stop shorter than twice that); at least a millisecond."""
        if self.began is None or self.seconds <= 0:
            return bound
        # a stop shorter than twice CLOSE_SECONDS scales what it keeps down with it (the
        # close's at most half the stop): at stop_seconds 1 or 2 the keep was the whole
        # stop, and every step of the drain was cut at a millisecond
        keep *= min(1.0, self.seconds / (2 * CLOSE_SECONDS))
        left = self.seconds - (time.monotonic() - self.began) - keep
        return max(0.001, min(bound, left))

    def now(self, why: str) -> None:
        """Exit now (``why``: what asked for it), as when the deadline passes."""
        self._end(f"{why} while {self.stage}")

    def _expired(self) -> None:
        self._end(f"the stop took longer than server.stop_seconds ({self.seconds:g} s); "
                  f"still {self.stage}")

    def _end(self, what: str) -> None:
        if not self._lock.acquire(blocking=False):
            return
        log.error("%s: exiting now; writes still under way are lost, as in a crash (the "
                  "next start restores what reached the ssd tier)", what)
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - the exit must happen whatever a handler does
                pass
        self._exit(1)
