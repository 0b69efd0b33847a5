"""The daemon: a ZeroMQ ROUTER on an asyncio (uvloop) loop, wiring the store and the arena.

Three parts serve requests: the transport (``kvstore.transport``: sockets, frames, send
tracking), the sessions and their limits (``kvstore.sessions``), and the verbs
(``kvstore.verbs``: one handler per request type).  The server runs their lifecycle,
wires the tier movers, dispatches each request to its handler, and finishes in a task
the requests that must wait for bytes to move or room to free (``kvstore.later``);
the mover pipeline (``kvstore.moves``) carries out every move between tiers.
Each request gets exactly one reply; every failure becomes a typed error reply and
leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import zmq

from kvstore import protocol as p
from kvstore import start_signals
from kvstore.arena_waits import ArenaWaits
from kvstore.auth import Auth, read_metrics_token
from kvstore.config import Config, ServerConfig, merge_live, parse_size, restart_needed
from kvstore.errors import (
    CapacityError,
    ConfigError,
    ForbiddenError,
    KVStoreError,
    MalformedError,
    TooLargeError,
    UnavailableError,
)
from kvstore.events import EventPublisher
from kvstore.gpu_mover import GpuMover
from kvstore.heap import settle_every
from kvstore.invariant_watch import InvariantWatch
from kvstore.later import Finisher
from kvstore.logs import configure, in_effect
from kvstore.metrics import UNAUTHENTICATED, Metrics, stats_on_loop
from kvstore.moves import Moves
from kvstore.namespace_verbs import NamespaceVerbs
from kvstore.plans import Plan
from kvstore.policy_switches import PolicySwitches
from kvstore.remote import RemoteTier
from kvstore.routing import RoutingVerbs
from kvstore.scheduler.admission import PolicyChain
from kvstore.scheduler.queues import TransferKind
from kvstore.sdnotify import Notifier
from kvstore.sessions import Sessions, tenant_of_connection
from kvstore.side_socket import SideSocket
from kvstore.slab_moves import class_stats
from kvstore.ssd_copies import tenant_bytes as ssd_tenant_bytes
from kvstore.ssd_flush import withdraw_unrooted
from kvstore.stopping import SYNC_LEAVES_SECONDS, StopDeadline
from kvstore.store import BlockStore, Limits, Namespace
from kvstore.tiering import SsdMover
from kvstore.tiers.arena_fds import side_path
from kvstore.tiers.dram import Arenas, DramArena, sweep_stale_arenas
from kvstore.transfers import TransferGate, serving
from kvstore.transport import Transport, keep_receive_buffers, unpredictable_routing_ids
from kvstore.under_way import UnderWay
from kvstore.removals import GET_OWNER
from kvstore.verbs import Verbs, arena_to_make

log = logging.getLogger("kvstore.server")
# A reaper's timer this late (seconds): the daemon itself did not run (SIGSTOP, a host
# that stalled), and no lease ends before what its clients sent meanwhile is read (every
# session's lease ran out at once, its requests waiting unread behind the timer)
STALL_SECONDS = 2.0


class Server:
    """The kvstore daemon.  ``await serve()`` runs it until ``stop()``."""

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        s = config.server
        self.limits = _limits(s)
        self.max_keys = s.max_keys_per_request
        self.max_request_bytes = config.max_request_bytes
        self.debug_invariants = s.debug_invariants
        self.invariant_watch: InvariantWatch | None = None  # made on the loop, when needed
        self.store = _block_store(config, self.limits)
        self.defer = "defer" in config.dram.pressure
        self.scheduling = {"defers": 0, "defer_timeouts": 0, "rejects": 0, "recomputed_tokens": 0}
        self.arenas: Arenas | None = None
        self.ssd: SsdMover | None = None
        self.remote: RemoteTier | None = None
        self.gpu: GpuMover | None = None
        self.gpu_reason = ""  # why the configured GPU tier is off
        self.transfers = TransferGate(config.server.max_transfers_in_flight,
                                      weights=config.server.tenant_weights, metrics=metrics)
        self.sessions = Sessions(
            self.store, s, clock=clock, grantee_pin_share=config.auth.grantee_pin_share,
            grantee_pin_total=config.auth.grantee_pin_total,
            max_bytes_in_flight=parse_size(s.max_bytes_in_flight, "server.max_bytes_in_flight"),
            max_tenant_bytes_in_flight=parse_size(s.max_bytes_in_flight_per_tenant,
                                                  "server.max_bytes_in_flight_per_tenant"))
        self.invariant_violations = 0
        self.auth = Auth(config)
        _warn_of_settings(config)
        self.transport = Transport(config, self.auth, self._on_message,
                                   lambda pin: self.verbs.get_sent(pin),  # (a get's pin, sent)
                                   lambda: self.moves.freed(), self.sessions.unread)
        self.transport.admitted = self.sessions.known
        self.arena_waits = ArenaWaits(self._on_message, self.spawn,
                                      lambda peer, reply: self.transport.send(peer, reply, []))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining_grants = False  # a slice of the grantees' discharges is due
        self._reap_due = math.inf  # when the reaper's timer is due (time.monotonic())
        self._stopped: asyncio.Event | None = None
        self.stop_deadline = StopDeadline()  # (begun by run_server's signal handler)
        self._tasks: set[asyncio.Task[None]] = set()
        self.policy_switches = PolicySwitches(self.store)  # SIGHUP's, in loop turns
        self.moves = Moves(self.store, clock)  # its tiers' movers join in start()
        self.finisher = Finisher(self)
        self.under_way = UnderWay(s.max_requests_under_way, s.max_keys_under_way, s.tenant_weights)
        self.verbs: Verbs = (verbs := Verbs(self))
        self.sides: list[SideSocket] = []
        verbs.add(RoutingVerbs(self, verbs.removals.turns).table() | NamespaceVerbs(self).table())
        self.events = EventPublisher(config.events, self.store, self.auth,
                                     self.transport.secure_file, config.server.handshake_seconds) \
            if config.events.endpoint else None

    @property
    def endpoints(self) -> list[str]:
        return self.transport.endpoints

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the arena and bind the sockets (synchronous; the loop must be running).
        A step that fails closes those before it (``_close_parts``): the arena file, a
        full-size file in /dev/shm, is not left behind by a daemon that never served."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        unpredictable_routing_ids()  # before any ROUTER socket: the replay socket's too
        keep_receive_buffers()
        d = self.config.dram
        sweep_stale_arenas(d.directory)
        self.arenas = Arenas(self.config.dram_capacity, d.directory, populate=d.populate,
                             max_arenas=d.max_arenas, memfd=self.config.memfd_arenas,
                             budget=self.store.dram_budget)  # (its arenas sparse then)
        self.store.move_bytes = lambda ns, source, target: self.arena_for(ns.tenant).move(
            source, target, ns.block_bytes)  # (a slab handed to another block size)
        try:
            self._start_parts()
        except BaseException:
            self.store.on_forget = None
            self._close_parts()
            raise
        self.moves.attach(ssd=self.ssd, remote=self.remote, gpu=self.gpu)
        self._loop.call_soon(self.moves.start)  # restored SSD copies to send, say
        self._schedule_reaper()
        self.store.touch_owner(GET_OWNER, math.inf)

    def _start_parts(self) -> None:
        """What ``start`` opens after the arenas, in order; each is set on the server as
        it opens, for ``_close_parts``."""
        assert self.arenas is not None and self._loop is not None
        if not self.config.tenant_arenas:
            self.arenas.get("")  # the one arena, made (and its pages touched) at start-up
        if self.config.ssd_capacity:
            self.ssd = SsdMover(self.config, self.store, self.slot, self.transfers)
            restored = self.ssd.restore()
            self.ssd.metrics = self.metrics
            self.store.on_forget = self.ssd.forget_namespace
            log.info("ssd tier: %d blocks restored from %s", restored, self.config.ssd_path)
        if self.config.remote.url or self.config.remote.backend:
            self.remote = RemoteTier(self.config, self.store, self.slot, self.transfers)
        if self.config.gpu.device:
            self._start_gpu()
        if self.events is not None:
            # its first batch clears what subscribers knew of this daemon and announces
            # what the SSD index brought back
            self.events.open(self._loop)
            self.events.start(self.ssd is not None)
            log.info("kv events on %s", ", ".join(self.events.endpoints))
        self.transport.open(self._loop)
        self._open_side_socket()

    async def serve(self, on_ready: Callable[[Server], None] | None = None) -> None:
        try:
            self.start()
        except BaseException:
            if self.remote is not None:
                await self.remote.close()
            raise
        if on_ready is not None:
            on_ready(self)
        assert self._stopped is not None
        await self._stopped.wait()
        try:
            await self.drain()
        finally:  # (a drain that failed part way still closes the tiers and the index)
            self.close()

    def _open_side_socket(self) -> None:
        """The unix socket beside each ipc endpoint that hands out memfd arenas and peer
        tickets (``kvstore.side_socket``), when either is in use."""
        if not (self.config.memfd_arenas or self.auth.gated):
            return
        assert self._loop is not None
        for endpoint in self.transport.endpoints:
            path = side_path(endpoint)
            if path is not None:
                side = SideSocket(path, self.auth, self.sessions, lambda: self.arenas,
                                  self.transport.secure_file)
                side.open(self._loop)
                self.sides.append(side)

    def _start_gpu(self) -> None:
        """The GPU tier, or a logged reason why it is off (no device here)."""
        assert self.arenas is not None
        shared = self.arenas.by_name.get("")
        try:
            self.gpu = GpuMover(self.config, self.store, self.slot, self.transfers,
                                self.moves.freed, shared.buffer if shared else None)
        except UnavailableError as exc:
            self.gpu_reason = str(exc)
            log.warning("gpu tier off: %s", exc)

    async def drain(self, bound: float = 30.0) -> None:
        """Stop taking requests, let those under way finish (within ``bound`` seconds),
        flush writes to SSD and sync its index."""
        await drain_server(self, bound)

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    def close(self) -> None:
        if self.invariant_watch is not None:
            self.invariant_watch.close()
        # what is forgotten from here on keeps its SSD record (gone at the next start)
        self.store.on_forget = None
        for owner in list(self.store.owners):
            self.store.drop_owner(owner)
        self._close_parts()

    def _close_parts(self) -> None:
        """Close the sockets, the tiers and the arenas, those that are open: at the end,
        or when ``start`` fails part way (the remote tier, closed asynchronously, is left
        to ``drain`` or ``serve``)."""
        for side in self.sides:
            side.close()
        self.sides.clear()
        self.transport.close()
        if self.events is not None:
            self.events.close()
        if self.ssd is not None:
            self.ssd.close()
            self.ssd = None
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        if self.arenas is not None:
            self.arenas.close()

    # -- dispatch ------------------------------------------------------------------------------
    def _on_message(self, routing_id: bytes, frames: list[zmq.Frame], secure: bool,
                    made: bool | BaseException | None = None) -> None:
        """Handle one request from the transport: exactly one reply, now or from a task
        (``made``: after the arena it needs was made, or failed to be)."""
        if self.arena_waits and self.arena_waits.holds(routing_id, frames, secure):
            return  # (behind a request of its connection's waiting for an arena)
        start = time.perf_counter()
        # a request is labelled with its session's tenant, once there is one: a refused
        # hello's self-named tenant never takes one of the metrics' tenant labels
        verb, tenant, code = "invalid", UNAUTHENTICATED, None
        if len(frames) < 2:
            self.transport.send(routing_id, p.ErrorReply(0, MalformedError.code,
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
            verbs = self.verbs
            verb = verbs.names[type(request)]
            handler = verbs.table[type(request)]
            curve_tenant = str(frames[1].get("User-Id")) if secure else None
            if made is None and (
                    making := arena_to_make(self, routing_id, request, curve_tenant)) is not None:
                self.arena_waits.wait(making, routing_id, frames, secure)
                return
            if isinstance(made, BaseException):
                raise made  # (its arena could not be made: not tried again, on the loop)
            if isinstance(request, p.Hello):
                session = verbs.greet(routing_id, request, curve_tenant,
                                      self.transport.peer_uid(routing_id, frames))
                tenant = session.tenant
                hello = handler(session, request, frames[2:])
                assert isinstance(hello, tuple), "a hello is answered at once"
                reply, payload = hello
            else:
                session = self.sessions.get(routing_id)
                if secure and str(frames[1].get("User-Id")) != session.tenant:
                    raise ForbiddenError(_ANOTHER_TENANTS)  # (see there)
                tenant = session.tenant
                if not isinstance(request, _NEVER_LIMITED):
                    # a release or abort frees; it is never refused
                    self.sessions.admit(session, routing_id)
                self.store.touch_owner(session.id, self.clock())
                finisher = self.finisher
                with serving(_TRANSFER_KIND.get(verb, TransferKind.WRITEBACK), tenant):
                    try:
                        answer = finisher.attempt(handler, session, request, frames[2:],
                                                  verb, early=True)
                    except CapacityError as exc:
                        if not finisher.may_defer(verb):
                            raise
                        answer = finisher.deferral(tenant, exc)
                    finally:
                        self.sessions.counted(session)
                    if not isinstance(answer, tuple):
                        # bytes must move between tiers first, or the reply comes later:
                        # finish in a task
                        try:
                            finisher.hold(session, request, frames[2:], answer, verb)
                        except BaseException:
                            if isinstance(answer, Plan):
                                self.moves.abandon(answer)
                            else:
                                answer.reply.close()
                                answer.gave_up()  # (what it held goes now, not at gc)
                            raise
                        self.spawn(finisher.finish(
                            routing_id, rid, verb, tenant, start, handler, session, request,
                            frames[2:], answer))
                        return
                    reply, payload = answer
        except KVStoreError as exc:  # (one that cannot be decoded: its session's tenant)
            code, tenant = exc.code, tenant_of_connection(self.sessions, routing_id, tenant)
            reply, payload = p.ErrorReply(rid, exc.code, str(exc)), []
            if isinstance(exc, CapacityError):
                self.finisher.rejected(tenant, exc)
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("internal error handling a request",
                          extra={"rid": rid, "verb": verb, "tenant": tenant})
            code = "internal"
            reply, payload = p.ErrorReply(rid, "internal", f"internal error: {exc!r}"), []
        if not self.transport.send(routing_id, reply, payload):
            code = "internal"  # (it could not be encoded: an internal error went instead)
        self.store.index.settle()  # a lookup's hits, now its reply is sent (``later``)
        self.policy_switches.after_request()  # a request's share of ``auto``'s samples
        if code is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("%s failed: %s", verb, code, extra={"rid": rid, "verb": verb,
                                                         "tenant": tenant})
        self.moves.withdraw_dropped()
        if verb in _FREES_ROOM and len(self.moves.room):
            self.moves.freed()
        if self.metrics is not None:
            self.metrics.observe_request(verb, time.perf_counter() - start, code, tenant)
        if self.debug_invariants:
            self.check_invariants()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._loop is not None
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def reload(self, new: Config) -> list[str]:
        """Apply the settings that can change live; returns those that need a restart."""
        restart = restart_needed(self.config, new)
        self.config = merge_live(self.config, new)
        self._apply_live()
        configure(self.config.server.log_level, self.config.server.log_format)
        return restart

    def _apply_live(self) -> None:
        """Hand the live settings (``config.LIVE_SETTINGS``) to the parts that use them."""
        s = self.config.server
        self.store.limits = self.limits = _limits(s)
        self.max_keys = s.max_keys_per_request
        self.debug_invariants = s.debug_invariants
        self.sessions.configure(s, self.config.auth.grantee_pin_share,
                                self.config.auth.grantee_pin_total)
        self.sessions.bound_bytes_in_flight(s)
        self.store.ssd_admit_after = self.config.ssd.admit_after
        self.policy_switches.change(self.config.dram.eviction_policy, self.spawn)

    def arena_for(self, tenant: str) -> DramArena:
        """The arena a tenant's blocks live in (its own, with per-tenant arenas)."""
        assert self.arenas is not None
        return self.arenas.get(self.store.arena_of(tenant))

    def slot(self, ns: Namespace, offset: int) -> memoryview:
        """A block's DRAM slot in its arena."""
        return self.arena_for(ns.tenant).slot(offset, ns.block_bytes)

    def check_invariants(self) -> bool:
        """Run the store's and the sessions' checkers; a violation is logged and counted,
        never fatal.  Past a size, in a forked snapshot off the loop (``InvariantWatch``):
        True then, and a violation is counted when the check ends."""
        if self.invariant_watch is None and self._loop is not None:
            self.invariant_watch = InvariantWatch(
                self._loop, self._check_all,
                lambda: sum(len(ns.blocks) for ns in self.store.namespaces.values()),
                self._violated)
        if self.invariant_watch is not None:
            return self.invariant_watch.after_request()
        try:
            self._check_all()
        except AssertionError as exc:
            self._violated(str(exc))
            return False
        return True

    def _check_all(self) -> None:
        self.store.check_invariants()
        self.sessions.check_invariants()
        self.under_way.check()

    def _violated(self, what: str) -> None:
        self.invariant_violations += 1
        log.error("invariant violated: %s", what)

    # -- housekeeping ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Every part's figures, as ``kvstore stats`` shows them."""
        return server_stats(self)

    def _schedule_reaper(self, late: bool = False) -> None:
        assert self._loop is not None  # (after a late round the next is never: one skip)
        period = min(1.0, self.limits.lease_seconds / 4)
        self._reap_due = math.inf if late else time.monotonic() + period
        self._loop.call_later(period, self._reap)

    def _reap(self) -> None:
        if not self.transport.is_open:
            return
        if time.monotonic() - self._reap_due > STALL_SECONDS:  # the daemon did not run:
            return self._schedule_reaper(late=True)  # what came meanwhile is read first
        gone = set(self.store.expire(self.finisher.kept_alive(self.clock())))
        if gone:
            self.sessions.forget(gone)
            log.info("lease expired for %d session(s); their holdings were rolled back", len(gone))
            self.moves.freed()
        self.sessions.drop_idle_tenants()
        self._drain_grants()
        self.transport.give_back_buffers_when_quiet()
        self._schedule_reaper()

    def _drain_grants(self) -> None:
        """The grantees' pin discharges still queued (a lease's end queues all of its
        session's) go on a bounded slice a loop turn, requests or none, until done."""
        grants = self.sessions.grant_pins
        grants.drain()
        again = not grants.settled and self.transport.is_open
        if again and not self._draining_grants:
            assert self._loop is not None
            self._draining_grants = True
            self._loop.call_soon(self._drain_grants_again)

    def _drain_grants_again(self) -> None:
        self._draining_grants = False
        self._drain_grants()



