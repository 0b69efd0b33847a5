"""What grantees keep pinned in the namespaces of the tenants that granted them.

``auth.shared_tenants`` lets a grantee ``acquire`` and ``lookup_pin`` the owner's blocks,
and a pinned block is never evicted: without a bound, one grantee could pin most of the
owner's DRAM and leave its owner's own reservations no room.  The per-tenant pin caps
count pins, not bytes, so they do not bound that.  Here each grantee tenant's pins in
each owner's namespaces are counted in bytes: the slots of the *distinct* blocks it keeps
pinned there (many sessions of one grantee pinning one shared system prompt hold its
bytes once: that is what they keep from eviction), within ``share`` of the owner's DRAM
tier (its arena, or its quota of a shared one).

Kept incrementally: a pin adds and a release subtracts only its own blocks' slots (the
work the store does for the pin anyway), never a walk of other holdings.  Pure
bookkeeping: block and pin objects in, counts out; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvstore.blocks import Block, Namespace, Pin
from kvstore.errors import LimitExceededError

Capacity = Callable[[Namespace], int]  # the owner's DRAM bytes a share is a share of


class GrantPins:
    """Bytes of owners' DRAM each grantee tenant keeps pinned, per owner."""

    def __init__(self, share: float, capacity: Capacity) -> None:
        self.share = share
        self.capacity = capacity
        self.held: dict[tuple[str, str], int] = {}  # (grantee, owner) -> bytes pinned
        # grantee -> block -> its pins on the block (the block counts once in ``held``)
        self._refs: dict[str, dict[Block, int]] = {}

    def __repr__(self) -> str:
        return f"GrantPins(share={self.share:g}, held={self.held})"

    def limit(self, ns: Namespace) -> int:
        """The most bytes of ``ns``'s owner's DRAM one grantee may keep pinned."""
        return int(self.share * self.capacity(ns))

    def check(self, grantee: str, ns: Namespace, blocks: Iterable[Block | None]) -> None:
        """Refuse (LimitExceededError) a pin of ``blocks`` by ``grantee`` in ``ns`` (of
        another tenant) that would take the grantee past its share of the owner's DRAM;
        nothing changes either way.  Missing blocks (None) are left out: the pin itself
        fails then."""
        refs = self._refs.get(grantee, {})
        new = {b for b in blocks if b is not None and b not in refs}
        if not new:
            return  # (a block it has pinned already takes no more room)
        slot = ns.cls.slot_bytes
        held = self.held.get((grantee, ns.tenant), 0)
        limit = self.limit(ns)
        if held + len(new) * slot > limit:
            raise LimitExceededError(
                f"tenant {grantee!r} keeps {held} bytes of tenant {ns.tenant!r}'s DRAM "
                f"pinned (limit {limit}, auth.grantee_pin_share = {self.share:g} of "
                f"{self.capacity(ns)}); {len(new)} more blocks would pass it; release "
                f"some, or read with get (which copies)")

    def charge(self, grantee: str, pin: Pin) -> None:
        """Count a pin ``grantee`` took in another tenant's namespace."""
        if not pin.blocks:
            return
        ns = pin.blocks[0].ns
        refs = self._refs.setdefault(grantee, {})
        added = 0
        for block in pin.blocks:
            count = refs.get(block, 0)
            if not count:
                added += 1
            refs[block] = count + 1
        if added:
            key = (grantee, ns.tenant)
            self.held[key] = self.held.get(key, 0) + added * ns.cls.slot_bytes

    def discharge(self, grantee: str, pin: Pin) -> None:
        """A counted pin went (released, or its session's lease ran out)."""
        if not pin.blocks:
            return
        ns = pin.blocks[0].ns
        refs = self._refs[grantee]
        gone = 0
        for block in pin.blocks:
            count = refs[block] - 1
            if count:
                refs[block] = count
            else:
                del refs[block]
                gone += 1
        if not refs:
            del self._refs[grantee]
        if gone:
            key = (grantee, ns.tenant)
            left = self.held[key] - gone * ns.cls.slot_bytes
            assert left >= 0, f"{grantee!r} gave back more of {ns.tenant!r} than it held"
            if left:
                self.held[key] = left
            else:
                del self.held[key]

    def stats(self) -> dict[str, dict[str, int]]:
        """Every grantee's bytes pinned, by grantee and owner (the operator's view)."""
        out: dict[str, dict[str, int]] = {}
        for (grantee, owner), n in self.held.items():
            out.setdefault(grantee, {})[owner] = n
        return out

    def of(self, grantee: str) -> dict[str, int]:
        """The bytes ``grantee`` keeps pinned, by owner (its own figures only)."""
        return {owner: n for (g, owner), n in self.held.items() if g == grantee}

    def check_invariants(self, pins: dict[str, list[Pin]]) -> None:
        """The counts match the counted pins (``pins``: each grantee's), recounted."""
        refs: dict[str, dict[Block, int]] = {}
        for grantee, held in pins.items():
            for pin in held:
                mine = refs.setdefault(grantee, {})
                for block in pin.blocks:
                    mine[block] = mine.get(block, 0) + 1
        assert refs == self._refs, f"{self} counts other pins than those held"
        sums: dict[tuple[str, str], int] = {}
        for grantee, blocks in refs.items():
            for block in blocks:
                key = (grantee, block.ns.tenant)
                sums[key] = sums.get(key, 0) + block.ns.cls.slot_bytes
        assert sums == self.held, f"{self} does not sum its pins' blocks: {sums}"
