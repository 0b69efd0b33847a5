"""The verbs: one handler per request type of the protocol, and the table that maps them.

A handler takes the request's session, the decoded request and its payload frames, and
returns the reply with its payload frames, raises a typed error, or returns what the
request waits on (``kvstore.pending``: a plan of moves, or a reply still to come).
Handlers run on the event loop and never wait.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from kvstore import protocol as p
from kvstore.auth import Auth
from kvstore.commit_waits import CommitWaits
from kvstore.config import Config
from kvstore.errors import (
    CapacityError,
    ForbiddenError,
    LeaseExpiredError,
    LimitExceededError,
    MalformedError,
    NotFoundError,
    TooLargeError,
    UnknownNamespaceError,
    VersionMismatchError,
)
from kvstore.events import EventPublisher
from kvstore.gpu_mover import GpuMover
from kvstore.index import leading_in_dram, leading_present
from kvstore.metrics import Metrics
from kvstore.moves import Moves
from kvstore.pending import Later, Pending
from kvstore.policy_switches import PolicySwitches
from kvstore.removals import GET_OWNER, Removals
from kvstore.scheduler.admission import TokenRequest, admit_batch
from kvstore.remote import RemoteTier
from kvstore.sessions import Session, Sessions
from kvstore.slab_moves import own_slots, set_aside
from kvstore.store import Block, BlockStore, Limits, Namespace, Pin, Plan, Reservation, Skip
from kvstore.tiering import SsdMover
from kvstore.tiers.dram import Arenas, DramArena
from kvstore.transport import PinnedFrames, Transport
from kvstore.under_way import UnderWay

log = logging.getLogger("kvstore.server")

# how long a get over the bytes-in-flight limit waits, in a task, for its session's replies
# still being sent (a reply its peer has read counts as sent a little later; 5 ms refused
# one get in about a thousand on a loaded machine)
_SENT_WAIT = 0.05
# bytes a put copies into the arena in one loop turn (about a millisecond); a larger put
# copies the rest in the turns after
PUT_SLICE_BYTES = 8 << 20

Outcome = tuple[p.Message, list[Any]]
Answer = Outcome | Pending
Handler = Callable[[Session, Any, list[Any]], Answer]


class Daemon(Protocol):
    """What the verbs, and finishing requests (``kvstore.later``), use of the daemon."""

    @property
    def config(self) -> Config: ...
    @property
    def defer(self) -> bool: ...
    @property
    def debug_invariants(self) -> bool: ...

    @property
    def store(self) -> BlockStore: ...
    @property
    def sessions(self) -> Sessions: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def auth(self) -> Auth: ...
    @property
    def metrics(self) -> Metrics | None: ...
    @property
    def ssd(self) -> SsdMover | None: ...
    @property
    def remote(self) -> RemoteTier | None: ...
    @property
    def gpu(self) -> GpuMover | None: ...
    @property
    def moves(self) -> Moves: ...
    @property
    def policy_switches(self) -> PolicySwitches: ...
    @property
    def events(self) -> EventPublisher | None: ...
    @property
    def gpu_reason(self) -> str: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def max_keys(self) -> int: ...
    @property
    def max_request_bytes(self) -> int: ...
    @property
    def scheduling(self) -> dict[str, int]: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def arenas(self) -> Arenas | None: ...
    @property
    def under_way(self) -> UnderWay: ...

    def arena_for(self, tenant: str) -> DramArena: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...

    def stats(self) -> dict[str, Any]: ...

    def check_invariants(self) -> bool: ...


class Verbs:
    """The handlers of every request type, and ``table``, the map from type to handler."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.table: dict[type[Any], Handler] = {
            p.Hello: self._hello,
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
            p.Bye: self._bye,
            p.Warm: self._warm,
            p.Prefetch: self._prefetch,
            p.ReserveBatch: functools.partial(reserve_batch, self),
            p.Report: self._report,
            p.GpuAttach: self._gpu_attach,
            p.LookupPin: functools.partial(lookup_pin, self),
        }
        self.names = {t: str(t.__struct_config__.tag) for t in self.table}
        # get replies zmq still sends: pin id -> (session, its bytes counted in flight)
        self.sending: dict[int, tuple[Session, int]] = {}
        self.removals = Removals(daemon, self.sending)
        self.commits = CommitWaits(daemon.store, daemon.sessions)  # after older writers

    def add(self, table: dict[type[Any], Handler]) -> None:
        """More handlers (the routing verbs, say)."""
        self.table.update(table)
        self.names.update({t: str(t.__struct_config__.tag) for t in table})

    def greet(self, routing_id: bytes, req: p.Hello, curve_tenant: str | None,
              uid: int | None = None) -> Session:
        """The session a hello opens (or attaches to), once its version and credentials
        pass; the ``Hello`` handler then replies with its facts.  ``uid``: the sender's,
        over ipc."""
        if req.version != p.PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"client speaks protocol {req.version}, daemon speaks {p.PROTOCOL_VERSION}; "
                f"upgrade the older side")
        tenant = self.d.auth.tenant_of(req.tenant, req.token, curve_tenant)
        # its arena after the cheap checks, before the session: refused for want of one
        # (``dram.max_arenas``), no session; refused for another reason, no arena
        return self.d.sessions.hello(routing_id, tenant, req.attach, uid,
                                     prepare=self.d.arena_for)

    # -- checks the verbs share ---------------------------------------------------------------
    def _namespace(self, session: Session, ns_id: bytes) -> Namespace:
        if ns_id not in session.namespaces:
            raise UnknownNamespaceError("namespace not opened in this session; open it first")
        return self.d.store.namespaces[ns_id]

    def _writable(self, session: Session, ns_id: bytes) -> Namespace:
        """A namespace the session opened and may write in: its tenant's own, or one
        ``auth.shared_writers`` lets it write in (a ``shared_tenants`` grant is to read)."""
        ns = self._namespace(session, ns_id)
        if not self.d.auth.may_write(session.tenant, ns.tenant):
            raise ForbiddenError(
                f"tenant {session.tenant!r} may read the namespaces of tenant {ns.tenant!r}, "
                f"not write in them, evict or drop them (auth.shared_writers grants that)")
        return ns

    def _check_keys(self, keys: list[bytes]) -> None:
        # Each key's length was checked by the decoder; the count is a setting.
        max_keys = self.d.max_keys
        if len(keys) > max_keys:
            raise TooLargeError(f"{len(keys)} keys in one request; the limit is {max_keys}")

    # -- verbs ---------------------------------------------------------------------------------
    def _hello(self, session: Session, req: p.Hello, payload: list[Any]) -> Outcome:
        d = self.d
        arena = d.arena_for(session.tenant)
        return p.HelloReply(
            req.rid, p.PROTOCOL_VERSION, session.id, session.tenant, arena.path,
            arena.capacity_bytes, d.limits.lease_seconds, d.max_keys,
            d.max_request_bytes, bool(d.config.events.endpoint), True), []

    def _open(self, session: Session, req: p.OpenNamespace, payload: list[Any]) -> Outcome:
        d = self.d
        identity = req.identity
        if not d.auth.may_open(session.tenant, identity.tenant):
            raise ForbiddenError(
                f"session of tenant {session.tenant!r} cannot open a namespace of tenant "
                f"{identity.tenant!r}")
        if (identity.namespace_id not in d.store.namespaces
                and not d.auth.may_write(session.tenant, identity.tenant)):
            # a grantee to read makes no namespace: it would count against its owner's
            # cap (and be recorded in the owner's name), however many it made up
            raise ForbiddenError(
                f"tenant {session.tenant!r} may read the namespaces of tenant "
                f"{identity.tenant!r} and this one does not exist: a grantee opens only "
                f"namespaces their owner has made")
        if identity.block_bytes > d.max_request_bytes:
            raise TooLargeError(f"blocks of {identity.block_bytes} bytes exceed the request "
                                f"limit of {d.max_request_bytes}")
        ns = d.sessions.open_namespace(session, identity)  # (its SSD record: with its blocks)
        arena = d.arena_for(identity.tenant)
        return p.NamespaceReply(req.rid, ns.id, ns.block_bytes, ns.cls.slot_bytes,
                                arena.path, arena.capacity_bytes), []

    def _lookup(self, session: Session, req: p.Lookup, payload: list[Any]) -> Answer:
        d = self.d
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        tiers = d.store.lookup(ns, req.keys, later=True)  # (settled once answered)
        hits = len(tiers)
        if d.remote is not None and hits < len(req.keys) and d.remote.healthy:
            d.store.index.settle()  # (the reply comes from a task: its hits heard now)
            return Later(self._remote_lookup(req.rid, ns, req.keys, tiers))
        if d.metrics is not None:
            bt = ns.identity.block_tokens
            d.metrics.observe_lookup_tokens(d.store.tier, session.tenant, hits * bt,
                                            (len(req.keys) - hits) * bt)
        return p.LookupReply(req.rid, hits, p.tier_runs(tiers)), []

    def _reserve(self, session: Session, req: p.Reserve, payload: list[Any]) -> Answer:
        ns = self._writable(session, req.ns)
        self._check_keys(req.keys)
        self.d.sessions.check_cap(session, "reservations")
        self.d.sessions.check_grant_reserve(session, ns, len(req.keys))  # a writer grantee
        r = self._reserve_slots(session, ns, req.keys, req.parent, Skip.asked(req))
        if isinstance(r, Plan):
            return r
        return p.ReserveReply(req.rid, r.id, r.slots(), self.d.limits.lease_seconds,
                              self._tokens_wanted()), []

    def _tokens_wanted(self) -> bool:
        """Whether commits should carry token ids: someone hears the events."""
        events = self.d.events
        return events is not None and events.tokens_wanted

    def _reserve_slots(self, session: Session, ns: Namespace, keys: list[bytes],
                       parent: bytes | None, skip_held: bool | int) -> Reservation | Plan:
        store, clock = self.d.store, self.d.clock
        try:
            return store.reserve(session.id, ns, keys, parent, clock(), skip_held, session.tenant)
        except CapacityError:
            # Blocks of get replies stay pinned until zmq has sent them, which a client
            # that already holds the reply can outrun by a few microseconds: reap those
            # sent since the last look (never a wait on the loop), then try once more.
            if not self.d.transport.reap_some():
                raise
        return store.reserve(session.id, ns, keys, parent, clock(), skip_held, session.tenant)

    def _commit(self, session: Session, req: p.Commit, payload: list[Any]) -> Answer:
        return self.commits.commit(session, req, lambda: self._commit_now(session, req))

    def _commit_now(self, session: Session, req: p.Commit) -> Outcome:
        result = self.d.store.commit(session.id, req.reservation, self.d.clock(),
                                     req.checksums, req.token_ids or req.tokens)
        self._committed(result.blocks)
        return p.CommitReply(req.rid, result.created, result.duplicates, result.dropped), []

    def _committed(self, blocks: list[Block]) -> None:
        self.d.moves.committed(blocks)

    def _abort(self, session: Session, req: p.Abort, payload: list[Any]) -> Outcome:
        self.d.store.abort(session.id, req.reservation)
        return p.OkReply(req.rid), []

    def _acquire(self, session: Session, req: p.Acquire, payload: list[Any]) -> Answer:
        d = self.d
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        d.sessions.check_cap(session, "pins")
        d.sessions.check_grant(session, ns, req.keys)  # another tenant's: in bytes too
        pin = self._acquire_or_fetch(session.id, ns, req.keys)
        if isinstance(pin, Plan):
            return pin
        d.sessions.pinned(session, pin)
        gpu_offsets: list[int] = []
        if d.gpu is not None and d.store.gpu is not None:
            gpu_offsets = d.store.gpu.offsets(pin.blocks)
            if -1 in gpu_offsets:
                d.moves.reused(pin.blocks)  # used again: worth a copy on the GPU
        return p.AcquireReply(req.rid, pin.id, pin.offsets, pin.checksums, gpu_offsets), []

    def _acquire_or_fetch(self, owner: object, ns: Namespace,
                          keys: list[bytes]) -> Pin | Plan:
        d = self.d
        try:
            return d.store.acquire(owner, ns, keys, d.clock())
        except NotFoundError:
            if d.remote is None or not d.remote.healthy:
                raise
            return Plan(fetch=(ns, keys))  # it may be in the remote store

    def _release(self, session: Session, req: p.Release, payload: list[Any]) -> Outcome:
        self.d.store.release(session.id, req.pin)
        self.d.sessions.unpinned(session, req.pin)
        return p.OkReply(req.rid), []

    def _put(self, session: Session, req: p.Put, payload: list[Any]) -> Answer:
        d = self.d
        ns = self._writable(session, req.ns)
        self._check_keys(req.keys)
        if len(req.keys) * ns.block_bytes > d.max_request_bytes:
            raise TooLargeError(f"put of {len(req.keys)} blocks exceeds the request limit of "
                                f"{d.max_request_bytes} bytes; split it")
        if len(payload) != len(req.keys):
            raise MalformedError(f"put of {len(req.keys)} keys carries {len(payload)} frames")
        if req.checksums and len(req.checksums) != len(req.keys):
            raise MalformedError(f"put of {len(req.keys)} keys carries {len(req.checksums)} "
                                 f"checksums")
        for i, frame in enumerate(payload):
            if len(frame) != ns.block_bytes:
                raise MalformedError(f"frame {i} holds {len(frame)} bytes; a block of this "
                                     f"namespace is {ns.block_bytes}")
        d.sessions.check_grant_reserve(session, ns, len(req.keys))  # a writer grantee
        now = d.clock()
        # the daemon has the bytes: a key held in DRAM takes no slot, its frame unread
        r = self._reserve_slots(session, ns, req.keys, req.parent, Skip.HELD)
        if isinstance(r, Plan):
            return r
        payload = unheld(r, payload)
        if len(payload) * ns.block_bytes > PUT_SLICE_BYTES:
            return Later(_put_in_slices(self, session, req, ns, r, payload),
                         functools.partial(_abort_held, d, session, r))
        try:
            view, size = d.arena_for(ns.tenant).view, ns.block_bytes
            for offset, frame in zip(r.offsets, payload):
                view[offset:offset + size] = frame.buffer
        except BaseException:
            d.store.abort(session.id, r.id)
            raise
        return self._put_done(session, req, r, now)

    def _put_done(self, session: Session, req: p.Put, r: Reservation,
                  now: float) -> tuple[p.Message, list[Any]]:
        """Commit a put's reservation, its bytes in the arena."""
        d = self.d
        try:  # the store checks the token ids (refused: before anything is published)
            result = d.store.commit(session.id, r.id, now, req.checksums,
                                    req.token_ids or req.tokens)
        except MalformedError:
            d.store.abort(session.id, r.id)
            raise
        self._committed(result.blocks)
        return p.PutReply(req.rid, result.created, result.duplicates,
                          self._tokens_wanted()), []

    def _get(self, session: Session, req: p.Get, payload: list[Any]) -> Answer:
        d = self.d
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        if len(req.keys) * ns.block_bytes > d.max_request_bytes:
            raise TooLargeError(f"get of {len(req.keys)} blocks exceeds the request limit of "
                                f"{d.max_request_bytes} bytes; split it")
        # its blocks stay pinned until the reply is sent, as long as a peer does not
        # read: another tenant's count against the grantee's share, as its acquires do
        d.sessions.check_grant(session, ns, req.keys)
        pin = self._acquire_or_fetch(GET_OWNER, ns, req.keys)
        if isinstance(pin, Plan):
            return pin
        d.sessions.pinned_for_get(session, pin)
        size, arena = ns.block_bytes, d.arena_for(ns.tenant)
        frames = [arena.slot(offset, size) for offset in pin.offsets]
        if not frames:
            self._unpin_get(pin.id)
            return p.GetReply(req.rid, 0), []
        held = len(frames) * size
        try:  # pinned until sent, outside any lease: within the bytes-in-flight limits
            d.sessions.hold_bytes(session, held)
        except LimitExceededError:  # unless its session's replies are still being sent
            own = {pin_id for pin_id, (s, _) in self.sending.items() if s is session}
            trackers = d.transport.trackers_of(own)
            if not trackers:
                self._unpin_get(pin.id)
                raise
            return Later(self._get_after_sends(req.rid, session, pin, frames, held, trackers),
                         functools.partial(self._unpin_get, pin.id))  # (given up: unpinned)
        except BaseException:
            self._unpin_get(pin.id)
            raise
        self.sending[pin.id] = (session, held)
        return p.GetReply(req.rid, len(frames), pin.checksums), PinnedFrames(frames, pin.id)

    async def _get_after_sends(self, rid: int, session: Session, pin: Pin,
                               frames: list[memoryview], held: int,
                               trackers: list[Any]) -> tuple[p.Message, list[Any]]:
        """A get over the bytes-in-flight limit, once its session's replies still being
        sent are (``_SENT_WAIT`` at most: a reply its peer has read counts as sent only
        when zmq gives its buffer back, a little later), admitted if that made room."""
        d = self.d
        try:
            await d.transport.sent(trackers, _SENT_WAIT)
            d.sessions.hold_bytes(session, held)
        except BaseException:
            self._unpin_get(pin.id)
            raise
        self.sending[pin.id] = (session, held)
        return p.GetReply(rid, len(frames), pin.checksums), PinnedFrames(frames, pin.id)

    def get_sent(self, pin_id: int) -> None:
        """A zero-copy get reply went out (or could not): its pin and bytes go back."""
        session, held = self.sending.pop(pin_id)
        self.d.sessions.release_bytes(session, held)
        self._unpin_get(pin_id)

    def _unpin_get(self, pin_id: int) -> None:
        """A get's pin goes back, and its count against a grantee's share."""
        if GET_OWNER in self.d.store.owners:  # (gone: the daemon closes, all went back)
            self.d.store.release(GET_OWNER, pin_id)
        self.d.sessions.unpinned_get(pin_id)

    def _evict(self, session: Session, req: p.Evict, payload: list[Any]) -> Answer:
        ns = self._writable(session, req.ns)
        self._check_keys(req.keys)
        return self.removals.evict(req.rid, ns, req.keys, session)

    def _drop(self, session: Session, req: p.DropNamespace, payload: list[Any]) -> Answer:
        return self.removals.drop(req.rid, self._writable(session, req.ns), session)

    def _warm(self, session: Session, req: p.Warm, payload: list[Any]) -> Outcome:
        d = self.d
        ns = self._writable(session, req.ns)  # the owner's eviction order: not a read
        self._check_keys(req.keys)
        if not 0 < req.seconds <= 86400:
            raise MalformedError("warm: seconds must be in (0, 86400]")
        return p.CountReply(req.rid, d.store.keep_warm(ns, req.keys,
                                                       d.clock() + req.seconds)), []

    def _prefetch(self, session: Session, req: p.Prefetch, payload: list[Any]) -> Answer:
        d = self.d
        ns = self._namespace(session, req.ns)
        self._check_keys(req.keys)
        cached = d.store.lookup(ns, req.keys)
        ready = leading_in_dram(ns, req.keys)
        if ready == len(req.keys) or (d.ssd is None and d.remote is None):
            return p.PrefetchReply(req.rid, ready, len(cached)), []
        task = d.under_way.background(session, len(req.keys), lambda: d.moves.bring_up(
            ns, req.keys, len(cached)), d.spawn)
        if not req.wait:
            return p.PrefetchReply(req.rid, ready, len(cached)), []
        return Later(self._prefetch_reply(req, ns, task), counted=True)

    async def _remote_lookup(self, rid: int, ns: Namespace, keys: list[bytes],
                             tiers: list[str]) -> p.Message:
        """The lookup's reply once the remote store says how much more of the chain it
        holds."""
        remote = self.d.remote
        assert remote is not None
        more = await remote.leading(ns, keys[len(tiers):])
        tiers = tiers + ["remote"] * more
        return p.LookupReply(rid, len(tiers), p.tier_runs(tiers))

    async def _prefetch_reply(self, req: p.Prefetch, ns: Namespace,
                              task: asyncio.Task[None]) -> p.Message:
        timeout = req.timeout_ms / 1000 if req.timeout_ms > 0 else None
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            pass  # what is up by now is the answer; the rest goes on in the background
        cached = sum(1 for _ in leading_present(ns, req.keys))
        return p.PrefetchReply(req.rid, leading_in_dram(ns, req.keys), cached)

    def _report(self, session: Session, req: p.Report, payload: list[Any]) -> Outcome:
        if not 0 <= req.recomputed_tokens <= p.MAX_REPORTED_TOKENS:
            raise MalformedError(f"recomputed_tokens must be 0 to {p.MAX_REPORTED_TOKENS}")
        counts = self.d.scheduling  # saturates: stats (msgpack) always carry it
        counts["recomputed_tokens"] = min(counts["recomputed_tokens"] + req.recomputed_tokens,
                                          MAX_COUNTER)
        return p.OkReply(req.rid), []

    def _stats(self, session: Session, req: p.Stats, payload: list[Any]) -> Outcome:
        self.d.transport.reap_sends()  # pins of get replies already sent are not holdings
        return p.StatsReply(req.rid, stats_for(self.d, session.tenant)), []

    def _gpu_attach(self, session: Session, req: p.GpuAttach, payload: list[Any]) -> Outcome:
        d = self.d
        if d.gpu is None:
            return p.GpuReply(req.rid, b"", d.gpu_reason or "no gpu tier is configured "
                              "(gpu.device, or kvstore serve --gpu-device)"), []
        return p.GpuReply(req.rid, d.gpu.handle), []

    def _ping(self, session: Session, req: p.Ping, payload: list[Any]) -> Outcome:
        return p.OkReply(req.rid), []

    def _bye(self, session: Session, req: p.Bye, payload: list[Any]) -> Outcome:
        """End the session now, as its lease's end would: a client that closed left
        its holdings for a lease's length (a save given up on against a frozen daemon
        kept its slots reserved 30 s after the engine moved on, or exited).  A session
        with other connections attached goes on without this one (its holdings are the
        session's, for the others): the last connection's goodbye ends it."""
        d = self.d
        if len(session.connections) > 1:
            d.sessions.leave(d.sessions.asking)
        else:
            d.store.drop_owner(session.id)
            d.sessions.end(session)  # (its connection told it said goodbye)
            d.moves.freed()
        return p.OkReply(req.rid), []


