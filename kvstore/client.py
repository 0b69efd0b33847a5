"""The client library: the public face of kvstore.

``Client`` is the blocking client; ``AsyncClient`` (``kvstore.aclient``, re-exported
here) is its asyncio twin.  Both are thin shells over ``kvstore.client_core``, which
builds every request and reads every reply: a shell only sends and receives over a
ZeroMQ DEALER socket.  Both map the daemon's DRAM arena for zero-copy reads and writes
and raise the typed errors of ``kvstore.errors``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TypeVar

import zmq

from kvstore import protocol as p
from kvstore.aclient import (
    AsyncClient,
    AsyncHeld,
    AsyncNamespace,
    AsyncNamespaceOpener,
    AsyncReservation,
)
from kvstore.client_core import (
    BatchResult,
    HeldCore,
    LookupResult,
    NamespaceCore,
    PlanItem,
    PrefetchResult,
    CLOSE_WAIT_S,
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
    checksum,
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

__all__ = ["AsyncClient", "AsyncHeld", "AsyncNamespace", "AsyncNamespaceOpener",
           "AsyncReservation", "BatchResult", "Client", "CurveKeys", "Held", "LookupResult",
           "Namespace", "PlanItem", "PrefetchResult", "Reservation", "RouteResult", "Router",
           "checksum"]

T = TypeVar("T")
_MAX_MS = (1 << 31) - 1  # the longest ZeroMQ timeout (an int in milliseconds)
# ints: ``&`` on zmq's PollEvent flag goes through the enum machinery (a few us a call)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class Client(SessionCore):
    """A blocking connection to the daemon.  Use as a context manager or call close().

    ``tenant`` (or $KVSTORE_TENANT) names the tenant where the daemon trusts its clients;
    where it checks credentials, ``token`` (or $KVSTORE_TOKEN) or, on ``tcp://``, ``curve``
    keys (or $KVSTORE_CURVE_SERVER_KEY and $KVSTORE_CURVE_CLIENT_CERT) decide it.
    With ``checksums``, every block written carries its xxh3_64, which readers verify
    (``get`` does, ``held.verify()`` on request); it costs a pass over the bytes."""

    def __init__(self, endpoint: str | None = None, *, tenant: str | None = None,
                 token: str | None = None, timeout: float = 30.0, map_arena: bool = True,
                 curve: CurveKeys | None = None, checksums: bool = False) -> None:
        super().__init__(endpoint, tenant=tenant, token=token, timeout=timeout,
                         map_arena=map_arena, curve=curve, checksums=checksums)
        admission = self._admission()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock: Any = None
        self._watched = False  # whether the socket's refusal monitor is open
        self._receive_timeout = -1.0  # the timeout RCVTIMEO is set to (_wait sets it)
        self._early: dict[int, Received] = {}  # replies that came before the one awaited
        # requests sent whose replies ``_wait`` will read: only theirs are kept in _early
        self._awaited: set[int] = set()
        # held while a reply is filed (``_file``), and by a refused ``_wait`` while it
        # looks for its reply in ``_early`` or gives it up: never both at once
        self._filing = threading.RLock()
        self._routers: dict[tuple[str, ...], Router] = {}  # connections of route()
        # held while a thread sends or receives: a second thread is refused, not let
        # into the same socket (ZeroMQ's sockets are not thread-safe: two threads'
        # frames interleaved, and one read the other's replies)
        self._io = threading.RLock()
        try:  # whatever fails, the context goes too (its I/O thread and descriptors)
            watch = self._checks_handshake()
            self._sock = make_socket(self._ctx, self.endpoint, self._curve, admission,
                                     watch=watch)
            self._watched = watch  # its refusal monitor is open until _greet closes it
            self._on_hello(self._greet())
        except BaseException:
            self.close()
            raise

    # -- I/O ------------------------------------------------------------------------------
    def _greet(self) -> Received:
        """Say hello and wait for the reply; where the daemon checks the handshake (the
        socket is watched), its refusal is ForbiddenError at once, not a silence as long
        as the timeout."""
        req = self._hello_request()
        if not self._checks_handshake():
            return self._call(req)
        sock = self._sock
        monitor = sock.get_monitor_socket()
        try:
            # Not a blocking send: a handshake refused before the hello went takes the
            # connection's queue with it, and a send then waited for a peer for good
            # (whatever the timeout), the refusal unheard.  Sent once there is a queue.
            sent = self._send(req, wait=False)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN if sent else zmq.POLLIN | zmq.POLLOUT)
            poller.register(monitor, zmq.POLLIN)
            deadline = time.monotonic() + self.timeout
            while self.timeout < 0 or (left := deadline - time.monotonic()) > 0:
                ready = dict(poller.poll(None if self.timeout < 0 else math.ceil(left * 1000)))
                if monitor in ready and (status := handshake_refusal(monitor)) is not None:
                    raise self._handshake_refused(status)
                if not sent and ready.get(sock, 0) & zmq.POLLOUT:
                    sent = self._send(req, wait=False)
                    if sent:
                        poller.modify(sock, zmq.POLLIN)
                elif sent and sock in ready:
                    return self._wait(req.rid)
            raise self._no_reply()
        finally:
            stop_watching(sock)
            self._watched = False

    def _call(self, req: p.Message, payload: Sequence[Any] = ()) -> Received:
        """Send a request and wait for its reply (unchecked: the core checks it)."""
        self._send(req, payload)
        return self._wait(req.rid)

    def _send(self, req: p.Message, payload: Sequence[Any] = (), wait: bool = True) -> bool:
        """Send a request whose reply ``_wait(req.rid)`` will read: replies to other
        requests read meanwhile are kept for their own ``_wait``.

        With no high-water mark a DEALER queues whatever its peer has not taken, but a
        socket with no connection to queue on (ZeroMQ dropped it: a handshake the
        daemon refused, a token expired by a reconnect) took a blocking send for good,
        whatever the timeout.  So the send never blocks: such a socket is waited on
        for the timeout, then UnavailableError (``wait`` False: False at once)."""
        if self._sock is None:
            raise KVStoreError("the client is closed")
        self._usable()
        header = p.encoder.encode(req)
        frames = [header, *payload] if payload else None
        self._claim()
        try:
            if self.drops:  # dropped unreleased (``client_drops``): given back first
                self._post_now(self._dropped_requests())
            if not self._send_frames(header, frames, wait):
                return False
            # awaited before another thread may read its reply (added after the socket
            # was let go, a reply read by then was dropped: its caller timed out)
            self._awaited.add(req.rid)
        finally:
            self._io.release()
        return True

    def _send_frames(self, header: bytes, frames: list[Any] | None = None,
                     wait: bool = True) -> bool:
        """``_send``'s send (the socket claimed): never blocking; a socket with no
        connection to queue on is waited on for the timeout (``wait``), then
        UnavailableError; False if not ``wait`` and nothing was sent."""
        sock = self._sock
        while True:
            try:
                if frames is not None:
                    sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                else:  # a header alone: one send (send_multipart checks every part)
                    sock.send(header, zmq.NOBLOCK)
                return True
            except zmq.Again:
                if not wait:
                    return False
                timeout = None if self.timeout < 0 else math.ceil(self.timeout * 1000)
                if not sock.poll(timeout, zmq.POLLOUT):
                    raise self._no_reply() from None

    def _claim(self) -> None:
        """Take the socket for this thread's send or receive, or refuse: another thread
        is in it."""
        if not self._io.acquire(blocking=False):
            raise KVStoreError("this client is in use by another thread: a Client serves "
                               "one thread at a time (open one per thread, or use "
                               "AsyncClient)")

    @contextmanager
    def _claimed(self) -> Iterator[None]:
        """The socket held by this thread across a change of a reservation's or a pin's
        state and the request that says so, so that a refusal (closed, another thread
        in a call) comes before the change: refused after it, a release or commit left
        the pins or slots held in the daemon and the object marked done, its retry a
        no-op (or "already committed")."""
        if self._sock is None:
            raise KVStoreError("the client is closed")
        self._usable()
        self._claim()
        try:
            yield
        finally:
            self._io.release()

    def _run(self, exchange: Exchange[T]) -> T:
        """Carry out a verb of several requests, one after the other."""
        return self._begin(exchange)()

    def _begin(self, exchange: Exchange[T]) -> Callable[[], T]:
        """``_run`` in two halves: the first request goes now; the call returned waits
        for its reply and carries out the rest.  Call it exactly once."""
        try:
            req, payload = next(exchange)
        except StopIteration as done:
            value: T = done.value
            return lambda: value
        self._send(req, payload)

        def finish() -> T:
            try:
                nxt, more = exchange.send(self._wait(req.rid))
                while True:
                    nxt, more = exchange.send(self._call(nxt, more))
            except StopIteration as done:
                result: T = done.value
                return result
        return finish

    def _post(self, req: p.Message) -> None:
        """Send a request whose reply nobody waits for (a release): it is read, and
        settled by the core, while waiting for a later reply, or at ``close``."""
        if self._sock is None:
            raise KVStoreError("the client is closed")
        self._usable()
        self._claim()
        try:
            self._post_unread(req)
        finally:
            self._io.release()

    def _post_unread(self, req: p.Message) -> None:
        sock = self._sock
        if self.drops:  # dropped unreleased (``client_drops``): given back first
            self._post_now(self._dropped_requests())
        # keep the backlog short: as many replies read as posted ones are unread, at
        # most (an endpoint that kept sending replies to nothing held the caller for good)
        for _ in range(len(self._unread)):
            if not self._unread or not sock.getsockopt(_EVENTS) & _POLLIN:
                break
            self._file(self._receive())
        header = self._posted(req)
        try:
            self._send_frames(header)
        except BaseException:
            self._unread.pop(req.rid, None)  # (not sent: no reply to wait for at close)
            raise

    def _wait(self, rid: int) -> Received:
        try:
            if rid in self._early:
                return self._early.pop(rid)
            if self._sock is None:  # closed since the request went (its reply is lost)
                raise KVStoreError("the client is closed")
            try:
                self._claim()
            except KVStoreError:
                with self._filing:  # the thread reading may be filing its reply now
                    if rid in self._early:  # filed since: it is this call's
                        return self._early.pop(rid)
                    self._abandon(rid)  # what its reply holds, if it comes, goes back
                raise
            try:
                if rid in self._early:  # filed by another thread since the check above
                    return self._early.pop(rid)
                return self._receive_for(rid)
            except BaseException:
                # Given up on (a timeout, the session gone, a KeyboardInterrupt): what
                # its reply holds goes back when it comes (an interrupted acquire's
                # pins were held for the life of the session, nobody left to release)
                self._abandon(rid)
                raise
            finally:
                self._io.release()
        finally:
            self._awaited.discard(rid)  # answered, or given up on (``_abandoned``)

    def _receive_for(self, rid: int) -> Received:
        """Read replies until ``rid``'s (others filed for their own waits)."""
        if self._receive_timeout != self.timeout:
            # a receive waits at most the timeout: one call per reply rather than a
            # poll and a receive (a poll builds a Poller each time)
            ms = int(self.timeout * 1000)
            self._sock.setsockopt(zmq.RCVTIMEO, -1 if ms < 0 else min(ms, _MAX_MS))
            self._receive_timeout = self.timeout
        # (each receive waits the timeout anew: replies to other requests coming one
        # after another, from a hostile endpoint, kept a caller waiting for good)
        until = time.monotonic() + self.timeout if self.timeout >= 0 else math.inf
        while True:
            try:
                received = self._receive()
            except zmq.Again:  # RCVTIMEO passed (given up on: ``_wait``)
                raise self._no_reply() from None
            if received[0].rid == rid or received[0].rid == 0:  # 0: the daemon could
                self._heard(received[0])                      # not tell whose it is
                return received
            self._file(received)
            if self._lost:  # the session is gone: no reply of ours will come
                self._usable()
            if time.monotonic() > until:
                raise self._no_reply()

    def _abandon(self, rid: int) -> None:
        # under ``_filing``: a refused thread gives its request up meanwhile (two
        # threads trimming the oldest of ``_abandoned`` at once took the same one)
        with self._filing:
            super()._abandon(rid)

    def _receive(self) -> Received:
        return decode_reply(receive(self._sock))

    def _file(self, received: Received) -> None:
        """Keep a reply that came before the one awaited; drop a posted request's, and
        give back what a reply to one given up on holds."""
        reply = received[0]
        self._heard(reply)
        with self._filing:  # decided apart from a refused ``_wait`` looking for its reply
            if reply.rid not in self._abandoned:
                if not self._settle(reply) and reply.rid in self._awaited:
                    # (a reply to no request awaited, ours answered already or never
                    # sent, is dropped: kept, an endpoint that answered each request
                    # again had them all kept for good, payloads and all)
                    self._early[reply.rid] = received
                return
            undo = self._give_back(reply)
        self._post_now(undo)

    def _post_now(self, reqs: list[p.Message]) -> None:
        """Post requests that give something back, the socket claimed, never waiting
        (replies are being read, or a call's request is about to go): with no
        connection to queue on, the daemon's lease takes it back, no reply awaited."""
        for sent, req in enumerate(reqs):
            if not self._send_frames(self._posted(req), wait=False):
                self._unread.pop(req.rid, None)
                log.warning("could not give %d request(s) back to the daemon: no "
                            "connection", len(reqs) - sent)
                return

    # -- verbs ----------------------------------------------------------------------------
    def namespace(self, identity: Identity) -> Namespace:
        """Open (or create) the namespace of an identity."""
        received = self._call(self._namespace_request(identity))
        return Namespace(self, identity, Namespace._opened(received))

    def stats(self) -> dict[str, Any]:
        return self._on_stats(self._call(self._stats_request()))

    def ping(self) -> None:
        """Renew this session's leases (reservations and pins)."""
        self._on_ok(self._call(self._ping_request()))

    def gpu_pool(self) -> Any:
        """The GPU tier's device pool, mapped into this process (a
        ``kvstore.tiers.gpu.PoolMapping``), or None (``gpu_reason`` says why).  Reloads
        use it by themselves once it is mapped."""
        req = self._gpu_request()
        return self._pool if req is None else self._on_gpu(self._call(req))

    def report(self, recomputed_tokens: int) -> None:
        """Tell the daemon (for its metrics) how many tokens the engine recomputed."""
        self._on_ok(self._call(self._report_request(recomputed_tokens)))

    def snapshot(self, page: int = SNAPSHOT_PAGE) -> p.SnapshotReply:
        """Every cached block the tenant may see, per tier: ``blocks`` of (key, parent,
        tier), parents first; start from it and apply the event batches after ``seq``.
        It comes in pages of at most ``page`` entries' worth (the daemon serves others
        between them), read here one after another; the store may change meanwhile,
        which those batches make good (``kvstore.routing`` says why)."""
        return self._run(self._snapshot_pages(page))

    def probe(self, keys: Sequence[bytes] = ()) -> p.ProbeReply:
        """What a router asks, of this daemon: the longest cached prefix of a key chain
        per tier (nothing touched), the wait ahead of a new transfer and the load
        bandwidth per tier (bytes a second, measured where the daemon has read enough).
        No keys: just the figures."""
        return check_reply(self._call(p.Probe(self._next_rid(), list(keys)))[0],
                           p.ProbeReply)

    def route(self, keys: Sequence[bytes], endpoints: Sequence[str], *,
              deadline: float = 0.05, prefill_rate: float = DEFAULT_PREFILL_RATE,
              tokens: int | None = None, block_tokens: int | None = None
              ) -> list[RouteResult]:
        """Ask the daemons at ``endpoints`` in parallel where the key chain is cached;
        their answers cheapest first, those that did not answer within ``deadline``
        seconds last (see ``kvstore.router``).  The connections stay for the next call."""
        key = tuple(endpoints)
        router = self._routers.pop(key, None)  # (back in as the most recently used)
        if router is None:
            router = Router(endpoints, tenant=self._tenant, token=self._token or None,
                            curve=self._curve)
            if len(self._routers) >= ROUTERS_KEPT:
                self._routers.pop(next(iter(self._routers))).close()
        self._routers[key] = router
        return router.route(keys, deadline=deadline, tokens=tokens,
                            block_tokens=block_tokens, prefill_rate=prefill_rate)

    def close(self) -> None:
        if self._forked:  # the parent's socket and context: left to the parent
            self._routers.clear()
            self._unmap()
            self._sock = None
            return
        # another thread in a call: it is out within its timeout (a receive waits that
        # long at most); closing the socket under it would not be safe, so past that the
        # client is left open (a warning), never an error from close
        if not self._io.acquire(timeout=self.timeout + CLOSE_WAIT_S if self.timeout >= 0
                                else -1):
            log.warning("a client not closed: another thread is still in a call")
            return
        try:
            self._close()
        finally:
            self._io.release()

    def _close(self) -> None:
        for router in self._routers.values():
            router.close()
        self._routers.clear()
        self._unmap()
        if self._sock is not None:
            # Posted releases must reach the daemon before the socket goes (it drops what
            # it has not sent), or their pins would stay until the session's lease ends.
            deadline = time.monotonic() + self._close_wait()
            try:
                self._post_now(self._dropped_requests())  # (the goodbye may go then)
                while self._unread and (left := deadline - time.monotonic()) > 0:
                    if not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                        break
                    self._file(self._receive())
            except (KVStoreError, zmq.ZMQError) as exc:
                log.warning("closing without the replies to posted releases: %s", exc)
            if self._watched:  # a connect failed before its hello: term would wait on it
                stop_watching(self._sock)
                self._watched = False
            self._sock.close(linger=say_bye(self._sock, self._bye_request()))
            self._sock = None
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Namespace(NamespaceCore[Client]):
    """An opened namespace: keys, lookup, reserve/commit, acquire/release, put/get."""

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        return self.client._run(self._lookup(keys))

    def _send_lookup(self, keys: Sequence[bytes]) -> Callable[[], LookupResult]:
        """``lookup`` in two halves (see ``_send_acquire``)."""
        return self.client._begin(self._lookup(keys))

    def lookup_pin(self, keys: Sequence[bytes]) -> tuple[LookupResult, Held | None]:
        """``lookup``, and the leading hits in DRAM pinned in the same round trip (None:
        nothing pinned); ``release()`` the pin as an acquire's.  A daemon that predates
        it refuses it as malformed (MalformedError): lookup and acquire instead."""
        return self._send_lookup_pin(keys)()

    def _send_lookup_pin(self, keys: Sequence[bytes]
                         ) -> Callable[[], tuple[LookupResult, Held | None]]:
        """``lookup_pin`` in two halves (see ``_send_acquire``)."""
        wait = self.client._begin(self._lookup_pin(keys))
        listed = list(keys)

        def reply() -> tuple[LookupResult, Held | None]:
            found = wait()
            if not found.pin:
                return found.found, None
            held = Held(self, listed)
            held._on_pinned(found)
            return found.found, held
        return reply

    def reserve(self, keys: Sequence[bytes], parent: bytes | None = None) -> Reservation:
        """Slots for every key (all or CapacityError); commit() publishes them."""
        r = Reservation(self, list(keys), self._parent(keys, parent))
        r._on_reserved(self.client._call(r._reserve_request()))
        return r

    def acquire(self, keys: Sequence[bytes]) -> Held:
        """Pin every key's block (NotFoundError if any is not cached); release() unpins."""
        held = Held(self, list(keys))
        held._on_acquired(self.client._call(held._acquire_request()))
        return held

    def _send_acquire(self, keys: Sequence[bytes]) -> Callable[[], Held]:
        """``acquire`` in two halves, for a caller that has work to do during the round
        trip: the request goes now; the call returned waits for the reply and gives the
        pins (or raises what ``acquire`` raises).  Call it exactly once: until then its
        reply is kept, and its pins held, by the client."""
        held = Held(self, list(keys))
        req = held._acquire_request()
        self.client._send(req)

        def reply() -> Held:
            held._on_acquired(self.client._wait(req.rid))
            return held
        return reply

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any],
            parent: bytes | None = None) -> int:
        """Store blocks through frames (reserve, write and commit in one step); new blocks."""
        return self.client._run(self._put(keys, blocks, parent))

    def get(self, keys: Sequence[bytes], verify: bool = True) -> list[bytes]:
        """The blocks' bytes (NotFoundError if any is not cached; CorruptError if one does
        not match the checksum it was written with)."""
        return self.client._run(self._get(keys, verify))

    def evict(self, keys: Sequence[bytes]) -> int:
        """Remove the keys' blocks and every block that hangs below them, but the pinned
        ones and their prefixes; returns how many entries went."""
        return self._on_count(self.client._call(self._evict_request(keys)))

    def keep_warm(self, keys: Sequence[bytes], seconds: float) -> int:
        """Soft-pin blocks for ``seconds``: eviction takes them last.  Returns how many."""
        return self._on_count(self.client._call(self._warm_request(keys, seconds)))

    def prefetch(self, keys: Sequence[bytes], *, wait: bool = False,
                 timeout: float | None = None) -> PrefetchResult:
        """Bring blocks up to DRAM ahead of use: best effort (returns at once), or wait
        (until done, or ``timeout`` seconds); the result is a usable prefix."""
        return self._on_prefetch(self.client._call(self._prefetch_request(keys, wait, timeout)))

    def post_prefetch(self, keys: Sequence[bytes]) -> None:
        """A best-effort ``prefetch`` without waiting for its reply (a refusal is only
        logged): for a caller on a path where a round trip counts."""
        self.client._post(self._prefetch_request(keys, False, None))

    def reserve_batch(self, plan: Sequence[PlanItem]) -> BatchResult[Reservation]:
        """Reserve the blocks of a token plan, all or none (CapacityError is not raised:
        the result says which requests would fit)."""
        received = self.client._call(self._reserve_batch_request(plan))
        return self._on_reserve_batch(plan, received, lambda keys: Reservation(self, keys))

    def offload(self, kv_caches: Any, page_ids: Sequence[int], keys: Sequence[bytes], *,
                layout: str = "per_layer", parent: bytes | None = None) -> int:
        """Store an engine's pages under ``keys`` (cached leading keys are skipped).

        ``kv_caches`` is the engine's paged cache in ``layout`` (see ``kvstore.kernels``);
        page ``page_ids[i]`` holds the block of ``keys[i]``.  Returns blocks stored.
        """
        self._check_pages(kv_caches, page_ids, keys, layout)
        hit = self.lookup(keys).blocks
        if hit == len(keys):
            return 0
        with self.reserve(keys[hit:], parent=keys[hit - 1] if hit else parent) as r:
            self._gather(kv_caches, page_ids[hit:], r, layout)
            return r.commit()

    def reload(self, keys: Sequence[bytes], kv_caches: Any, page_ids: Sequence[int], *,
               layout: str = "per_layer") -> int:
        """Copy the blocks of ``keys`` into the engine's pages (NotFoundError if any is
        missing, and then no page is written).  Returns blocks loaded."""
        self._check_pages(kv_caches, page_ids, keys, layout)
        if not keys:
            return 0
        self.client._pin_arena(self.arena, kv_caches)
        with self.acquire(keys) as held:
            self._scatter(held, kv_caches, page_ids, layout)
        return len(keys)

    def close(self) -> None:
        """Stop using the namespace in this session (its blocks stay; open it again to
        use it): a session opens at most ``server.max_namespaces_per_session`` at once.
        Refused (``LimitExceededError``) while a reservation of this session in it is
        open.  This object's requests are refused after it (``UnknownNamespaceError``)."""
        self.client._on_ok(self.client._call(p.CloseNamespace(self.client._next_rid(), self.id)))

    def drop(self) -> int:
        """Drop every unpinned block of this namespace that was there when the drop
        was asked for; returns how many entries it removed.  What is committed into the
        namespace after that (while the daemon waits for this session's get replies
        still being sent, behind another removal of it, or between its slices) is kept,
        with its prefixes, and not counted."""
        return self._on_count(self.client._call(self._drop_request()))


