"""Sessions and the limits on them: request rates, bytes in flight, per-tenant caps.

A session is what a hello opens: a tenant, the namespaces it opened, and a lease in the
store that its reservations and pins share (the store's owner of the same id).  Several
connections may attach to one session.

Per-tenant caps on reservations and pins are checked in O(1): each session remembers how
many it held when last counted, and its tenant keeps the sum.  A session's holdings change
only through its own requests (counted after each one) and when its lease runs out
(``forget``), so the sums stay exact; ``check_invariants`` recounts them.

What a session pins in namespaces of other tenants (granted by ``auth.shared_tenants``)
is counted in bytes too, per grantee tenant and owner (``kvstore.grant_pins``): the
session keeps the pins it was charged for, and gives them back as they are released or
its lease runs out; the pins of its get replies there count to its tenant until the
replies are sent (``get_pins``: they outlive the lease).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.blocks import Pin
from kvstore.config import ServerConfig
from kvstore.sizes import parse_size
from kvstore.errors import (
    ForbiddenError,
    KVStoreError,
    LimitExceededError,
    NoSessionError,
    SessionExpiredError,
)
from kvstore.grant_pins import GrantPins
from kvstore.identity import Identity
from kvstore.namespace_closes import NamespaceCloses
from kvstore.store import BlockStore, Namespace
from kvstore.unread import UnreadBytes

_NO_SESSION = (f"{NoSessionError.PREFIX} for this connection: the first request must be "
               "hello (a daemon that restarted has none of the connections before it)")
_EXPIRED_REMEMBERED = 4096  # connections whose session expired, told so (not "no session")
# Connections one session keeps (a client's sockets, reconnects attaching again): past
# it, the oldest is let go (a peer without a session again).  Unbounded, each attach held
# about 140 bytes for the session's life, and each lease's end walked them all: a
# million attaches, 81 MB and 350 ms of the loop.
CONNECTIONS_PER_SESSION = 64
_LET_GO = (f"{NoSessionError.PREFIX}: {CONNECTIONS_PER_SESSION} newer connections attached "
           "to this one's session")
# a connection that said goodbye while others of its session stayed: it was a peer
# without a session again, and past its first few messages (or at once, a put's
# frames) the transport dropped what it sent unanswered, as a stranger's
_SAID_GOODBYE = (f"{NoSessionError.PREFIX}: this connection said goodbye and left its "
                 "session; say hello again for a new one")

Holding = Literal["reservations", "pins"]


@dataclass(eq=False)
class Session:
    id: str
    tenant: str
    namespaces: set[bytes] = field(default_factory=set)
    uids: set[int] = field(default_factory=set)  # of its ipc connections' processes
    tokens: float = 0.0          # request-rate bucket
    refilled: float = 0.0
    bytes_in_flight: int = 0     # payload of deferred puts and of get replies not yet sent
    reservations: int = 0        # open reservations and pins, when last counted
    pins: int = 0
    # its pins in other tenants' namespaces, by id, counted in ``Sessions.grant_pins``
    grant_pins: dict[int, Pin] = field(default_factory=dict)
    # its pins in other tenants' namespaces taken uncounted (a share of 1 counts none)
    free_pins: set[int] = field(default_factory=set)
    connections: dict[bytes, None] = field(default_factory=dict)  # routing ids, oldest first
    said_goodbye: bool = False  # ended by its last connection's goodbye, not its lease

    def __repr__(self) -> str:
        return f"Session({self.id[:8]}, tenant={self.tenant}, namespaces={len(self.namespaces)})"

    def attach(self, connection: bytes) -> bytes | None:
        """``connection`` is one of the session's; the oldest let go, if one is."""
        self.connections[connection] = None
        if len(self.connections) <= CONNECTIONS_PER_SESSION:
            return None
        oldest = next(iter(self.connections))
        del self.connections[oldest]
        return oldest


