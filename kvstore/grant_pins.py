"""What grantees keep pinned in the namespaces of the tenants that granted them.

``auth.shared_tenants`` lets a grantee ``acquire``, ``lookup_pin`` and ``get`` the owner's
blocks, and a pinned block is never evicted (a get's, until its reply is sent: as long
as a peer does not read): without a bound, one grantee could pin most of the owner's
DRAM and leave its owner's own reservations no room.  The per-tenant pin caps count
pins, not bytes, so they do not bound that.  Here each grantee tenant's pins in each
owner's namespaces are counted in bytes, within ``share`` of the owner's DRAM tier (its
arena, or its quota of a shared one): the slots of the *distinct* blocks it keeps
pinned there *and of their ancestors*.  Distinct, because many sessions of one grantee
pinning one shared system prompt hold its bytes once; ancestors, because eviction is
leaf first (prefix closure): a pinned leaf keeps its whole chain in place, so pinning
the last block of each chain would otherwise hold the arena for the price of a few.
(An ancestor only on SSD is counted too: conservative, and stable while it moves.)

Kept incrementally, as a radix cache keeps its lock counts: each block the grantee
protects counts its pins by the grantee and its protected children; a pin walks up from
its blocks only until it meets a block already protected, a release only until a count
stays above zero, so the work is that of the blocks newly (un)protected, never a walk
of other holdings; a refused pin stops walking as soon as it is over.  Pure
bookkeeping over block and pin objects (a block's parent never changes); no I/O.
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
        # grantee -> each block it protects (pinned, or an ancestor of a pinned one) ->
        # its pins by the grantee and its protected children (its slot counts once in
        # ``held`` while this is above zero)
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
        slot = ns.cls.slot_bytes
        held = self.held.get((grantee, ns.tenant), 0)
        limit = self.limit(ns)
        new: set[Block] = set()
        for block in blocks:
            b = block
            while b is not None and b not in refs and b not in new:
                new.add(b)
                if held + len(new) * slot > limit:  # (stops walking here)
                    raise LimitExceededError(
                        f"tenant {grantee!r} keeps {held} bytes of tenant {ns.tenant!r}'s "
                        f"DRAM pinned, with the prefixes that pins keep in place (limit "
                        f"{limit}, auth.grantee_pin_share = {self.share:g} of "
                        f"{self.capacity(ns)}); this would pass it; release some")
                b = b.parent

    def charge(self, grantee: str, pin: Pin) -> None:
        """Count a pin ``grantee`` took in another tenant's namespace."""
        if not pin.blocks:
            return
        refs = self._refs.setdefault(grantee, {})
        added = 0
        for block in pin.blocks:
            b: Block | None = block
            while b is not None:  # up to the first block it protects already
                count = refs.get(b, 0)
                refs[b] = count + 1
                if count:
                    break
                added += 1
                b = b.parent
        if added:
            ns = pin.blocks[0].ns
            key = (grantee, ns.tenant)
            self.held[key] = self.held.get(key, 0) + added * ns.cls.slot_bytes

    def discharge(self, grantee: str, pin: Pin) -> None:
        """A counted pin went (released, sent, or its session's lease ran out)."""
        if not pin.blocks:
            return
        refs = self._refs[grantee]
        gone = 0
        for block in pin.blocks:
            b: Block | None = block
            while b is not None:  # up while a block is protected no more
                count = refs[b] - 1
                if count:
                    refs[b] = count
                    break
                del refs[b]
                gone += 1
                b = b.parent
        if not refs:
            del self._refs[grantee]
        if gone:
            ns = pin.blocks[0].ns
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
        """The counts match the counted pins (``pins``: each grantee's), recounted: each
        protected block (pinned, or an ancestor of one) counts its pins and its
        protected children, and the bytes sum the protected blocks' slots."""
        refs: dict[str, dict[Block, int]] = {}
        for grantee, held in pins.items():
            mine: dict[Block, int] = {}
            for pin in held:
                for block in pin.blocks:
                    mine[block] = mine.get(block, 0) + 1
            protected: set[Block] = set()
            for block in list(mine):
                b: Block | None = block
                while b is not None and b not in protected:
                    protected.add(b)
                    b = b.parent
            for b in protected:
                mine.setdefault(b, 0)
                if b.parent is not None:
                    mine[b.parent] = mine.get(b.parent, 0) + 1
            if mine:
                refs[grantee] = mine
        assert refs == self._refs, f"{self} counts other pins than those held"
        sums: dict[tuple[str, str], int] = {}
        for grantee, blocks in refs.items():
            for block in blocks:
                key = (grantee, block.ns.tenant)
                sums[key] = sums.get(key, 0) + block.ns.cls.slot_bytes
        assert sums == self.held, f"{self} does not sum its pins' blocks: {sums}"