MAX_COUNTER = (1 << 63) - 1  # where a summed counter stops (msgpack's int64)


# what a tenant's stats leave out with credentials set, unless it is an operator
# (``auth.operators``): figures of the whole daemon, which others' requests move
DAEMON_WIDE = ("tiers", "scheduling", "ssd_io", "gpu", "remote", "events", "before_hello",
               "under_way", "replies", "eviction_switch", "eviction_samples", "side_socket",
               "invariant_violations", "invariant_checks_forked")


def stats_for(d: Daemon, tenant: str) -> dict[str, Any]:
    """The daemon's stats as a session of ``tenant`` sees them.  With credentials, tenants
    are kept apart: only the figures of the tenants whose namespaces it may open, never
    the others' names or use, and none of the whole daemon's (``DAEMON_WIDE``) unless it
    is one of ``auth.operators``; without them (one user's host), every tenant's."""
    stats = d.stats()
    if not d.config.credentials or tenant in d.config.auth.operators:
        return stats
    for name in DAEMON_WIDE:  # they move with every tenant's requests
        stats.pop(name, None)

    def visible(other: str) -> bool:
        return d.auth.may_open(tenant, other)

    # how many sessions and namespaces the daemon holds is others' business too
    stats["sessions"] = sum(t.sessions for name, t in d.sessions.tenants.items()
                            if visible(name))
    stats["namespaces"] = sum(len(group) for name, group
                              in d.store.tenant_namespaces.items() if visible(name))
    # and how many the sessions of each that ended held (the closes still queued)
    stats["namespace_closes_queued"] = sum(
        n for name, n in d.sessions.closes.by_tenant.items() if visible(name))
    for tenant_bytes in ("tenant_dram_bytes", "ssd_tenant_bytes", "remote_tenants"):
        if tenant_bytes in stats:
            stats[tenant_bytes] = {other: nbytes for other, nbytes
                                   in stats[tenant_bytes].items() if visible(other)}
    transfers = stats["transfers"]  # its queues are the daemon's: only the waits
    stats["transfers"] = {"waits": {
        name: {other: waited for other, waited in by_tenant.items() if visible(other)}
        for name, by_tenant in transfers["waits"].items()}}
    # with an arena per tenant, each arena's order is one tenant's figures; its own
    # only: an owner's order counts its grantees' pins and moves with their reads, which
    # a co-grantee must not learn
    stats["eviction_orders"] = [repr(policy) for name, dram in d.store.drams.items()
                                if name == tenant for policy in dram.policies.values()]
    # slabs per block size: of its own arena only (a shared tier's move with the others')
    stats["slab_classes"] = {"dram": [c for c in stats["slab_classes"]["dram"]
                                      if c["arena"] == tenant], "ssd": []}
    # what it keeps pinned of other tenants' DRAM (auth.grantee_pin_share): its own
    stats["grantee_pinned_bytes"] = {tenant: d.sessions.grant_pins.of(tenant)}
    return stats


