"""The bytes of big replies ZeroMQ still holds for their peers (``RepliesInFlight``):
by connection, by tenant and in all, so that neither a tenant's many sessions nor many
tenants together make the daemon hold more than their bounds (``Sessions.admit``)."""

from __future__ import annotations

from collections.abc import Callable


def _no_tenant(peer: bytes) -> str | None:
    return None


class UnreadBytes:
    """Bytes of replies not yet sent, per peer (``by_peer``), per tenant (``by_tenant``,
    the tenant a peer had when its first such reply was counted) and in all (``total``).
    A peer or tenant with none has no entry: nothing stays once its replies are sent or
    dropped (a gone peer's are)."""

    def __init__(self, tenant_of: Callable[[bytes], str | None] = _no_tenant) -> None:
        self.by_peer: dict[bytes, int] = {}
        self.by_tenant: dict[str, int] = {}
        self.total = 0
        self.tenant_of = tenant_of
        self._tenants: dict[bytes, str] = {}  # peer with bytes unread -> its tenant

    def __bool__(self) -> bool:
        return bool(self.by_peer)

    def __repr__(self) -> str:
        return (f"UnreadBytes(peers={len(self.by_peer)}, tenants={len(self.by_tenant)}, "
                f"total={self.total})")

    def add(self, peer: bytes, size: int) -> None:
        """``size`` more bytes of ``peer``'s replies are held."""
        held = self.by_peer.get(peer)
        if held is None:
            held = 0
            tenant = self.tenant_of(peer)
            if tenant is not None:
                self._tenants[peer] = tenant
        self.by_peer[peer] = held + size
        self.total += size
        tenant = self._tenants.get(peer)
        if tenant is not None:
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + size

    def sent(self, peer: bytes, size: int) -> None:
        """``size`` bytes of ``peer``'s replies went (or were dropped)."""
        left = self.by_peer[peer] - size
        self.total -= size
        tenant = self._tenants.get(peer)
        if tenant is not None:
            tenant_left = self.by_tenant[tenant] - size
            if tenant_left:
                self.by_tenant[tenant] = tenant_left
            else:
                del self.by_tenant[tenant]
        if left:
            self.by_peer[peer] = left
        else:
            del self.by_peer[peer]
            self._tenants.pop(peer, None)

    def check(self) -> None:
        """The sums match (AssertionError if not)."""
        assert self.total == sum(self.by_peer.values()), self
        by_tenant: dict[str, int] = {}
        for peer, tenant in self._tenants.items():
            by_tenant[tenant] = by_tenant.get(tenant, 0) + self.by_peer[peer]
        assert by_tenant == self.by_tenant, (by_tenant, self.by_tenant)
