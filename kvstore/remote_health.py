"""Whether the remote tier is skipped: by every tenant, or by one.

A backend call that fails outright (connection refused, an error reply) is the store's
failure: every tenant skips the tier for ``remote.unhealthy_seconds``.  A call that times
out is judged first.  One tenant's huge reads, or its calls queued behind its own, time
out while the store answers everyone else; before, such a timeout ("get_into did not
finish within 2 s") marked the tier down for every tenant, and another tenant's blocks
only the remote store held were not found.  Now:

- while calls are under way, the store is asked every quarter of ``timeout_s`` whether
  it answers (the backend's ``health``: one small command on a connection no data call
  waits for).  A timeout is the store's failure where nothing came back since the call
  began, neither another call nor that question: a store that hangs (paused, frozen) is
  down for everyone at the first timeout of a call begun since, as before;
- otherwise it is the asking tenant's own, and only that tenant skips the tier for the
  cooldown.  Its other calls under way end at once, as timed out: they would, and they
  hold the backend's connections (its pool) that another tenant's small read waits for;
- a call that began before another tenant's own timeout waited behind that tenant's
  load: its timeout is not its tenant's own, and it is made once more (the load gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from kvstore.errors import CallTimeoutError, KVStoreError
from kvstore.plugins import BackendHealth

log = logging.getLogger("kvstore.remote")

T = TypeVar("T")


class TierHealth:
    """The remote tier's health, for all tenants and per tenant; ``probe`` asks the
    store whether it answers (within ``timeout_s``), ``spawn`` runs the asking in the
    background while calls are under way."""

    def __init__(self, cooldown: float, timeout_s: float,
                 probe: Callable[[], Awaitable[BackendHealth]],
                 spawn: Callable[[Coroutine[Any, Any, None]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown = cooldown
        self.timeout_s = timeout_s
        self.clock = clock
        self._probe = probe
        self._spawn = spawn
        self.down_until = 0.0  # every tenant skips the tier until then
        self.tenants: dict[str, float] = {}  # tenant -> until when it skips the tier
        self.answered_at = float("-inf")  # when a backend call last came back
        self._asking = False  # the store is asked whether it answers (calls under way)
        self._calls: dict[str, set[asyncio.Timeout]] = {}  # tenant -> its calls under way
        self.counters = {"tenant_timeouts": 0, "calls_again": 0, "probes": 0,
                         "probes_failed": 0, "late_checks": 0}
        # the last failure that took the tier down for every tenant: (its call, the
        # error's kind and code, when); the log has its text
        self.last_failure: tuple[str, str, float] | None = None

    def __repr__(self) -> str:
        return (f"TierHealth(healthy={self.healthy}, tenants_skipping={len(self.tenants)}, "
                f"asking={self._asking})")

    @property
    def healthy(self) -> bool:
        """Whether the store is taken to answer (no judgement for every tenant)."""
        return self.clock() >= self.down_until

    def serves(self, tenant: str) -> bool:
        """Whether ``tenant``'s calls go to the store now."""
        return self.healthy and lapsed(self.tenants, tenant, self.clock())

    def skipping(self) -> int:
        """How many tenants skip the tier now for their own timeouts."""
        return sum(not self.serves(t) for t in list(self.tenants))

    def clear(self) -> None:
        """Forget every judgement (the stop's last write-back tries once whatever)."""
        self.down_until = 0.0
        self.tenants.clear()

    def failed(self, what: str, exc: Exception, began: float | None = None) -> None:
        """The store failed a call (not one timed out for a tenant's own load): every
        tenant skips it for the cooldown.  A call for no tenant (``began``: when it
        began) that timed out while the store answered others waited behind their
        load: not the store's failure (the generation check, behind one tenant's huge
        reads, once marked the tier down for every tenant)."""
        if (began is not None and isinstance(exc, CallTimeoutError)
                and self.answered_at >= began):
            self.counters["late_checks"] += 1
            log.info("remote %s timed out behind other calls while the store answers "
                     "(%s)", what, exc)
            return
        if self.healthy:
            log.warning("remote %s failed (%s); skipping the remote tier for %gs",
                        what, exc, self.cooldown)
        now = self.clock()
        self.down_until = now + self.cooldown
        code = getattr(exc, "code", "internal")
        self.last_failure = (what, f"{type(exc).__name__}: {code}", now)

    def failure(self) -> dict[str, Any] | None:
        """The last failure that took the tier down for every tenant, for stats: its
        call, the error's kind and code, how long ago, and whether the tier is still
        skipped for it; None if none.  Only what any tenant may see (no address, no
        server text: those are the log's, for the operator)."""
        if self.last_failure is None:
            return None
        what, error, at = self.last_failure
        return {"call": what, "error": error, "seconds_ago": round(self.clock() - at, 3),
                "skipped_for_seconds": round(max(0.0, self.down_until - self.clock()), 3)}

    async def call(self, tenant: str, what: str, make: Callable[[], Awaitable[T]]) -> T:
        """``await make()``, one backend call for ``tenant``; a failure is judged (see
        the module's text), then raised.  One that timed out behind another tenant's
        load is made once more."""
        for again in (False, True):
            began = self.clock()
            try:
                async with self._calling(tenant):
                    return await make()
            except CallTimeoutError as exc:
                if not self._timed_out(tenant, began, what, exc) or again:
                    raise
                self.counters["calls_again"] += 1
            except KVStoreError as exc:
                self.failed(what, exc)
                raise
        raise AssertionError("unreachable: the second try returns or raises")

    @asynccontextmanager
    async def _calling(self, tenant: str) -> AsyncIterator[None]:
        """Around one backend call: counted as an answer if it comes back;
        CallTimeoutError if it is ended for another of the tenant's that timed out."""
        calls = self._calls.setdefault(tenant, set())
        if not self._asking:
            self._asking = True
            self._spawn(self._ask())
        try:
            async with asyncio.timeout(None) as scope:
                calls.add(scope)
                try:
                    yield
                finally:
                    calls.discard(scope)
        except TimeoutError:
            if not scope.expired():
                raise
            raise CallTimeoutError("ended: another call of the tenant timed out, and it "
                                   "skips the remote tier for now") from None
        finally:
            if not calls and self._calls.get(tenant) is calls:
                del self._calls[tenant]
        self.answered_at = self.clock()

    def _timed_out(self, tenant: str, began: float, what: str, exc: Exception) -> bool:
        """A call for ``tenant`` begun at ``began`` timed out: whether it waited behind
        another tenant's load (to be made again); else it is the store's failure, or
        the tenant's own (see the module's text)."""
        if not self.serves(tenant):
            return False  # (ended with the tenant's others, or the tier went down)
        if self.answered_at < began:
            self.failed(what, exc)  # nothing answers: the store's failure
            return False
        if any(until - self.cooldown >= began
               for other, until in self.tenants.items() if other != tenant):
            return True
        self.counters["tenant_timeouts"] += 1
        log.warning("remote %s for tenant %r timed out while the store answers (%s); that "
                    "tenant skips the remote tier for %gs", what, tenant, exc, self.cooldown)
        self.tenants[tenant] = self.clock() + self.cooldown
        now = asyncio.get_running_loop().time()
        for scope in self._calls.pop(tenant, ()):
            scope.reschedule(now)  # its other calls under way end (see the module's text)
        return False

    async def _ask(self) -> None:
        """While calls are under way, whether the store answers, every quarter of
        ``timeout_s``."""
        try:
            while self._calls and self.healthy:
                self.counters["probes"] += 1
                if (await self._probe()).ok:
                    self.answered_at = self.clock()
                else:
                    self.counters["probes_failed"] += 1
                await asyncio.sleep(self.timeout_s / 4)
        finally:
            self._asking = False


def lapsed(untils: dict[str, float], tenant: str, now: float) -> bool:
    """Whether ``tenant``'s skip in ``untils`` (tenant -> until when) is over, or it has
    none; one over is let go (the map holds the tenants skipping only)."""
    until = untils.get(tenant)
    if until is None:
        return True
    if now < until:
        return False
    del untils[tenant]
    return True