def _expire(expired: dict[bytes, Any], connection: bytes, why: Any = None) -> None:
    """Remember that ``connection`` has no session any more (the latest
    ``_EXPIRED_REMEMBERED``), to tell it so (``why``)."""
    expired[connection] = why
    if len(expired) > _EXPIRED_REMEMBERED:
        del expired[next(iter(expired))]


def _check_unread(unread: int, limit: int) -> None:
    """A connection's big replies not yet sent, within ``limit`` (0: no limit)."""
    if limit and unread >= limit:
        raise LimitExceededError(f"{unread} bytes of this connection's replies are not "
                                 f"read yet (limit {limit}); read them first")


@dataclass(eq=False)
class Tenant:
    """What a tenant's sessions hold together, for the per-tenant limits."""

    name: str
    # its sessions by id: what is counted over them walks these, never every tenant's
    members: dict[str, Session] = field(default_factory=dict)
    tokens: float = 0.0          # request-rate bucket, made at the first limited request
    refilled: float | None = None
    bytes_in_flight: int = 0
    reservations: int = 0
    pins: int = 0

    @property
    def sessions(self) -> int:
        return len(self.members)

    def __repr__(self) -> str:
        return (f"Tenant({self.name!r}, sessions={self.sessions}, "
                f"reservations={self.reservations}, pins={self.pins}, "
                f"bytes_in_flight={self.bytes_in_flight})")


@dataclass(eq=False)
class IdleTenants:
    """The tenants that may hold nothing any more (no session), to forget once their
    request rate bucket is full again: else every name a hello ever gave (a daemon
    without credentials takes the one a client names) stayed for good.  A tenant made
    anew is then the same as the one forgotten, so no limit is lifted."""

    names: dict[str, None] = field(default_factory=dict)

    def note(self, tenant: Tenant | None) -> None:
        if tenant is not None and not tenant.sessions:
            self.names[tenant.name] = None

    def drop(self, tenants: dict[str, Tenant], now: float) -> None:
        """Take out of ``tenants`` those with no session and nothing in flight whose
        bucket is full (one that is not yet is looked at again next time)."""
        for name in list(self.names):
            tenant = tenants.get(name)
            if tenant is None or tenant.sessions:
                del self.names[name]
            elif (not tenant.bytes_in_flight and not tenant.reservations
                  and not tenant.pins and (tenant.refilled is None
                                           or now - tenant.refilled >= 1.0)):
                # (holdings without a session would be a defect the invariant check
                # reports; here, on the reaper's turn, such a tenant is only kept)
                del tenants[name]
                del self.names[name]