async def _put_in_slices(v: Verbs, session: Session, req: p.Put, ns: Namespace,
                         r: Reservation, payload: list[Any]) -> p.Message:
    """A put of more than ``PUT_SLICE_BYTES`` copies into the arena a slice a loop
    turn (a 256 MiB put held every client's requests 80-150 ms), then commits as
    ``_put`` does.  Between slices its reservation may go (the session closed or its
    lease ran out, and the slots went back): then nothing more is written there."""
    d = v.d
    view, size = d.arena_for(ns.tenant).view, ns.block_bytes
    budget = PUT_SLICE_BYTES
    try:
        for offset, frame in zip(r.offsets, payload):
            buf = frame.buffer
            for start in range(0, size, PUT_SLICE_BYTES):
                end = min(size, start + PUT_SLICE_BYTES)
                view[offset + start:offset + end] = buf[start:end]
                budget -= end - start
                if budget <= 0:
                    await v.removals.turns.turn()  # a turn for everyone else, and by turns
                    budget = PUT_SLICE_BYTES
                    if not _holds(d, session, r):
                        raise LeaseExpiredError(
                            "the put's reservation was rolled back while its bytes "
                            "were copied (its session closed or its lease ran out)")
    except BaseException:
        if _holds(d, session, r):
            d.store.abort(session.id, r.id)
        raise
    reply, _ = v._put_done(session, req, r, d.clock())
    return reply


