"""One budget of slabs over a daemon's per-tenant DRAM arenas.

With an arena per tenant (``dram.per_tenant_arenas``) each arena's pool spans
``dram.capacity``, so that any tenant may grow to all of it; the budget keeps the
arenas together within it: a slab any pool takes from its empty ones counts against
``capacity // slab_bytes`` slabs for them all, and a slab going back to a pool's empty
ones goes back to the budget, its pages to the system once another arena's growth
needs the memory (``grew``; ``on_release``: the daemon punches them out of the arena's
memory), its own arena taking it again first meanwhile.  A pool sees only what the budget has left
(``SlabPool.empty_for``).  What a pool holds is counted from the pool itself (its
slabs in use and those set aside for a class), so the budget keeps no count that could
drift from them.

Once the budget is spent, a tenant below its weighted share (``tenant_weights``,
default 1 each, over the arenas holding slabs and its own) takes a slab from the arena
furthest over its share (``kvstore.slab_moves.SlabMoves.from_other_arenas``); one at or
over its share makes room among its own blocks.  A shared arena has no budget.

The arenas are sparse files clients map and write in place, and a page first touched
when the memory file system is full raises SIGBUS in whichever process touches it.  So
where the daemon backs slabs (``backer``), a pool hands out no slot of a slab whose
memory is not there: an empty slab is taken only once its memory was allocated
(``back``, on the daemon's thread, ahead of need while the budget has memory to spare,
else while a request waits for it), and where the allocation failed (the file system
full) the pool takes only slabs that kept their memory (``is_short``) for a while, its
requests making room among its own blocks.

With more arenas writing than slabs (a share under one slab each), an arena holding
none took one from another at each request, and the slabs bounced between arenas
(each bounce a slab's blocks evicted, its memory given back and allocated again: 53
slabs taken in 144 puts of 24 tenants over 16 slabs).  Such an arena now takes a slab
only from one at most one over its share that has not written for ``min_hold`` seconds
(``idle``; nor been read: ``SlabMoves`` counts its hits as use), else it is refused
(``kvstore.slab_moves``): the budget is too small for the tenants writing, which only
the operator can change; a tenant that stops writing and reading gives its slab to one
waiting.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol


class SlabPool(Protocol):
    """What the budget reads of a pool (``kvstore.pool.SlabPool``, which imports this)."""

    _owner: dict[int, Any]
    _earmarked_total: int
    _resident: set[int]
    _backing: set[int]
    _empty: list[int]
    slab_bytes: int
    budget: ArenaBudget | None


# The fewest slabs a budget over per-tenant arenas is cut into (``budget_slab_bytes``).
BUDGET_SLABS = 16
# Empty slabs an arena keeps backed by memory ahead of need, while the budget has memory
# to spare: its next slab's allocation (1 ms a 4 MiB slab, 16 ms a 64 MiB one, on
# /dev/shm) is done on a thread before a request needs it.
AHEAD = 1
# Seconds an arena has not written for before an arena holding no slab may take its
# last one (with more arenas than slabs).
MIN_HOLD = 1.0
# Seconds an arena whose slab found no memory takes only slabs that kept theirs, before
# a slab's memory is asked for again (sooner where memory was given back meanwhile).
SHORT_SECONDS = 1.0


def budget_slab_bytes(slab_bytes: int, capacity_bytes: int) -> int:
    """The slab size of per-tenant arenas: at most a sixteenth of the capacity (in
    64 KiB steps, at least 64 KiB), so that a budget of one slab (a small capacity
    under the default 64 MiB slab) does not let only one tenant at a time hold blocks."""
    per = capacity_bytes // BUDGET_SLABS // (1 << 16) * (1 << 16)
    return max(min(slab_bytes, per), min(slab_bytes, 1 << 16))


def budget_over_arenas(per_tenant: bool, capacity_bytes: int, slab_bytes: int,
                       weights: Mapping[str, float]) -> ArenaBudget | None:
    """The budget of a store's DRAM arenas: one over them all where each tenant has its
    own (as many slabs as one pool of ``capacity_bytes`` has), none for a shared one."""
    if not per_tenant:
        return None
    slab = min(slab_bytes, capacity_bytes) if capacity_bytes else slab_bytes
    return ArenaBudget(capacity_bytes // slab if slab else 0, weights)


def join_budget(budget: ArenaBudget | None, pool: SlabPool, name: str) -> None:
    """Count a new arena's pool against ``budget``, if there is one."""
    if budget is not None:
        budget.join(pool, name)


def held(pool: SlabPool) -> int:
    """The slabs a pool holds of its budget: in use by a class, or set aside for one."""
    return len(pool._owner) + pool._earmarked_total


