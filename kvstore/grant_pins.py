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

Bounded a request, since the daemon's one loop does this work (~190 ns a block): a pin
may walk at most ``MAX_PREFIX_STEPS`` blocks beyond those it names (else pinning the
last block of a 100k-block chain walks the chain each time, even when refused); a chain
pinned from its head in order walks one step a key, so long chains pinned that way
pass.  A release can still free a long chain at once (the pins below it released first,
or a lease ending): its discharge is queued and done ``MAX_PREFIX_STEPS`` blocks at a
time (``drain``, each request); meanwhile the grantee is over-counted, which only
refuses it sooner, and the counts are exact once the queue is empty.  With a share of 1
nothing is counted at all (``counting``): no pin could be refused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from kvstore.blocks import Block, Namespace, Pin
from kvstore.errors import LimitExceededError

Capacity = Callable[[Namespace], int]  # the owner's DRAM bytes a share is a share of

# blocks a pin may walk up beyond those it names; also the discharge done a request
MAX_PREFIX_STEPS = 4096


class GrantPins:
    """Bytes of owners' DRAM each grantee tenant keeps pinned, per owner."""

    def __init__(self, share: float, capacity: Capacity, total: float = 1.0) -> None:
        self.share = share
        self.total = total  # of the owner's DRAM, over all its grantees' distinct blocks
        # each block some grantee protects -> how many grantees do; the owner's slots
        # so protected (a block many grantees pin counts once)
        self._grantees: dict[Block, int] = {}
        self.total_held: dict[str, int] = {}
        self.capacity = capacity
        self.held: dict[tuple[str, str], int] = {}  # (grantee, owner) -> bytes pinned
        # grantee -> each block it protects (pinned, or an ancestor of a pinned one) ->
        # its pins by the grantee and its protected children (its slot counts once in
        # ``held`` while this is above zero)
        self._refs: dict[str, dict[Block, int]] = {}
        # discharges still to do: [grantee, the pin's blocks, next index, block to
        # decrement next (None: the next of the pin's blocks)]
        self._pending: deque[list[object]] = deque()
        self.max_steps = MAX_PREFIX_STEPS  # (tests lower it)

    def __repr__(self) -> str:
        return f"GrantPins(share={self.share:g}, held={self.held})"

    def limit(self, ns: Namespace) -> int:
        """The most bytes of ``ns``'s owner's DRAM one grantee may keep pinned."""
        return int(self.share * self.capacity(ns))

    @property
    def counting(self) -> bool:
        """Whether pins are counted: not with a share of 1, which refuses none (pins
        taken then stay uncounted if the share is lowered later)."""
        return min(self.share, self.total) < 1.0

    def check(self, grantee: str, ns: Namespace, blocks: Iterable[Block | None],
              reserved: int = 0) -> None:
        """Refuse (LimitExceededError) a pin of ``blocks`` by ``grantee`` in ``ns`` (of
        another tenant) that would take the grantee past its share of the owner's DRAM,
        with the ``reserved`` slots it holds open there (a writer grantee's: else it
        holds its share in reservations and again in pins), or walk more than
        ``MAX_PREFIX_STEPS`` unprotected blocks beyond those it names; nothing changes
        either way.  Missing blocks (None) are left out: the pin itself fails then."""
        self.drain()
        refs = self._refs.get(grantee, {})
        slot = ns.cls.slot_bytes
        held = self.held.get((grantee, ns.tenant), 0) + reserved * slot
        limit = self.limit(ns)
        everyone = self.total_held.get(ns.tenant, 0)
        total_limit = int(self.total * self.capacity(ns))
        grantees = self._grantees
        fresh = 0  # new blocks no grantee protects yet
        named = [b for b in blocks if b is not None]
        names = set(named)
        new: set[Block] = set()
        beyond = 0
        for block in named:
            b: Block | None = block
            while b is not None and b not in refs and b not in new:
                new.add(b)
                if b not in grantees:
                    fresh += 1
                    if everyone + fresh * slot > total_limit:
                        raise LimitExceededError(
                            f"tenant {ns.tenant!r}'s grantees together keep {everyone} "
                            f"bytes of its DRAM pinned (limit {total_limit}, "
                            f"auth.grantee_pin_total = {self.total:g}); this would pass it")
                if b not in names:
                    beyond += 1
                    if beyond > self.max_steps:
                        raise LimitExceededError(
                            f"this pin of tenant {ns.tenant!r}'s blocks would count more "
                            f"than {self.max_steps} unpinned prefix blocks above them "
                            f"(auth.grantee_pin_share counts the prefixes a pin keeps in "
                            f"place); pin the chain from its head (with its prefix keys)")
                if held + len(new) * slot > limit:  # (stops walking here)
                    raise LimitExceededError(
                        f"tenant {grantee!r} keeps {held} bytes of tenant {ns.tenant!r}'s "
                        f"DRAM pinned or reserved, with the prefixes that pins keep in "
                        f"place (limit {limit}, auth.grantee_pin_share = {self.share:g} "
                        f"of {self.capacity(ns)}); this would pass it; release some")
                b = b.parent

    def check_reserve(self, grantee: str, ns: Namespace, slots: int) -> None:
        """Refuse (LimitExceededError) a writer grantee's reservation that would take
        its reserved ``slots`` in the owner's namespaces (this one's included), with
        what it keeps pinned there, past its share: open reservations hold DRAM slots
        that nothing else counts (else a writer reserves the owner's arena full)."""
        held = self.held.get((grantee, ns.tenant), 0)
        limit = self.limit(ns)
        if held + slots * ns.cls.slot_bytes > limit:
            raise LimitExceededError(
                f"tenant {grantee!r} would hold {slots} reserved slots of tenant "
                f"{ns.tenant!r}'s DRAM with {held} bytes pinned there (limit {limit}, "
                f"auth.grantee_pin_share = {self.share:g}); commit or abort some")

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
                others = self._grantees.get(b, 0)
                self._grantees[b] = others + 1
                if not others:
                    self.total_held[b.ns.tenant] = (self.total_held.get(b.ns.tenant, 0)
                                                    + b.ns.cls.slot_bytes)
                b = b.parent
        if added:
            ns = pin.blocks[0].ns
            key = (grantee, ns.tenant)
            self.held[key] = self.held.get(key, 0) + added * ns.cls.slot_bytes

    def discharge(self, grantee: str, pin: Pin, now: bool = True) -> None:
        """A counted pin went (released, sent, or its session's lease ran out): queued,
        and done now as far as ``MAX_PREFIX_STEPS`` blocks allow (``drain``); with
        ``now`` False only queued (a lease's end lets go of all its session's pins in
        one loop pass: each drained there would add up to seconds)."""
        if pin.blocks:
            self._pending.append([grantee, pin.blocks, 0, None])
            if now:
                self.drain()

    @property
    def settled(self) -> bool:
        """Whether no discharge waits (the counts are exact then)."""
        return not self._pending

    def drain(self) -> None:
        """Do up to ``max_steps`` blocks of the queued discharges (a request's worth)."""
        self._drain(self.max_steps)

    def settle(self) -> None:
        """Do all the queued discharges (the counts are exact then)."""
        self._drain(None)

    def _drain(self, steps: int | None) -> None:
        """Do up to ``steps`` blocks of the queued discharges (None: all of them): each
        block's count drops by one, and a block protected no more is no longer counted
        and drops its parent's count in turn."""
        pending = self._pending
        while pending and (steps is None or steps > 0):
            item = pending[0]
            grantee, blocks, i, b = item
            assert isinstance(grantee, str) and isinstance(blocks, list)
            assert isinstance(i, int) and (b is None or isinstance(b, Block))
            refs = self._refs[grantee]
            while steps is None or steps > 0:
                if b is None:
                    if i == len(blocks):
                        break
                    b = blocks[i]
                    i += 1
                if steps is not None:
                    steps -= 1
                count = refs[b] - 1
                if count:
                    refs[b] = count
                    b = None
                    continue
                del refs[b]  # protected no more: up to its parent
                self._uncount(grantee, b)
                b = b.parent
            if b is None and i == len(blocks):
                pending.popleft()
                if not refs:
                    del self._refs[grantee]
            else:
                item[2], item[3] = i, b

    def _uncount(self, grantee: str, block: Block) -> None:
        ns = block.ns
        key = (grantee, ns.tenant)
        left = self.held[key] - ns.cls.slot_bytes
        assert left >= 0, f"{grantee!r} gave back more of {ns.tenant!r} than it held"
        if left:
            self.held[key] = left
        else:
            del self.held[key]
        others = self._grantees[block] - 1
        if others:
            self._grantees[block] = others
            return
        del self._grantees[block]
        total = self.total_held[ns.tenant] - ns.cls.slot_bytes
        if total:
            self.total_held[ns.tenant] = total
        else:
            del self.total_held[ns.tenant]

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
        protected children, and the bytes sum the protected blocks' slots.  Queued
        discharges are done first (a debug check: it settles the counts it checks)."""
        self.settle()
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
        grantees: dict[Block, int] = {}
        for blocks in refs.values():
            for block in blocks:
                grantees[block] = grantees.get(block, 0) + 1
        assert grantees == self._grantees, f"{self} counts other grantees per block"
        totals: dict[str, int] = {}
        for block in grantees:
            totals[block.ns.tenant] = totals.get(block.ns.tenant, 0) + block.ns.cls.slot_bytes
        assert totals == self.total_held, f"{self} does not sum its owners' blocks: {totals}"