# A session outlives its connection (till its lease ends), and a peer may name a gone
# connection's routing id as its own: on a secure socket, whose handshake authenticated
# the tenant (User-Id), a request is served only for a session of that tenant.
_ANOTHER_TENANTS = ("this routing id is a session of another tenant's; connect again "
                    "without naming one")
_NEVER_LIMITED = (p.Release, p.Abort, p.Bye)  # they give back what others wait for
# The class of the copies a request starts (the rest, such as a put's demotions, are
# write-back): reloads come first, an engine waits on them.
_TRANSFER_KIND = {"acquire": TransferKind.RELOAD, "get": TransferKind.RELOAD,
                  "lookup": TransferKind.RELOAD, "prefetch": TransferKind.PREFETCH}
_FREES_ROOM = frozenset({"release", "abort", "commit", "evict", "drop", "put", "get"})


def server_stats(server: Server) -> dict[str, Any]:
    """The figures of every part of ``server``: O(tiers), never a walk of blocks."""
    backlogs = server.store.backlogs
    out: dict[str, Any] = {
        "tiers": server.store.tier_stats(),
        "sessions": len(server.sessions),
        "namespaces": len(server.store.namespaces),
        "namespace_closes_queued": len(server.sessions.closes),
        "invariant_violations": server.invariant_violations,
        "invariant_checks_forked": (server.invariant_watch.forked
                                    if server.invariant_watch is not None else 0),
        # (and the requests in line for DRAM room now: deferred, or waiting for room coming)
        "scheduling": {**server.scheduling, "waiting_for_room": len(server.moves.room)},
        "transfers": server.transfers.stats(),
        "eviction_policies": {"dram": server.config.dram.eviction_policy, "ssd": "lru"},
        "evictions_by_policy": {"dram": server.policy_switches.evictions_by_policy()},
        # each DRAM class's order as it stands (auto: which candidate leads, scores)
        "eviction_orders": [repr(policy) for dram in server.store.drams.values()
                            for policy in dram.policies.values()],
        # a change of policy (SIGHUP) passing the blocks on: blocks passed so far
        "eviction_switch": server.policy_switches.stats(),
        # auto's sampled references kept for later turns: waiting now, taken so far
        "eviction_samples": {"waiting": len(backlogs) if backlogs is not None else 0,
                             "taken_later": backlogs.taken if backlogs is not None else 0},
        "slab_classes": class_stats(server.store),  # slabs per block size, per tier
        "tenant_dram_bytes": {tenant: nbytes for dram in server.store.drams.values()
                              for tenant, nbytes in dram.used.items()},
        # bytes of other tenants' DRAM each grantee keeps pinned (auth.grantee_pin_share)
        "grantee_pinned_bytes": server.sessions.grant_pins.stats(),
    }
    if server.arenas is not None and server.arenas.sparse:  # (the others hold it all)
        # the memory the arenas' files hold now: their slabs written, less those given back
        out["tiers"]["dram"]["allocated"] = sum(server.arenas.allocated_bytes().values())
    if server.ssd is not None:
        out["ssd_io"] = server.ssd.stats()
        if "ssd" in out["tiers"]:  # 0 once its directory was removed under the daemon
            out["tiers"]["ssd"]["healthy"] = int(server.ssd.lost is None)
        # each tenant's SSD copies, as its share of the tier counts them
        out["ssd_tenant_bytes"] = ssd_tenant_bytes(server.store)
    if server.gpu is not None:
        out["gpu"] = server.gpu.stats()
    elif server.gpu_reason:
        out["gpu"] = {"off": server.gpu_reason}
    if server.remote is not None:
        out["remote"] = server.remote.stats()
        out["remote"]["copying_from_ssd"] = server.moves.copying_from_ssd
        # each tenant's values in it, as this daemon knows them, and those deleted or
        # not sent to keep it within remote.max_bytes_per_tenant
        out["remote_tenants"] = server.remote.shares.stats()
    if server.events is not None:
        out["events"] = server.events.stats()
    out["settings"] = live_settings(server)
    out["before_hello"] = {"dropped": server.transport.dropped_before_hello}
    out["under_way"] = server.under_way.stats()  # requests and prefetches in tasks
    out["replies"] = {"dropped_unread": server.transport.dropped_unread,
                      "unread_bytes": sum(server.transport.unread.values())}
    if server.sides:
        out["side_socket"] = {key: sum(side.counts[key] for side in server.sides)
                              for key in server.sides[0].counts}
    return out


