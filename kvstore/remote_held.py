"""Write-through blocks the remote store did not take, held to be sent again: those the
tier's outage kept from it, and those it answered but refused (full: Redis at its
maxmemory under noeviction), which were dropped before and never had a remote copy.
Bounded (``DEFERRED_MOST``, the oldest of the tenant holding most let go past it);
the remote tier sends them again with a commit, or at the generation watch's next check
when no commit comes, once the store is healthy and has refused nothing for a cooldown
(``RemoteTier.send_held``), so a full store is tried again once a cooldown, not by a
loop nor by every commit; a tenant's only once it is served again.
Those DRAM let go meanwhile go from their SSD copies (``RemoteTier.from_ssd``)."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.store import Block

# Write-through blocks held, at most (the oldest go unsent past it): a few seconds of
# commits on a busy host, a few MiB of entries
DEFERRED_MOST = 1 << 14


class HeldWrites:
    """The blocks held back, by tenant, each tenant's oldest first; ``counters``: the
    remote tier's, whose ``deferred_writes`` counts each block held and
    ``unsent_writes`` each let go.

    By tenant, since a tenant whose own calls timed out skips the tier for a while
    (``remote_health``) while the others' go on: every commit of another tenant's took
    all the blocks held and sent them, each held again as its tenant still skipped (up to
    ``DEFERRED_MOST`` walked on the loop at each commit, each counted again).  Past the
    bound the tenant holding the most lets its oldest go."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self._held: dict[str, dict[Block, None]] = {}  # tenant -> its blocks held
        self._count = 0  # over every tenant

    def __len__(self) -> int:
        return self._count

    def hold(self, blocks: list[Block]) -> None:
        """Hold ``blocks`` to be sent later (while they are still cached here)."""
        held = self._held
        for b in blocks:
            mine = held.setdefault(b.ns.tenant, {})
            if b not in mine:  # (one held back again, its tenant's skip not over)
                mine[b] = None
                self._count += 1
                self.counters["deferred_writes"] += 1
        while self._count > DEFERRED_MOST:
            most = max(held, key=lambda tenant: len(held[tenant]))
            mine = held[most]
            del mine[next(iter(mine))]
            if not mine:
                del held[most]
            self._count -= 1
            self.counters["unsent_writes"] += 1

    def after_send(self, blocks: list[Block], written: list[bool | None] | None,
                   serving: bool) -> None:
        """A write-through send of ``blocks`` answered ``written`` (as ``RemoteTier.send``
        does): those the store refused are held, or all of them where it failed and the
        tier no longer serves their tenant (an outage: sent again once it is over)."""
        if written is None:
            if not serving:
                self.hold(blocks)
        elif not all(written):  # refused (a full store), or gone with what the store lost
            self.hold([b for b, good in zip(blocks, written) if good is False])

    def take(self, serves: Callable[[str], bool]) -> list[Block]:
        """The blocks held of every tenant ``serves`` says the tier serves now, none of
        them held afterwards; the others' stay held."""
        out: list[Block] = []
        for tenant in [t for t in self._held if serves(t)]:
            mine = self._held.pop(tenant)
            self._count -= len(mine)
            out += mine
        return out

    def __repr__(self) -> str:
        return f"HeldWrites({self._count} held, {len(self._held)} tenants)"
