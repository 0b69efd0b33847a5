"""The bytes of big replies ZeroMQ still holds for their peers (``RepliesInFlight``):
by connection, by tenant and in all, so that neither a tenant's many sessions nor many
tenants together make the daemon hold more than their bounds (``Sessions.admit``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _no_tenant(peer: bytes) -> str | None:
    return None


class UnreadBytes:
    """Bytes of replies not yet sent, per peer (``by_peer``), per tenant (``by_tenant``)
    and in all (``total``).  Each reply is charged to a tenant as it is counted: the
    one that asked for it where the caller knows it, else the tenant of the peer's
    session then (none: a peer without a session).  A peer or tenant with none has no
    entry: nothing stays once its replies are sent or dropped (a gone peer's are).

    A peer's replies were charged to the tenant its session had when the first of them
    was counted, until every one was sent: a whole snapshot's reply, sent after its
    session ended (a goodbye), was charged to none, and so was every reply of that
    connection after it, hello said again, while that one stayed unread."""

    def __init__(self, tenant_of: Callable[[bytes], str | None] = _no_tenant) -> None:
        self.by_peer: dict[bytes, int] = {}
        self.by_tenant: dict[str, int] = {}
        self.total = 0
        self.tenant_of = tenant_of
        self._charged: dict[tuple[bytes, str], int] = {}  # (peer, tenant) -> bytes

    def __bool__(self) -> bool:
        return bool(self.by_peer)

    def __repr__(self) -> str:
        return (f"UnreadBytes(peers={len(self.by_peer)}, tenants={len(self.by_tenant)}, "
                f"total={self.total})")

    def add(self, peer: bytes, size: int, tenant: str | None = None) -> str | None:
        """``size`` more bytes of a reply to ``peer`` are held, asked for by ``tenant``
        (None: the tenant of the peer's session now); the tenant charged, for ``sent``."""
        self.by_peer[peer] = self.by_peer.get(peer, 0) + size
        self.total += size
        if tenant is None:
            tenant = self.tenant_of(peer)
        if tenant is not None:
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + size
            charged = (peer, tenant)
            self._charged[charged] = self._charged.get(charged, 0) + size
        return tenant

    def sent(self, peer: bytes, size: int, tenant: str | None = None) -> None:
        """``size`` bytes of a reply to ``peer`` went (or were dropped), charged to
        ``tenant`` (what ``add`` returned)."""
        _less(self.by_peer, peer, size)
        self.total -= size
        if tenant is not None:
            _less(self.by_tenant, tenant, size)
            _less(self._charged, (peer, tenant), size)

    def check(self) -> None:
        """The sums match (AssertionError if not)."""
        assert self.total == sum(self.by_peer.values()), self
        by_tenant: dict[str, int] = {}
        by_peer: dict[bytes, int] = {}
        for (peer, tenant), size in self._charged.items():
            by_tenant[tenant] = by_tenant.get(tenant, 0) + size
            by_peer[peer] = by_peer.get(peer, 0) + size
        assert by_tenant == self.by_tenant, (by_tenant, self.by_tenant)
        assert all(0 < size <= self.by_peer.get(peer, 0)
                   for peer, size in by_peer.items()), (by_peer, self.by_peer)


def _less(counts: dict[Any, int], key: Any, size: int) -> None:
    """``counts[key]`` less ``size``; no entry once none is left."""
    left = counts[key] - size
    if left:
        counts[key] = left
    else:
        del counts[key]
