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
that error).  An evict or a drop is not refused for the daemon's bound (it still counts
in it): those waiting for room hold the bound, and one refused would leave them waiting
for the room it makes until their deadline, every tenant's requests refused meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
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

    def __init__(self, most_requests: int = 16384, most_keys: int = 1 << 22) -> None:
        self.most_requests = most_requests
        self.most_keys = most_keys
        self.sessions: dict[str, int] = {}  # session id -> requests under way
        self.tenant_keys: dict[str, int] = {}  # tenant -> keys those name
        self.requests = 0  # over every session
        self.keys = 0  # over every tenant

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
        if not freeing and (self.requests >= self.most_requests or (
                keys and self.keys and self.keys + keys > self.most_keys)):
            raise LimitExceededError(
                f"the daemon has {self.requests} requests and prefetches naming "
                f"{self.keys} keys still under way over every session (limits "
                f"{self.most_requests} and {self.most_keys} keys: "
                f"server.max_requests_under_way, server.max_keys_under_way); wait for "
                f"your replies, and try again")
        self.sessions[session.id] = held + 1
        self.requests += 1
        if keys:  # (a request of no keys, a snapshot's say, counts for its session only)
            self.tenant_keys[session.tenant] = tenant_keys + keys
            self.keys += keys

    def give(self, session: Session, keys: int) -> None:
        """One of ``session``'s is done (``take``'s ``keys``)."""
        held = self.sessions[session.id] - 1
        self.requests -= 1
        if held:
            self.sessions[session.id] = held
        else:
            del self.sessions[session.id]
        if not keys:
            return
        self.keys -= keys
        left = self.tenant_keys[session.tenant] - keys
        if left:
            self.tenant_keys[session.tenant] = left
        else:
            del self.tenant_keys[session.tenant]

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
