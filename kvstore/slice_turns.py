"""Work too big for one loop turn, done a slice a turn: the slices of all of it by turns.

Whole snapshots (``kvstore.routing``), drops and evicts in slices (``kvstore.removals``)
and large puts (``kvstore.verbs``) each go a slice of about a millisecond at a time,
then give the loop a turn, so that a request arriving meanwhile waits for at most one
slice.  Each gave a turn of its own: many under way at once (they are per request, and
a tenant may have many sessions) each ran a slice in every turn, so a turn lasted as
many milliseconds as there were slicers.  200 whole snapshots of a 60k-block store,
asked by 100 sessions of one tenant, held another tenant's pings 309 ms at the median
and 1.3 s at the most for ten seconds; ``SliceTurns`` queues them instead: one slice a
loop turn over all of them, in the order they asked, so a turn holds one slice however
many wait (the pings: 0.2 ms at the median, a few ms at the most), and the slicers
together go as fast as before (each slice is CPU; the turns between them cost
microseconds).
"""

from __future__ import annotations

import asyncio
from collections import deque


class SliceTurns:
    """The queue of slicers waiting for a loop turn of their own."""

    def __init__(self) -> None:
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._handle: asyncio.Handle | None = None  # the next turn's wake-up, if set

    def __repr__(self) -> str:
        return f"SliceTurns(waiting={len(self._waiting)})"

    @property
    def waiting(self) -> int:
        """Slicers waiting for their turn."""
        return len(self._waiting)

    async def turn(self) -> None:
        """Return in a later loop turn, once every slicer that asked before has had its
        own: call before each slice (the first too, as many may begin in one turn)."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        self._waiting.append(woken)
        if self._handle is None:
            self._handle = loop.call_soon(self._wake_next)
        await woken  # (cancelled: left in the queue, done, and skipped there)

    def _wake_next(self) -> None:
        """Wake the first slicer still waiting (its slice runs in the next turn, before
        this is called again), and come again next turn while others wait."""
        self._handle = None
        waiting = self._waiting
        while waiting:
            woken = waiting.popleft()
            if not woken.done():
                woken.set_result(None)
                break
        if waiting:
            self._handle = asyncio.get_running_loop().call_soon(self._wake_next)
