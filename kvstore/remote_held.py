"""Write-through blocks the remote store did not take, held to be sent again: those the
tier's outage kept from it, and those it answered but refused (full: Redis at its
maxmemory under noeviction), which were dropped before and never had a remote copy.
Bounded (``DEFERRED_MOST``, the oldest let go past it); the remote tier sends them
again with a commit once the store is healthy and has refused nothing for a cooldown
(``RemoteTier.committed``), so a full store is tried again once a cooldown, not by a
loop nor by every commit."""

from __future__ import annotations

from kvstore.store import Block

# Write-through blocks held, at most (the oldest go unsent past it): a few seconds of
# commits on a busy host, a few MiB of entries
DEFERRED_MOST = 1 << 14


class HeldWrites:
    """The blocks held back, oldest first; ``counters``: the remote tier's, whose
    ``deferred_writes`` counts each block held and ``unsent_writes`` each let go."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self._held: dict[Block, None] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, blocks: list[Block]) -> None:
        """Hold ``blocks`` to be sent later (while they are still cached here)."""
        held = self._held
        for b in blocks:
            if b not in held:  # (one held back again, its tenant's skip not over)
                held[b] = None
                self.counters["deferred_writes"] += 1
        while len(held) > DEFERRED_MOST:
            del held[next(iter(held))]
            self.counters["unsent_writes"] += 1

    def take(self) -> list[Block]:
        """Every block held, oldest first; none held afterwards."""
        held, self._held = self._held, {}
        return list(held)

    def __repr__(self) -> str:
        return f"HeldWrites({len(self._held)} held)"