def unheld(r: Reservation, frames: list[Any]) -> list[Any]:
    """A put's frames of the keys its reservation gave a slot (``r.offsets``' order)."""
    if not r.held:
        return frames
    return [frame for i, frame in enumerate(frames) if i not in r.held]


def _abort_held(d: Daemon, session: Session, r: Reservation) -> None:
    """A put in slices given up before its copy began (the server refused it: its
    session's bytes in flight at the limit): its reservation goes back.  Else it stayed
    held, with no id its client could abort, until the session ended."""
    if _holds(d, session, r):
        d.store.abort(session.id, r.id)
        d.sessions.counted(session)  # (counted after the attempt that took it)


def _holds(d: Daemon, session: Session, r: Reservation) -> bool:
    """Whether the session still holds reservation ``r``."""
    state = d.store.owners.get(session.id)
    return state is not None and state.reservations.get(r.id) is r


def reserve_batch(v: Verbs, session: Session, req: p.ReserveBatch,
                  payload: list[Any]) -> Answer:
    """Reserve the blocks of a whole token plan, all or none.  Admitted by the slots its
    size could have (``BlockStore.available_slots``), those of slabs other sizes could
    hand over among them; a plan that those turn out not to hold (their slabs each with
    a pinned block, say) gets the answer the size's own slots give, not an error."""
    d = v.d
    ns = v._writable(session, req.ns)
    if len(req.plan) > d.max_keys:  # before any work that grows with it
        raise TooLargeError(f"{len(req.plan)} plan items in one request; the limit is "
                            f"{d.max_keys}")
    bt = ns.identity.block_tokens
    requests = [TokenRequest(item.reserved_tokens, item.new_tokens) for item in req.plan]
    for i, (item, need) in enumerate(zip(req.plan, admit_batch(requests, bt, 0).blocks)):
        if len(item.keys) != need:
            raise MalformedError(f"plan item {i} adds {need} blocks but names "
                                 f"{len(item.keys)} keys")
    v._check_keys([k for item in req.plan for k in item.keys])
    # one reservation per item with keys: all under the tenant's cap, or none
    d.sessions.check_cap(session, "reservations", sum(1 for item in req.plan if item.keys))
    d.sessions.check_grant_reserve(session, ns, sum(len(item.keys) for item in req.plan))
    # keys held in DRAM take no slot: pinned till every item is reserved (each item's
    # reserve pins its own), so that no room made for one item evicts another's
    held, skipped = d.store.leases.pin_plan(ns, [item.keys for item in req.plan], session.id,
                                            session.tenant, Skip.asked(req))
    try:  # (nor do awaited keys: counted in ``skipped``)
        return _reserve_plan(v, session, req, ns, requests, skipped)
    finally:
        for h in held:
            d.store.leases.unpin_held(h)