class Sessions:
    """The daemon's sessions by connection and by id, their tenants, and their limits."""

    def __init__(self, store: BlockStore, settings: ServerConfig, *,
                 clock: Callable[[], float], max_bytes_in_flight: int,
                 max_tenant_bytes_in_flight: int, grantee_pin_share: float = 1.0,
                 grantee_pin_total: float = 1.0) -> None:
        self.store = store
        self.clock = clock
        self.max_bytes_in_flight = max_bytes_in_flight
        self.max_tenant_bytes_in_flight = max_tenant_bytes_in_flight
        self.bytes_in_flight = 0  # over every session (``hold_bytes``)
        self.by_connection: dict[bytes, Session] = {}  # routing id -> session
        self.by_id: dict[str, Session] = {}
        self.tenants: dict[str, Tenant] = {}
        self._expired: dict[bytes, None] = {}
        # connections let go past a session's CONNECTIONS_PER_SESSION, apart: attaches
        # (one tenant's) never push other tenants' lease ends out of ``_expired``
        # (and those that said goodbye and left one: each with what it is told)
        self._let_go: dict[bytes, str] = {}
        self.idle = IdleTenants()
        self.closes = NamespaceCloses(store)  # ended sessions' namespaces, closed in slices
        self.grant_pins = GrantPins(grantee_pin_share, self._owner_dram, grantee_pin_total)
        # pins of get replies not yet sent in other tenants' namespaces, by id: counted
        # to the asking tenant (they outlive its session's lease, till zmq sends them)
        self.get_pins: dict[int, tuple[str, Pin]] = {}
        # bytes of big replies unsent, by connection, tenant and in all (``RepliesInFlight``)
        self.unread = UnreadBytes(self._tenant_of)
        self.asking = b""  # the connection of the request being handled (``get``)
        self.configure(settings, grantee_pin_share, grantee_pin_total)

    def configure(self, s: ServerConfig, grantee_pin_share: float | None = None,
                  grantee_pin_total: float | None = None) -> None:
        """Take the (live-changeable) limits from the server settings (and
        ``auth.grantee_pin_share``: a lower share refuses new pins, takes none back)."""
        if grantee_pin_share is not None:
            self.grant_pins.share = grantee_pin_share
        if grantee_pin_total is not None:
            self.grant_pins.total = grantee_pin_total
        self.max_requests_per_second = s.max_requests_per_second
        self.max_requests_per_second_per_tenant = s.max_requests_per_second_per_tenant
        self.max_reservations_per_tenant = s.max_reservations_per_tenant
        self.max_pins_per_tenant = s.max_pins_per_tenant
        self.max_namespaces_per_session = s.max_namespaces_per_session
        self.max_namespaces_per_tenant = s.max_namespaces_per_tenant
        self.max_total_bytes_in_flight = parse_size(s.max_bytes_in_flight_total,
                                                    "server.max_bytes_in_flight_total")
        # each session a hello opens holds about 1.6 KB till its lease ends, whether its
        # connection stays or not (0: no limit)
        self.max_sessions_per_tenant = s.max_sessions_per_tenant

    def bound_bytes_in_flight(self, s: ServerConfig) -> None:
        """A reload's bounds on bytes in flight per session and per tenant (the daemon's
        is ``configure``'s): a lower one refuses what would pass it, takes back nothing
        under way.  (The constructor's are the start-up's.)"""
        self.max_bytes_in_flight = parse_size(s.max_bytes_in_flight, "server.max_bytes_in_flight")
        self.max_tenant_bytes_in_flight = parse_size(s.max_bytes_in_flight_per_tenant,
                                                     "server.max_bytes_in_flight_per_tenant")

    def __len__(self) -> int:
        return len(self.by_id)

    def __repr__(self) -> str:
        return (f"Sessions(sessions={len(self.by_id)}, connections={len(self.by_connection)}, "
                f"tenants={len(self.tenants)})")

    # -- hello, attach, lookup ---------------------------------------------------------------
    def hello(self, routing_id: bytes, tenant: str, attach: str,
              uid: int | None = None, *,
              prepare: Callable[[str], object] | None = None) -> Session:
        """A new session for a connection, or the connection attached to one of its
        tenant's sessions (``attach``, a session id); ``uid`` is the connecting process's
        (over ipc), the one its arenas' descriptors may go to (``kvstore.side_socket``).
        ``prepare(tenant)`` runs once the cheap checks pass, before the session opens
        (the daemon makes the tenant's arena there, which may be refused): a hello
        refused by those checks makes nothing."""
        if routing_id in self.by_connection:
            raise ForbiddenError("this connection already has a session; a second hello is "
                                 "refused (connect again for a new one)")
        try:
            # a hello is a request of its tenant's too: else a peer that connects, says
            # hello and goes, again and again, makes sessions past any rate (each held
            # till its lease)
            self._admit_tenant(tenant)
            attached = self.by_id.get(attach) if attach else None
            if attach and (attached is None or attached.tenant != tenant):
                raise ForbiddenError("no such session to attach to")
            held, cap = self.tenants.get(tenant), self.max_sessions_per_tenant
            if cap and attached is None and held is not None and held.sessions >= cap:
                raise LimitExceededError(f"tenant {tenant!r} has {cap} sessions (the limit); "
                                         f"close one, or wait for an idle one's lease to end")
            if prepare is not None:
                prepare(tenant)
        except BaseException:
            self.idle.note(self.tenants.get(tenant))  # one made for a refused hello
            raise
        if attached is not None:
            session = attached
        else:
            session = Session(secrets.token_hex(16), tenant)
            self.by_id[session.id] = session
            self._tenant(tenant).members[session.id] = session
        if uid is not None:
            session.uids.add(uid)
        self.by_connection[routing_id] = session
        if (let_go := session.attach(routing_id)) is not None:
            del self.by_connection[let_go]
            _expire(self._let_go, let_go, _LET_GO)
        self.store.touch_owner(session.id, self.clock())
        return session

    def drop_idle_tenants(self) -> None:
        """Forget the tenants left with nothing (``IdleTenants``)."""
        self.idle.drop(self.tenants, self.clock())

    def known(self, routing_id: bytes) -> bool:
        """Whether a connection has a session, or had one that expired (it is told so)."""
        return (routing_id in self.by_connection or routing_id in self._expired
                or routing_id in self._let_go)

    def get(self, routing_id: bytes) -> Session:
        """The session of a connection; an error that says why when there is none.  The
        connection is remembered as the one asking (``asking``), for the request's
        handler."""
        self.asking = routing_id
        session = self.by_connection.get(routing_id)
        if session is None:
            if (why := self._let_go.get(routing_id)) is not None:
                raise NoSessionError(why)
            if routing_id in self._expired:
                raise SessionExpiredError(
                    f"{SessionExpiredError.PREFIX} and its holdings were rolled back; "
                    "connect again")
            raise NoSessionError(_NO_SESSION)
        return session

    def leave(self, routing_id: bytes) -> None:
        """A connection of a session others are attached to said goodbye: it leaves the
        session (which goes on for the others; the last one's goodbye ends it): a peer
        without a session again."""
        session = self.by_connection.pop(routing_id)
        del session.connections[routing_id]
        _expire(self._let_go, routing_id, _SAID_GOODBYE)  # told so, never dropped unread

    def end(self, session: Session) -> None:
        """The last connection of ``session`` said goodbye: the session ends, as at its
        lease's end, and that connection is told so, not that a lease ran out."""
        session.said_goodbye = True
        self.forget({session.id})
        if self._expired.pop(self.asking, 0) is None:  # (remembered there, for a lease)
            _expire(self._let_go, self.asking, _SAID_GOODBYE)

    def forget(self, gone: set[object]) -> None:
        """Drop the sessions whose lease ran out (their holdings are rolled back), and
        remember their connections for a while, to tell them so."""
        for owner in gone:
            session = self.by_id.pop(owner, None) if isinstance(owner, str) else None
            if session is not None:
                tenant = self._tenant(session.tenant)
                del tenant.members[session.id]
                self.idle.note(tenant)
                tenant.reservations -= session.reservations
                tenant.pins -= session.pins
                session.reservations = session.pins = 0
                for pin in session.grant_pins.values():  # the store dropped them
                    self.grant_pins.discharge(session.tenant, pin, now=False)
                session.grant_pins.clear()
                session.free_pins.clear()
                self._close_namespaces(session)
                for routing_id in session.connections:
                    del self.by_connection[routing_id]
                    _expire(self._expired, routing_id)

    def _close_namespaces(self, session: Session) -> None:
        """A session that ended no longer uses its namespaces: their closes are queued,
        done a slice a loop turn (``kvstore.namespace_closes``)."""
        self.closes.queue(session.tenant, session.namespaces)  # (handed over whole)
        session.namespaces = set()

    def open_namespace(self, session: Session, identity: Identity) -> Namespace:
        """The namespace of ``identity``, open in the session (its one use of it), within
        the caps (if refused, nothing is made)."""
        ns_id = identity.namespace_id
        if ns_id in session.namespaces:
            return self.store.namespaces[ns_id]
        self._check_namespaces(session, identity.tenant, ns_id)
        ns = self.store.open_namespace(identity)
        session.namespaces.add(ns_id)
        return ns

    def _check_namespaces(self, session: Session, tenant: str, ns_id: bytes) -> None:
        """The caps on namespaces, for one the session has not open: the session's open
        ones, and a tenant's (those some session has open or that hold blocks: the store
        forgets the others); one the store has already passes the tenant's."""
        cap = self.max_namespaces_per_session
        if len(session.namespaces) >= cap:
            raise LimitExceededError(
                f"the session has {len(session.namespaces)} namespaces open (limit {cap})")
        cap = self.max_namespaces_per_tenant
        if cap and ns_id not in self.store.namespaces:
            held = len(self.store.tenant_namespaces.get(tenant, ()))
            if held >= cap:
                raise LimitExceededError(
                    f"tenant {tenant!r} has {held} namespaces in use (limit {cap}); a "
                    f"namespace no session has open and that holds no block is forgotten"
                    + closing_soon(self.closes.by_tenant.get(tenant, 0)))

    def _tenant(self, name: str) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name)
        return tenant

    # -- limits ----------------------------------------------------------------------------
    def admit(self, session: Session, connection: bytes = b"") -> None:
        """Request rates, per session and per tenant, as token buckets (a burst of one
        second's worth each), and the connection's big replies unread (within
        ``max_bytes_in_flight``), the tenant's and the daemon's too while it has some
        unread (``check_totals``).  Each request also does a bounded part of the grantee
        pins' queued discharges (``GrantPins.drain``): exact counts soon after."""
        if self.unread:
            _check_unread(self.unread.by_peer.get(connection, 0), self.max_bytes_in_flight)
            if session.tenant in self.unread.by_tenant:
                check_totals(self, session.tenant)
        self.grant_pins.drain()
        now = self.clock()
        rate = self.max_requests_per_second
        if rate:
            session.tokens = min(rate, session.tokens + (now - session.refilled) * rate)
            session.refilled = now
            if session.tokens < 1.0:
                raise LimitExceededError(
                    f"more than {rate:g} requests per second from this session; slow down")
        self._admit_tenant(session.tenant, now)
        if rate:
            session.tokens -= 1.0

    def _admit_tenant(self, name: str, now: float | None = None) -> None:
        """The tenant's request rate: a token from its bucket, or LimitExceededError."""
        tenant_rate = self.max_requests_per_second_per_tenant
        if not tenant_rate:
            return
        now = self.clock() if now is None else now
        bucket = self._tenant(name)
        if bucket.refilled is None:
            bucket.tokens, bucket.refilled = tenant_rate, now
        bucket.tokens = min(tenant_rate, bucket.tokens + (now - bucket.refilled) * tenant_rate)
        bucket.refilled = now
        if bucket.tokens < 1.0:
            raise LimitExceededError(
                f"more than {tenant_rate:g} requests per second from tenant {name!r}; "
                f"slow down")
        bucket.tokens -= 1.0

    def check_cap(self, session: Session, what: Holding, adding: int = 1) -> None:
        """Per-tenant caps on open reservations and pins, over all its sessions: refused
        unless ``adding`` more fit under it."""
        if what == "reservations":
            cap = self.max_reservations_per_tenant
        else:
            cap = self.max_pins_per_tenant
        if not cap:
            return
        tenant = self.tenants[session.tenant]
        held = tenant.reservations if what == "reservations" else tenant.pins
        if held + adding > cap:
            raise LimitExceededError(
                f"tenant {session.tenant!r} holds {held} {what} (limit {cap}); "
                f"{adding} more would pass it; release some")

    def counted(self, session: Session) -> None:
        """Count a session's holdings again after a request of its own; its tenant's
        sums take the difference."""
        state = self.store.owners.get(session.id)
        reservations, pins = (0, 0) if state is None else (len(state.reservations),
                                                           len(state.pins))
        if reservations != session.reservations or pins != session.pins:
            if session.id in self.by_id:  # one that expired meanwhile gave them back
                tenant = self.tenants[session.tenant]
                tenant.reservations += reservations - session.reservations
                tenant.pins += pins - session.pins
                session.reservations, session.pins = reservations, pins

    # -- pins in other tenants' namespaces --------------------------------------------------
    def check_grant(self, session: Session, ns: Namespace, keys: list[bytes]) -> None:
        """Refuse (LimitExceededError), before anything is pinned, a pin of ``keys`` in
        another tenant's namespace past the session's tenant's share of that tenant's
        DRAM (``auth.grantee_pin_share``); nothing for its own namespaces."""
        if ns.tenant == session.tenant or not self.grant_pins.counting:
            return
        blocks = ns.blocks
        self.grant_pins.check(session.tenant, ns, (blocks.get(key) for key in keys),
                              reserved=self._reserved_in(session.tenant, ns.tenant))

    def check_grant_reserve(self, session: Session, ns: Namespace, count: int) -> None:
        """Refuse (LimitExceededError) a reservation of ``count`` blocks in another
        tenant's namespace (a ``shared_writers`` grantee's) that would take its tenant's
        open reservations in that tenant's namespaces, with its pins there, past its
        share.  Recounted from the store each time (no state to give back at commit,
        abort or lease end): the slots each of the tenant's sessions holds reserved in
        that tenant's namespaces, which the store keeps as they change (O(sessions), not
        O(reservations): 100k one-key reservations made each reserve walk them all)."""
        if ns.tenant == session.tenant or not self.grant_pins.counting:
            return
        reserved = count + self._reserved_in(session.tenant, ns.tenant)
        self.grant_pins.check_reserve(session.tenant, ns, reserved)

    def _reserved_in(self, tenant: str, owner: str) -> int:
        """The slots ``tenant``'s sessions hold reserved in ``owner``'s namespaces (its
        own sessions walked: every tenant's made each reserve cost O(all sessions), 1.3
        ms at 60k, which another tenant's hellos could add)."""
        reserved = 0
        owners = self.store.owners
        held = self.tenants.get(tenant)
        for other in held.members.values() if held is not None else ():
            state = owners.get(other.id)
            if state is not None:
                reserved += state.reserved_in.get(owner, 0)
        return reserved

    def pinned(self, session: Session, pin: Pin) -> None:
        """Count a pin the session took (``acquire``, ``lookup_pin``) if it is in
        another tenant's namespace."""
        if pin.blocks and pin.blocks[0].ns.tenant != session.tenant:
            if not self.grant_pins.counting:
                session.free_pins.add(pin.id)
                return
            self.grant_pins.charge(session.tenant, pin)
            session.grant_pins[pin.id] = pin

    def unpinned(self, session: Session, pin_id: int) -> None:
        """A pin of the session went back (``release``, or a reply that never went)."""
        session.free_pins.discard(pin_id)
        pin = session.grant_pins.pop(pin_id, None)
        if pin is not None:
            self.grant_pins.discharge(session.tenant, pin)

    def pinned_for_get(self, session: Session, pin: Pin) -> None:
        """Count the pin of a get reply (until sent) if it is in another tenant's
        namespace: a peer that never reads holds it as long as an acquire."""
        if (pin.blocks and pin.blocks[0].ns.tenant != session.tenant
                and self.grant_pins.counting):
            self.grant_pins.charge(session.tenant, pin)
            self.get_pins[pin.id] = (session.tenant, pin)

    def unpinned_get(self, pin_id: int) -> None:
        """A get reply's pin went back (sent, or never to be)."""
        held = self.get_pins.pop(pin_id, None)
        if held is not None:
            self.grant_pins.discharge(*held)

    def _owner_dram(self, ns: Namespace) -> int:
        """The DRAM a grantee's share is of: the arena of ``ns``'s owner, or what its
        owner may hold of a shared one (``dram.tenant_quota``)."""
        capacity = ns.dram.pool.capacity_bytes
        quota = self.store.tenant_quota
        if quota and not self.store.per_tenant:
            return min(capacity, quota)
        return capacity

    def hold_bytes(self, session: Session, held: int) -> None:
        """Count the payload of a request that finishes later, within both limits (0: no
        limit): a request is admitted while what is under way is below the limit, so a
        peer that never reads holds at most the limit and one request, and one whose
        replies zmq has not yet counted as sent (a little after the peer has them) is
        not shut out, nor one larger than the limit.  Nothing waits on the loop."""
        if not held:  # (a request that waits and holds nothing: a drop after sends)
            return
        limit = self.max_bytes_in_flight
        if limit and session.bytes_in_flight >= limit:
            raise LimitExceededError(
                f"the session has {session.bytes_in_flight} bytes in requests still under "
                f"way (limit {limit}); wait for their replies")
        tenant = check_totals(self, session.tenant)
        session.bytes_in_flight += held
        tenant.bytes_in_flight += held
        self.bytes_in_flight += held

    def _tenant_of(self, connection: bytes) -> str | None:
        session = self.by_connection.get(connection)
        return None if session is None else session.tenant

    def release_bytes(self, session: Session, held: int) -> None:
        """The request that held ``held`` bytes has its reply."""
        if not held:  # (held nothing: its tenant may be gone, and must not come back)
            return
        session.bytes_in_flight -= held
        tenant = self._tenant(session.tenant)
        tenant.bytes_in_flight -= held
        self.bytes_in_flight -= held
        self.idle.note(tenant)  # (a reply that outlived its session's lease)

    def check_invariants(self) -> None:
        """Each session's counts match its holdings in the store, and each tenant's sums
        match its sessions' counts (AssertionError if not)."""
        check_sessions(self)