class ArenaBudget:
    """The slabs all arenas together may hold, and which arena holds how many."""

    def __init__(self, slabs: int, weights: Mapping[str, float]) -> None:
        self.slabs = slabs
        self.weights = weights  # by tenant (the arena's name); 1 where not given
        self.pools: dict[SlabPool, str] = {}  # each arena's pool -> the arena's name
        # told (arena name, offset, length) of each slab that went back: its pages are
        # given back to the system by the daemon (None: nothing to give, in tests)
        self.on_release: Callable[[str, int, int], None] | None = None
        self.released = 0  # slabs gone back to the budget since start
        self.taken = 0  # slabs one arena gave up for another below its share
        # told (arena name, slab index, offset, length) of each empty slab whose memory
        # is to be allocated; it answers ``backed`` later (None: slabs need no backing)
        self.backer: Callable[[str, int, int, int], None] | None = None
        # a wait for the backer's next answer, for a request that waits on one (None:
        # a turn of the loop)
        self.waiter: Callable[[], Callable[[], Awaitable[None]]] | None = None
        self.short: dict[SlabPool, float] = {}  # pools whose slab found no memory: when
        self.backed_slabs = 0  # slabs whose memory was allocated ahead of their use
        self.backing_failed = 0  # allocations that found no memory
        self.clock: Callable[[], float] = time.monotonic
        self.min_hold = MIN_HOLD
        self._used_at: dict[SlabPool, float] = {}  # when each last took slots
        self.held_back = 0  # requests refused while every slab was in use (``min_hold``)

    def join(self, pool: SlabPool, name: str) -> None:
        """Count ``pool`` (the arena ``name``'s) against the budget from now on."""
        assert pool.budget is None and not pool._owner, "a pool joins empty, once"
        pool.budget = self
        self.pools[pool] = name
        self.back_ahead(pool)  # (its first slab's memory before its first request)

    @property
    def spare(self) -> int:
        """Slabs no arena holds (0 while a warm restart's claims hold more)."""
        return max(0, self.slabs - sum(held(p) for p in self.pools))

    def grew(self, pool: SlabPool | None = None) -> None:
        """A pool took an empty slab: while the slabs the arenas hold and the empty ones
        whose pages are still there pass the budget, the pages of those go back to the
        system, the arena with most of them first.  An emptied slab keeps its pages for
        its arena until another's growth needs the memory: giving them back (the
        kernel's 45-60 ms for a 64 MiB slab on a loaded host) and taking them again
        (a fault a page) is paid only where memory passes between arenas, not each time
        a slab of a busy arena empties and fills again.  Then ``pool``'s next slab is
        backed ahead, where slabs are backed (``back_ahead``)."""
        over = self.memory() - self.slabs
        while over > 0 and self._release_one():
            over -= 1
        if pool is not None:
            self.back_ahead(pool)

    def memory(self) -> int:
        """Slabs whose memory the arenas hold or are being given: in use, empty with
        their pages kept, and being backed (not those set aside for a class: a claim on
        the budget, whose memory comes when the class takes it)."""
        return sum(len(p._owner) + len(p._resident) + len(p._backing) for p in self.pools)

    def unbacked(self, pool: SlabPool, slabs: int) -> int:
        """Of ``slabs`` empty slabs ``pool`` is about to take, those whose memory is not
        there yet (0 where slabs need no backing)."""
        if self.backer is None:
            return 0
        return max(0, slabs - len(pool._resident))

    def back(self, pool: SlabPool, count: int, *, ahead: bool = False) -> int:
        """Have the memory of ``count`` more of ``pool``'s empty slabs allocated (beside
        those being backed); other arenas' kept pages go back first where the memory
        would pass the budget, unless ``ahead`` (then only within what is spare).  How
        many were asked for."""
        backer = self.backer
        if backer is None or count <= 0:
            return 0
        wanted = [i for i in reversed(pool._empty)
                  if i not in pool._resident and i not in pool._backing][:count]
        asked = 0
        for index in wanted:
            if self.memory() >= self.slabs:
                if ahead:
                    break
                self._release_one(exclude=pool)
                if self.memory() >= self.slabs:
                    break
            pool._backing.add(index)
            asked += 1
            size = pool.slab_bytes
            backer(self.pools[pool], index, index * size, size)
        return asked

    def back_ahead(self, pool: SlabPool) -> None:
        """Keep ``AHEAD`` empty slabs of ``pool`` backed, within the memory to spare."""
        if self.backer is not None and not self.is_short(pool):
            missing = AHEAD - len(pool._resident) - len(pool._backing)
            if missing > 0 and pool._empty:
                self.back(pool, missing, ahead=True)

    def backed(self, name: str, index: int, ok: bool | None) -> None:
        """The daemon's answer to ``backer``: the memory of arena ``name``'s slab
        ``index`` was allocated (``ok``), or the file system had none (False), or
        nothing was done (None: the arena is not made yet, or closed)."""
        pool = next((p for p, n in self.pools.items() if n == name), None)
        if pool is None or index not in pool._backing:
            return
        pool._backing.discard(index)
        if ok is None:
            return
        if not ok:
            self.backing_failed += 1
            self.short[pool] = self.clock()
            return
        self.backed_slabs += 1
        self.short.pop(pool, None)
        if index in pool._empty:  # (not taken meanwhile: a claim, say)
            pool._resident.add(index)

    def used(self, pool: SlabPool) -> None:
        """``pool`` hands out slots now (``idle``)."""
        self._used_at[pool] = self.clock()

    def idle(self, pool: SlabPool) -> bool:
        """Whether ``pool`` handed out no slot for ``min_hold`` seconds."""
        at = self._used_at.get(pool)
        return at is None or self.clock() - at >= self.min_hold

    def starved(self, pool: SlabPool) -> bool:
        """Whether ``pool`` holds no slab, its share less than one (more arenas than
        slabs): it takes only an idle arena's last slab."""
        return not held(pool) and self.shares(pool)[pool] < 1

    def is_short(self, pool: SlabPool) -> bool:
        """Whether ``pool``'s last slab found no memory, lately (``SHORT_SECONDS``)."""
        at = self.short.get(pool)
        return at is not None and self.clock() - at < SHORT_SECONDS

    def _release_one(self, exclude: SlabPool | None = None) -> bool:
        """Give back the pages of one empty slab kept by the arena with most (never
        ``exclude``'s: the arena whose slab's memory this makes room for, which would
        give back one slab's memory to allocate another's); whether there was one."""
        keeping = [p for p in self.pools if p._resident and p is not exclude]
        if not keeping:
            return False
        pool = max(keeping, key=lambda p: len(p._resident))
        index = pool._resident.pop()
        self.released += 1
        self.short.clear()  # (memory given back: a slab's allocation may succeed again)
        if self.on_release is not None:
            size = pool.slab_bytes
            self.on_release(self.pools[pool], index * size, size)
        return True

    def shares(self, asking: SlabPool) -> dict[SlabPool, float]:
        """Each arena's weighted share of the slabs, in slabs: over the arenas holding
        slabs and ``asking``."""
        among = [p for p in self.pools if p is asking or held(p)]
        weight = {p: self.weights.get(self.pools[p], 1.0) for p in among}
        total = sum(weight.values()) or 1.0
        return {p: self.slabs * w / total for p, w in weight.items()}

    def below_share(self, pool: SlabPool) -> bool:
        """Whether ``pool`` may take one more slab and stay within its share; or holds
        none (more arenas than slabs: one at a time would be served otherwise)."""
        mine = held(pool)
        return not mine or mine + 1 <= self.shares(pool)[pool] + 1e-9

    def over_share(self, asking: SlabPool) -> list[SlabPool]:
        """The other arenas holding more than their share, furthest over it first; for
        an arena ``starved``, of those at most one slab over it only the ``idle``."""
        share = self.shares(asking)
        starved = self.starved(asking)
        over = [p for p in share if p is not asking and held(p) > share[p] + 1e-9
                and (not starved or held(p) > share[p] + 1 or self.idle(p))]
        return sorted(over, key=lambda p: share[p] - held(p))

    def figures(self) -> dict[str, object]:
        """The budget in slabs, what is spare, and what each arena holds."""
        return {"slabs": self.slabs, "spare": self.spare, "released": self.released,
                "taken": self.taken, "kept": sum(len(p._resident) for p in self.pools),
                "backed": self.backed_slabs, "backing_failed": self.backing_failed,
                "held_back": self.held_back,
                "held": {name: held(p) for p, name in self.pools.items()}}

    def check(self) -> None:
        """The arenas hold at most the budget (claims at a warm restart aside)."""
        total = sum(held(p) for p in self.pools)
        assert total <= self.slabs, f"the arenas hold {total} slabs of a budget of {self.slabs}"
        assert all(p._resident <= set(p._empty) for p in self.pools), (
            "a slab whose pages are kept is not empty")
        assert all(not p._backing & p._resident and p._backing <= set(p._empty)
                   for p in self.pools), "a slab being backed is kept or in use"
        kept = sum(len(p._resident) + len(p._backing) for p in self.pools)
        assert self.memory() <= self.slabs, f"{kept} empty slabs keep pages past the budget"
        assert all(p.budget is self for p in self.pools), "a pool left its budget"

    def __repr__(self) -> str:
        return f"ArenaBudget(slabs={self.slabs}, spare={self.spare}, arenas={len(self.pools)})"
