"""The daemon: a ZeroMQ ROUTER on an asyncio (uvloop) loop, wiring the store and the arena.

The socket is a plain non-blocking zmq socket drained from the loop's reader callback on
its file descriptor (cheaper than zmq.asyncio).  ZeroMQ's descriptor is edge-triggered,
so every drain reads until the socket says it has nothing more.  Each request gets
exactly one reply; every failure becomes a typed error reply and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import secrets
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvstore import protocol as p
from kvstore.auth import Auth
from kvstore.config import SECTIONS, Config, parse_size
from kvstore.errors import (
    CapacityError,
    ForbiddenError,
    KVStoreError,
    LeaseExpiredError,
    LimitExceededError,
    MalformedError,
    NotFoundError,
    TooLargeError,
    UnavailableError,
    UnknownNamespaceError,
    VersionMismatchError,
)
from kvstore.gpu_mover import GpuMover
from kvstore.metrics import Metrics, stats_on_loop
from kvstore.remote import RemoteTier
from kvstore.scheduler.admission import PolicyChain
from kvstore.scheduler.queues import TransferKind
from kvstore.sdnotify import Notifier
from kvstore.store import (
    Block,
    BlockStore,
    DemotionNeeded,
    Limits,
    Namespace,
    Pin,
    PromotionNeeded,
    Reservation,
)
from kvstore.tiering import SsdMover
from kvstore.tiers.dram import Arenas, DramArena, sweep_stale_arenas
from kvstore.transfers import TransferGate, serving

log = logging.getLogger("kvstore.server")

_DRAIN_BATCH = 256
_GET_OWNER = ("daemon", "get")  # pins held while zero-copy get frames are in flight


@dataclass(eq=False)
class Session:
    id: str
    tenant: str
    namespaces: set[bytes] = field(default_factory=set)
    tokens: float = 0.0          # request-rate bucket
    refilled: float = 0.0
    bytes_in_flight: int = 0     # payload held by requests still moving between tiers

    def __repr__(self) -> str:
        return f"Session({self.id[:8]}, tenant={self.tenant}, namespaces={len(self.namespaces)})"


Outcome = tuple[p.Message, list[Any]]


class Server:
    """The kvstore daemon.  ``await serve()`` runs it until ``stop()``."""

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        s = config.server
        self.limits = Limits(
            lease_seconds=s.lease_seconds,
            max_reservations_per_owner=s.max_reservations_per_session,
            max_pins_per_owner=s.max_pins_per_session,
        )
        self.max_keys = s.max_keys_per_request
        self.max_request_bytes = config.max_request_bytes
        self.max_bytes_in_flight = parse_size(s.max_bytes_in_flight,
                                              "server.max_bytes_in_flight")
        self.max_tenant_bytes_in_flight = parse_size(s.max_bytes_in_flight_per_tenant,
                                                     "server.max_bytes_in_flight_per_tenant")
        self._tenant_buckets: dict[str, list[float]] = {}  # tenant -> [tokens, refilled]
        self._tenant_bytes: dict[str, int] = {}
        self.store = BlockStore(config.dram_capacity, config.dram_slab_bytes,
                                limits=self.limits, eviction_policy=config.dram.eviction_policy,
                                per_tenant=config.dram.per_tenant_arenas,
                                ssd_capacity=config.ssd_capacity,
                                ssd_slab_bytes=config.ssd_slab_bytes,
                                ssd_admit_after=config.ssd.admit_after,
                                tenant_quota=config.tenant_quota,
                                tenant_weights=config.server.tenant_weights)
        self.store.pressure = PolicyChain(tuple(config.dram.pressure)).steps  # type: ignore[arg-type]
        self.defer = "defer" in config.dram.pressure
        self._deferred: collections.deque[asyncio.Future[None]] = collections.deque()
        self.scheduling = {"defers": 0, "defer_timeouts": 0, "rejects": 0,
                           "recomputed_tokens": 0}
        self.arenas: Arenas | None = None
        self.ssd: SsdMover | None = None
        self.remote: RemoteTier | None = None
        self.gpu: GpuMover | None = None
        self.gpu_reason = ""  # why the configured GPU tier is off
        self.transfers = TransferGate(config.server.max_transfers_in_flight,
                                      weights=config.server.tenant_weights, metrics=metrics)
        self.sessions: dict[bytes, Session] = {}  # routing id -> session
        self._by_session_id: dict[str, Session] = {}
        self._expired: dict[bytes, None] = {}
        self._in_flight_gets: list[tuple[zmq.MessageTracker, int]] = []
        self._reap_timer = False
        self.invariant_violations = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None  # the first socket; None once closed
        self._socks: list[zmq.Socket[bytes]] = []
        self._sock_curve: list[bool] = []
        self._fds: list[int] = []
        self.auth = Auth(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.endpoints: list[str] = []
        self.handlers: dict[type[Any], Callable[[Session, Any, list[Any]], Outcome]] = {
            p.OpenNamespace: self._open,
            p.Lookup: self._lookup,
            p.Reserve: self._reserve,
            p.Commit: self._commit,
            p.Abort: self._abort,
            p.Acquire: self._acquire,
            p.Release: self._release,
            p.Put: self._put,
            p.Get: self._get,
            p.Evict: self._evict,
            p.DropNamespace: self._drop,
            p.Stats: self._stats,
            p.Ping: self._ping,
            p.Warm: self._warm,
            p.Prefetch: self._prefetch,
            p.ReserveBatch: self._reserve_batch,
            p.Report: self._report,
            p.GpuAttach: self._gpu_attach,
        }
        verb_types: list[type[Any]] = [p.Hello, *self.handlers]
        self._verbs = {t: str(t.__struct_config__.tag) for t in verb_types}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the arena and bind the sockets (synchronous; the loop must be running)."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        d = self.config.dram
        sweep_stale_arenas(d.directory)
        self.arenas = Arenas(self.config.dram_capacity, d.directory, populate=d.populate,
                             max_arenas=d.max_arenas)
        if not d.per_tenant_arenas:
            self.arenas.get("")  # the one arena, made (and its pages touched) at start-up
        if self.config.ssd_capacity:
            try:
                self.ssd = SsdMover(self.config, self.store, self.slot, self.transfers)
                restored = self.ssd.restore()
                self.ssd.metrics = self.metrics
            except BaseException:
                self.arenas.close()
                raise
            log.info("ssd tier: %d blocks restored from %s", restored, self.config.ssd_path)
        if self.config.remote.url or self.config.remote.backend:
            try:
                self.remote = RemoteTier(self.config, self.store, self.slot,
                                         self.reserve_moving, self.transfers)
                if self.ssd is not None and self.remote.write_back:
                    self.ssd.remote_writer = self.remote.demote
                    self.remote.on_written = self.ssd.room_freed
                    self.ssd.on_written = self.remote.ssd_written
                    self.remote.ssd_read = self.ssd.read_copies
                    self.remote.on_ssd_dropped = self.ssd.removed
                    self._loop.call_soon(self.remote.ssd_written)  # restored ones, too
            except BaseException:
                if self.ssd is not None:
                    self.ssd.close()
                self.arenas.close()
                raise
        if self.config.gpu.device:
            self._start_gpu()
        self._ctx = zmq.Context()
        endpoints = [self.config.endpoint, *self.config.server.extra_endpoints]
        curve = self.auth.curve_enabled
        groups = [[e for e in endpoints if not (curve and e.startswith("tcp://"))]]
        if curve:
            groups.append([e for e in endpoints if e.startswith("tcp://")])
        for i, group in enumerate(groups):
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_request_bytes + p.MAX_HEADER_BYTES)
            if i == 1:
                self.auth.make_curve_server(self._ctx, sock)
            for endpoint in group:
                self.endpoints.append(self._bind(sock, endpoint))
            self._socks.append(sock)
            self._sock_curve.append(i == 1)
            fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
            self._fds.append(fd)
            self._loop.add_reader(fd, self._drain, i)
            self._loop.call_soon(self._drain, i)
        self._sock = self._socks[0]
        self._schedule_reaper()
        self.store.touch_owner(_GET_OWNER, math.inf)

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str) -> str:
        if endpoint.startswith("ipc://"):
            path = Path(endpoint[len("ipc://"):])
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if path.exists():
                if _socket_alive(endpoint):
                    raise KVStoreError(f"another daemon is serving {endpoint}")
                path.unlink()
        sock.bind(endpoint)
        bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)
        return bound

    async def serve(self, on_ready: Callable[[Server], None] | None = None) -> None:
        self.start()
        if on_ready is not None:
            on_ready(self)
        assert self._stopped is not None
        await self._stopped.wait()
        await self.drain()
        self.close()

    def _start_gpu(self) -> None:
        """The GPU tier, or a logged reason why it is off (no device here)."""
        assert self.arenas is not None
        shared = self.arenas.by_name.get("")
        try:
            self.gpu = GpuMover(self.config, self.store, self.slot, self.transfers,
                                arena=shared.buffer if shared is not None else None)
        except UnavailableError as exc:
            self.gpu_reason = str(exc)
            log.warning("gpu tier off: %s", exc)
        except BaseException:
            if self.ssd is not None:
                self.ssd.close()
            self.arenas.close()
            raise

    async def drain(self, bound: float = 30.0) -> None:
        """Stop taking requests, let those under way finish (within ``bound`` seconds),
        flush writes to SSD and sync its index."""
        if self._sock is not None and self._loop is not None:
            for fd in self._fds:
                self._loop.remove_reader(fd)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=bound)
        if self.remote is not None:
            try:
                await asyncio.wait_for(self.remote.stop_copying_ssd(), bound)
                await asyncio.wait_for(self.remote.drain(), bound)
                flushed = await asyncio.wait_for(self.remote.flush(), bound)
                if flushed:
                    log.info("wrote %d blocks back to the remote store on the way out",
                             flushed)
            except TimeoutError:
                log.error("remote writes still under way at exit were dropped")
            await self.remote.close()
        if self.gpu is not None:
            try:
                await asyncio.wait_for(self.gpu.drain(), bound)
            except TimeoutError:
                log.error("copies into the gpu tier still under way at exit were dropped")
        if self.ssd is not None:
            try:
                await asyncio.wait_for(self.ssd.drain(), bound)
            except (TimeoutError, KVStoreError) as exc:
                log.error("could not flush the ssd tier on the way out: %r", exc)

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    def close(self) -> None:
        for owner in list(self.store.owners):
            self.store.drop_owner(owner)
        if self._sock is not None and self._loop is not None:
            for fd, sock in zip(self._fds, self._socks):
                self._loop.remove_reader(fd)
                sock.close(linger=0)
            for endpoint in self.endpoints:
                if endpoint.startswith("ipc://"):
                    try:
                        os.unlink(endpoint[len("ipc://"):])
                    except FileNotFoundError:
                        pass
        self.auth.close()
        if self._ctx is not None:
            self._ctx.term()
        if self.ssd is not None:
            self.ssd.close()
            self.ssd = None
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        if self.arenas is not None:
            self.arenas.close()
        self._sock = None

    # -- socket plumbing --------------------------------------------------------------------
    def _drain(self, index: int = 0) -> None:
        if self._sock is None:
            return
        sock = self._socks[index]
        for _ in range(_DRAIN_BATCH):
            events: int = sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
            if not events & zmq.POLLIN:
                break
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._on_message(frames, index)
        else:
            assert self._loop is not None
            self._loop.call_soon(self._drain, index)  # more waiting: yield to others first
        self._reap_sends()

    def _send(self, peer: bytes, reply: p.Message, payload: list[Any]) -> None:
        """Reply to ``peer``: the socket's index byte, then the peer's routing id."""
        if self._sock is None:
            return
        sock, routing_id = self._socks[peer[0]], peer[1:]
        header = p.encoder.encode(reply)
        try:
            if payload:
                if isinstance(payload, PinnedFrames):
                    tracker = sock.send_multipart([routing_id, header, *payload], copy=False,
                                                  track=True)
                    assert tracker is not None, "track=True returns a tracker"
                    self._in_flight_gets.append((tracker, payload.pin))
                    self._reap_sends()
                else:
                    sock.send_multipart([routing_id, header, *payload], copy=False)
            else:
                sock.send_multipart([routing_id, header], copy=False)
        except zmq.ZMQError as exc:
            log.warning("dropping a reply to a gone peer: %s", exc)
            if isinstance(payload, PinnedFrames):
                self.store.release(_GET_OWNER, payload.pin)
        # ZeroMQ's descriptor is edge-triggered: a send may take in messages that arrived
        # meanwhile and clear the edge, and a reply sent from a task (not from the drain)
        # would then leave them waiting with no wake-up.  Drain again if any are queued.
        events: int = sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
        if events & zmq.POLLIN and self._loop is not None:
            self._loop.call_soon(self._drain, peer[0])

    def _reap_sends(self) -> None:
        """Drop the pins of get replies that zmq has finished sending."""
        if not self._in_flight_gets:
            return
        pending = []
        for tracker, pin_id in self._in_flight_gets:
            if tracker.done:
                self.store.release(_GET_OWNER, pin_id)
            else:
                pending.append((tracker, pin_id))
        if self._deferred and len(pending) < len(self._in_flight_gets):
            self._wake_deferred()
        self._in_flight_gets = pending
        if pending and not self._reap_timer and self._loop is not None:
            self._reap_timer = True
            # uvloop rounds delays down to whole milliseconds: less than 1 ms would spin
            self._loop.call_later(0.001, self._reap_timer_fired)

    def _reap_timer_fired(self) -> None:
        self._reap_timer = False
        self._reap_sends()

    # -- dispatch ------------------------------------------------------------------------------
    def _on_message(self, frames: list[zmq.Frame], index: int = 0) -> None:
        start = time.perf_counter()
        verb, tenant, code = "invalid", "", None
        # peers of different sockets may share routing ids: key them by socket too
        routing_id = bytes((index,)) + frames[0].bytes
        if len(frames) < 2:
            self._send(routing_id, p.ErrorReply(0, MalformedError.code,
                                                "a request needs a header frame"), [])
            return
        header = frames[1].buffer
        rid = 0
        try:
            if len(header) > p.MAX_HEADER_BYTES:
                raise TooLargeError(f"header of {len(header)} bytes; the limit is "
                                    f"{p.MAX_HEADER_BYTES}")
            try:
                request = p.request_decoder.decode(header)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError,
                    UnicodeDecodeError) as exc:
                rid = p.request_id_of(bytes(header))
                raise MalformedError(f"bad request header: {exc}") from None
            rid = request.rid
            verb = self._verbs[type(request)]
            if isinstance(request, p.Hello):
                tenant = request.tenant
                curve_tenant = (str(frames[1].get("User-Id")) if self._sock_curve[index]
                                else None)
                reply, payload = self._hello(routing_id, request, curve_tenant)
            else:
                session = self._session(routing_id)
                tenant = session.tenant
                if not isinstance(request, _NEVER_LIMITED):
                    self._admit(session)  # a release or abort frees; it is never refused
                self.store.touch_owner(session.id, self.clock())
                handler = self.handlers[type(request)]
                with serving(_TRANSFER_KIND.get(verb, TransferKind.WRITEBACK), tenant):
                    try:
                        try:
                            reply, payload = self._attempt(handler, session, request,
                                                           frames[2:], verb, early=True)
                        except CapacityError as exc:
                            if not self.defer or verb not in _DEFERRABLE:
                                raise
                            raise self._defer(tenant, exc) from None
                    except (DemotionNeeded, PromotionNeeded, RemoteFetch, RemoteLookup,
                            Deferred, Later) as plan:
                        # The bytes must move between tiers first: finish in a task.
                        held = sum(len(f) for f in frames[2:])
                        if session.bytes_in_flight + held > self.max_bytes_in_flight:
                            raise LimitExceededError(
                                f"the session has {session.bytes_in_flight} bytes in requests "
                                f"still under way (limit {self.max_bytes_in_flight}); wait for "
                                f"their replies") from None
                        tenant_held = self._tenant_bytes.get(session.tenant, 0)
                        if (self.max_tenant_bytes_in_flight
                                and tenant_held + held > self.max_tenant_bytes_in_flight):
                            raise LimitExceededError(
                                f"tenant {session.tenant!r} has {tenant_held} bytes in requests "
                                f"still under way (limit {self.max_tenant_bytes_in_flight})"
                            ) from None
                        session.bytes_in_flight += held
                        self._tenant_bytes[session.tenant] = tenant_held + held
                        self._spawn(self._finish_later(
                            routing_id, rid, verb, tenant, start, handler, session, request,
                            frames[2:], plan))
                        return
        except KVStoreError as exc:
            code = exc.code
            reply, payload = p.ErrorReply(rid, exc.code, str(exc)), []
            if isinstance(exc, CapacityError):
                self._rejected(tenant, exc)
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("internal error handling a request",
                          extra={"rid": rid, "verb": verb, "tenant": tenant})
            code = "internal"
            reply, payload = p.ErrorReply(rid, "internal", f"internal error: {exc!r}"), []
        self._send(routing_id, reply, payload)
        if code is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("%s failed: %s", verb, code, extra={"rid": rid, "verb": verb,
                                                         "tenant": tenant})
        if self.store.dropped_ssd and self.ssd is not None:
            self.ssd.removed(self.store.dropped_ssd)
            self.store.dropped_ssd = []
        if self._deferred and verb in _FREES_ROOM:
            self._wake_deferred()
        if self.metrics is not None:
            self.metrics.observe_request(verb, time.perf_counter() - start, code, tenant)
        if self.config.server.debug_invariants:
            self.check_invariants()

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        assert self._loop is not None
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _defer(self, tenant: str, exc: CapacityError) -> Deferred:
        """No room now: wait for some, in order, until the deferral's deadline."""
        self.scheduling["defers"] += 1
        if self.metrics is not None:
            self.metrics.observe_defer("dram", tenant)
        return Deferred(self.clock() + self.config.dram.defer_seconds, str(exc))

    async def _finish_later(self, routing_id: bytes, rid: int, verb: str, tenant: str,
                            start: float, handler: Callable[[Session, Any, list[Any]], Outcome],
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
                    if isinstance(plan, Deferred) or not self.defer or verb not in _DEFERRABLE:
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
        held = sum(len(f) for f in payload)
        session.bytes_in_flight -= held
        self._tenant_bytes[session.tenant] = self._tenant_bytes.get(session.tenant, 0) - held
        self._send(routing_id, reply, out)
        if self.metrics is not None:
            self.metrics.observe_request(verb, time.perf_counter() - start, code, tenant)
        if self.config.server.debug_invariants:
            self.check_invariants()

    def _rejected(self, tenant: str, exc: CapacityError) -> None:
        self.scheduling["rejects"] += 1
        if self.metrics is not None:
            self.metrics.observe_reject("dram", tenant, exc.cause)

    def _attempt(self, handler: Callable[[Session, Any, list[Any]], Outcome],
                 session: Session, request: Any, payload: list[Any], verb: str, *,
                 early: bool) -> Outcome:
        """Run a handler; ``early``: a request that may still defer makes room only by
        the pressure steps before "defer"."""
        self.store.early = early and self.defer and verb in _DEFERRABLE
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

    def _admit(self, session: Session) -> None:
        """Request rates, per session and per tenant, as token buckets (a burst of one
        second's worth each)."""
        s = self.config.server
        now = self.clock()
        rate = s.max_requests_per_second
        if rate:
            session.tokens = min(rate, session.tokens + (now - session.refilled) * rate)
            session.refilled = now
            if session.tokens < 1.0:
                raise LimitExceededError(
                    f"more than {rate:g} requests per second from this session; slow down")
        tenant_rate = s.max_requests_per_second_per_tenant
        if tenant_rate:
            bucket = self._tenant_buckets.setdefault(session.tenant, [tenant_rate, now])
            bucket[0] = min(tenant_rate, bucket[0] + (now - bucket[1]) * tenant_rate)
            bucket[1] = now
            if bucket[0] < 1.0:
                raise LimitExceededError(
                    f"more than {tenant_rate:g} requests per second from tenant "
                    f"{session.tenant!r}; slow down")
            bucket[0] -= 1.0
        if rate:
            session.tokens -= 1.0

    def _tenant_cap(self, session: Session, what: str) -> None:
        """Per-tenant caps on open reservations and pins, over all its sessions."""
        s = self.config.server
        cap = s.max_reservations_per_tenant if what == "reservations" else s.max_pins_per_tenant
        if not cap:
            return
        held = sum(len(getattr(self.store.owners[x.id], what))
                   for x in self._by_session_id.values()
                   if x.tenant == session.tenant and x.id in self.store.owners)
        if held >= cap:
            raise LimitExceededError(
                f"tenant {session.tenant!r} holds {held} {what} (limit {cap}); "
                f"release some")

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

    def reload(self, new: Config) -> list[str]:
        """Apply the settings that can change live; returns those that need a restart."""
        old, s = self.config, new.server
        self.limits = Limits(lease_seconds=s.lease_seconds,
                             max_reservations_per_owner=s.max_reservations_per_session,
                             max_pins_per_owner=s.max_pins_per_session)
        self.store.limits = self.limits
        self.max_keys = s.max_keys_per_request
        self.store.ssd_admit_after = new.ssd.admit_after
        from kvstore.logs import configure

        configure(s.log_level, s.log_format)
        live = {("server", f) for f in ("lease_seconds", "max_keys_per_request",
                                        "max_reservations_per_session", "max_pins_per_session",
                                        "log_level", "log_format", "debug_invariants",
                                        "max_requests_per_second", "max_reservations_per_tenant",
                                        "max_pins_per_tenant",
                                        "max_requests_per_second_per_tenant")}
        live.add(("ssd", "admit_after"))
        restart = []
        for section in SECTIONS:
            before = msgspec.structs.asdict(getattr(old, section))
            after = msgspec.structs.asdict(getattr(new, section))
            for field, value in after.items():
                if before[field] != value and (section, field) not in live:
                    restart.append(f"{section}.{field}")
        self.config = _merge_live(old, new)
        return restart

    def arena_for(self, tenant: str) -> DramArena:
        """The arena a tenant's blocks live in (its own, with per-tenant arenas)."""
        assert self.arenas is not None
        return self.arenas.get(self.store.arena_of(tenant))

    def slot(self, ns: Namespace, offset: int) -> memoryview:
        """A block's DRAM slot in its arena."""
        return self.arena_for(ns.tenant).slot(offset, ns.block_bytes)

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
        return p.LookupReply(plan.rid, len(tiers), _runs(tiers))

    def check_invariants(self) -> bool:
        """Run the store's checker; a violation is logged and counted, never fatal."""
        try:
            self.store.check_invariants()
        except AssertionError as exc:
            self.invariant_violations += 1
            log.error("invariant violated: %s", exc)
            return False
        return True

    def _session(self, routing_id: bytes) -> Session:
        session = self.sessions.get(routing_id)
        if session is None:
            if routing_id in self._expired:
                raise LeaseExpiredError(
                    "this session's lease ran out and its holdings were rolled back; "
                    "connect again")
            raise ForbiddenError("no session: the first request must be hello")
        return session

    def _namespace(self, session: Session, ns_id: bytes) -> Namespace:
        if ns_id not in session.namespaces:
            raise UnknownNamespaceError("namespace not opened in this session; open it first")
        return self.store.namespaces[ns_id]

    def _check_keys(self, keys: list[bytes]) -> None:
        # Each key's length was checked by the decoder; the count is a setting.
        if len(keys) > self.max_keys:
            raise TooLargeError(f"{len(keys)} keys in one request; the limit is {self.max_keys}")

    # -- verbs ---------------------------------------------------------------------------------
    def _hello(self, routing_id: bytes, req: p.Hello, curve_tenant: str | None) -> Outcome:
        if req.version != p.PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"client speaks protocol {req.version}, daemon speaks {p.PROTOCOL_VERSION}; "
                f"upgrade the older side")
        tenant = self.auth.tenant_of(req.tenant, req.token, curve_tenant)
        if routing_id in self.sessions:
            raise ForbiddenError("this connection already has a session; a second hello is "
                                 "refused (connect again for a new one)")
        if req.attach:
            session = self._by_session_id.get(req.attach)
            if session is None or session.tenant != tenant:
                raise ForbiddenError("no such session to attach to")
        else:
            session = Session(secrets.token_hex(16), tenant)
            self._by_session_id[session.id] = session
        self.sessions[routing_id] = session
        self.store.touch_owner(session.id, self.clock())
        arena = self.arena_for(session.tenant)
        return p.HelloReply(
            req.rid, p.PROTOCOL_VERSION, session.id, session.tenant, arena.path,
            arena.capacity_bytes, self.limits.lease_seconds, self.max_keys,
            self.max_request_bytes), []

    def _open(self, session: Session, req: p.OpenNamespace, payload: list[Any]) -> Outcome:
        identity = req.identity
        if not self.auth.may_open(session.tenant, identity.tenant):
            raise ForbiddenError(
                f"session of tenant {session.tenant!r} cannot open a namespace of tenant "
                f"{identity.tenant!r}")
        if identity.block_bytes > self.max_request_bytes:
            raise TooLargeError(f"blocks of {identity.block_bytes} bytes exceed the request "
                                f"limit of {self.max_request_bytes}")
        known = identity.namespace_id in self.store.namespaces
        ns = self.store.open_namespace(identity)
        if not known and self.ssd is not None:
            self.ssd.remember_namespace(identity)
        session.namespaces.add(ns.id)
        arena = self.arena_for(identity.tenant)
        return p.NamespaceReply(req.rid, ns.id, ns.block_bytes, ns.cls.slot_bytes,
                                arena.path, arena.capacity_bytes), []

    def _lookup(self, session: Session, req: p.Lookup, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        tiers = self.store.lookup(ns, req.keys)
        hits = len(tiers)
        if self.remote is not None and hits < len(req.keys) and self.remote.healthy:
            raise RemoteLookup(req.rid, ns, req.keys, tiers)
        if self.metrics is not None:
            bt = ns.identity.block_tokens
            self.metrics.observe_lookup_tokens(self.store.tier, session.tenant, hits * bt,
                                               (len(req.keys) - hits) * bt)
        return p.LookupReply(req.rid, hits, _runs(tiers)), []

    def _reserve(self, session: Session, req: p.Reserve, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        self._tenant_cap(session, "reservations")
        r = self._reserve_slots(session, ns, req.keys, req.parent)
        return p.ReserveReply(req.rid, r.id, r.offsets, self.limits.lease_seconds), []

    def _reserve_slots(self, session: Session, ns: Namespace, keys: list[bytes],
                       parent: bytes | None) -> Reservation:
        try:
            return self.store.reserve(session.id, ns, keys, parent, self.clock())
        except CapacityError:
            if not self._in_flight_gets:
                raise
        # Blocks of get replies stay pinned until zmq has sent them, which a client that
        # already holds the reply can outrun by a few microseconds: wait for those sends
        # once, briefly, before refusing.
        for tracker, _ in self._in_flight_gets:
            try:
                tracker.wait(0.005)
            except zmq.NotDone:
                pass
        self._reap_sends()
        return self.store.reserve(session.id, ns, keys, parent, self.clock())

    def _commit(self, session: Session, req: p.Commit, payload: list[Any]) -> Outcome:
        result = self.store.commit(session.id, req.reservation, self.clock(), req.checksums)
        self._committed(result.blocks)
        return p.CommitReply(req.rid, result.created, result.duplicates), []

    def _committed(self, blocks: list[Block]) -> None:
        if self.ssd is not None:
            self.ssd.committed(blocks)
        if self.remote is not None:
            self.remote.committed(blocks)
        if self.gpu is not None:
            self.gpu.wanted(blocks)

    def _abort(self, session: Session, req: p.Abort, payload: list[Any]) -> Outcome:
        self.store.abort(session.id, req.reservation)
        return p.OkReply(req.rid), []

    def _acquire(self, session: Session, req: p.Acquire, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        self._tenant_cap(session, "pins")
        pin = self._acquire_or_fetch(session.id, ns, req.keys)
        gpu_offsets: list[int] = []
        if self.gpu is not None and self.store.gpu is not None:
            gpu_offsets = self.store.gpu.offsets(pin.blocks)
            if -1 in gpu_offsets:
                self.gpu.wanted(pin.blocks)  # used again: worth a copy on the GPU
        return p.AcquireReply(req.rid, pin.id, pin.offsets, pin.checksums, gpu_offsets), []

    def _acquire_or_fetch(self, owner: object, ns: Namespace, keys: list[bytes]) -> Pin:
        try:
            return self.store.acquire(owner, ns, keys, self.clock())
        except NotFoundError:
            if self.remote is None or not self.remote.healthy:
                raise
            raise RemoteFetch(ns, keys) from None

    def _release(self, session: Session, req: p.Release, payload: list[Any]) -> Outcome:
        self.store.release(session.id, req.pin)
        return p.OkReply(req.rid), []

    def _put(self, session: Session, req: p.Put, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        if len(req.keys) * ns.block_bytes > self.max_request_bytes:
            raise TooLargeError(f"put of {len(req.keys)} blocks exceeds the request limit of "
                                f"{self.max_request_bytes} bytes; split it")
        if len(payload) != len(req.keys):
            raise MalformedError(f"put of {len(req.keys)} keys carries {len(payload)} frames")
        if req.checksums and len(req.checksums) != len(req.keys):
            raise MalformedError(f"put of {len(req.keys)} keys carries {len(req.checksums)} "
                                 f"checksums")
        for i, frame in enumerate(payload):
            if len(frame) != ns.block_bytes:
                raise MalformedError(f"frame {i} holds {len(frame)} bytes; a block of this "
                                     f"namespace is {ns.block_bytes}")
        now = self.clock()
        r = self._reserve_slots(session, ns, req.keys, req.parent)
        try:
            view, size = self.arena_for(ns.tenant).view, ns.block_bytes
            for offset, frame in zip(r.offsets, payload):
                view[offset:offset + size] = frame.buffer
        except BaseException:
            self.store.abort(session.id, r.id)
            raise
        result = self.store.commit(session.id, r.id, now, req.checksums)
        self._committed(result.blocks)
        return p.PutReply(req.rid, result.created, result.duplicates), []

    def _get(self, session: Session, req: p.Get, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        if len(req.keys) * ns.block_bytes > self.max_request_bytes:
            raise TooLargeError(f"get of {len(req.keys)} blocks exceeds the request limit of "
                                f"{self.max_request_bytes} bytes; split it")
        pin = self._acquire_or_fetch(_GET_OWNER, ns, req.keys)
        size, arena = ns.block_bytes, self.arena_for(ns.tenant)
        frames = [arena.slot(offset, size) for offset in pin.offsets]
        if not frames:
            self.store.release(_GET_OWNER, pin.id)
            return p.GetReply(req.rid, 0), []
        return p.GetReply(req.rid, len(frames), pin.checksums), PinnedFrames(frames, pin.id)

    def _evict(self, session: Session, req: p.Evict, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        count, removed = self.store.evict(ns, req.keys)
        if self.ssd is not None:
            self.ssd.removed(removed)
        return p.CountReply(req.rid, count), []

    def _drop(self, session: Session, req: p.DropNamespace, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        count, removed = self.store.drop_namespace(ns)
        if self.ssd is not None:
            self.ssd.removed(removed)
        return p.CountReply(req.rid, count), []

    def _warm(self, session: Session, req: p.Warm, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        if not 0 < req.seconds <= 86400:
            raise MalformedError("warm: seconds must be in (0, 86400]")
        return p.CountReply(req.rid, self.store.keep_warm(ns, req.keys,
                                                          self.clock() + req.seconds)), []

    def _prefetch(self, session: Session, req: p.Prefetch, payload: list[Any]) -> Outcome:
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        cached = self.store.lookup(ns, req.keys)
        ready = _leading_in_dram(ns, req.keys)
        if ready == len(req.keys) or (self.ssd is None and self.remote is None):
            return p.PrefetchReply(req.rid, ready, len(cached)), []
        task = self._spawn(self._bring_up(ns, req.keys, len(cached)))
        if not req.wait:
            return p.PrefetchReply(req.rid, ready, len(cached)), []
        raise Later(self._prefetch_reply(req, ns, task))

    async def _bring_up(self, ns: Namespace, keys: list[bytes], cached: int) -> None:
        """Promote the cached part of a chain to DRAM, then fetch the rest from the remote
        tier; a partial result is still a usable prefix."""
        try:
            below = [b for k in keys[:cached] if (b := ns.blocks.get(k)) is not None
                     and b.offset is None and b.ssd_offset is not None]
            if below and self.ssd is not None:
                await self.ssd.promote(below)
            if cached < len(keys) and self.remote is not None and self.remote.healthy:
                await self.remote.fetch(ns, keys)
        except KVStoreError as exc:
            log.debug("prefetch stopped early: %s", exc)

    async def _prefetch_reply(self, req: p.Prefetch, ns: Namespace,
                              task: asyncio.Task[None]) -> p.Message:
        timeout = req.timeout_ms / 1000 if req.timeout_ms > 0 else None
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            pass  # what is up by now is the answer; the rest goes on in the background
        cached = sum(1 for _ in _leading_present(ns, req.keys))
        return p.PrefetchReply(req.rid, _leading_in_dram(ns, req.keys), cached)

    def _reserve_batch(self, session: Session, req: p.ReserveBatch,
                       payload: list[Any]) -> Outcome:
        """Reserve the blocks of a whole token plan, all or none."""
        from kvstore.scheduler.admission import TokenRequest, admit_batch

        ns = self._namespace(session, req.ns)
        bt = ns.identity.block_tokens
        requests = [TokenRequest(item.reserved_tokens, item.new_tokens) for item in req.plan]
        available = self.store.available_slots(ns)
        decision = admit_batch(requests, bt, available)
        for i, (item, need) in enumerate(zip(req.plan, decision.blocks)):
            if len(item.keys) != need:
                raise MalformedError(f"plan item {i} adds {need} blocks but names "
                                     f"{len(item.keys)} keys")
        self._check_keys([k for item in req.plan for k in item.keys])
        if not decision.admitted:
            self.store.counters.capacity_rejects += 1
            return p.BatchReply(req.rid, False, list(decision.blocks), list(decision.fitting),
                                [], [], self.limits.lease_seconds), []
        done: list[Reservation] = []
        try:
            for item in req.plan:
                if item.keys:
                    done.append(self.store.reserve(session.id, ns, item.keys, item.parent,
                                                   self.clock()))
        except BaseException:
            for r in done:
                self.store.abort(session.id, r.id)
            raise
        return p.BatchReply(req.rid, True, list(decision.blocks), [],
                            [r.id for r in done], [r.offsets for r in done],
                            self.limits.lease_seconds), []

    def _report(self, session: Session, req: p.Report, payload: list[Any]) -> Outcome:
        if req.recomputed_tokens < 0:
            raise MalformedError("recomputed_tokens cannot be negative")
        self.scheduling["recomputed_tokens"] += req.recomputed_tokens
        return p.OkReply(req.rid), []

    def _stats(self, session: Session, req: p.Stats, payload: list[Any]) -> Outcome:
        self._reap_sends()  # pins of get replies already sent are not holdings
        return p.StatsReply(req.rid, self.stats()), []

    def _gpu_attach(self, session: Session, req: p.GpuAttach, payload: list[Any]) -> Outcome:
        if self.gpu is None:
            return p.GpuReply(req.rid, b"", self.gpu_reason or "no gpu tier is configured "
                              "(gpu.device, or kvstore serve --gpu-device)"), []
        return p.GpuReply(req.rid, self.gpu.handle), []

    def _ping(self, session: Session, req: p.Ping, payload: list[Any]) -> Outcome:
        return p.OkReply(req.rid), []

    # -- housekeeping ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tiers": self.store.tier_stats(),
            "sessions": len(self._by_session_id),
            "namespaces": len(self.store.namespaces),
            "invariant_violations": self.invariant_violations,
            "scheduling": dict(self.scheduling),
            "transfers": self.transfers.stats(),
            "eviction_policies": {"dram": self.config.dram.eviction_policy, "ssd": "lru"},
            "tenant_dram_bytes": {tenant: nbytes for dram in self.store.drams.values()
                                  for tenant, nbytes in dram.used.items()},
        }
        if self.ssd is not None:
            out["ssd_io"] = self.ssd.stats()
        if self.gpu is not None:
            out["gpu"] = self.gpu.stats()
        elif self.gpu_reason:
            out["gpu"] = {"off": self.gpu_reason}
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        return out

    def _schedule_reaper(self) -> None:
        assert self._loop is not None
        period = min(1.0, self.limits.lease_seconds / 4)
        self._loop.call_later(period, self._reap)

    def _reap(self) -> None:
        if self._sock is None:
            return
        gone = set(self.store.expire(self.clock()))
        if gone:
            for routing_id, session in list(self.sessions.items()):
                if session.id in gone:
                    del self.sessions[routing_id]
                    self._by_session_id.pop(session.id, None)
                    self._expired[routing_id] = None
            while len(self._expired) > 4096:
                del self._expired[next(iter(self._expired))]
            log.info("lease expired for %d session(s); their holdings were rolled back", len(gone))
            self._wake_deferred()
        self._schedule_reaper()


_DEFERRABLE = frozenset({"reserve", "put", "acquire", "get"})
_NEVER_LIMITED = (p.Release, p.Abort)  # requests that give back what others wait for
# The class of the copies a request starts (the rest, such as a put's demotions, are
# write-back): reloads come first, an engine waits on them.
_TRANSFER_KIND = {"acquire": TransferKind.RELOAD, "get": TransferKind.RELOAD,
                  "lookup": TransferKind.RELOAD, "prefetch": TransferKind.PREFETCH}
_FREES_ROOM = frozenset({"release", "abort", "commit", "evict", "drop", "put", "get"})


class Later(Exception):
    """Not an error: the reply comes from a coroutine (a prefetch that waits)."""

    def __init__(self, reply: Coroutine[Any, Any, p.Message]) -> None:
        super().__init__("later")
        self.reply = reply


def _leading_present(ns: Namespace, keys: list[bytes]) -> Iterator[Block]:
    for key in keys:
        block = ns.blocks.get(key)
        if block is None or not block.present:
            return
        yield block


def _leading_in_dram(ns: Namespace, keys: list[bytes]) -> int:
    n = 0
    for block in _leading_present(ns, keys):
        if block.offset is None:
            break
        n += 1
    return n


class Deferred(Exception):
    """Not an error: no room now; wait for some, in order, until the deadline."""

    def __init__(self, deadline: float, cause: str = "") -> None:
        super().__init__("deferred")
        self.deadline = deadline
        self.waited = False
        self.expired = False  # the deadline passed: the last attempt runs every step
        self.cause = cause  # why there was no room, the last time it was tried


class RemoteFetch(Exception):
    """Not an error: the keys missing here may be in the remote store; fetch, then retry."""

    def __init__(self, ns: Namespace, keys: list[bytes]) -> None:
        super().__init__("fetch from the remote tier")
        self.ns = ns
        self.keys = keys


class RemoteLookup(Exception):
    """Not an error: ask the remote store for the part of the chain not found here."""

    def __init__(self, rid: int, ns: Namespace, keys: list[bytes], tiers: list[str]) -> None:
        super().__init__("look up in the remote tier")
        self.rid = rid
        self.ns = ns
        self.keys = keys
        self.tiers = tiers


Plan = DemotionNeeded | PromotionNeeded | RemoteFetch | RemoteLookup | Deferred | Later


class PinnedFrames(list[Any]):
    """Zero-copy payload frames of arena slots, pinned until zmq has sent them."""

    def __init__(self, frames: list[memoryview], pin: int) -> None:
        super().__init__(frames)
        self.pin = pin


def _merge_live(old: Config, new: Config) -> Config:
    """The running configuration with only the live-changeable fields taken from ``new``."""
    server = msgspec.structs.replace(
        old.server, lease_seconds=new.server.lease_seconds,
        max_keys_per_request=new.server.max_keys_per_request,
        max_reservations_per_session=new.server.max_reservations_per_session,
        max_pins_per_session=new.server.max_pins_per_session,
        log_level=new.server.log_level, log_format=new.server.log_format,
        debug_invariants=new.server.debug_invariants,
        max_requests_per_second=new.server.max_requests_per_second,
        max_reservations_per_tenant=new.server.max_reservations_per_tenant,
        max_pins_per_tenant=new.server.max_pins_per_tenant,
        max_requests_per_second_per_tenant=new.server.max_requests_per_second_per_tenant)
    ssd = msgspec.structs.replace(old.ssd, admit_after=new.ssd.admit_after)
    return msgspec.structs.replace(old, server=server, ssd=ssd)


def _runs(tiers: list[str]) -> list[tuple[str, int]]:
    runs: list[tuple[str, int]] = []
    for tier in tiers:
        if runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + 1)
        else:
            runs.append((tier, 1))
    return runs


def _socket_alive(endpoint: str) -> bool:
    """Whether something answers on an ipc endpoint (a stale socket file does not)."""
    import socket

    path = endpoint[len("ipc://"):]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


async def run_server(config: Config, on_ready: Callable[[Server], None] | None = None,
                     reload: Callable[[], Config] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, with metrics and systemd notifications; SIGHUP
    re-reads the configuration through ``reload`` and applies what can change live."""
    loop = asyncio.get_running_loop()
    server = Server(config)
    server.metrics = Metrics(stats_on_loop(loop, server.stats))
    close_http = server.metrics.start_http_server(config.server.metrics_port)
    notifier = Notifier()

    def ready(s: Server) -> None:
        if on_ready is not None:
            on_ready(s)
        notifier.ready(f"serving on {', '.join(s.endpoints)}")

    stop_watchdog = notifier.start_watchdog(loop, lambda: server._sock is not None)

    def stop() -> None:
        notifier.stopping()
        server.stop()

    def hangup() -> None:
        if reload is None:
            return
        notifier.reloading()
        try:
            restart = server.reload(reload())
        except KVStoreError as exc:
            log.error("reload refused, the running configuration stays: %s", exc)
        else:
            if restart:
                log.warning("reloaded; these settings need a restart to take effect: %s",
                            ", ".join(restart))
            else:
                log.info("reloaded the configuration")
        notifier.ready("reloaded")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    loop.add_signal_handler(signal.SIGHUP, hangup)
    try:
        await server.serve(ready)
    finally:
        stop_watchdog()
        if close_http is not None:
            close_http()
