"""Who the remote store's write-backs skip for a while, and why: the store, or a tenant.

A value the remote store refuses (full, under ``noeviction``) would be refused again at
each eviction that picked its block: write-backs skip the store for a cooldown, and
blocks leave DRAM meanwhile as they would without a remote store.  A value refused for
its tenant's share (``kvstore.remote_shares``) says nothing of the store, nor of the
other tenants' shares: only that tenant's write-backs skip it.  Before, one refusal of
either kind turned write-backs off for every tenant, so a tenant that kept writing past
its own share had every other tenant's evicted blocks dropped instead of written back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore.remote_health import lapsed

__all__ = ["Refusals"]


class Refusals:
    """Until when write-backs skip the remote store: all of them, or a tenant's."""

    __slots__ = ("cooldown", "until", "tenants", "clock")

    def __init__(self, cooldown: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown = cooldown
        self.until = 0.0  # the store refused values: every tenant's write-backs skip it
        self.tenants: dict[str, float] = {}  # a tenant's share refused values: its own
        self.clock = clock

    def refuse(self, tenant: str | None = None) -> bool:
        """The store refused values (``tenant`` None), or ``tenant``'s share did: skip it
        for a cooldown.  Whether this begins a cooldown (one not under way: to log)."""
        now = self.clock()
        if tenant is None:
            began, self.until = now >= self.until, now + self.cooldown
            return began
        began = now >= self.tenants.get(tenant, 0.0)
        self.tenants[tenant] = now + self.cooldown
        return began

    def taking(self) -> bool:
        """Whether write-backs go to the store (the store refused nothing lately)."""
        return self.clock() >= self.until

    def serves(self, tenant: str) -> bool:
        """Whether ``tenant``'s write-backs go to the store now."""
        now = self.clock()
        return now >= self.until and lapsed(self.tenants, tenant, now)

    def skipping(self) -> frozenset[str]:
        """The tenants whose write-backs skip the store now (their cooldowns under way);
        O(tenants skipping), each ended one let go."""
        if not self.tenants:
            return frozenset()
        now = self.clock()
        return frozenset(t for t in list(self.tenants) if not lapsed(self.tenants, t, now))

    def __repr__(self) -> str:
        return f"Refusals(until={self.until:.3f}, tenants={len(self.tenants)})"