def live_settings(server: Server) -> dict[str, Any]:
    """The live settings in effect, read back from the parts that use them."""
    limits, sessions = server.store.limits, server.sessions
    log_level, log_format = in_effect()
    return {
        "server.lease_seconds": limits.lease_seconds,
        "server.max_keys_per_request": server.max_keys,
        "server.max_reservations_per_session": limits.max_reservations_per_owner,
        "server.max_pins_per_session": limits.max_pins_per_owner,
        "server.log_level": log_level,
        "server.log_format": log_format,
        "server.debug_invariants": server.debug_invariants,
        "server.max_requests_per_second": sessions.max_requests_per_second,
        "server.max_reservations_per_tenant": sessions.max_reservations_per_tenant,
        "server.max_pins_per_tenant": sessions.max_pins_per_tenant,
        "server.max_namespaces_per_session": sessions.max_namespaces_per_session,
        "server.max_namespaces_per_tenant": sessions.max_namespaces_per_tenant,
        "server.max_sessions_per_tenant": sessions.max_sessions_per_tenant,
        "server.max_requests_per_second_per_tenant":
            sessions.max_requests_per_second_per_tenant,
        "server.stop_seconds": server.config.server.stop_seconds,  # (read at the signal)
        "server.max_bytes_in_flight": sessions.max_bytes_in_flight,
        "server.max_bytes_in_flight_per_tenant": sessions.max_tenant_bytes_in_flight,
        "server.max_bytes_in_flight_total": sessions.max_total_bytes_in_flight,
        "auth.grantee_pin_share": sessions.grant_pins.share,
        "auth.grantee_pin_total": sessions.grant_pins.total,
        "ssd.admit_after": server.store.ssd_admit_after,
        "dram.eviction_policy": server.store.dram_args[3],
    }


