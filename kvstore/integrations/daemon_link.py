"""An engine's link to the daemon, with no engine imports (testable without one).

``DaemonSettings`` / ``DaemonLink``: the daemon's endpoint, tenant, token and timeout
from an engine's extra configuration; a client connected on first use, or on a thread
of its own (``connect_in_background``: no step ever waits for a connect); the
namespaces opened through it (bounded, the least recent closed on the daemon, as many
as its cap on a session's needs); and a back-off after the
daemon failed to answer, during which every step of ``kvstore.integrations.engine_side``
is a miss at once.  A connect the daemon refused (a forged, expired or missing token, a
tenant its credentials do not name) is not tried again with the same settings until a
back-off that doubles with each refusal in a row has passed (``connect`` raises the
refusal again meanwhile, at once, with no handshake); new settings (a new token) are
tried at once.  A namespace the daemon cannot hold (blocks larger than its slabs) is
asked for once a client: the calls for it are misses, with one error logged.  A step
that fails the same way again and again (a daemon refusing every request for its rate
limit, or for want of room) is logged once, then once every ``REPEATS_S`` with a count.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar

from kvstore import protocol as p
from kvstore.client import Client, Namespace
from kvstore.client_wire import check_reply
from kvstore.errors import (
    ForbiddenError,
    KVStoreError,
    LeaseExpiredError,
    LimitExceededError,
    MalformedError,
    NamespaceInUseError,
    NoSessionError,
    TooLargeError,
    UnavailableError,
)
from kvstore.identity import Identity
from kvstore.logs import Repeats

logger = logging.getLogger(__name__)

BACKOFF_S = 10.0        # no daemon calls for this long after it failed to answer
SESSION_PING_S = 0.5    # the most a ping asking an older daemon for the session waits
MAX_NAMESPACES = 512    # namespaces kept open per link (the least recent closed past it)
EARLY_END_S = 1.0       # a back-off another link's answer ends, once this long passed
REFUSED_S = 1.0         # no connect with the same settings for this long after a refusal,
REFUSED_MAX_S = 60.0    # doubled with each refusal in a row, up to this
REPEATS_S = 10.0        # a step's failure repeated is logged at most once this long
REFRESH_RATES_S = 10.0  # how often the connector asks the daemon for its load rates


@dataclass(frozen=True)
class DaemonSettings:
    """Where the daemon is and who this engine is to it."""

    endpoint: str | None = None   # None: $KVSTORE_ENDPOINT or the runtime directory's
    tenant: str = "default"
    token: str | None = None      # None: $KVSTORE_TOKEN, as the client reads it
    timeout: float = 10.0         # seconds per request

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], *, timeout: float) -> DaemonSettings:
        """Settings from an engine's extra configuration (``endpoint``, ``tenant``,
        ``token``, ``timeout``); the tenant falls back to ``$KVSTORE_TENANT``, the token
        to ``$KVSTORE_TOKEN``."""
        token = extra.get("token")
        return cls(endpoint=extra.get("endpoint") or None,
                   tenant=str(extra.get("tenant") or os.environ.get("KVSTORE_TENANT",
                                                                    "default")),
                   token=None if token is None else str(token),
                   timeout=float(extra.get("timeout", timeout)))


@dataclass
class _Connected:
    """What a connect on a thread of its own, with ``settings``, came to."""

    settings: DaemonSettings
    client: Client | None = None
    namespaces: dict[Hashable, Namespace] = field(default_factory=dict)
    error: KVStoreError | None = None
    at: float = 0.0  # when the client last called the daemon (the link's clock)
    failed_at: float | None = None  # when the connect failed (the link's clock)
    dropped: bool = False  # the link was closed meanwhile: the thread closes its client
    lock: threading.Lock = field(default_factory=threading.Lock)  # for client and dropped


@dataclass(frozen=True)
class _Refused:
    """The daemon refused a connect with ``settings``: ``error`` is raised again, with no
    handshake, until ``until``; ``wait_s`` is that back-off (the next one doubles it)."""

    settings: DaemonSettings
    error: KVStoreError
    until: float
    wait_s: float
    count: int  # refusals in a row


def _is_refusal(exc: KVStoreError) -> bool:
    """Whether a failed connect was the daemon saying no (to the hello, its credentials
    or a namespace of the connect), which the same settings would meet again; not its
    silence or a session ended meanwhile."""
    return not isinstance(exc, (UnavailableError, LeaseExpiredError, NoSessionError))


class DaemonLink:
    """One engine's connection to the daemon: a client (made on first use, and again
    after a failure), its opened namespaces, and the back-off.  Not thread-safe: give
    each thread that talks to the daemon a link of its own (a background connect builds
    its client apart, and the link takes it over once the thread ended).

    ``map_arena=False`` for a link that never reads or writes blocks (lookups only).
    ``settings`` may be replaced (``use_token``): the next connect takes them."""

    def __init__(self, settings: DaemonSettings, *, backoff_s: float = BACKOFF_S,
                 refused_s: tuple[float, float] = (REFUSED_S, REFUSED_MAX_S),
                 max_namespaces: int = MAX_NAMESPACES,
                 clock: Callable[[], float] = time.monotonic, map_arena: bool = True) -> None:
        self.settings = settings
        self._backoff_s = backoff_s
        self._refused_s = refused_s  # the first back-off after a refusal, and the longest
        self._refused: _Refused | None = None  # the last connect's refusal, if it was one
        self._max_namespaces = max_namespaces
        self._clock = clock
        self._map_arena = map_arena
        self._client: Client | None = None
        self._namespaces: OrderedDict[Hashable, Namespace] = OrderedDict()
        # namespaces this client's daemon refused for good (blocks larger than its slabs
        # or requests, an identity it cannot take): not asked again, nor warned of, at
        # every call; forgotten with the client (a daemon restarted may take them)
        self._unopenable: dict[Hashable, KVStoreError] = {}
        self._unavailable_until = 0.0
        self._backed_off_at = 0.0  # when the latest back-off from silence began
        self._ended_early_at = -math.inf  # when ``answered_elsewhere`` last ended one
        self._background: dict[Hashable, Callable[[], Identity]] | None = None
        self._connecting: tuple[threading.Thread, _Connected] | None = None
        self._used: float | None = None  # when the link last handed out its client (``_alive``)
        self.failures = 0
        self.last_error: KVStoreError | None = None  # the latest step's that failed
        self._repeats = Repeats(logger, REPEATS_S, clock=clock)

    @property
    def endpoint(self) -> str:
        if self._client is not None:
            return self._client.endpoint
        return self.settings.endpoint or "(default endpoint)"

    def available(self) -> bool:
        """False while backing off from a daemon that did not answer, or that refused a
        connect with the link's settings."""
        now = self._clock()
        return now >= self._unavailable_until and self._refusal(now) is None

    def holds(self, client: Client) -> bool:
        """Whether ``client`` is still the link's (a failure lets it go, and with it the
        session's holdings: they are not to be counted on)."""
        return client is self._client

    def answered_elsewhere(self) -> None:
        """Another link of this engine to the daemon was answered lately (the
        scheduler's lookup, whose blocks the worker is asked to load): end a back-off
        from this link's own silence once ``EARLY_END_S`` of it passed, so that the
        loads offered after a hiccup of the daemon connect again rather than miss (and
        recompute) for the rest of the back-off's 10 s.  At most once per back-off's
        length: a daemon that answers lookups but not this link's calls stalls a step
        at most twice in that time, not at every step.  A refusal's back-off stands."""
        now = self._clock()
        if (now < self._unavailable_until and now - self._backed_off_at >= EARLY_END_S
                and now - self._ended_early_at >= self._backoff_s):
            self._unavailable_until = 0.0
            self._ended_early_at = now
            logger.info("kvstore: the daemon answered the scheduler; connecting again")

    def use_token(self, token: str) -> None:
        """Connect with ``token`` from now on: the next connect tries it at once, even
        while backing off from the refusal of the one before (a connected client is
        kept until it fails)."""
        self.settings = replace(self.settings, token=token)

    def _refusal(self, now: float) -> _Refused | None:
        """The refusal the link is backing off from, if any: one of its present
        settings, within the back-off."""
        refused = self._refused
        if refused is None or refused.settings != self.settings or now >= refused.until:
            return None
        return refused

    def _refuse(self, settings: DaemonSettings, exc: KVStoreError) -> None:
        """Back off from a connect with ``settings`` that the daemon refused: twice the
        last back-off after a refusal of the same settings, the first one else."""
        first, longest = self._refused_s
        last = self._refused
        wait_s, count = first, 1
        if last is not None and last.settings == settings:
            wait_s, count = min(longest, last.wait_s * 2), last.count + 1
        self._refused = _Refused(settings, exc, self._clock() + wait_s, wait_s, count)

    def connect(self) -> Client:
        """The client, connected now if it is not (raises the daemon's error: at once,
        with no handshake, the refusal of the link's settings it is backing off from)."""
        if self._client is None:
            now = self._clock()
            refused = self._refusal(now)
            if refused is not None:  # a copy: the type and its fields (a cause), chained
                again = copy.copy(refused.error)
                again.args = (f"{refused.error} (refused {refused.count} time(s) in a row; "
                              f"not tried again for {refused.until - now:.1f}s unless the "
                              "settings change)",)
                raise again from refused.error
            s = self.settings
            try:
                self._client = Client(s.endpoint, tenant=s.tenant, token=s.token,
                                      timeout=s.timeout, map_arena=self._map_arena)
            except KVStoreError as exc:
                if _is_refusal(exc):
                    self._refuse(s, exc)
                raise
            self._refused = None
            self._used = self._clock()
        return self._client

    def connect_in_background(self, namespaces: Mapping[Hashable, Callable[[], Identity]]
                              = MappingProxyType({})) -> None:
        """Connect, and open ``namespaces`` (key: identity), on a thread of its own, now
        and whenever the link has lost its client (after the back-off): until the thread
        is done, ``client`` and ``namespace`` return None at once, never waiting for the
        daemon; a daemon that is not up is a failed connect, tried again later."""
        self._background = dict(namespaces)
        if self._client is None and self._connecting is None:
            self._spawn()

    def connecting(self) -> bool:
        """Whether a background connect is under way (its outcome taken once it ended)."""
        if self._connecting is None:
            return False
        thread, pending = self._connecting
        if thread.is_alive():
            return True
        self._connecting = None
        if pending.error is not None:
            if _is_refusal(pending.error):
                self._refuse(pending.settings, pending.error)
            self.failed("connect", pending.error)
            failed_at = pending.failed_at
            if (isinstance(pending.error, UnavailableError) and failed_at is not None
                    and failed_at < self._backed_off_at):
                # The back-off runs from the connect's failure, not from its outcome
                # taken at a later call: a daemon started meanwhile (after the engine,
                # or again) was left alone a whole back-off more, every request a miss.
                self._backed_off_at = failed_at
                self._unavailable_until = failed_at + self._backoff_s
        elif pending.client is not None:
            self._refused = None
            self._client = pending.client
            self._namespaces.update(pending.namespaces)
            self._used = pending.at  # the session idles from its connect, not from now
        return False

    def wait_connected(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) for a background connect to end; whether
        the link has a client then."""
        if self._connecting is not None:
            self._connecting[0].join(timeout)
        self.connecting()  # takes the outcome, if it ended
        return self._client is not None

    def _spawn(self) -> None:
        pending = _Connected(self.settings)
        thread = threading.Thread(target=self._connect_apart, args=(pending,),
                                  name="kvstore-connect", daemon=True)
        self._connecting = thread, pending
        thread.start()

    def _connect_apart(self, pending: _Connected) -> None:
        """On the connect thread: touches only ``pending``."""
        s = pending.settings
        try:
            client = Client(s.endpoint, tenant=s.tenant, token=s.token, timeout=s.timeout,
                            map_arena=self._map_arena)
        except KVStoreError as exc:
            pending.error, pending.failed_at = exc, self._clock()
            return
        try:
            for key, identity in (self._background or {}).items():
                pending.namespaces[key] = client.namespace(identity())
        except KVStoreError as exc:
            client.close()
            pending.error, pending.failed_at = exc, self._clock()
            return
        except BaseException:
            client.close()
            raise
        with pending.lock:
            pending.at = self._clock()  # its last call to the daemon
            pending.client = client
            dropped = pending.dropped
        if dropped:  # the link was closed before this connect ended: nobody takes it
            client.close()

    def _alive(self) -> None:
        """After an idle spell of half the daemon's lease, ask whether the session still
        lives (the daemon ends one idle for a whole lease, and a link keeping its client
        would fail every call from then on); an ended one is dropped, to connect again."""
        client, now = self._client, self._clock()
        if client is None:
            return
        hello = client.hello
        used = self._used
        if hello is not None and used is not None and now - used > hello.lease_seconds / 2:
            try:
                client.ping()
            except (LeaseExpiredError, ForbiddenError) as exc:  # ended, or restarted
                logger.info("kvstore: the daemon refused a ping (%s); connecting again", exc)
                self.close()
            except KVStoreError as exc:
                self.failed("ping", exc)
        self._used = now

    def client(self) -> Client | None:
        """The client, or None while backing off, connecting in the background, or when
        connecting failed."""
        if self.connecting() or not self.available():
            return None
        self._alive()
        if self._client is None and self._background is not None:
            self._spawn()
            return None
        try:
            return self.connect()
        except KVStoreError as exc:
            self.failed("connect", exc)
            return None

    def namespace(self, key: Hashable, identity: Callable[[], Identity]) -> Namespace | None:
        """The namespace opened under ``key`` (opening ``identity()`` the first time), or
        None while backing off or when the daemon failed."""
        ns = self._namespaces.get(key)
        if ns is not None and self.available():
            self._alive()
            if self._client is not None:
                self._namespaces.move_to_end(key)
                return ns
        client = self.client()
        if client is None:
            return None
        ns = self._namespaces.get(key)  # opened by a background connect just taken over
        if ns is not None:
            return ns
        if key in self._unopenable:
            return None
        try:
            ns = self._open(client, identity())
        except (TooLargeError, MalformedError) as exc:
            self.failures += 1
            logger.error("kvstore: the daemon cannot hold this namespace (%s); every call "
                         "for it is a miss until the link connects again", exc)
            if len(self._unopenable) >= self._max_namespaces:
                self._unopenable.pop(next(iter(self._unopenable)))
            self._unopenable[key] = exc
            return None
        except KVStoreError as exc:
            self.failed("open namespace", exc)
            return None
        while len(self._namespaces) >= self._max_namespaces and self._close_oldest():
            pass
        self._namespaces[key] = ns
        return ns

    def _open(self, client: Client, identity: Identity) -> Namespace:
        """Open ``identity``; where the session has as many open as the daemon allows
        (``server.max_namespaces_per_session``), the least recently used are closed,
        up to a quarter of them, and it is opened again (an engine serving more cache
        salts than that was refused each new one for good)."""
        try:
            return client.namespace(identity)
        except LimitExceededError as exc:
            if "namespaces open" not in str(exc) or not self._namespaces:
                raise
        for _ in range(max(1, len(self._namespaces) // 4)):
            if not self._close_oldest():
                break
        return client.namespace(identity)

    def _close_oldest(self) -> bool:
        """Close the least recently used namespace on the daemon (its blocks stay) and
        forget it here (one with a reservation open stays open, and is the most recent
        now); whether any was let go.  A close refused for another limit (the session's
        or tenant's request rate) ends the round, the namespace kept where it was: it
        was taken for a save under way, and every other namespace was asked in turn,
        each refused, of a daemon asking for fewer requests."""
        for _ in range(len(self._namespaces)):
            key, ns = self._namespaces.popitem(last=False)
            try:
                ns.close()
            except NamespaceInUseError:  # a save in it under way: kept
                self._namespaces[key] = ns
                continue
            except LimitExceededError:
                self._namespaces[key] = ns
                self._namespaces.move_to_end(key, last=False)
                return False
            except KVStoreError:  # (gone with an old session: let go here all the same)
                pass
            return True
        return False

    def failed(self, what: str, exc: KVStoreError) -> None:
        """Log a failed step; a daemon that did not answer is left alone for a while, and
        its client dropped (a late reply may come first); so is, to connect again at the
        next call, a session it ended or does not know (it restarted on the endpoint)."""
        self.failures += 1
        self.last_error = exc
        # a kind per step (not per request: "save for request 7") and error
        self._repeats.log(logging.WARNING, (what.split(" for ")[0], type(exc)),
                          "kvstore: %s failed: %s", what, exc)
        if isinstance(exc, UnavailableError):
            self._backed_off_at = self._clock()
            self._unavailable_until = self._backed_off_at + self._backoff_s
            self.close()
        elif isinstance(exc, LeaseExpiredError):
            self.reconnect()
        elif isinstance(exc, NoSessionError) or (isinstance(exc, ForbiddenError)
                                                  and self._session_gone()):
            logger.info("kvstore: the daemon knows no session of this link; connecting again")
            self.reconnect()

    def reconnect(self) -> None:
        """Drop the client, whose session the daemon ended or lost; a link that connects
        in the background starts that connect now, not at its next call (which would
        miss, and the engine's next request too, while it is under way)."""
        self.close()
        if self._background is not None:
            self._spawn()

    def _session_gone(self) -> bool:
        """After a refusal that does not say "no session", whether the daemon has none for
        the client: a ping is refused too, or unanswered within a short wait (a daemon
        drops a sessionless peer's messages past the first few).  A lone refusal keeps it,
        and so does a ping refused for a reason of its own (a rate limit: the session is
        there), which is no failure of a step: the caller counted the one it had."""
        client = self._client
        if client is None:
            return False
        timeout, client.timeout = client.timeout, min(client.timeout, SESSION_PING_S)
        try:
            client.ping()
        except (ForbiddenError, LeaseExpiredError, UnavailableError):
            return True
        except KVStoreError as exc:
            logger.info("kvstore: the daemon refused a ping, with a session: %s", exc)
        finally:
            client.timeout = timeout
        return False

    def close(self) -> None:
        """Drop the client (the daemon drops this session's pins with it)."""
        connecting, self._connecting = self._connecting, None
        if connecting is not None:  # ends within the settings' timeout, as a rule
            thread, pending = connecting
            thread.join(self.settings.timeout + 1.0)
            with pending.lock:  # one that ends later closes what it made itself
                pending.dropped = True
                made = pending.client
            if made is not None:
                made.close()
        client, self._client = self._client, None
        self._namespaces.clear()
        self._unopenable.clear()
        self._used = None
        if client is not None:
            client.close()

    def __repr__(self) -> str:
        state = ("connected" if self._client else
                 "connecting" if self._connecting is not None else "idle")
        if not self.available():
            refused = self._refusal(self._clock())
            state = ("backing off" if refused is None else
                     f"backing off from {refused.count} refusal(s)")
        return (f"DaemonLink({self.endpoint}, {state}, namespaces={len(self._namespaces)}, "
                f"failures={self.failures})")


class PostedRates:
    """A request for the daemon's load rates per tier (a probe with no keys), sent and
    not waited for: its reply is read while the link's client waits for others (a
    request's lookups), and taken once it is there (``ready``), so that no step waits a
    round trip for figures an offer can take from the last answer."""

    def __init__(self, link: DaemonLink, client: Client) -> None:
        self._link = link
        self._client = client
        self._rid = client._next_rid()
        client._send(p.Probe(self._rid, []))

    def ready(self) -> bool:
        """Whether ``take`` returns at once: the reply came, or the client is gone."""
        return self._rid in self._client._early or not self._link.holds(self._client)

    def take(self) -> dict[str, float] | None:
        """The daemon's rates (bytes a second), or None (no answer); only once ready."""
        if not self._link.holds(self._client):
            return None
        try:
            reply = check_reply(self._client._wait(self._rid)[0], p.ProbeReply)
        except KVStoreError as exc:
            self._link.failed("probe", exc)
            return None
        return dict(reply.bandwidth)

    def drop(self) -> None:
        """Give the reply up (it is dropped when it comes)."""
        if self._link.holds(self._client):
            self._client._abandon(self._rid)
            self._client._awaited.discard(self._rid)
            self._client._early.pop(self._rid, None)


def post_rates(link: DaemonLink) -> PostedRates | None:
    """Ask the daemon for its load rates without waiting (None: no client now)."""
    client = link.client()
    if client is None:
        return None
    try:
        return PostedRates(link, client)
    except KVStoreError as exc:
        link.failed("probe", exc)
        return None


W = TypeVar("W", bound="Worth")


class Worth(Protocol):
    """What ``LoadRates`` needs of ``pipeline.LoadWorth`` (which imports this module)."""

    @property
    def prefill_tokens_per_s(self) -> float: ...

    def with_rates(self: W, bytes_per_s: Mapping[str, float]) -> W: ...


class LoadRates(Generic[W]):
    """The load rates an offer is judged by: the daemon's per tier (measured where it
    has read enough, else its own configured figure), asked for at most every
    ``refresh_s`` seconds by ``ask``'s ``post`` (a probe sent, not waited for: a
    request's lookup never waits a round trip for it) and taken by ``current`` once its
    reply is in, over the configured ``LoadWorth`` they start from and fall back to (a
    reply not in by the next refresh, or none: the daemon did not answer).  Nothing is
    asked while every block is offered anyway (no prefill rate), nor with ``refresh_s``
    0 (the configured rates only)."""

    def __init__(self, configured: W, *, refresh_s: float = REFRESH_RATES_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if refresh_s < 0:
            raise ValueError(f"the rates' refresh must be >= 0 seconds, not {refresh_s}")
        self.configured = configured
        self._worth = configured
        self._refresh_s = refresh_s
        self._clock = clock
        self._next = 0.0
        self._posted: PostedRates | None = None  # asked, its reply not taken yet
        self.refreshes = 0   # answers taken
        self.measured: dict[str, float] = {}  # the daemon's last answer, bytes a second

    def ask(self, post: Callable[[], PostedRates | None]) -> None:
        """Ask for the daemon's rates with ``post`` if a refresh is due (none waits)."""
        if (not self.configured.prefill_tokens_per_s or not self._refresh_s
                or self._posted is not None or self._clock() < self._next):
            return
        self._next = self._clock() + self._refresh_s
        self._posted = post()
        if self._posted is None:  # no client: the configured rates until one answers
            self._worth = self.configured

    def current(self) -> W:
        """The rates to judge an offer by: the last answer's, the one asked for taken
        if its reply is in (never waited for)."""
        posted = self._posted
        if posted is not None and posted.ready():
            self._posted = None
            rates = posted.take()
            if rates is None:  # the configured rates until the daemon answers again
                self._worth = self.configured
            else:
                self.measured = rates
                self._worth = self.configured.with_rates(rates)
                self.refreshes += 1
        elif posted is not None and self._clock() >= self._next:  # no answer in time
            posted.drop()
            self._posted = None
            self._worth = self.configured
        return self._worth

    def __repr__(self) -> str:
        return f"LoadRates({self._worth!r}, refreshes={self.refreshes})"
