"""The asyncio client: the twin of ``kvstore.client.Client``, verb for verb.

A thin shell over ``kvstore.client_core`` like the blocking one: it sends what the core
builds and hands the core what comes back.  Requests carry ids, so many may be in flight
at once (``asyncio.gather``); a reader on the loop takes every reply and hands each to
the request that waits for it.

The socket is a plain ZeroMQ socket whose descriptor the loop watches, as the daemon's
transport does, rather than a ``zmq.asyncio`` one: a send goes out at once, and one
wake-up reads every reply that has come, without a future per send and per receive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar

import zmq

from kvstore import protocol as p
from kvstore.client_core import (
    BatchResult,
    HeldCore,
    LookupResult,
    NamespaceCore,
    PlanItem,
    PrefetchResult,
    SNAPSHOT_PAGE,
    ReservationCore,
    SessionCore,
    log,
)
from kvstore.client_wire import (
    CurveKeys,
    Exchange,
    Received,
    check_reply,
    decode_reply,
    handshake_refusal,
    make_socket,
    receive,
    say_bye,
    stop_watching,
)
from kvstore.errors import KVStoreError
from kvstore.identity import Identity
from kvstore.router import DEFAULT_PREFILL_RATE, ROUTERS_KEPT, Router, RouteResult

T = TypeVar("T")
# ints: ``&`` on zmq's PollEvent flag goes through the enum machinery (a few us a call)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
# replies a reader callback hands over before the loop's other work (the rest next turn)
_DRAIN_REPLIES = 256


async def _close_router(router: Router, lock: asyncio.Lock) -> None:
    """Close ``router`` once no query uses it (its lock is held till a query's thread is
    done)."""
    async with lock:
        router.close()


class AsyncClient(SessionCore):
    """An asyncio connection to the daemon; many requests may be in flight at once.
    ``async with AsyncClient(...) as client`` (or ``await client.connect()``); the
    arguments are those of ``Client``."""

    def __init__(self, endpoint: str | None = None, *, tenant: str | None = None,
                 token: str | None = None, timeout: float = 30.0, map_arena: bool = True,
                 curve: CurveKeys | None = None, checksums: bool = False) -> None:
        super().__init__(endpoint, tenant=tenant, token=token, timeout=timeout,
                         map_arena=map_arena, curve=curve, checksums=checksums)
        self._ctx: zmq.Context[Any] | None = None
        self._sock: Any = None
        self._watched = False  # whether the socket's refusal monitor is open
        self._waiting: dict[int, asyncio.Future[Received]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1  # the socket's descriptor, watched by the loop while connected
        self._drain_set = False  # a drain is set for the loop's next turn
        self._settled: asyncio.Event | None = None  # set once no posted reply is unread
        self._routers: dict[tuple[str, ...], tuple[Router, asyncio.Lock]] = {}  # of route()
        self._letting_go: set[asyncio.Task[None]] = set()  # routers closing once free
        self._routes_closed = False  # close() began: no router is made any more
        # one snapshot at a time: the daemon keeps a few walks a session, so many at once
        # would end each other's
        self._snapshots: asyncio.Lock | None = None

    async def connect(self) -> AsyncClient:
        """Open the socket and say hello.  The side socket's exchanges (a handshake
        ticket, the arena's descriptor) and the arena's mapping block: they run in the
        loop's default executor, not on the loop."""
        loop = asyncio.get_running_loop()
        # (a drain set on a loop that ended before it ran, at a close: none is set here)
        self._drain_set = False
        admission = await loop.run_in_executor(None, self._admission)
        self._ctx = zmq.Context()
        try:  # whatever fails, the context goes too (its I/O thread and descriptors)
            watch = self._checks_handshake()
            self._sock = make_socket(self._ctx, self.endpoint, self._curve, admission,
                                     watch=watch)
            self._watched = watch  # its refusal monitor is open until _greet closes it
            self._loop = loop
            self._fd = self._sock.getsockopt(zmq.FD)
            loop.add_reader(self._fd, self._readable)
            received = await self._greet(loop)
            await loop.run_in_executor(None, self._on_hello, received)
        except BaseException:
            await self.close()
            raise
        return self

    # -- I/O ------------------------------------------------------------------------------
    async def _greet(self, loop: asyncio.AbstractEventLoop) -> Received:
        """Say hello and wait for the reply; where the daemon checks the handshake (the
        socket is watched), its refusal is ForbiddenError at once, not a silence as long
        as the timeout."""
        req = self._hello_request()
        if not self._checks_handshake():
            return await self._call(req)
        sock = self._sock
        monitor = sock.get_monitor_socket()
        fd = monitor.getsockopt(zmq.FD)
        refused: asyncio.Future[int] = loop.create_future()

        def heard() -> None:  # the descriptor is edge-triggered: read every event
            status = handshake_refusal(monitor)
            if status is not None and not refused.done():
                refused.set_result(status)

        loop.add_reader(fd, heard)
        heard()  # events that came before the reader was added
        call = asyncio.ensure_future(self._call(req))
        try:
            await asyncio.wait((call, refused), return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                return call.result()
            raise self._handshake_refused(refused.result())
        finally:
            call.cancel()
            loop.remove_reader(fd)
            stop_watching(sock)
            self._watched = False

    def _readable(self) -> None:
        # The descriptor's reader: a drain set for the next turn reads what woke it.  Run
        # here too (and set by each send that saw replies waiting), every wake in a flood
        # of replies added a drain to each later turn, and a turn handed over 256 replies
        # for each of them.
        if not self._drain_set:
            self._drain()

    def _drain_soon(self) -> None:
        """Drain in the loop's next turn, once however often asked before it runs."""
        if not self._drain_set and self._loop is not None:
            self._drain_set = True
            self._loop.call_soon(self._drain_turn)

    def _drain_turn(self) -> None:
        self._drain_set = False
        self._drain()

    def _drain(self) -> None:
        """Hand every reply that has come to its waiter.  ZeroMQ's descriptor is
        edge-triggered: read until none is left, or ``_DRAIN_REPLIES`` of them and the
        rest in the loop's next turn (an endpoint that sent replies faster than they
        decode held the loop in this callback for as long as it kept sending)."""
        sock = self._sock  # (waiters wake after this returns: none can close it meanwhile)
        for _ in range(_DRAIN_REPLIES):
            if sock is None or not sock.getsockopt(_EVENTS) & _POLLIN:
                return
            try:
                frames = receive(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._deliver(frames)
        self._drain_soon()  # more may wait: the edge is taken

    def _deliver(self, frames: list[zmq.Frame]) -> None:
        try:
            received = decode_reply(frames)
        except KVStoreError as exc:  # whose it was cannot be told: fail every waiter
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(exc)
            return
        rid = received[0].rid
        if self._heard(received[0]):  # the session is gone: no other reply will come
            for other, future in self._waiting.items():
                if other != rid and not future.done() and (gone := self._gone()):
                    future.set_exception(gone)
        if rid == 0:  # the daemon could not tell whose it is: every waiter gets it
            for future in self._waiting.values():
                if not future.done():
                    future.set_result(received)
            return
        waiter = self._waiting.pop(rid, None)
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(received)
            else:  # its caller gave up (cancelled, timed out) and has not woken yet
                self._post_now(self._give_back(received[0]))
        elif rid in self._abandoned:
            self._post_now(self._give_back(received[0]))
        elif self._settle(received[0]) and not self._unread and self._settled is not None:
            self._settled.set()

    async def _send(self, frames: list[Any], deadline: float) -> None:
        """Send at once (with no high-water mark a DEALER queues what its peer has not
        taken yet); then read what the send let in: it may have taken the descriptor's
        edge for replies already queued.  A socket with no connection to queue on (one
        ZeroMQ dropped, its handshake refused) is waited on until ``deadline`` (the
        loop's clock), then UnavailableError."""
        sock = self._sock
        while True:
            try:
                # a header alone: one send (send_multipart checks every part first)
                if len(frames) == 1:
                    sock.send(frames[0], zmq.NOBLOCK)
                else:
                    sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:  # no connection to queue on: wait for one, till the deadline
                if self._loop is None or self._loop.time() >= deadline:
                    raise self._no_reply() from None
                await asyncio.sleep(0.001)
                if self._sock is None:
                    raise KVStoreError("the client was closed") from None
        if sock.getsockopt(_EVENTS) & _POLLIN:
            self._drain_soon()

    def _expire(self, future: asyncio.Future[Received]) -> None:
        if not future.done():
            future.set_exception(self._no_reply())

    async def _call(self, req: p.Message, payload: Sequence[Any] = ()) -> Received:
        """Send a request and wait for its reply (unchecked: the core checks it)."""
        if self._sock is None or self._loop is None:
            raise KVStoreError("the client is not connected")
        self._usable()
        if self.drops:  # dropped unreleased (``client_drops``): given back first
            self._post_now(self._dropped_requests())
        loop = self._loop
        future: asyncio.Future[Received] = loop.create_future()
        self._waiting[req.rid] = future
        try:
            header = p.encoder.encode(req)
            deadline = loop.time() + self.timeout  # the request's, sending included
            await self._send([header, *payload] if payload else [header], deadline)
            # a timer rather than asyncio.wait_for, which costs a task's worth per call
            timer = loop.call_at(deadline, self._expire, future)
            try:
                return await future
            except BaseException:  # timed out or cancelled: what the reply holds goes back
                if future.done() and not future.cancelled() and future.exception() is None:
                    self._post_now(self._give_back(future.result()[0]))  # come already
                elif self._waiting.get(req.rid) is future:  # else its reply came, given back
                    self._abandon(req.rid)
                raise
            finally:
                timer.cancel()
        finally:
            self._waiting.pop(req.rid, None)

    def _post_now(self, reqs: list[p.Message]) -> None:
        """Post requests that give something back from where no send may wait (never
        with the sockets ``make_socket`` sets up: they queue without limit); then read
        what the sends let in, as ``_send`` does."""
        sock = self._sock
        if sock is None or not reqs:
            return
        for sent, req in enumerate(reqs):
            try:
                sock.send(self._posted(req), zmq.NOBLOCK)
            except zmq.Again:  # no connection to queue on: the daemon's lease takes
                self._unread.pop(req.rid, None)  # them back (no reply to wait for)
                log.warning("could not give %d request(s) back to the daemon: no "
                            "connection", len(reqs) - sent)
                break
        if sock.getsockopt(_EVENTS) & _POLLIN:
            self._drain_soon()

    async def _run(self, exchange: Exchange[T]) -> T:
        """Carry out a verb of several requests, one after the other."""
        try:
            req, payload = next(exchange)
            while True:
                req, payload = exchange.send(await self._call(req, payload))
        except StopIteration as done:
            result: T = done.value
            return result

    async def _post(self, req: p.Message) -> None:
        """Send a request whose reply nobody waits for (a release): the reader settles
        it with the core when it comes."""
        if self._sock is None or self._loop is None:
            raise KVStoreError("the client is not connected")
        self._usable()
        if self.drops:  # dropped unreleased (``client_drops``): given back first
            self._post_now(self._dropped_requests())
        await self._send([self._posted(req)], self._loop.time() + self.timeout)

    # -- verbs ----------------------------------------------------------------------------
    def namespace(self, identity: Identity) -> AsyncNamespaceOpener:
        """``ns = await client.namespace(identity)``."""
        return AsyncNamespaceOpener(self, identity)

    async def stats(self) -> dict[str, Any]:
        return self._on_stats(await self._call(self._stats_request()))

    async def ping(self) -> None:
        """Renew this session's leases (reservations and pins)."""
        self._on_ok(await self._call(self._ping_request()))

    async def gpu_pool(self) -> Any:
        """See ``Client.gpu_pool``."""
        req = self._gpu_request()
        return self._pool if req is None else self._on_gpu(await self._call(req))

    async def report(self, recomputed_tokens: int) -> None:
        """Tell the daemon (for its metrics) how many tokens the engine recomputed."""
        self._on_ok(await self._call(self._report_request(recomputed_tokens)))

    async def snapshot(self, page: int = SNAPSHOT_PAGE) -> p.SnapshotReply:
        """See ``Client.snapshot``; one at a time on this client (the others wait)."""
        if self._snapshots is None:
            self._snapshots = asyncio.Lock()
        async with self._snapshots:
            return await self._run(self._snapshot_pages(page))

    async def probe(self, keys: Sequence[bytes] = ()) -> p.ProbeReply:
        """See ``Client.probe``."""
        return check_reply((await self._call(p.Probe(self._next_rid(), list(keys))))[0],
                           p.ProbeReply)

    async def route(self, keys: Sequence[bytes], endpoints: Sequence[str], *,
                    deadline: float = 0.05, prefill_rate: float = DEFAULT_PREFILL_RATE,
                    tokens: int | None = None, block_tokens: int | None = None
                    ) -> list[RouteResult]:
        """See ``Client.route``: the query runs in a worker thread, one at a time per set
        of endpoints (a router's sockets serve one query at once: its lock is held till
        the thread is done, even if this task is cancelled first, so that no other
        thread, nor its closing, uses the sockets meanwhile)."""
        while True:
            if self._routes_closed:
                raise KVStoreError("the client is closed")
            routers, key = self._routers, tuple(endpoints)
            entry = routers.pop(key, None)  # (back in as the most recently used)
            if entry is None:
                entry = (Router(endpoints, tenant=self._tenant, token=self._token or None,
                                curve=self._curve), asyncio.Lock())
            routers[key] = entry
            if len(routers) > ROUTERS_KEPT:  # the least recently used goes once free
                closing = asyncio.ensure_future(_close_router(*routers.pop(next(iter(routers)))))
                self._letting_go.add(closing)
                closing.add_done_callback(self._letting_go.discard)
            router, lock = entry
            await lock.acquire()
            if router.closed:  # let go while this waited for it: a new one
                lock.release()
                continue
            try:
                query = asyncio.ensure_future(asyncio.to_thread(
                    router.route, keys, deadline=deadline, tokens=tokens,
                    block_tokens=block_tokens, prefill_rate=prefill_rate))
            except BaseException:
                lock.release()
                raise
            query.add_done_callback(lambda _: lock.release())
            return await asyncio.shield(query)

    async def close(self) -> None:
        if self._forked:  # the parent's socket, context and loop registration: its own
            self._routers.clear()  # (removing the reader here took the parent's: the
            self._unmap()          # loop's epoll is shared across a fork)
            self._sock = self._ctx = None
            self._fd = -1
            return
        self._routes_closed = True
        entries = list(self._routers.values())  # (a route meanwhile finds none to use)
        self._routers.clear()
        for router, lock in entries:
            await _close_router(router, lock)
        if self._letting_go:
            await asyncio.gather(*self._letting_go)
        self._unmap()
        if self._sock is not None:  # dropped unreleased: given back (the goodbye may go)
            try:
                self._post_now(self._dropped_requests())
            except zmq.ZMQError as exc:
                log.warning("closing without giving back dropped holdings: %s", exc)
        if self._unread and self._sock is not None:
            # Posted releases must reach the daemon before the socket goes (it drops what
            # it has not sent), or their pins would stay until the session's lease ends.
            settled = self._settled = asyncio.Event()
            try:
                await asyncio.wait_for(settled.wait(), self._close_wait())
            except TimeoutError:
                log.warning("closing without the replies to %d posted releases",
                            len(self._unread))
            self._settled = None
        if self._fd >= 0 and self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._fd = -1
        # no reply is read any more: a call still waiting for one is told so now (it
        # waited out its whole timeout before, then blamed the daemon)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(KVStoreError("the client was closed while this call "
                                                  "waited for its reply"))
        if self._sock is not None:
            if self._watched:  # a connect failed before its hello: term would wait on it
                stop_watching(self._sock)
                self._watched = False
            self._sock.close(linger=say_bye(self._sock, self._bye_request()))
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncNamespaceOpener:
    """What ``AsyncClient.namespace`` returns: await it for the namespace."""

    def __init__(self, client: AsyncClient, identity: Identity) -> None:
        self.client = client
        self.identity = identity

    def __await__(self) -> Any:
        return self._open().__await__()

    async def _open(self) -> AsyncNamespace:
        c = self.client
        received = await c._call(c._namespace_request(self.identity))
        ns = AsyncNamespace(c, self.identity, AsyncNamespace._opened(received))
        path, size = ns.arena
        if path and c._maps_ahead(path):  # mapped here, off the loop, not at first use
            await asyncio.get_running_loop().run_in_executor(None, c._view_of, path, size)
        return ns


