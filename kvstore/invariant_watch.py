"""The full invariant check after requests (``--debug-invariants``), kept off the loop.

The checker walks every block (3-10 us each: about a second for 400k blocks), so after
each request it runs on the loop only while the store is small: ``inline_blocks`` (1024,
a few ms; at 20k, as it was, each request held the loop 170 ms, and a client sending
request after request kept the loop in the drain's batch for seconds, a drop's slices
waiting that long each).  Beyond it the check runs in a forked child: a copy-on-write
snapshot of the heap, checked as it was when the request ended, while the loop serves
on (the fork itself holds the loop for a time that grows with the heap: 6 ms at 400k
blocks, 26 ms at 1M).  One check runs at a time; requests that end meanwhile ask for
one more, run when it finishes, so the last state is always checked.  A violation the
child finds comes back through a pipe and is reported like one found inline.  The
checker stays complete: it is the same function either way.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable

log = logging.getLogger("kvstore.invariants")

_REPORT_LIMIT = 16 << 10  # bytes of a violation's message the child sends back


class InvariantWatch:
    """Runs ``check`` after requests: inline while ``size()`` is at most
    ``inline_blocks``, in a forked child beyond; violations go to ``on_violation``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, check: Callable[[], None],
                 size: Callable[[], int], on_violation: Callable[[str], None], *,
                 inline_blocks: int = 1024) -> None:
        self.loop = loop
        self.check = check
        self.size = size
        self.on_violation = on_violation
        self.inline_blocks = inline_blocks
        self.forked = 0  # checks run in a child so far
        self._child: tuple[int, int] | None = None  # (pid, read end of its pipe)
        self._report = b""
        self._again = False

    @property
    def running(self) -> bool:
        """Whether a forked check is under way."""
        return self._child is not None

    def after_request(self) -> bool:
        """Check now (inline: False on a violation), or start or queue a forked check
        (True: its verdict comes later)."""
        if self.size() <= self.inline_blocks:
            try:
                self.check()
            except AssertionError as exc:
                self.on_violation(str(exc) or "assertion failed")
                return False
            return True
        if self._child is None:
            self._fork()
        else:
            self._again = True
        return True

    def _fork(self) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: check the snapshot, report, and leave without cleanup
            os.close(read)
            gc.disable()  # no finalizer of the parent's objects may run here
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                self.check()
                report = b""
            except AssertionError as exc:
                report = (str(exc) or "assertion failed").encode()
            except BaseException as exc:  # a bug in the checker is a finding too
                report = f"the checker failed: {exc!r}".encode()
            try:
                os.write(write, report[:_REPORT_LIMIT])
            finally:
                os._exit(0)
        os.close(write)
        self.forked += 1
        self._child = (pid, read)
        self._report = b""
        self.loop.add_reader(read, self._readable)

    def _readable(self) -> None:
        assert self._child is not None
        pid, read = self._child
        chunk = os.read(read, 1 << 16)
        if chunk:
            self._report += chunk
            return
        self.loop.remove_reader(read)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        self._child = None
        if self._report:
            self.on_violation(self._report.decode(errors="replace"))
        elif status:
            self.on_violation(f"the checker's process ended with status {status}")
        if self._again:
            self._again = False
            self._fork()

    def close(self) -> None:
        """Stop watching; a check under way is stopped."""
        if self._child is not None:
            pid, read = self._child
            self.loop.remove_reader(read)
            os.close(read)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self._child = None
        self._again = False