async def drain_server(server: Server, bound: float) -> None:
    """Stop taking requests, let those under way finish (within ``bound`` seconds, or
    what the stop's deadline leaves), flush writes to SSD and sync its index."""
    stop = server.stop_deadline
    server.transport.stop_reading()
    server.moves.room.stop()  # deferred requests: no room frees now, their last steps run
    server.verbs.commits.stop()  # commits waiting for other writers: none commits now
    if server._tasks:
        await asyncio.wait(list(server._tasks), timeout=stop.left(bound))
    server.sessions.closes.finish()  # ended sessions' namespaces: no request is served now
    if server.remote is not None:
        stop.enter("writing blocks back to the remote store")
        try:
            await asyncio.wait_for(server.moves.stop_copying_ssd(), stop.left(bound))
            await asyncio.wait_for(server.remote.drain(), stop.left(bound))
            flushed = await asyncio.wait_for(server.remote.flush(), stop.left(bound))
            if flushed:
                log.info("wrote %d blocks back to the remote store on the way out",
                         flushed)
        except TimeoutError:
            log.error("remote writes still under way at exit were dropped")
        stop.enter("closing the remote store")
        try:
            await server.remote.close()
        except KVStoreError as exc:  # (the steps below still write and sync the ssd tier)
            log.error("could not close the remote store on the way out: %s", exc)
    if server.gpu is not None:
        stop.enter("finishing copies into the gpu tier")
        try:
            await asyncio.wait_for(server.gpu.drain(), stop.left(bound))
        except TimeoutError:
            log.error("copies into the gpu tier still under way at exit were dropped")
    stop.enter("finishing writes to the ssd tier")
    try:
        await asyncio.wait_for(server.moves.drain(), stop.left(bound))
    except TimeoutError:
        log.error("writes to the ssd tier still under way at exit were dropped")
    if server.ssd is not None and not server.ssd.write_through \
            and not server.store.allow_demote:
        log.info("blocks only dram holds were not written to ssd on the way out: "
                 "dram.pressure has no demote")
    elif server.ssd is not None and server.ssd.lost is not None:
        log.info("blocks only dram holds were not written to ssd on the way out: its "
                 "directory is gone (%s)", server.ssd.lost)
    elif server.ssd is not None:
        # write-back keeps on SSD only what DRAM evicted, write-through what the tier
        # took and kept (admitted, not evicted since): what DRAM alone holds goes there
        # now (its free room), or a restart would find none of it
        stop.enter("writing the blocks only dram holds to the ssd tier")
        within = stop.left(bound)
        try:
            flushed = await asyncio.wait_for(server.moves.flush_to_ssd(), within)
            if flushed:
                log.info("wrote %d blocks to the ssd tier on the way out", flushed)
        except TimeoutError:
            log.error("blocks only dram held were not all written to ssd within %.3gs",
                      within)
    if server.ssd is not None:
        # (whatever the flush wrote, or could not, or if it did not run: a copy below
        # one the tier lacks goes now, not as an orphan at the restart)
        unrooted = withdraw_unrooted(server.store)
        if unrooted:
            server.moves.removed(unrooted)
            log.info("withdrew %d ssd copies whose parents are not on the tier on the way "
                     "out", len(unrooted))
        stop.enter("syncing the ssd tier")
        try:
            await asyncio.wait_for(server.ssd.drain(),
                                   stop.left(bound, keep=SYNC_LEAVES_SECONDS))
        except (TimeoutError, KVStoreError) as exc:
            log.error("could not flush the ssd tier on the way out: %r", exc)
    stop.enter("closing the tiers")