class AsyncNamespace(NamespaceCore[AsyncClient]):
    """The asyncio twin of ``Namespace``."""

    async def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        return await self.client._run(self._lookup(keys))

    async def lookup_pin(self, keys: Sequence[bytes]) -> tuple[LookupResult, AsyncHeld | None]:
        """See ``Namespace.lookup_pin``."""
        found = await self.client._run(self._lookup_pin(keys))
        if not found.pin:
            return found.found, None
        held = AsyncHeld(self, list(keys))
        held._on_pinned(found)
        return found.found, held

    def reserve(self, keys: Sequence[bytes], parent: bytes | None = None) -> AsyncReservation:
        """``async with ns.reserve(keys) as r`` (or ``r = await ns.reserve(keys)``)."""
        return AsyncReservation(self, list(keys), self._parent(keys, parent))

    def acquire(self, keys: Sequence[bytes]) -> AsyncHeld:
        """``async with ns.acquire(keys) as held`` (or ``held = await ns.acquire(keys)``)."""
        return AsyncHeld(self, list(keys))

    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any],
                  parent: bytes | None = None) -> int:
        return await self.client._run(self._put(keys, blocks, parent))

    async def get(self, keys: Sequence[bytes], verify: bool = True) -> list[bytes]:
        return await self.client._run(self._get(keys, verify))

    async def evict(self, keys: Sequence[bytes]) -> int:
        return self._on_count(await self.client._call(self._evict_request(keys)))

    async def keep_warm(self, keys: Sequence[bytes], seconds: float) -> int:
        """See ``Namespace.keep_warm``."""
        return self._on_count(await self.client._call(self._warm_request(keys, seconds)))

    async def prefetch(self, keys: Sequence[bytes], *, wait: bool = False,
                       timeout: float | None = None) -> PrefetchResult:
        """See ``Namespace.prefetch``."""
        req = self._prefetch_request(keys, wait, timeout)
        return self._on_prefetch(await self.client._call(req))

    async def post_prefetch(self, keys: Sequence[bytes]) -> None:
        """See ``Namespace.post_prefetch``."""
        await self.client._post(self._prefetch_request(keys, False, None))

    async def reserve_batch(self, plan: Sequence[PlanItem]) -> BatchResult[AsyncReservation]:
        """See ``Namespace.reserve_batch``; the reservations are made already (commit or
        abort each, or use it in ``async with``)."""
        received = await self.client._call(self._reserve_batch_request(plan))
        return self._on_reserve_batch(plan, received, lambda keys: AsyncReservation(self, keys))

    async def offload(self, kv_caches: Any, page_ids: Sequence[int], keys: Sequence[bytes],
                      *, layout: str = "per_layer", parent: bytes | None = None) -> int:
        """See ``Namespace.offload``."""
        self._check_pages(kv_caches, page_ids, keys, layout)
        hit = (await self.lookup(keys)).blocks
        if hit == len(keys):
            return 0
        async with self.reserve(keys[hit:], parent=keys[hit - 1] if hit else parent) as r:
            self._gather(kv_caches, page_ids[hit:], r, layout)
            return await r.commit()

    async def reload(self, keys: Sequence[bytes], kv_caches: Any, page_ids: Sequence[int], *,
                     layout: str = "per_layer") -> int:
        """See ``Namespace.reload``."""
        self._check_pages(kv_caches, page_ids, keys, layout)
        if not keys:
            return 0
        self.client._pin_arena(self.arena, kv_caches)
        async with self.acquire(keys) as held:
            self._scatter(held, kv_caches, page_ids, layout)
        return len(keys)

    async def close(self) -> None:
        """As ``Namespace.close``: stop using the namespace in this session."""
        self.client._on_ok(await self.client._call(
            p.CloseNamespace(self.client._next_rid(), self.id)))

    async def drop(self) -> int:
        """Drop every unpinned block of this namespace that was there when the drop
        was asked for; returns how many entries it removed.  What is committed into the
        namespace after that (while the daemon waits for this session's get replies
        still being sent, behind another removal of it, or between its slices) is kept,
        with its prefixes, and not counted."""
        return self._on_count(await self.client._call(self._drop_request()))