def check_totals(sessions: Sessions, name: str) -> Tenant:
    """Tenant ``name``'s bytes in requests under way and in big replies unsent, over
    all its sessions, below its bound, and, where it leaves replies unread, the
    daemon's below its bound or its own below its share of it (0: no bound), or
    LimitExceededError: a tenant's many sessions (4096), or many tenants, that never
    read held a connection's bound each.  The tenant."""
    tenant = sessions._tenant(name)
    limit = sessions.max_tenant_bytes_in_flight
    unread = sessions.unread.by_tenant
    held = tenant.bytes_in_flight + unread.get(name, 0)
    if limit and held >= limit:
        raise LimitExceededError(
            f"tenant {name!r} has {held} bytes in replies not yet read and requests "
            f"still under way over its sessions (limit {limit}, "
            f"max_bytes_in_flight_per_tenant); read the replies first")
    # The daemon's bound refuses only the tenants that leave replies unread, each at its
    # share of the bound among them: counted for every tenant, two tenants that never
    # read (each within its own bound) got every other tenant's gets refused, told to
    # read replies it did not have
    limit = sessions.max_total_bytes_in_flight
    if limit and name in unread:
        total = sessions.bytes_in_flight + sessions.unread.total
        if total >= limit and held >= limit // len(unread):
            raise LimitExceededError(
                f"the daemon holds {total} bytes in replies not yet read and requests "
                f"still under way (limit {limit}, max_bytes_in_flight_total), tenant "
                f"{name!r} {held} of them; read the replies first")
    return tenant


