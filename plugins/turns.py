"""Turns at a bounded resource: the remote tier's places for backend calls, and a
backend's connections to its store.

The remote tier takes turns for its calls by tenant, reads before writes
(``UrgentFirst``), but a call, once let in, split its keys over every one of the
backend's connections, and those were handed out in the order asked: one tenant's big
reads (a 64 MiB call in four pieces, four such calls let in) queued a dozen pieces on
the connections, and another tenant's one-block read, let in next, waited behind all of
them (2.5 ms alone, 74 ms median beside three tenants' 64 MiB reads: benchmarks/
remote_fairness.py).  So the tier says whose call it makes (``calling``), and a backend
hands its connections out by the same turns (``turn``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar

# (urgent, tenant) of the backend call being made: a read or lookup is urgent, a write not
_CALLER: ContextVar[tuple[bool, str]] = ContextVar("kvstore_backend_caller",
                                                   default=(False, ""))

# urgent calls let in while a write waits, at most, before that write goes next: strictly
# first, a steady flood of reads let no write in, and write-throughs' blocks left DRAM
# with no remote copy
URGENT_RUN_MOST = 16


class calling:  # lower case: it reads as a function, ``with calling(urgent, tenant):``
    """Backend calls made in the body are ``tenant``'s, urgent (a read, a lookup) or not
    (a write), for the turns a backend's connections are handed out in."""

    def __init__(self, urgent: bool, tenant: str) -> None:
        self._caller = (urgent, tenant)
        self._token: object = None

    def __enter__(self) -> None:
        self._token = _CALLER.set(self._caller)

    def __exit__(self, *exc: object) -> None:
        _CALLER.reset(self._token)  # type: ignore[arg-type]


def turn() -> tuple[bool, str]:
    """Whose backend call this is: (urgent, tenant); (False, "") outside ``calling``."""
    return _CALLER.get()


class UrgentFirst:
    """At most ``limit`` holders at once, the urgent waiters (an engine's reads and
    lookups) let in before the others (write-throughs, write-backs), each kind in the
    order it came.  The remote tier's bound on its calls: taken before a transfer slot
    (a call waiting on a slow remote store must hold none of the slots the local tiers
    share), it would otherwise queue an engine's reload behind every write waiting
    there, as a plain semaphore does.

    Waiters take turns by tenant, each tenant's in the order they came: one tenant's
    flood of lookups and prefetches (hundreds of calls queued) made another's read wait
    for all of them, seconds, while a call holding a place timed out and the tier was
    skipped for every tenant.

    A tenant holds at most ``tenant_most`` places (all by default): the remote tier keeps
    one for the others, since a place is handed on only when a whole call leaves, and a
    tenant holding every place made another's one-block read wait for one of its 64 MiB
    calls (benchmarks/remote_fairness.py, four heavy readers: 2 ms alone, 37 ms median
    beside them).

    Urgent first, but not for ever: a write that waited while ``urgent_run_most`` urgent
    calls in a row were let in goes next (aging), so a flood of reads leaves writes a
    place in every ``urgent_run_most + 1``."""

    def __init__(self, limit: int, tenant_most: int | None = None,
                 urgent_run_most: int = URGENT_RUN_MOST) -> None:
        self._free = limit
        self._urgent_run_most = max(1, urgent_run_most)
        self._urgent_run = 0  # urgent waiters let in in a row while others waited
        self._tenant_most = limit if tenant_most is None else max(1, tenant_most)
        self._holding: dict[str, int] = {}  # tenant -> the places it holds
        # tenant -> its waiters, urgent and not; the tenants in the order of their turns
        self._urgent: dict[str, deque[asyncio.Future[None]]] = {}
        self._others: dict[str, deque[asyncio.Future[None]]] = {}

    def __repr__(self) -> str:
        return (f"UrgentFirst(free={self._free}, holding={sum(self._holding.values())}, "
                f"urgent_tenants={len(self._urgent)}, waiting={self.waiting})")

    @asynccontextmanager
    async def hold(self, urgent: bool, tenant: str = "") -> AsyncIterator[None]:
        # (a place is free only while every waiter's tenant holds its most)
        if self._free > 0 and not self._full(tenant):
            self._free -= 1
            self._holding[tenant] = self._holding.get(tenant, 0) + 1
        else:
            waiter = asyncio.get_running_loop().create_future()
            turns = self._urgent if urgent else self._others
            queue = turns.setdefault(tenant, deque())
            queue.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._leave(tenant)  # let in, then cancelled before it ran: the next
                elif waiter in queue:
                    queue.remove(waiter)
                    if not queue and turns.get(tenant) is queue:
                        del turns[tenant]
                raise
        try:
            yield
        finally:
            self._leave(tenant)

    def _full(self, tenant: str) -> bool:
        return self._holding.get(tenant, 0) >= self._tenant_most

    def _leave(self, tenant: str) -> None:
        """A holder of ``tenant`` left: the first waiter of the urgent tenant whose turn it
        is (of those below their most) comes in, else the first of the others', else the
        place is free; the others first after a run of ``urgent_run_most`` urgent ones."""
        held = self._holding[tenant] - 1
        if held:
            self._holding[tenant] = held
        else:
            del self._holding[tenant]
        kinds = (self._urgent, self._others)
        if self._others and self._urgent_run >= self._urgent_run_most:
            kinds = (self._others, self._urgent)
        for turns in kinds:
            # (the tenants waiting, not their waiters: a few, and each at most once)
            for waiting in list(turns):
                if self._full(waiting):
                    continue  # keeps its turn for when one of its calls leaves
                queue = turns.pop(waiting)
                while queue:
                    waiter = queue.popleft()
                    if not waiter.done():
                        if queue:
                            turns[waiting] = queue  # its next, after the others' turns
                        self._holding[waiting] = self._holding.get(waiting, 0) + 1
                        self._urgent_run = (self._urgent_run + 1
                                            if turns is self._urgent and self._others else 0)
                        waiter.set_result(None)
                        return
        self._free += 1

    @property
    def waiting(self) -> int:
        return (sum(map(len, self._urgent.values()))
                + sum(map(len, self._others.values())))