def _block_store(config: Config, limits: Limits) -> BlockStore:
    store = BlockStore(config.dram_capacity, config.dram_slab_bytes,
                       limits=limits, eviction_policy=config.dram.eviction_policy,
                       per_tenant=config.tenant_arenas,
                       ssd_capacity=config.ssd_capacity,
                       ssd_slab_bytes=config.ssd_slab_bytes,
                       ssd_admit_after=config.ssd.admit_after,
                       tenant_quota=config.tenant_quota,
                       tenant_weights=config.server.tenant_weights,
                       remote_tier=bool(config.remote.url or config.remote.backend),
                       samples_later=True)  # (``PolicySwitches``)
    store.chain = PolicyChain(tuple(config.dram.pressure))  # type: ignore[arg-type]
    return store


def _limits(s: ServerConfig) -> Limits:
    return Limits(lease_seconds=s.lease_seconds,
                  max_reservations_per_owner=s.max_reservations_per_session,
                  max_pins_per_owner=s.max_pins_per_session)


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one (what a process may do for
    itself); the limit now.  Each client connection is a descriptor, and at the limit
    ZeroMQ 4.3 aborts the process in an ipc socket's accept (a peer that opened plain
    connections past a shell's soft limit of 1024, sending nothing, killed the daemon)
    and spins a core in a tcp one; a connection that does not finish its handshake is
    closed after ``server.handshake_seconds``, so the bound is connections opened that
    fast.  The systemd unit sets 65536."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the limit on open files from %d to %d: %s",
                        soft, hard, exc)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        log.warning("the daemon may open %d files; each client connection takes one (raise "
                    "the hard limit, as the systemd unit's LimitNOFILE=65536 does)", soft)
    return soft


