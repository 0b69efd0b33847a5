"""Requests that must finish later: bytes to move between tiers, or room to free first.

A verb (or the store) raises a plan (``kvstore.plans``, and the store's
``DemotionNeeded`` and ``PromotionNeeded``); the server's dispatch catches it and runs
``_finish_later`` in a task, which carries the plan out, runs the request again, and
sends its one reply.  Deferred requests wait, in order, for a request that frees room.
``FinishLater`` is a part of ``Server``: the attributes it names are the server's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from kvstore import protocol as p
from kvstore.config import Config
from kvstore.errors import CapacityError, KVStoreError
from kvstore.metrics import Metrics
from kvstore.pending import Deferred, Later, Plan, RemoteFetch, RemoteLookup
from kvstore.remote import RemoteTier
from kvstore.sessions import Session, Sessions
from kvstore.store import BlockStore, DemotionNeeded, Namespace, PromotionNeeded, Reservation
from kvstore.tiering import SsdMover
from kvstore.transport import Transport
from kvstore.verbs import Handler, Outcome, tier_runs

log = logging.getLogger("kvstore.server")

# The verbs a full tier may defer (when the pressure chain has "defer").
DEFERRABLE = frozenset({"reserve", "put", "acquire", "get"})


class FinishLater:
    """The server's handling of requests that finish in a task (a part of ``Server``)."""

    config: Config
    store: BlockStore
    ssd: SsdMover | None
    remote: RemoteTier | None
    metrics: Metrics | None
    sessions: Sessions
    transport: Transport
    clock: Callable[[], float]
    defer: bool
    debug_invariants: bool
    scheduling: dict[str, int]
    _deferred: collections.deque[asyncio.Future[None]]
    _loop: asyncio.AbstractEventLoop | None

    def check_invariants(self) -> bool:
        raise NotImplementedError

    def _defer(self, tenant: str, exc: CapacityError) -> Deferred:
        """No room now: wait for some, in order, until the deferral's deadline."""
        self.scheduling["defers"] += 1
        if self.metrics is not None:
            self.metrics.observe_defer("dram", tenant)
        return Deferred(self.clock() + self.config.dram.defer_seconds, str(exc))

    async def _finish_later(self, routing_id: bytes, rid: int, verb: str, tenant: str,
                            start: float, handler: Handler,
                            session: Session, request: Any, payload: list[Any],
                            plan: Plan) -> None:
        """Move what the store asked for, then run the request again; one reply at the end."""
        code: str | None = None
        reply: p.Message
        out: list[Any]
        try:
            for _ in range(1000):
                if isinstance(plan, RemoteLookup):
                    reply, out = await self._remote_lookup(plan), []
                    break
                if isinstance(plan, Later):
                    reply, out = await plan.reply, []
                    break
                try:
                    await self._resolve(plan)
                except CapacityError as exc:
                    # no room to move the blocks into (DRAM full of pins, say): defer as
                    # the first attempt would have, if the pressure chain allows it
                    if isinstance(plan, Deferred) or not self.defer or verb not in DEFERRABLE:
                        raise
                    plan = self._defer(tenant, exc)
                    continue
                # until its deadline a deferred request runs only the steps before
                # "defer"; then, once, the steps after it too
                early = not (isinstance(plan, Deferred) and plan.expired)
                try:
                    reply, out = self._attempt(handler, session, request, payload, verb,
                                               early=early)
                    break
                except (DemotionNeeded, PromotionNeeded, RemoteFetch, RemoteLookup) as again:
                    plan = again
                except CapacityError as exc:
                    if not isinstance(plan, Deferred):
                        raise
                    if plan.expired:
                        self.scheduling["defer_timeouts"] += 1
                        raise CapacityError(
                            f"no room in the dram tier within "
                            f"{self.config.dram.defer_seconds:g}s (deferred, then rejected): "
                            f"{exc}", cause="deadline") from None
                    plan.cause = str(exc)
                    # still no room: wait again, first in line, until the deadline
            else:
                raise CapacityError("blocks kept moving between tiers; try again")
        except KVStoreError as exc:
            code = exc.code
            reply, out = p.ErrorReply(rid, exc.code, str(exc)), []
            if isinstance(exc, CapacityError):
                self._rejected(tenant, exc)
        except Exception as exc:
            log.exception("internal error finishing a request")
            code = "internal"
            reply, out = p.ErrorReply(rid, "internal", f"internal error: {exc!r}"), []
        self.sessions.release_bytes(session, sum(len(f) for f in payload))
        self.sessions.counted(session)
        self.transport.send(routing_id, reply, out)
        if self.metrics is not None:
            self.metrics.observe_request(verb, time.perf_counter() - start, code, tenant)
        if self.debug_invariants:
            self.check_invariants()

    def _rejected(self, tenant: str, exc: CapacityError) -> None:
        self.scheduling["rejects"] += 1
        if self.metrics is not None:
            self.metrics.observe_reject("dram", tenant, exc.cause)

    def _attempt(self, handler: Handler, session: Session, request: Any,
                 payload: list[Any], verb: str, *, early: bool) -> Outcome:
        """Run a handler; ``early``: a request that may still defer makes room only by
        the pressure steps before "defer"."""
        self.store.early = early and self.defer and verb in DEFERRABLE
        try:
            return handler(session, request, payload)
        finally:
            self.store.early = False

    async def _wait_for_room(self, plan: Deferred) -> None:
        """Wait, in order, until a request frees room or the deadline passes (then the
        plan is marked expired: one last attempt runs every pressure step)."""
        remaining = plan.deadline - self.clock()
        if remaining <= 0:
            plan.expired = True
            return
        assert self._loop is not None
        future: asyncio.Future[None] = self._loop.create_future()
        if plan.waited:
            self._deferred.appendleft(future)  # a retry that failed keeps its place
        else:
            self._deferred.append(future)
        plan.waited = True
        try:
            await asyncio.wait_for(future, remaining)
        except TimeoutError:
            plan.expired = True
        finally:
            if future in self._deferred:
                self._deferred.remove(future)

    def _wake_deferred(self) -> None:
        """Room may have freed: let the first deferred request try again."""
        while self._deferred:
            future = self._deferred.popleft()
            if not future.done():
                future.set_result(None)
                return

    async def _resolve(self, plan: Plan) -> None:
        if isinstance(plan, Deferred):
            await self._wait_for_room(plan)
            return
        if isinstance(plan, RemoteFetch):
            assert self.remote is not None
            await self.remote.fetch(plan.ns, plan.keys)
            return
        if isinstance(plan, DemotionNeeded) and self.ssd is None:
            assert self.remote is not None, "the store planned a write-back without a tier"
            if plan.remote:
                await self.remote.demote(plan.remote)
            else:
                await self.remote.room_coming()
            return
        assert self.ssd is not None, "the store planned a move without an ssd tier"
        assert isinstance(plan, (DemotionNeeded, PromotionNeeded)), plan
        try:
            await self.ssd.resolve(plan)
        except CapacityError:
            if isinstance(plan, PromotionNeeded) or self.store.ssd_writable:
                raise
            # the ssd tier failed the write-back: dram now evicts without it

    async def reserve_moving(self, owner: object, ns: Namespace, keys: list[bytes],
                             parent: bytes | None) -> Reservation:
        """Reserve DRAM slots, demoting to SSD first where the store asks for it."""
        for _ in range(4):
            try:
                return self.store.reserve(owner, ns, keys, parent, self.clock())
            except DemotionNeeded as plan:
                await self._resolve(plan)
        raise CapacityError("no room in the dram tier after writing back to ssd")

    async def _remote_lookup(self, plan: RemoteLookup) -> p.LookupReply:
        assert self.remote is not None
        more = await self.remote.leading(plan.ns, plan.keys[len(plan.tiers):])
        tiers = plan.tiers + ["remote"] * more
        return p.LookupReply(plan.rid, len(tiers), tier_runs(tiers))