def check_sessions(sessions: Sessions) -> None:
    """``Sessions.check_invariants``."""
    sums: dict[str, list[int]] = {}
    for session in sessions.by_id.values():
        state = sessions.store.owners.get(session.id)
        held = (0, 0) if state is None else (len(state.reservations), len(state.pins))
        assert (session.reservations, session.pins) == held, (
            f"{session} counted {session.reservations} reservations and {session.pins} "
            f"pins; it holds {held[0]} and {held[1]}")
        total = sums.setdefault(session.tenant, [0, 0, 0])
        total[0] += 1
        total[1] += session.reservations
        total[2] += session.pins
    for name, tenant in sessions.tenants.items():
        expected = sums.get(name, [0, 0, 0])
        assert [tenant.sessions, tenant.reservations, tenant.pins] == expected, (
            f"{tenant} does not sum its sessions: {expected}")
        assert all(sessions.by_id.get(i) is s for i, s in tenant.members.items()), tenant
    assert sessions.bytes_in_flight == sum(t.bytes_in_flight for t in sessions.tenants.values())
    sessions.unread.check()
    check_grant_pins(sessions)
    check_namespace_users(sessions)


def check_grant_pins(sessions: Sessions) -> None:
    """Each session counts exactly its pins in other tenants' namespaces, and the
    grantees' bytes sum those pins' blocks."""
    counted: dict[str, list[Pin]] = {}
    for session in sessions.by_id.values():
        state = sessions.store.owners.get(session.id)
        held = {} if state is None else state.pins
        foreign = {pin_id: pin for pin_id, pin in held.items()
                   if pin.blocks and pin.blocks[0].ns.tenant != session.tenant}
        assert set(foreign) == set(session.grant_pins) | session.free_pins, (
            f"{session} counts pins {sorted(session.grant_pins)} (and "
            f"{sorted(session.free_pins)} uncounted) in other tenants' namespaces; it "
            f"holds {sorted(foreign)}")
        assert not set(session.grant_pins) & session.free_pins, f"{session}: both"
        counted.setdefault(session.tenant, []).extend(session.grant_pins.values())
    for tenant, pin in sessions.get_pins.values():
        assert all(b.refs for b in pin.blocks), f"a get's pin {pin.id} is counted, gone"
        counted.setdefault(tenant, []).append(pin)
    sessions.grant_pins.check_invariants(counted)


