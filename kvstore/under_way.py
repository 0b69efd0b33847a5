"""What a session has under way in tasks: requests that finish later (a plan to carry out,
a reply a coroutine makes, a wait for room) and the prefetches it started.

Each such request is answered at once or later, but holds its decoded keys (about 55
bytes a key) and a task until then, and a peer may send the next one without waiting:
nothing bounded them.  A tenant whose DRAM was full of its own pins, under a pressure
chain that defers, sent reserve after reserve: each waited for room until its deadline,
as many as it sent.  So a session has at most ``SESSION_MOST`` of them under way, and a
tenant's, over its sessions, name at most ``TENANT_KEYS_MOST`` keys; past either,
``LimitExceededError`` and nothing is started (a best-effort prefetch too: its reply
is that error).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from kvstore.errors import LimitExceededError
from kvstore.sessions import Session

SESSION_MOST = 256  # a session's requests and prefetches under way in tasks, at most
TENANT_KEYS_MOST = 1 << 20  # the keys those of a tenant's sessions name together, at most


def keys_of(request: Any) -> int:
    """How many keys a request names (a token plan's, over its items)."""
    keys = getattr(request, "keys", None)
    if keys is not None:
        return len(keys)
    return sum(len(item.keys) for item in getattr(request, "plan", ()))


class UnderWay:
    """The count of each session's work under way in tasks, and each tenant's keys in it."""

    def __init__(self) -> None:
        self.sessions: dict[str, int] = {}  # session id -> requests under way
        self.tenant_keys: dict[str, int] = {}  # tenant -> keys those name

    def __repr__(self) -> str:
        return (f"UnderWay(sessions={len(self.sessions)}, "
                f"requests={sum(self.sessions.values())}, "
                f"keys={sum(self.tenant_keys.values())})")

    def stats(self) -> dict[str, int]:
        """Requests and prefetches under way in tasks, and the keys they name."""
        return {"requests": sum(self.sessions.values()),
                "keys": sum(self.tenant_keys.values())}

    def take(self, session: Session, keys: int) -> None:
        """Count one more of ``session``'s, naming ``keys`` keys; LimitExceededError
        (nothing counted) past a limit."""
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
        self.sessions[session.id] = held + 1
        if keys:  # (a request of no keys, a snapshot's say, counts for its session only)
            self.tenant_keys[session.tenant] = tenant_keys + keys

    def give(self, session: Session, keys: int) -> None:
        """One of ``session``'s is done (``take``'s ``keys``)."""
        held = self.sessions[session.id] - 1
        if held:
            self.sessions[session.id] = held
        else:
            del self.sessions[session.id]
        if not keys:
            return
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
