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

    Urgent waiters take turns by tenant, each tenant's in the order they came: one
    tenant's flood of lookups and prefetches (hundreds of calls queued) made another's
    read wait for all of them, seconds, while a call holding a place timed out and the
    tier was skipped for every tenant."""

    def __init__(self, limit: int) -> None:
        self._free = limit
        # tenant -> its urgent waiters; the tenants in the order of their turns
        self._urgent: dict[str, deque[asyncio.Future[None]]] = {}
        self._others: deque[asyncio.Future[None]] = deque()

    def __repr__(self) -> str:
        return (f"UrgentFirst(free={self._free}, urgent_tenants={len(self._urgent)}, "
                f"waiting={self.waiting})")

    @asynccontextmanager
    async def hold(self, urgent: bool, tenant: str = "") -> AsyncIterator[None]:
        if self._free > 0 and not self._urgent and not self._others:
            self._free -= 1
        else:
            waiter = asyncio.get_running_loop().create_future()
            queue = self._urgent.setdefault(tenant, deque()) if urgent else self._others
            queue.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._hand_on()  # let in, then cancelled before it ran: the next
                elif waiter in queue:
                    queue.remove(waiter)
                    if urgent and not queue and self._urgent.get(tenant) is queue:
                        del self._urgent[tenant]
                raise
        try:
            yield
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        """A holder left: the first waiter of the tenant whose turn it is comes in, else
        the first of the others, else the place is free."""
        while self._urgent:
            tenant = next(iter(self._urgent))
            queue = self._urgent.pop(tenant)
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    if queue:
                        self._urgent[tenant] = queue  # its next, after the others' turns
                    waiter.set_result(None)
                    return
        while self._others:
            waiter = self._others.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    @property
    def waiting(self) -> int:
        return sum(map(len, self._urgent.values())) + len(self._others)
