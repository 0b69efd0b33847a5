"""A big commit's blocks put on their eviction order a step a turn of the daemon's loop.

A commit puts its new blocks on their class's eviction order, deepest first (so that
parents end up warmer).  Under ``auto`` that order's duel also plays a sample of them
through its miniature caches: a commit of 4096 blocks held the loop 7.2-7.6 ms
(``benchmarks/evict_hold.py --sizes 4096 --policies auto``; ``lru`` 1.9-2.7), every
other client waiting.  So in the daemon a commit of more than ``STEP`` new blocks puts
its deepest ``STEP`` on the order at once and holds the rest off it, pinned by the store
itself (``Block.refs``), to be put on ``STEP`` a turn, deepest first: the order hears of
every block in the order one call would have told it, a few turns later.  Meanwhile
the held blocks are committed like any other (found by lookups, read, pinned by
clients) but are not evicted; hits on them are not told to the order, which has not
heard of them yet; and a request that finds too little to evict while blocks of its
class are held waits for them (``RoomMaker.room_coming``) rather than be refused.
Commits made meanwhile go on as they come, so a later commit's deepest blocks may reach
the order before an earlier one's head.  Outside the daemon (the simulators, in-process
tests) nothing is held: ``run_on`` starts the holding, on the daemon's loop (anything
with its ``call_soon``: this part of the store does no I/O).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.blocks import Block, Namespace
    from kvstore.pool import SlabClass
    from kvstore.scheduler.eviction import EvictionPolicy

# New blocks of one commit put on their order in one turn of the loop (about 1.8 us each
# under ``auto``, 0.5 under ``lru``).
STEP = 1024


class _Counted(Protocol):
    pinned_blocks: int  # (``StoreCore``'s count of blocks with refs)


class _Loop(Protocol):
    def call_soon(self, callback: Callable[[], None], /) -> object: ...


class OrderHolds:
    """The blocks of big commits held off their eviction orders, and their putting on."""

    def __init__(self, store: _Counted) -> None:
        self.store = store
        self.held: set[Block] = set()
        self._steps: deque[list[Block]] = deque()  # each a stretch of one commit's blocks
        self._by_class: dict[SlabClass, int] = {}
        self._loop: _Loop | None = None
        self._freed: Callable[[], None] = _nothing
        self._due = False

    def run_on(self, loop: _Loop, freed: Callable[[], None]) -> None:
        """Hold big commits' blocks from now on, put on their orders in turns of ``loop``;
        ``freed`` is told after each step (requests waiting for room may find it)."""
        self._loop, self._freed = loop, freed

    def insert(self, ns: Namespace, policy: EvictionPolicy[Block], fresh: list[Block]) -> None:
        """Put a commit's new blocks (a chain's, head first) on ``policy``, deepest first:
        all now, or the deepest ``STEP`` now and the rest in later turns."""
        if self._loop is None or len(fresh) <= STEP:
            policy.insert_many(reversed(fresh))
            return
        cut = len(fresh) - STEP
        policy.insert_many(reversed(fresh[cut:]))
        held = fresh[:cut]
        for block in held:
            block.refs += 1  # (refs were 0: a new DRAM copy)
        self.held.update(held)
        store = self.store
        store.pinned_blocks += cut
        pinned = ns.dram.pinned
        pinned[ns.tenant] = pinned.get(ns.tenant, 0) + cut * ns.cls.slot_bytes
        self._by_class[ns.cls] = self._by_class.get(ns.cls, 0) + cut
        for end in range(cut, 0, -STEP):  # deepest first
            self._steps.append(held[max(0, end - STEP):end])
        if not self._due:
            self._due = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        self._due = False
        if self._steps:
            self.step()
        if self._steps and self._loop is not None:
            self._due = True
            self._loop.call_soon(self._turn)
        self._freed()

    def step(self) -> None:
        """Put the next held stretch on its order (deepest first), its blocks let go."""
        blocks = self._steps.popleft()
        ns = blocks[0].ns
        store = self.store
        self.held.difference_update(blocks)
        left = self._by_class[ns.cls] - len(blocks)
        if left:
            self._by_class[ns.cls] = left
        else:
            del self._by_class[ns.cls]
        let_go = 0
        for block in blocks:
            block.refs -= 1
            let_go += not block.refs
        if let_go:
            store.pinned_blocks -= let_go
            pinned = ns.dram.pinned
            rest = pinned[ns.tenant] - let_go * ns.cls.slot_bytes
            if rest:
                pinned[ns.tenant] = rest
            else:
                del pinned[ns.tenant]
        policy = ns.dram.policy(ns.cls)
        policy.insert_many(reversed(blocks))
        if let_go < len(blocks):  # pinned by a client meanwhile: off the order until let go
            for block in blocks:
                if block.refs:
                    policy.pin(block)

    def settle(self) -> None:
        """Every held block on its order now."""
        while self._steps:
            self.step()

    def told(self, blocks: Sequence[Block]) -> Sequence[Block]:
        """Those of ``blocks`` their order has heard of (hits to tell it of)."""
        held = self.held
        return [b for b in blocks if b not in held] if held else blocks

    def holding(self, cls: SlabClass | None) -> bool:
        """Whether blocks of ``cls`` (of any class if None) are held off their order."""
        return bool(self._by_class) if cls is None else cls in self._by_class

    def __len__(self) -> int:
        return len(self.held)


def _nothing() -> None:
    pass
