"""The garbage collector kept from walking the index.

CPython runs a full collection whenever what survived the young generations grows by a
quarter of the old one; with millions of long-lived blocks each such collection walks
all of them and holds the event loop for as long (a third of a second at 100k blocks,
seconds at a million, measured by ``benchmarks/loop_stalls.py``).  The index holds no
reference cycles that die (an entry leaves its parent's child links and its eviction
order's links as it goes, and an order replaced unlinks its entries, ``release``; so
reference counting frees it), so the daemon moves what survived into the collector's
permanent generation from time to time (``gc.freeze``), and starts no full collection
in between (the oldest generation's threshold out of reach): one would still walk all
that came since the last freeze, 50-90 ms of a busy second's ingest.  Young collections
go on as before, and one runs just before each freeze (but not before the freeze that
ends a warm restart, which built only entries), so short-lived cycles (a failed
request's traceback) are still freed, and after a second quiet second in a row the
whole unfrozen heap is collected (a few ms); a cycle that outlives the young
generations and dies in a busy second or in the quiet one right after it, or that is
frozen and dies later, is kept until exit: the price of never walking the index (a
load that is busy every other second has no full collection at all).  (Measured with CPython 3.11's generational collector.)
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager


FULL_COLLECTIONS_OFF = 1 << 30  # the oldest generation's threshold once settling: never reached
# A settle after at most this many young collections that passed objects on to the old
# generation (about 7000 objects each) collects the old one too: a quiet second, a few ms.
QUIET_RUNS = 10


def settle(full: bool = False) -> None:
    """Collect the young generations (``full``: all of them), then freeze every object
    that survived: the next full collections skip them.  O(the objects made since the
    last settle); the freeze itself is O(1).

    Between settles the collector starts no full collection of its own (its oldest
    generation's threshold raised): one would walk every object that survived since the
    last settle, up to a second of ingest (50-90 ms at 150k blocks/s).  The price: a
    cycle that outlived the young generations and died before the settle is freed only
    by a ``full`` settle (``settle_every`` makes one after two quiet seconds in a row),
    else frozen."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTIONS_OFF)
    gc.collect(2 if full else 1)
    gc.freeze()


@contextmanager
def paused() -> Iterator[None]:
    """No collection while the block runs (building millions of entries that all live
    on, as a warm restart does: each full collection on the way would walk all that was
    built so far, over half the restart's time); then freeze what it made, uncollected
    (a young collection would walk every entry built: 1.6 s of a 1M-block restart)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def settle_every(loop: asyncio.AbstractEventLoop, seconds: float = 1.0) -> Callable[[], None]:
    """Settle the heap now and every ``seconds`` on ``loop``, fully after a quiet spell
    (``QUIET_RUNS``) that followed another: the first quiet spell after a busy one still
    holds what the busy one made last (the tail of an ingest: a full collection walked
    it, 3.5-26 ms of the loop at 400k blocks), so it is frozen, and the next quiet one is
    collected.  Returns what stops it (and gives the collector its thresholds back)."""
    handle: asyncio.TimerHandle | None = None
    thresholds = gc.get_threshold()
    runs = gc.get_count()[2]  # young collections that passed objects on, so far
    was_quiet = True

    def tick() -> None:
        nonlocal handle, runs, was_quiet
        quiet = gc.get_count()[2] - runs <= QUIET_RUNS
        settle(full=quiet and was_quiet)
        runs, was_quiet = gc.get_count()[2], quiet
        handle = loop.call_later(seconds, tick)

    def stop() -> None:
        if handle is not None:
            handle.cancel()
        gc.set_threshold(*thresholds)

    tick()
    return stop