class AsyncReservation(ReservationCore[AsyncNamespace]):
    """``async with ns.reserve(keys) as r``: write ``r.buffers``, then ``await
    r.commit()``; leaving the block without a commit aborts."""

    def __await__(self) -> Any:
        return self._reserve().__await__()

    async def _reserve(self) -> AsyncReservation:
        if not self.reserved:
            self._on_reserved(await self.ns.client._call(self._reserve_request()))
        return self

    async def commit(self) -> int:
        """See ``Reservation.commit``."""
        return self._on_commit(await self.ns.client._call(self._commit_request()))

    async def abort(self) -> None:
        """See ``Reservation.abort``."""
        req = self._abort_request()
        if req is not None:
            self.ns.client._on_ok(await self.ns.client._call(req))

    async def __aenter__(self) -> AsyncReservation:
        return await self._reserve()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: object) -> None:
        if not self.done and self.ns.client._sock is not None:
            if exc is None:
                await self.abort()
                return
            try:  # the body's own error comes through, not the abort's (the lease
                await self.abort()  # rolls the reservation back where the abort did not)
            except KVStoreError as failed:
                log.warning("aborting a reservation after %s failed: %s",
                            type(exc).__name__, failed)


class AsyncHeld(HeldCore[AsyncNamespace]):
    """``async with ns.acquire(keys) as held``: read-only ``held.buffers`` until
    release."""

    def __await__(self) -> Any:
        return self._acquire().__await__()

    async def _acquire(self) -> AsyncHeld:
        if not self.acquired:
            self._on_acquired(await self.ns.client._call(self._acquire_request()))
        return self

    async def release(self) -> None:
        """Unpin, without waiting for the daemon: done before this client's next
        request."""
        req = self._release_request()
        if req is not None:
            await self.ns.client._post(req)

    async def __aenter__(self) -> AsyncHeld:
        return await self._acquire()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: object) -> None:
        if self.ns.client._sock is None:
            return
        if exc is None:
            await self.release()
            return
        try:  # the body's own error comes through, not the release's (a session gone
            await self.release()  # took its pins with it)
        except KVStoreError as failed:
            log.warning("releasing pins after %s failed: %s", type(exc).__name__, failed)
