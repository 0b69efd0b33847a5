"""A change of eviction policy at runtime, passed on a few items at a time (``Switch``).

``BlockStore.set_eviction_policy`` (a SIGHUP that names another ``dram.eviction_policy``)
handed every cached block of a class to the new order in one call: at a million blocks
0.76 to 1.4 s of the daemon's loop between LRU and ``auto``, 6.1 s from SLRU to hit
density (``python benchmarks/eviction_cost.py --switch 1M``), every client stalled, and
ten times that at 10M.  A ``Switch`` stands in for the class's order (inside its
``WarmPins``, which keeps the soft and hard pins as they are) while the items move, and
moves them in steps: ``step(most)`` from the calls it takes (twice the items an insert
or a hit names, at least ``PASS_A_CALL``) and from the daemon's loop between requests
(``kvstore.policy_switches``), so it ends whether or not traffic comes.

It works with any two orders through their common interface alone.  An item lives in
one of four places, each item in one at a time (those kept in the items' links share
them: a place takes an item only once the others let it go):

- ``old``: the order that was in charge, only shrinking: its coldest items leave it as
  its victims would (``pop_victims``), to the new order;
- ``new``: the new order, holding ``old``'s coldest items so far, coldest first;
- ``fresh``: the items inserted or hit since the switch began, least recently first
  (an item of ``old`` or ``new`` hit again moves here, as it is now the warmest);
- ``pinned``: the items pinned since the switch began, apart until passed on last.

Any call that names an item takes it out of ``old`` and ``new`` first (their
``remove`` forgets an item they do not hold), so no table of the items passed on is
needed.  The items pinned before the switch stay where ``old`` keeps its pinned ones
until ``old`` has given up its last evictable item; they are then taken out of it
(those still pinned: ``is_pinned``) and passed on with the others pinned.  Victims come
from ``new`` first (the coldest items, as the new order ranks them), then ``old``'s
cold end, then ``fresh``'s.  Once ``old`` is empty, ``fresh`` passes to ``new`` in its
order, then the pinned items, pinned; ``done`` tells the owner, which puts ``new`` in
charge.  The new order sees every item as newly inserted in the order the old one
would have given them up (their hits since are kept in that order; counts of past hits
are not: an adaptive order learns them again), as the one-call switch did.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from itertools import chain, islice
from typing import Any, Generic, TypeVar

from kvstore.scheduler.density import HitDensityPolicy
from kvstore.scheduler.eviction import AutoPolicy
from kvstore.scheduler.handover import LET_GO_A_STEP, Handover, parts_of
from kvstore.scheduler.linked import Queue, queue, release_links
from kvstore.scheduler.policy import EvictionPolicy

T = TypeVar("T", bound=Hashable)

# Items passed on per insert or hit call: twice the items it names, at least
# PASS_A_CALL, besides the daemon's loop turns (a fixed number a call let an ingest of
# more than about 320 blocks a loop turn refill ``fresh`` faster than it drained: the new
# order never in charge)
PASS_A_CALL = 64

_ABSENT: Any = object()


def _any(item: object) -> bool:
    return True


def _nothing(item: object) -> None:
    return None


def _leftovers(order: EvictionPolicy[Any]) -> list[Iterator[None]]:
    """The ghost tables of an order given up (a duel's: of its order in charge), each
    emptied a step at a time: its victims' names, up to four times the cache for hit
    density (the old order's victims as it is drained, too), which let go at once held
    one call for tens of milliseconds at a million blocks (see ``Handover``)."""
    if isinstance(order, Switch):  # a switch drained: what its old order left, inherited
        litter, order._litter = order._litter, []
        return litter
    inner = getattr(order, "_order", order) if order.name == "auto" else order
    parts = None if isinstance(inner, Handover) else parts_of(inner)
    return [] if parts is None else parts.leftovers()


def _duel_let_go(duel: AutoPolicy[Any], step: int) -> Iterator[None]:
    """``duel.release()`` a few entries at a time, pausing (``yield``) after each, once
    its items are gone: the latest victims' names (up to 256k), the miniatures' keys and
    their ghosts (up to 8192 keys each), let go at once, held one call 7-10 ms at a
    million blocks (``benchmarks/eviction_cost.py --switch 1M``)."""
    gone = duel._gone
    while gone:
        for _ in range(min(step, len(gone))):
            gone.pop()
        yield
    for mini in duel._minis:
        parts = parts_of(mini.order)
        if parts is None:
            continue
        for q in parts.queues:  # (a Python call a key: a quarter as many a step)
            while q:
                for _ in range(min(step // 4, len(q))):
                    del q[next(iter(q))]
                yield
        for litter in parts.leftovers():
            yield from litter
    yield from duel._nodes.dismantle(step)
    duel.release()


def _coldest_of(order: EvictionPolicy[Any]) -> Callable[[], Any] | None:
    """A reader of the next item ``order``'s listing names (its victims' order, but for
    S3-FIFO's promotions), or None where its lists cannot be read in place (a switch, a
    duel handing over)."""
    if isinstance(order, Switch):
        return None
    inner = getattr(order, "_order", order) if order.name == "auto" else order
    parts = None if isinstance(inner, Handover) else parts_of(inner)
    return None if parts is None else parts.coldest


class Switch(EvictionPolicy[T], Generic[T]):
    """The order in charge while ``old``'s items pass to ``new`` (see the module doc).

    ``pinned``: the items pinned now (off ``old``'s order, kept in its pinned ones);
    ``is_pinned(item)``: whether an item is pinned now; ``links``: the attributes the
    orders keep their lists in (None: tables); ``done(new)`` is called once every item
    is in ``new``."""

    def __init__(self, old: EvictionPolicy[T], new: EvictionPolicy[T], pinned: Iterable[T],
                 is_pinned: Callable[[T], bool], links: str | None,
                 done: Callable[[EvictionPolicy[T]], None]) -> None:
        self.name = new.name
        self.ghost_key = new.ghost_key
        for part in old.parts() if isinstance(old, Switch) else [old]:
            if isinstance(part, AutoPolicy):  # leaving charge: its elections count no
                part.defer_to(None)  # more, and it is let go in steps once drained
        self.old: EvictionPolicy[T] | None = old
        self.new = new
        self._fresh: Queue[T] = queue(links)
        # the attribute naming the list an item is on, where the orders keep them in
        # links (the store's): an item on none, and not pinned, is held by no order
        self._owner = None if links is None else f"{links}_order"
        self._pinned: dict[T, None] = {}
        self._pinned_before: list[T] | None = list(pinned)
        self._is_pinned = is_pinned
        self._done = done
        self.finished = False
        self.passed = 0  # items handed to ``new`` so far
        self._litter: list[Iterator[None]] = []  # the old order's tables, let go in steps
        # the old order's next item to pass on, read in place where its lists can be
        # (no victim taken: a victim's name joins the ghosts, up to four times the
        # cache's, whose tables grew and split while the switch went); else its victims
        self._cold = _coldest_of(old)
        # the new order if it is hit density, and the items passed before their parents
        self._density = new if isinstance(new, HitDensityPolicy) else None
        self._waiting: dict[Any, list[T]] = {}

    # -- where an item is ------------------------------------------------------------
    def _take(self, item: T, leaving: bool = False) -> None:
        """Take ``item`` out of wherever it is, but ``pinned``: ``leaving`` the cache,
        or to be passed on again (hit density keeps its entry aside meanwhile, its
        children's links to it with it: a new entry would count none of them)."""
        if self.old is not None:
            self.old.remove(item)
        if leaving or self._density is None:
            self.new.remove(item)  # (hit density's: an entry set aside goes too)
        else:
            self._density.set_aside(item)
        self._fresh.pop(item, None)

    def _freshen(self, item: T) -> None:
        """``item`` was inserted or hit: the warmest of the items not yet in ``new``."""
        if item in self._pinned:
            return
        if self._is_pinned(item):  # pinned before the switch, still in ``old``'s pins
            self._take(item)
            self._pinned[item] = None
            return
        owner = self._owner
        if owner is not None and getattr(item, owner) is None:
            # on no order's list and pinned in none: not the orders' to hold (a block
            # being demoted, or written back): ignored, as every order ignores an item
            # it does not hold (taken into ``fresh``, such a block was a victim again
            # while its write ran, and one pinned meanwhile stayed evictable)
            return
        fresh = self._fresh
        if item in fresh:
            fresh.move_to_end(item)
        else:
            self._take(item)
            fresh[item] = None

    # -- the steps ---------------------------------------------------------------------
    def step(self, most: int) -> None:
        """Pass on up to ``most`` items: ``old``'s coldest, then (``old`` empty) its
        pinned ones, then ``fresh``, then the pinned; at the end ``new`` is in charge."""
        if self.finished:
            return
        old = self.old
        if old is not None:
            moved: list[T] = []
            cold = self._cold
            if cold is not None:  # read off its lists, as its victims would go
                remove = old.remove
                while len(moved) < most and (item := cold()) is not None:
                    remove(item)
                    if moved and moved[-1] is item:  # still listed: not its to take out
                        moved.pop()  # (a duel's item it does not track): its victims
                        self._cold = None
                        break
                    moved.append(item)
            if self._cold is None:
                moved += old.pop_victims(_any, most - len(moved), _nothing)
            if not moved and len(old):  # an order that gives up none of what it lists
                moved = list(islice(old.evictable(), most))
                for item in moved:
                    old.remove(item)
            if moved:
                self._pass(moved)
                most -= len(moved)
            if most <= 0 or len(old):
                return
            # every evictable item gone: the pinned ones it keeps, taken out of it (a
            # slice a step: a grantee may hold many)
            before = self._pinned_before or []
            taken = min(most, len(before))
            for _ in range(taken):
                item = before.pop()
                if item not in self._pinned and item not in self._fresh and self._is_pinned(item):
                    old.remove(item)
                    self._pinned[item] = None
            most -= taken
            if before or most <= 0:
                return
            self._pinned_before = None
            self._litter = _leftovers(old)
            if isinstance(old, AutoPolicy):  # its tables, its miniatures', let go in steps
                self._litter.append(_duel_let_go(old, LET_GO_A_STEP))
            else:
                old.release()
            self.old = None
        fresh = self._fresh
        if fresh:
            batch = list(islice(iter(fresh), most))
            for item in batch:
                del fresh[item]
            self._pass(batch)
            most -= len(batch)
            if most <= 0 or fresh:
                return
        pinned = self._pinned
        if pinned:
            batch = list(islice(iter(pinned), most))
            new = self.new
            for item in batch:
                del pinned[item]
            self._pass(batch)
            for item in batch:
                new.pin(item)
            if pinned:
                return
        if self._litter:  # a step of a table the old order left
            if next(self._litter[-1], _ABSENT) is _ABSENT:
                self._litter.pop()
            return
        self.finished = True
        if self._density is not None:  # children whose parents never came: as one call
            self._density.end_aside()
            self._density.link_later(self._waiting)
        self._waiting = {}
        self._done(self.new)

    def _pass(self, batch: list[T]) -> None:
        """Hand ``batch`` to the new order; hit density links the children it passed
        before their parents once those come (``link_late``), as one call of them all
        would have (its own ``_later`` ends at the next victim or hit)."""
        self.new.insert_many(batch)
        if self._density is not None:
            self._density.link_late(batch, self._waiting)
        self.passed += len(batch)

    # -- the order's interface -----------------------------------------------------------
    def insert(self, item: T) -> None:
        # new to every order (a commit's, or one a warm pin let go: off the orders)
        if self._is_pinned(item):  # (a warm pin let go of a pinned item)
            self._pinned[item] = None
        else:
            self._fresh[item] = None
        self.step(PASS_A_CALL)

    def insert_many(self, items: Iterable[T]) -> None:
        fresh, is_pinned = self._fresh, self._is_pinned
        count = 0
        for item in items:
            count += 1
            if is_pinned(item):
                self._pinned[item] = None
            else:
                fresh[item] = None
        self.step(max(PASS_A_CALL, 2 * count))

    def access(self, item: T) -> None:
        self._freshen(item)
        self.step(PASS_A_CALL)

    def access_many(self, items: Iterable[T]) -> None:
        count = 0
        for item in items:
            count += 1
            self._freshen(item)
        self.step(max(PASS_A_CALL, 2 * count))

    def pin(self, item: T) -> None:
        if item not in self._pinned:
            self._take(item)
            self._pinned[item] = None

    def unpin(self, item: T) -> None:
        # pinned since the switch began, or before it (kept in ``old``'s pins, or in
        # ``new``'s once passed on): evictable now, the warmest
        if self._pinned.pop(item, _ABSENT) is _ABSENT:
            self._take(item)
        self._fresh[item] = None

    def remove(self, item: T) -> None:
        self._take(item, leaving=True)
        self._pinned.pop(item, None)

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        victim = self.new.pop_victim(allowed)
        if victim is None and self.old is not None:
            victim = self.old.pop_victim(allowed)
        if victim is None:
            fresh = self._fresh
            victim = next((item for item in fresh if allowed(item)), None)
            if victim is not None:
                del fresh[victim]
        return victim

    def evictable(self) -> Iterator[T]:
        parts: list[Iterable[T]] = [self.new.evictable(), list(self._fresh)]
        if self.old is not None:
            parts.insert(1, self.old.evictable())
        return chain.from_iterable(parts)

    def __len__(self) -> int:
        return len(self.new) + len(self._fresh) + (len(self.old) if self.old is not None else 0)

    def release(self) -> None:
        if self.old is not None:
            self.old.release()
            self.old = None
        for litter in self._litter:  # what the old order left (a duel's own release)
            for _ in litter:
                pass
        self._litter = []
        release_links(self._fresh)
        self.new.release()

    def expect(self, capacity: int) -> None:
        self.new.expect(capacity)

    def parts(self) -> list[EvictionPolicy[T]]:
        """The orders it holds items in now (``old`` while it has any, and ``new``), a
        switch among them by its own parts."""
        held = [self.new] if self.old is None else [self.old, self.new]
        return [p for order in held
                for p in (order.parts() if isinstance(order, Switch) else [order])]

    def __repr__(self) -> str:
        old = "-" if self.old is None else f"{self.old.name}:{len(self.old)}"
        return (f"Switch(to={self.name}, old={old}, new={len(self.new)}, "
                f"fresh={len(self._fresh)}, pinned={len(self._pinned)}, passed={self.passed})")