def _reserve_plan(v: Verbs, session: Session, req: p.ReserveBatch, ns: Namespace,
                  requests: list[TokenRequest], held: list[int]) -> Answer:
    """``reserve_batch`` once checked, the blocks held in DRAM pinned (``held``: each
    item's keys taking no slot, awaited too): admitted by the slots it takes, or none."""
    d, bt = v.d, ns.identity.block_tokens
    available = d.store.available_slots(ns)
    own = own_slots(ns.dram, ns.cls)  # (without another size's slabs)
    decision = admit_batch(requests, bt, available, held=held)
    if not decision.admitted:
        d.store.counters.capacity_rejects += 1
        return p.BatchReply(req.rid, False, list(decision.blocks), list(decision.fitting),
                            [], [], d.limits.lease_seconds, v._tokens_wanted()), []
    done: list[Reservation] = []
    try:
        for item in req.plan:
            if item.keys:
                r = d.store.reserve(session.id, ns, item.keys, item.parent, d.clock(),
                                    Skip.asked(req), session.tenant)
                if isinstance(r, Plan):  # room first: all or none, so none yet
                    for taken in done:
                        d.store.abort(session.id, taken.id)
                    if (r.earmarks or r.drains) and done:  # a slab (or a step of one)
                        # taken: those the aborts emptied stay the batch's too (not for
                        # a turn it only waits out while another size takes its slabs:
                        # two batches waiting so would each hold slabs aside from the
                        # other, turn after turn)
                        set_aside(r, ns.dram.pool, ns.cls, decision.total)
                    if done:
                        d.moves.freed()
                    return r
                done.append(r)
    except BaseException as exc:
        for r in done:
            d.store.abort(session.id, r.id)
        if not isinstance(exc, CapacityError) or exc.cause == "quota":
            raise
        mine = admit_batch(requests, bt, own, held=held)
        if mine.admitted:
            raise  # (not a slab the other sizes held after all)
        if done:
            d.moves.freed()
        return p.BatchReply(req.rid, False, list(mine.blocks), list(mine.fitting),
                            [], [], d.limits.lease_seconds, v._tokens_wanted()), []
    return p.BatchReply(req.rid, True, list(decision.blocks), [],
                        [r.id for r in done], [r.slots() for r in done],
                        d.limits.lease_seconds, v._tokens_wanted()), []