def check_namespace_users(sessions: Sessions) -> None:
    """Each namespace counts as users at least the sessions that have it open and the
    reservations in it (fewer, and it could be forgotten in use; more is a caller of
    the store's own, as a test or a restore), and the store keeps none that nothing
    uses and that holds no entry."""
    users = sessions.closes.users()  # (each ended session's still counts, till closed)
    sessions.closes.check()
    for session in sessions.by_id.values():
        for ns_id in session.namespaces:
            assert ns_id in sessions.store.namespaces, f"{session} has a forgotten namespace"
            users[ns_id] = users.get(ns_id, 0) + 1
    for state in sessions.store.owners.values():
        for r in state.reservations.values():
            assert sessions.store.namespaces.get(r.ns.id) is r.ns, f"{r} in a forgotten namespace"
            users[r.ns.id] = users.get(r.ns.id, 0) + 1
    for ns_id, ns in sessions.store.namespaces.items():
        assert ns.users >= users.get(ns_id, 0), (
            f"{ns} counts {ns.users} users; {users.get(ns_id, 0)} use it")
        assert ns.users or ns.blocks, f"{ns} is unused and empty, yet kept"


def closing_soon(queued: int) -> str:
    """What a refusal at the tenant's namespace cap adds while closes of its sessions
    that ended are queued (``kvstore.namespace_closes``)."""
    if not queued:
        return ""
    return (f" ({queued} namespaces its sessions that ended left open are being closed "
            f"now; try again in a moment)")


def tenant_of_connection(sessions: Sessions, routing_id: bytes, otherwise: str) -> str:
    """The tenant of a connection's session, for the metrics of a request that failed
    before its session was looked up (a header that cannot be decoded, or too big);
    ``otherwise`` for a connection without one (a refused hello's self-named tenant
    never takes a label)."""
    session = sessions.by_connection.get(routing_id)
    return otherwise if session is None else session.tenant


def gone_while_waiting(session: Session) -> KVStoreError:
    """What a request of ``session``, which ended while the request waited, is answered:
    its lease ran out, or its last connection said goodbye (then no lease ran out)."""
    if session.said_goodbye:
        return NoSessionError(f"{NoSessionError.PREFIX}: the session said goodbye while the "
                              "request waited; its holdings were rolled back")
    return SessionExpiredError(f"{SessionExpiredError.PREFIX} while the request waited; its "
                               "holdings were rolled back; connect again")
