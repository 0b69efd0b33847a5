"""A duel's hand-over to another order, passed on a few items at a time.

``Duel._take_over`` passed every cached item to the new order in one call, all of it
on the daemon's event loop: at a million blocks 0.44 to 0.62 s of CPU between the linked
orders, 1.4 to 1.7 s to hit density (``python benchmarks/eviction_cost.py --handover
1M``), every client stalled while ``auto`` changed its mind, and ten times that at 10M.
A ``Handover`` stands in for the order in charge while the items move, and moves a few
with the traffic it takes (``PASS_A_BURST`` every ``BURST`` items inserted or
referenced, never with a victim asked for: it keeps ahead of the traffic), so no call
holds the loop for long: at a million blocks the switch took 1.3 to 1.75 ms (a copy of
the latest victims' names and of the pinned items) and the longest 64-item lookup while
the items moved 1.1 ms, for 0.97 to 1.18 s of CPU in all over about 4500 lookups (twice
the one call's).  Its steps fall after the same items however the calls group them, so
the same references give the same victims in the daemon (a chain's hits in one call,
reported twice) and in the replay's simulator (block by block, once).

What the items end up as is what the one-call hand-over (``hand_over_at_once``) made
of them: the new order is handed the old one's items in the order the old one listed
them, coldest first, those hit since they entered (or back since their eviction) hit
again, then the items referenced since the hand-over began, in the order of their
latest reference, then the pinned ones, then the names of the latest victims as its
ghosts (left to finish before any other call, the same victims from then on:
``tests/scheduler/test_scheduler_handover_slices.py``).  Meanwhile an item lives in
one of four places:

- ``old``: the order that was in charge, holding the items not passed on yet; it only
  shrinks (items passed on from its cold end, referenced, pinned or removed);
- ``new``: the order taking over, holding the old one's coldest items so far;
- ``fresh``: the items inserted or referenced since the hand-over began, least recently
  referenced first (an item of ``old`` or ``new`` referenced again moves here, so that
  nothing passed on later lands after it);
- ``pinned``: the pinned items, apart until passed on last.

Victims come from ``new`` first (the coldest items, as the new order ranks them), then
``old``'s cold end, then ``fresh``'s.  In the replay's cells (``python
benchmarks/duel_decisions.py``: the shared and chat traces, the generated workloads, at
four capacities) hand-overs in slices changed 12 of 196 cells' hits, by -0.4% to +0.75%
(the chat trace at 10%).  To or from hit density too (it was one call, 1.4 to 2.0 s at
a million blocks): its class lists are emptied oldest stamp first (as its
``evictable`` lists them), and, handed a chain's children before their parent, it
counts them as the parent's once the parent comes (``HitDensityPolicy.link_late``), as
one call of them all did.  A hand-over of ``HANDOVER_AT_ONCE`` items or fewer is one
call.
Nothing here is O(items) in one call but the release of a hand-over cut short
(``release``, as an order's own).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from functools import partial
from itertools import chain, islice
from typing import Any, Generic, TypeVar

from kvstore.scheduler.density import HitDensityPolicy
from kvstore.scheduler.linked import LinkedOrder, Queue, links_of, queue, release_links
from kvstore.scheduler.policy import EvictionPolicy
from kvstore.scheduler.sharded import FifoMap, ShardedDict, empty_in_steps

T = TypeVar("T", bound=Hashable)

# Every BURST items of traffic (inserted or referenced), PASS_A_BURST items passed on
# (about 1 us each: a 1024-block commit passes 2048, a few ms), or NAMES_A_STEP names
# read (into shards by hash: about 0.3 ms) or an eighth of that recalled (a name into a
# ghost map is a Python call: 2048 a step, four steps a 64-block lookup, held one 8-11
# ms).  Passing twice the traffic keeps the hand-over ahead of it.
BURST = 16
PASS_A_BURST = 64
NAMES_A_STEP = 2048
NAME_SHARDS = 251  # the names' dicts (prime, as ``sharded.SHARDS``)
# An old order's tables, let go a step at a time: LET_GO_A_STEP ghosts, or SWEEP_A_STEP
# of hit density's entries (each may free its parents' with it)
LET_GO_A_STEP = 1024
SWEEP_A_STEP = 64
SEEN_MOST = 4096  # hits remembered in one tick, at most

_ABSENT: Any = object()


def _oldest(q: Queue[T]) -> T | None:
    return q.oldest() if isinstance(q, LinkedOrder) else next(iter(q), None)


def _victims_gone(gone: Iterable[Hashable], ghost_key: Callable[[Any], Hashable],
                  resident: Iterable[Any]) -> tuple[list[Hashable], set[Any]]:
    """The latest victims' names (``gone``, oldest first), each once at its latest
    eviction, less those of the ``resident`` items (cached again since: a miss that
    brought one back): the ghosts a new order is handed; and those resident items
    themselves, back since their eviction (a ghost hit, had the new order been in
    charge).  O(items), as the hand-over is; a table of the names only."""
    names: dict[Hashable, None] = {}
    for name in gone:
        names.pop(name, None)
        names[name] = None
    back: set[Any] = set()
    for item in resident:
        if names.pop(ghost_key(item), _ABSENT) is None:
            back.add(item)
    return list(names), back


def hand_over_at_once(old: Any, new: Any, pinned: list[T], state_of: Callable[[T], Any],
                      gone: Iterable[Hashable], ghost_key: Callable[[T], Hashable],
                      let_go: Callable[[Any], None], tune: Callable[[], None]) -> None:
    """The whole hand-over from ``old`` to ``new`` in one call (O(items)): what the
    slices end with (a small cache's, and to or from hit density).  The items pass in
    the order ``old`` lists them, those hit since they entered hit again, pinned ones
    pinned.  Hit density is handed only part of its warmth: its histograms are its
    miniature's, but an item hit since it entered comes as hit once (its class of one
    hit), whatever its hits (the item states keep one bit of them); it learns the rest
    as they are hit again."""
    listed = list(old.evictable())
    let_go(old)
    ghosts, back = _victims_gone(gone, ghost_key, chain(listed, pinned))
    # hit density counts a parent's tracked children: linked across the two groups
    density = new if isinstance(new, HitDensityPolicy) else None
    waiting: dict[Any, list[T]] = {}
    for group in (listed, pinned):  # as the slices pass them (hit density's stamps)
        # A fresh order knows no ghost: inserting them all at once is inserting each.
        new.insert_many(group)
        if density is not None:
            density.link_late(group, waiting)
        # hit since they entered (``_items``' states: True, or an odd int), or back
        # since their eviction (``back``): the new order would have taken such a miss
        # as a ghost hit (SLRU's protected segment, ARC's T2, a hit class of density)
        new.access_many([item for item in group
                         if hit_since_entered(state_of, item) or item in back])
    for item in pinned:
        new.pin(item)
    if density is not None and waiting:  # the rest of the call it ended within, a
        density.link_later(waiting)  # chain's parents perhaps
    tune()
    new.recall(ghosts)


class _Parts:
    """An order's lists, coldest first, read in place: how an order the hand-over
    leaves is emptied a few items at a time (its ``evictable`` copies them all; its
    pinned items pass to the hand-over when it begins)."""

    def __init__(self, order: EvictionPolicy[Any], queues: list[Queue[Any]]) -> None:
        self.order = order
        self.queues = queues  # listed in turn

    def holds(self, item: Any) -> bool:
        """Whether ``item`` is on one of its lists (its pinned ones passed to the
        hand-over when it began: what the order still counts as pinned is stale)."""
        return any(item in q for q in self.queues)

    def coldest(self) -> Any:
        """The next item its listing names (``evictable``'s order), None if none."""
        for q in self.queues:
            item = _oldest(q)
            if item is not None:
                return item
        return None

    def leftovers(self) -> list[Iterator[None]]:
        """Its tables left once its lists are empty, each emptied a step at a time (see
        ``ShardedDict.dismantle``): its ghosts (SLRU's and hit density's up to two and
        four times the cache, ARC's two lists), let go at once 57 ms of one call at a
        million blocks, and kept by nothing else."""
        boxes = [getattr(self.order, n) for n in ("_ghost", "_b1", "_b2")
                 if hasattr(self.order, n)]
        return [box.dismantle(LET_GO_A_STEP) if isinstance(box, (FifoMap, ShardedDict))
                else empty_in_steps([box], LET_GO_A_STEP) for box in boxes]


class _DensityParts(_Parts):
    """Hit density's class lists, emptied as its ``evictable`` lists them: the oldest of
    the lists' oldest items first (``HitDensityPolicy.coldest``)."""

    def coldest(self) -> Any:
        assert isinstance(self.order, HitDensityPolicy)
        return self.order.coldest()

    def leftovers(self) -> list[Iterator[None]]:
        """Its ghosts, and its entries left: those of the items pinned when the
        hand-over began (passed on by it), each holding its parent's entry, and so
        whole chains of entries (let go at once, at a million blocks, 37 ms of one
        call): a few at a time."""
        assert isinstance(self.order, HitDensityPolicy)
        entries = self.order._entries
        tables = entries.shards if isinstance(entries, ShardedDict) else [entries]
        return [*super().leftovers(), empty_in_steps(tables, SWEEP_A_STEP)]


# The lists of the linked orders ``auto`` duels, by their names, in the order their
# ``evictable`` lists them (read in place: ``eviction.py``, which imports the duel, is
# not imported here).
_LISTS = {"lru": ("_order",), "slru": ("_probation", "_protected"), "arc": ("_t1", "_t2"),
          # no candidate of the duel, but a change of policy reads it so too
          "s3fifo": ("_small", "_main")}


def parts_of(order: object) -> _Parts | None:
    """The lists of an order ``auto`` duels, which pass its items a few at a time; None
    for another."""
    if isinstance(order, HitDensityPolicy):
        return _DensityParts(order, list(order._queues))
    names = _LISTS.get(getattr(order, "name", ""))
    if names is None or not isinstance(order, EvictionPolicy):
        return None
    return _Parts(order, [getattr(order, n) for n in names])


def hit_since_entered(state_of: Callable[[Any], Any], item: Any) -> bool:
    """Whether a duel's item was hit since it entered (its state: True, or an odd int)."""
    state = state_of(item)
    return state is True or (state is not False and state is not None and state & 1 == 1)


def start_handover(old: object, new: object, pinned: list[T],
                   state_of: Callable[[T], Any], gone: Sequence[Hashable],
                   ghost_key: Callable[[T], Hashable], tune: Callable[[], None],
                   done: Callable[[Any], None],
                   read: Callable[[], None] | None = None) -> Handover[T] | None:
    """A hand-over in slices from ``old`` to ``new`` (a duel's orders; ``state_of``
    reads its items' states), or None where both cannot (one call does it)."""
    parts = parts_of(old)
    if parts is None or parts_of(new) is None:
        return None
    assert isinstance(new, EvictionPolicy)
    return Handover(parts, new, pinned, partial(hit_since_entered, state_of), gone,
                    ghost_key, tune, done, read)


def _recalled(names: list[dict[Hashable, None]],
              kept: list[list[Hashable]]) -> Iterator[Hashable]:
    """The names not taken out (``names``' shards, ``kept`` each step's, newest first),
    oldest first, each let go of as it comes (nothing of them left to free in one call
    at the end).  A function, not a method: its paused frame holds no hand-over, so one
    cut short while it recalls leaves no cycle for the collector the daemon keeps off."""
    while kept:
        step = kept.pop()
        for name in reversed(step):
            if names[hash(name) % NAME_SHARDS].pop(name, _ABSENT) is not _ABSENT:
                yield name


class Handover(EvictionPolicy[T], Generic[T]):
    """The order in charge while ``old``'s items pass to ``new`` (see the module doc).

    ``pinned``: the items pinned now, in the order pinned; ``hit(item)``: whether an
    item was hit since it entered; ``gone``: the latest victims' names, oldest first,
    read where they are (not copied: 256k names, 0.5-2 ms cold), left as they are until
    read (the duel keeps later victims' names aside meanwhile) and ``read()`` then;
    ``tune()`` gives ``new`` its miniature's settings once it holds every item;
    ``done(new)`` is called once it has its ghosts too (the duel puts it in charge).

    Its steps, each a few items (or names) per call: the names of ``gone`` read into a
    table (newest first, so each keeps its latest place); ``old`` passed on; ``fresh``
    passed on; the pinned items passed on (from then on ``new`` takes every call, but
    for the pinned items not passed yet); the names left recalled as ghosts."""

    def __init__(self, old: _Parts, new: EvictionPolicy[T], pinned: Iterable[T],
                 hit: Callable[[T], bool], gone: Sequence[Hashable],
                 ghost_key: Callable[[T], Hashable], tune: Callable[[], None],
                 done: Callable[[EvictionPolicy[T]], None],
                 read: Callable[[], None] | None = None) -> None:
        self.name = new.name
        self._old: _Parts | None = old
        self._new = new
        # on the old order's links (an item is in one list at a time), or a table
        links = links_of(old.queues[0])
        self._fresh: Queue[T] = queue(links)
        self._owner = None if links is None else f"{links}_order"
        # Pinned items stay where the old order keeps them (off its lists) until passed.
        self._pinned: dict[T, None] = dict.fromkeys(pinned)
        self._all_in = False  # every item but the pinned ones here is in ``new``
        self._hit = hit
        # read into ``_names`` in slices, newest first, by one iterator where they lie
        # (a skip to the next slice each step walked up to 256k cold names: 12-14 ms)
        self._gone: Iterator[Hashable] | None = reversed(gone)
        self._unread = len(gone)
        self._read = read
        # each name once, at its latest eviction; a name met among the items passed on
        # is taken out (cached again since: back), the rest recalled at the end.  In
        # ``NAME_SHARDS`` dicts by hash, each step's names kept newest first in a list
        # of their own (``_kept``): one dict of 256k names grew in single steps of 3.5
        # and 6.5 ms (at 22k and 45k names; one call a hand-over at 1M blocks).
        self._names: list[dict[Hashable, None]] = [{} for _ in range(NAME_SHARDS)]
        self._kept: list[list[Hashable]] = []
        self._key = ghost_key
        self._recall: Iterator[Hashable] | None = None
        self._tune = tune
        self._done = done
        self.finished = False
        self.passed = 0  # items handed to ``new`` so far
        self._count = 0  # items of traffic since the last step
        self._seen: set[T] = set()  # items referenced since the last insert or victim
        # the new order if it is hit density, which counts a parent's tracked children,
        # and the items passed on before their parent, by parent (``link_late``)
        self._density = new if isinstance(new, HitDensityPolicy) else None
        self._waiting: dict[Any, list[T]] = {}
        self._litter: list[Iterator[None]] = []  # what the old order left, let go in steps

    # -- moving items ---------------------------------------------------------------
    def _pass(self, batch: list[T]) -> None:
        """Hand ``batch`` to the new order as the one-call hand-over did."""
        new, hit, names, key = self._new, self._hit, self._names, self._key
        new.insert_many(batch)
        if self._density is not None:
            self._density.link_late(batch, self._waiting)
        # every item's name taken out of the ghosts (resident), hit or not
        again = [item for item in batch
                 if names[hash(name := key(item)) % NAME_SHARDS].pop(name, _ABSENT) is None
                 or hit(item)]
        if again:
            new.access_many(again)
        self.passed += len(batch)

    def step(self, most: int) -> None:
        """Pass on up to ``most`` items (or read or recall a few thousand names): each
        phase in turn takes what the one before left of ``most``."""
        if self.finished or not self._read_names():
            return
        if self._litter:  # a table's step of it
            if next(self._litter[-1], _ABSENT) is _ABSENT:
                self._litter.pop()
        most = self._pass_old(most)
        if most <= 0:
            return
        most = self._pass_fresh(most)
        if most <= 0:
            return
        self._all_in = True
        most = self._pass_pinned(most)
        if not self._pinned and self._recall is None:  # every item in the new order
            self._tune()  # at the real cache's size, now the new order's
            self._recall = _recalled(self._names, self._kept)
        if most > 0 and self._recall_ghosts() and not self._litter:
            self.finished = True
            self._seen = set()
            if self._density is not None:  # the rest of this call's items, hit density's
                self._density.end_aside()
                self._density.link_later(self._waiting)
            self._waiting = {}
            self._done(self._new)

    def _read_names(self) -> bool:
        """Read ``NAMES_A_STEP`` of the latest victims' names where they lie (newest
        first, so each keeps its latest place); whether all are read."""
        gone = self._gone
        if gone is None:
            return True
        try:
            chunk = list(islice(gone, min(NAMES_A_STEP, self._unread)))
        except RuntimeError:  # let go of meanwhile (the duel released): none to read
            chunk = []
        self._unread = self._unread - len(chunk) if chunk else 0
        names, kept = self._names, []
        for name in chunk:
            shard = names[hash(name) % NAME_SHARDS]
            if name not in shard:
                shard[name] = None
                kept.append(name)
        self._kept.append(kept)
        if self._unread > 0:
            return False
        self._gone = None
        if self._read is not None:
            self._read()
        return True

    def _pass_old(self, most: int) -> int:
        """Pass on up to ``most`` of the old order's items, coldest first; what is left
        of ``most`` (0 while the old order holds more)."""
        old = self._old
        if old is None:
            return most
        batch: list[T] = []
        remove = old.order.remove
        while len(batch) < most and (item := old.coldest()) is not None:
            remove(item)
            batch.append(item)
        if batch:
            self._pass(batch)
            most -= len(batch)
        if most > 0:  # it is empty: nothing is walked
            old.order.release()
            self._litter = old.leftovers()
            self._old = None
        return most

    def _pass_fresh(self, most: int) -> int:
        """Pass on up to ``most`` of the items referenced since the hand-over began,
        least recently first; what is left of ``most``."""
        fresh = self._fresh
        if not fresh:
            return most
        batch: list[T] = []
        while len(batch) < most and (item := _oldest(fresh)) is not None:
            del fresh[item]
            batch.append(item)
        self._pass(batch)
        return most - len(batch)

    def _pass_pinned(self, most: int) -> int:
        """Pass on up to ``most`` pinned items, pinned in the new order; what is left of
        ``most`` (0 while more are left)."""
        pinned = self._pinned
        if not pinned:
            return most
        batch: list[T] = []
        while len(batch) < most and pinned:
            item = next(iter(pinned))
            del pinned[item]
            batch.append(item)
        self._pass(batch)
        new = self._new
        for item in batch:
            new.pin(item)
        return 0 if pinned else most - len(batch)

    def _recall_ghosts(self) -> bool:
        """An eighth of ``NAMES_A_STEP`` of the names left as the new order's ghosts,
        oldest first; whether none was left."""
        assert self._recall is not None
        names = list(islice(self._recall, max(1, NAMES_A_STEP // 8)))
        if names:
            self._new.recall(names)
            return False
        return True

    def _feed(self, batch: list[T], take: Callable[[list[T]], None]) -> None:
        """``take`` ``batch`` in runs, a step after each ``BURST`` items of the traffic
        the hand-over has taken (inserted or referenced): at the same items however
        the calls group them (the store hits a chain in one call, the replay's
        simulator block by block), so the same references make the same decisions."""
        at, n = 0, len(batch)
        while at < n:
            # the rest of the burst's room (the whole batch, uncopied, where it fits)
            run = batch if not at and self._count + n <= BURST else \
                batch[at:at + BURST - self._count]
            take(run)
            at += len(run)
            self._count += len(run)
            if self._count >= BURST:
                self._count = 0
                self.step(PASS_A_BURST)

    def _where(self, item: T) -> str:
        """Where an item this order holds is, until all are in the new order: 'pinned',
        'fresh', 'old' or 'new'."""
        if item in self._pinned:
            return "pinned"
        if self._owner is not None:  # on links: the list holding it says (one read)
            owner = getattr(item, self._owner)
            if owner is self._fresh:
                return "fresh"
            old = self._old
            # (``in`` by identity: a ``LinkedOrder`` has no ``==`` of its own)
            return "old" if old is not None and owner in old.queues else "new"
        if item in self._fresh:
            return "fresh"
        if self._old is not None and self._old.holds(item):
            return "old"
        return "new"

    def _referenced(self, item: T) -> None:
        """A reference to ``item``: to ``fresh``'s warm end, wherever it was."""
        place = self._where(item)
        if place == "fresh":
            self._fresh.move_to_end(item)
        elif place == "old":
            assert self._old is not None
            self._old.order.remove(item)
            self._fresh[item] = None
        elif place == "new":
            self._set_aside(item)
            self._fresh[item] = None
        # pinned: referenced while pinned, its place is decided when it is unpinned

    # -- the order's calls ------------------------------------------------------------
    def insert(self, item: T) -> None:
        self._feed([item], self._insert_run)

    def insert_many(self, items: Iterable[T]) -> None:
        self._feed(items if type(items) is list else list(items), self._insert_run)

    def _insert_run(self, run: list[T]) -> None:
        self._seen.clear()  # a new tick
        if self._all_in:
            self._new.insert_many(run)
            if self._density is not None:  # a chain split between two runs, linked
                # (once finished, by hit density itself: ``link_later``)
                self._density.link_late(run, self._waiting)
        elif isinstance(self._fresh, LinkedOrder):
            self._fresh.extend(run)
        else:
            self._fresh.update(dict.fromkeys(run))

    def access(self, item: T) -> None:
        self.access_many([item])

    def access_many(self, items: Iterable[T]) -> None:
        batch = items if type(items) is list else list(items)
        if not self.finished:
            # A hit counts once a tick (an insert or a victim ends one), as the duel's
            # miniatures count it: the daemon's lookup and acquire report each hit of a
            # request, the replay's simulator once, and both must make the same steps,
            # to the last (the pinned items passed on and the ghosts recalled come
            # after every item is in the new order).
            seen = self._seen
            if len(seen) > SEEN_MOST:  # hits alone for long: no tick ends
                seen.clear()
            before = len(seen)
            batch = [item for item in batch if item not in seen]
            seen.update(batch)
            if len(seen) - before < len(batch):  # an item named twice in the call
                batch = list(dict.fromkeys(batch))
        self._feed(batch, self._access_run)

    def _access_run(self, run: list[T]) -> None:
        if self._all_in:
            pinned = self._pinned
            self._new.access_many([i for i in run if i not in pinned] if pinned else run)
        else:
            for item in run:
                self._referenced(item)

    def pin(self, item: T) -> None:
        if item in self._pinned:
            return
        if self._all_in:
            self._new.pin(item)
            return
        self._take_out(item, leaving=False)
        self._pinned[item] = None

    def unpin(self, item: T) -> None:
        if self._pinned.pop(item, _ABSENT) is _ABSENT:
            self._new.unpin(item)  # passed on already: the new order's
        elif self._all_in:
            self._pass([item])  # evictable again, in the new order
        else:
            self._fresh[item] = None  # evictable again, as the warmest

    def remove(self, item: T) -> None:
        if self._pinned.pop(item, _ABSENT) is not _ABSENT:
            self._forget_aside(item)
        elif self._all_in:
            self._new.remove(item)
        else:
            self._take_out(item, leaving=True)

    def _take_out(self, item: T, leaving: bool) -> None:
        """Take an unpinned item off whichever list holds it (before all are in the new
        order): ``leaving`` the cache, or to be passed on again."""
        place = self._where(item)
        if place == "fresh":
            del self._fresh[item]
            if leaving:
                self._forget_aside(item)
        elif place == "old":
            assert self._old is not None
            self._old.order.remove(item)
        elif leaving:
            self._new.remove(item)
        else:
            self._set_aside(item)

    def _set_aside(self, item: T) -> None:
        """Take ``item`` out of the new order until it is passed on again: hit density
        keeps its entry, its children's links with it (see ``set_aside``)."""
        if self._density is not None:
            self._density.set_aside(item)
        else:
            self._new.remove(item)

    def _forget_aside(self, item: T) -> None:
        """An item off the new order leaves the cache: hit density may keep its entry
        set aside (``set_aside``), which goes with it."""
        if self._density is not None:
            self._density.remove(item)

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        # No step here: the store asks for victims in passes that may find none (a pass
        # per kind of victim), which the replay's simulator does not, and the same
        # references must give the same steps in both.  Victims come with inserts,
        # whose steps carry the hand-over on.
        self._seen.clear()  # a new tick
        victim = self._new.pop_victim(allowed)
        if victim is None and self._old is not None:
            victim = self._old.order.pop_victim(allowed)
        if victim is None and not self._all_in:
            for item in self._fresh:
                if allowed(item):
                    del self._fresh[item]
                    self._forget_aside(item)
                    return item
        return victim

    def adopt_tuning(self, learned: EvictionPolicy[T], scale: float) -> None:
        self._new.adopt_tuning(learned, scale)

    def recall(self, names: Iterable[Hashable]) -> None:
        self._new.recall(names)

    def evictable(self) -> Iterator[T]:
        if self._all_in:
            return self._new.evictable()
        old = self._old.order.evictable() if self._old is not None else iter(())
        return chain(self._new.evictable(), old, list(self._fresh))

    def release(self) -> None:
        if self._old is not None:
            self._old.order.release()
            self._old = None
        self._new.release()
        release_links(self._fresh)
        self._fresh = OrderedDict()
        self._pinned = {}
        if self._density is not None:
            self._density.end_aside()
        self._waiting = {}
        self._litter = []

    def __len__(self) -> int:
        if self._all_in:
            return len(self._new)
        old = len(self._old.order) if self._old is not None else 0
        return len(self._new) + old + len(self._fresh)

    def __repr__(self) -> str:
        old = len(self._old.order) if self._old is not None else 0
        return (f"Handover(to={self.name}, old={old}, new={len(self._new)}, "
                f"fresh={len(self._fresh)}, pinned={len(self._pinned)}, "
                f"passed={self.passed}, finished={self.finished})")