def lookup_pin(v: Verbs, session: Session, req: p.LookupPin, payload: list[Any]) -> Answer:
    """A lookup that pins its leading hits in DRAM for the session: a client that reads
    what it finds saves the acquire's round trip.  Every check runs before the pin; a
    session or tenant at its pin limit, or a grantee at its share of the owner's DRAM
    (``auth.grantee_pin_share``), gets the lookup, nothing pinned (the client acquires
    later, as after a plain lookup)."""
    d = v.d
    ns = v._namespace(session, req.ns)
    v._check_keys(req.keys)
    tiers = d.store.lookup(ns, req.keys)
    ready = leading_in_dram(ns, req.keys[:len(tiers)])
    pin: Pin | None = None
    if ready:
        try:
            d.sessions.check_cap(session, "pins")
            d.sessions.check_grant(session, ns, req.keys[:ready])
            got = d.store.acquire(session.id, ns, req.keys[:ready], d.clock(), promote=False)
            pin = got if isinstance(got, Pin) else None
            if pin is not None:
                d.sessions.pinned(session, pin)
        except LimitExceededError:
            pin = None
    if d.remote is not None and len(tiers) < len(req.keys) and d.remote.healthy:
        return Later(_remote_lookup_pin(v, req.rid, session, ns, req.keys, tiers, pin),
                     functools.partial(_unpin_lookup, v, session, pin))
    if d.metrics is not None:
        bt = ns.identity.block_tokens
        d.metrics.observe_lookup_tokens(d.store.tier, session.tenant, len(tiers) * bt,
                                        (len(req.keys) - len(tiers)) * bt)
    return _lookup_pin_reply(req.rid, len(tiers), p.tier_runs(tiers), pin), []


