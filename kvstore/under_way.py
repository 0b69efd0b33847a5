"""What a session has under way in tasks: requests that finish later (a plan to carry out,
a reply a coroutine makes, a wait for room) and the prefetches it started.

Each such request is answered at once or later, but holds its decoded keys (about 55
bytes a key) and a task until then, and a peer may send the next one without waiting:
nothing bounded them.  A tenant whose DRAM was full of its own pins, under a pressure
chain that defers, sent reserve after reserve: each waited for room until its deadline,
as many as it sent.  So a session has at most ``SESSION_MOST`` of them under way, and a
tenant's, over its sessions, name at most ``TENANT_KEYS_MOST`` keys; and the daemon's,
over every session and tenant, are at most ``server.max_requests_under_way`` naming at
most ``server.max_keys_under_way`` keys (before, many tenants, or one tenant's many
sessions, together held tasks and keys without bound).  Past any of them,
``LimitExceededError`` and nothing is started (a best-effort prefetch too: its reply is
that error).  An evict or a drop is not refused for the daemon's bound: those waiting for
room hold the bound, and one refused would leave them waiting for the room it makes until
their deadline, every tenant's requests refused meanwhile.  Nor does it count against the
bound for the other requests (``freeing``; it counts in the totals and in its session's
and tenant's own): an evict waits up to a second for its session's get replies that
ZeroMQ is still sending (``Removals``), so a tenant that left its get replies unread and
sent evict after evict held the whole bound, and every other tenant's request that had
to wait was refused, for as long as it went on.

Within the daemon's bounds each tenant holds at most its share, so that one tenant's
many sessions (each below its own bound) cannot take the whole of them and leave every
other tenant's requests refused.  A tenant's share of each bound is its weight
(``server.tenant_weights``, 1 by default) over the weights of the tenants with work under
way, itself included, plus one default weight: room kept for a tenant that has none yet.
Alone, a tenant holds at most half; with two of equal weight under way, a third each,
and so on.  A tenant already past a share that shrank (another came) keeps what it has
and is refused more until its requests finish below it; its first request is never
refused for its share (a share rounds up to one request).  Past it, ``LimitExceededError``
names the tenant and its share; an evict or a drop is not refused for it either.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from kvstore.errors import LimitExceededError
from kvstore.sessions import Session

SESSION_MOST = 256  # a session's requests and prefetches under way in tasks, at most
TENANT_KEYS_MOST = 1 << 20  # the keys those of a tenant's sessions name together, at most
FREEING = frozenset({"evict", "drop"})  # verbs that give room back: not refused daemon-wide


def keys_of(request: Any) -> int:
    """How many keys a request names (a token plan's, over its items)."""
    keys = getattr(request, "keys", None)
    if keys is not None:
        return len(keys)
    return sum(len(item.keys) for item in getattr(request, "plan", ()))


class UnderWay:
    """The count of each session's work under way in tasks, each tenant's keys in it, and
    the daemon's: at most ``most_requests`` naming ``most_keys`` keys together."""

    def __init__(self, most_requests: int = 16384, most_keys: int = 1 << 22,
                 weights: Mapping[str, float] | None = None) -> None:
        self.most_requests = most_requests
        self.most_keys = most_keys
        self.weights = dict(weights or {})  # tenant -> its weight in the shares (default 1)
        self.sessions: dict[str, int] = {}  # session id -> requests under way
        self.tenant_requests: dict[str, int] = {}  # tenant -> requests under way
        self.tenant_keys: dict[str, int] = {}  # tenant -> keys those name
        self.requests = 0  # over every session
        self.keys = 0  # over every tenant
        self.weight_under_way = 0.0  # the weights of the tenants in ``tenant_requests``
        # of ``requests`` and ``keys``, the evicts' and drops' (not held against others)
        self.freeing = 0
        self.freeing_keys = 0

    def __repr__(self) -> str:
        return (f"UnderWay(sessions={len(self.sessions)}, requests={self.requests}, "
                f"keys={self.keys})")

    def stats(self) -> dict[str, int]:
        """Requests and prefetches under way in tasks, and the keys they name."""
        return {"requests": self.requests, "keys": self.keys}

    def check(self) -> None:
        """The daemon's counts are the sums of the sessions' and the tenants'."""
        assert self.requests == sum(self.sessions.values()), f"{self!r}: requests"
        assert self.keys == sum(self.tenant_keys.values()), f"{self!r}: keys"
        assert self.requests == sum(self.tenant_requests.values()), f"{self!r}: tenants"
        assert 0 <= self.freeing <= self.requests, f"{self!r}: freeing {self.freeing}"
        assert 0 <= self.freeing_keys <= self.keys, f"{self!r}: freeing {self.freeing_keys}"

    def share(self, tenant: str) -> float:
        """The part of the daemon's bounds ``tenant`` may hold now: its weight over the
        weights under way (its own included) and one default weight for a newcomer."""
        weight = self.weights.get(tenant, 1.0)
        others = self.weight_under_way - (weight if tenant in self.tenant_requests else 0.0)
        return weight / (others + weight + 1.0)

    def take(self, session: Session, keys: int, *, freeing: bool = False) -> None:
        """Count one more of ``session``'s, naming ``keys`` keys; LimitExceededError
        (nothing counted) past a limit (``freeing``: an evict or a drop, past the
        daemon's only where it is past a session's or a tenant's limit)."""
        held = self.sessions.get(session.id, 0)
        if held >= SESSION_MOST:
            raise LimitExceededError(
                f"the session has {held} requests and prefetches still under way (limit "
                f"{SESSION_MOST}); wait for their replies")
        tenant_keys = self.tenant_keys.get(session.tenant, 0)
        if tenant_keys and tenant_keys + keys > TENANT_KEYS_MOST:
            raise LimitExceededError(
                f"tenant {session.tenant!r} has {tenant_keys} keys in requests and "
                f"prefetches still under way (limit {TENANT_KEYS_MOST}); wait for their "
                f"replies")
        tenant_held = self.tenant_requests.get(session.tenant, 0)
        if not freeing:
            self._check_share(session.tenant, tenant_held, tenant_keys, keys)
        requests, held_keys = self.requests - self.freeing, self.keys - self.freeing_keys
        if not freeing and (requests >= self.most_requests or (
                keys and held_keys and held_keys + keys > self.most_keys)):
            raise LimitExceededError(
                f"the daemon has {requests} requests and prefetches naming "
                f"{held_keys} keys still under way over every session (limits "
                f"{self.most_requests} and {self.most_keys} keys: "
                f"server.max_requests_under_way, server.max_keys_under_way); wait for "
                f"your replies, and try again")
        self.sessions[session.id] = held + 1
        self.requests += 1
        if freeing:
            self.freeing += 1
            self.freeing_keys += keys
        if not tenant_held:
            self.weight_under_way += self.weights.get(session.tenant, 1.0)
        self.tenant_requests[session.tenant] = tenant_held + 1
        if keys:  # (a request of no keys, a snapshot's say, counts for its session only)
            self.tenant_keys[session.tenant] = tenant_keys + keys
            self.keys += keys

    def give(self, session: Session, keys: int, *, freeing: bool = False) -> None:
        """One of ``session``'s is done (``take``'s ``keys`` and ``freeing``)."""
        held = self.sessions[session.id] - 1
        self.requests -= 1
        if freeing:
            self.freeing -= 1
            self.freeing_keys -= keys
        if held:
            self.sessions[session.id] = held
        else:
            del self.sessions[session.id]
        tenant_held = self.tenant_requests[session.tenant] - 1
        if tenant_held:
            self.tenant_requests[session.tenant] = tenant_held
        else:
            del self.tenant_requests[session.tenant]
            self.weight_under_way -= self.weights.get(session.tenant, 1.0)
            if not self.tenant_requests:  # (no rounding error left over)
                self.weight_under_way = 0.0
        if not keys:
            return
        self.keys -= keys
        left = self.tenant_keys[session.tenant] - keys
        if left:
            self.tenant_keys[session.tenant] = left
        else:
            del self.tenant_keys[session.tenant]

    def _check_share(self, tenant: str, held: int, tenant_keys: int, keys: int) -> None:
        """LimitExceededError where one more request of ``tenant`` (naming ``keys``) would
        take it past its share of the daemon's bounds."""
        share = self.share(tenant)
        most_requests = max(1.0, self.most_requests * share)
        most_keys = self.most_keys * share
        if held + 1 > most_requests or (keys and tenant_keys and tenant_keys + keys > most_keys):
            raise LimitExceededError(
                f"tenant {tenant!r} has {held} requests and prefetches naming {tenant_keys} "
                f"keys still under way, its share of the daemon's bounds now (at most "
                f"{int(most_requests)} naming {int(most_keys)} keys: {share:.0%} of "
                f"server.max_requests_under_way and server.max_keys_under_way, by "
                f"server.tenant_weights and the tenants with work under way); wait for its "
                f"replies, and try again")

    def background(self, session: Session, keys: int,
                   work: Callable[[], Coroutine[Any, Any, None]],
                   spawn: Callable[[Coroutine[Any, Any, None]], Any]) -> Any:
        """Start ``work()`` in a task (``spawn``'s) counted as one of ``session``'s (a
        prefetch that goes on after its reply); LimitExceededError past a limit."""
        self.take(session, keys)
        try:
            return spawn(self._counted(session, keys, work()))
        except BaseException:
            self.give(session, keys)
            raise

    async def _counted(self, session: Session, keys: int,
                       work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        finally:
            self.give(session, keys)