async def run_server(config: Config, on_ready: Callable[[Server], None] | None = None,
                     reload: Callable[[], Config] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, with metrics and systemd notifications; SIGHUP
    re-reads the configuration through ``reload`` and applies what can change live."""
    loop = asyncio.get_running_loop()
    raise_open_files_limit()
    web = config.server  # the metrics port's settings
    token = read_metrics_token(web.metrics_token_file) if web.metrics_token_file else b""
    server = Server(config)
    server.metrics = Metrics(stats_on_loop(loop, server.stats),
                             known_tenants=config.named_tenants)
    try:
        close_http = server.metrics.start_http_server(web.metrics_port, web.metrics_addr,
                                                      token)
    except OSError as exc:  # (nothing is bound or started yet: nothing to close)
        raise ConfigError(f"server.metrics_addr, metrics_port: cannot serve metrics on "
                          f"{web.metrics_addr} port {web.metrics_port}: {exc}") from None
    notifier = Notifier()

    def ready(s: Server) -> None:
        if on_ready is not None:
            on_ready(s)
        notifier.ready(f"serving on {', '.join(s.endpoints)}")
        if start_signals.came():  # a SIGHUP while starting: the file may have changed
            loop.call_soon(hangup)

    stop_watchdog = notifier.start_watchdog(loop, lambda: server.transport.is_open)
    stop_settling = settle_every(loop)  # full collections never walk the index

    def stop() -> None:
        if server.stop_deadline.begun:  # a second signal: the stop is taking too long
            server.stop_deadline.now("a second stop signal came")
            return
        notifier.stopping()
        server.stop_deadline.begin(server.config.server.stop_seconds, notifier)
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
        finally:
            # whatever the reload did, the daemon still serves: systemd, told it was
            # reloading, waits for READY=1 and fails the unit's reload without it
            notifier.ready("reloaded")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    loop.add_signal_handler(signal.SIGHUP, hangup)
    try:
        await server.serve(ready)
    finally:
        stop_watchdog()
        stop_settling()
        if close_http is not None:
            close_http()
        server.stop_deadline.enter("waiting for the tiers' threads to end")


def _warn_of_settings(config: Config) -> None:
    """Warnings of settings the daemon takes but a user may not mean."""
    slabs = config.ssd_capacity // config.ssd_slab_bytes if config.ssd_capacity else 0
    if slabs == 1:
        # slabs go to one block size at a time: a second size found no SSD room at
        # all, and a clean stop's flush (which trades half of a size's slabs) none
        log.warning("ssd.capacity %s holds one slab of %d bytes (ssd.slab_size %s): "
                    "one block size at a time can use the ssd tier; a smaller "
                    "ssd.slab_size lets several", config.ssd.capacity,
                    config.ssd_slab_bytes, config.ssd.slab_size)
    if config.server.socket_group and not config.credentials:
        log.warning("server.socket_group: every user in group %r may connect and name "
                    "any tenant, as no credentials are set; set auth.peer_tenants (or "
                    "auth.secret_file) to take each engine's tenant from its user",
                    config.server.socket_group)