async def _remote_lookup_pin(v: Verbs, rid: int, session: Session, ns: Namespace,
                             keys: list[bytes], tiers: list[str],
                             pin: Pin | None) -> p.Message:
    """The remote lookup's reply (``Verbs._remote_lookup``) with the pin taken; the pin
    goes back if no reply does."""
    try:
        found = await v._remote_lookup(rid, ns, keys, tiers)
    except BaseException:
        _unpin_lookup(v, session, pin)
        raise
    assert isinstance(found, p.LookupReply), type(found)
    return _lookup_pin_reply(rid, found.blocks, found.tier_runs, pin)


def _unpin_lookup(v: Verbs, session: Session, pin: Pin | None) -> None:
    """A lookup's pin goes back when no reply carries it: the remote lookup failed, or
    the request was given up before it ran (refused for the work under way: the pin
    stayed the session's, unknown to its client, until the session ended)."""
    if pin is not None and session.id in v.d.store.owners:
        v.d.store.release(session.id, pin.id)
        v.d.sessions.unpinned(session, pin.id)
        v.d.sessions.counted(session)  # (counted after the attempt that took it)


def _lookup_pin_reply(rid: int, blocks: int, runs: list[tuple[str, int]],
                      pin: Pin | None) -> p.LookupPinReply:
    if pin is None:
        return p.LookupPinReply(rid, blocks, runs)
    return p.LookupPinReply(rid, blocks, runs, pin.id, pin.offsets, pin.checksums)


def arena_to_make(d: Daemon, routing_id: bytes, req: Any,
                  curve_tenant: str | None) -> Coroutine[Any, Any, None] | None:
    """The making of the arena a hello (or a shared writer's first namespace of its
    owner's) needs and that does not exist yet: a tenant's own arena takes a second
    or so a GiB to allocate and map, which on the loop stalled every other client;
    made on a thread, the request is then handled.  None: nothing to make."""
    arenas = d.arenas
    if not isinstance(req, (p.Hello, p.OpenNamespace)) or arenas is None \
            or not d.store.per_tenant:  # (every request asks: the cheapest test first)
        return None
    if isinstance(req, p.Hello):
        # (one the cheap checks refuse makes nothing: ``greet`` refuses it at once)
        if (req.version != p.PROTOCOL_VERSION or req.attach
                or routing_id in d.sessions.by_connection):
            return None
        tenant = d.auth.tenant_of(req.tenant, req.token, curve_tenant)
    else:  # a namespace: of another tenant's, which a shared writer may make
        session = d.sessions.get(routing_id)
        tenant = req.identity.tenant
        if not d.auth.may_write(session.tenant, tenant):
            return None
    name = d.store.arena_of(tenant)
    return None if name in arenas.by_name else arenas.make(name)