class Reservation(ReservationCore[Namespace]):
    """Reserved slots: write ``buffers``, then ``commit()``; leaving a ``with`` aborts."""

    def commit(self) -> int:
        """Publish the blocks; returns how many were new (the rest were cached already)."""
        client = self.ns.client
        with client._claimed():
            req = self._commit_request()
            client._send(req)
        return self._on_commit(client._wait(req.rid))

    def abort(self) -> None:
        """Return the slots (nothing to do once committed or aborted)."""
        if self.done or not self.reserved:
            return  # (nothing to do: not refused for a client closed since)
        client = self.ns.client
        with client._claimed():
            req = self._abort_request()
            if req is None:
                return
            client._send(req)
        client._on_ok(client._wait(req.rid))

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.done and self.ns.client._sock is not None:
            if exc is None:
                self.abort()
                return
            try:  # the body's own error comes through, not the abort's (the lease
                self.abort()  # rolls the reservation back where the abort did not)
            except KVStoreError as failed:
                log.warning("aborting a reservation after %s failed: %s",
                            type(exc).__name__, failed)


class Held(HeldCore[Namespace]):
    """Pinned blocks: read-only ``buffers`` in the arena until ``release()``."""

    def release(self) -> None:
        """Unpin, without a round trip: done before this client's next request."""
        if self.released or not self.acquired:
            return  # (nothing to do: not refused for a client closed since)
        client = self.ns.client
        with client._claimed():
            req = self._release_request()
            if req is not None:
                client._post(req)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.ns.client._sock is None:
            return
        if exc is None:
            self.release()
            return
        try:  # the body's own error comes through, not the release's (a session gone
            self.release()  # took its pins with it)
        except KVStoreError as failed:
            log.warning("releasing pins after %s failed: %s", type(exc).__name__, failed)
