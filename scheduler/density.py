"""Hit density: evict the block expected to earn the fewest hits for the room it holds.

After LHD (Beckmann, Chen and Cidon, "LHD: Improving Cache Hit Rate by Maximizing Hit
Density", NSDI 2018).  Every tracked block belongs to a class and has an age: the
references (inserts and counted hits) since its last one.  For each class the policy
learns online two histograms over age: at which ages its blocks were hit, and at which
they were evicted.  From them, a block of class ``c`` at age ``a`` has a *hit density*

    D(c, a) = P(hit again | c, age a) / E[references it still occupies | c, age a]
            = sum_{x >= a} hits_c(x) / sum_{x >= a} (x - a) * (hits_c(x) + evictions_c(x))

the hits it is expected to earn per unit of space-time; the victim is the candidate of
lowest density.  Whatever makes blocks alike in their reuse can be a class; this policy
uses what a prefix cache knows of a block:

- **how often it was hit** (0, 1, 2, 3-5, 6+): a chain's head shared by many
  conversations is hit by each of them (its fan-out shows as hits), a one-off tail never;
- **whether it came back** from the ghost history (a key evicted, then asked for again:
  the cache was too small for its reuse), which puts it in the classes of hit blocks;
- its **age** is the conversation's idle time: a chain no turn has extended for a while
  is less likely to continue, at whatever rate this traffic's think times say.

Histograms are in geometric age buckets (four per octave, so the learning is free of
any scale), decay by ``keep`` at each refresh (every ``refresh`` references), so the
densities follow the traffic.  Candidates are the least recently referenced blocks of
each class (at most ``skip`` passed over per class when the store's ``allowed`` test
refuses them): within a class density falls with age, so its oldest block stands for
it, and a victim costs O(classes), not a random sample.  No randomness: the daemon and
its simulator make the same choices from the same calls.  Until the first refresh (and
wherever no class has learned anything) the oldest candidate goes: LRU.

A hit reported twice (the store's lookup, then acquire) counts once: a hit counts at
most once per item per tick of a clock that advances on ``insert`` and ``pop_victim``,
as for S3-FIFO (``kvstore.scheduler.eviction``).
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from itertools import islice
from typing import Generic, NamedTuple, Protocol, TypeVar, cast

import numpy as np

from kvstore.scheduler.linked import LinkedOrder, Queue, links_of, queue, release_links
from kvstore.scheduler.policy import EvictionPolicy
from kvstore.scheduler.sharded import FifoMap, ShardedDict

T = TypeVar("T", bound=Hashable)

_BUCKETS = 112  # geometric age buckets: ages up to 2**29 references
_CLASS_OF_HITS = (0, 1, 2, 3, 3, 3)  # hit count -> class (6 and more: the last)
_CLASSES = 5


def age_bucket(age: int) -> int:
    """The histogram bucket of ``age``: exact below 8, then four per octave."""
    if age < 8:
        return age
    bits = age.bit_length()
    return min(_BUCKETS - 1, 4 * (bits - 2) + ((age >> (bits - 3)) & 3))


def _bucket_ages() -> list[float]:
    """The middle age of each bucket (the age its events are counted at)."""
    ages = [float(a) for a in range(8)]
    for bucket in range(8, _BUCKETS):
        bits, quarter = bucket // 4 + 2, bucket % 4
        low = (4 + quarter) << (bits - 3)
        ages.append(low + ((1 << (bits - 3)) - 1) / 2)
    return ages


_AGES = _bucket_ages()
# where each bucket starts (less half a reference): a block in bucket b is expected to
# stay from there to each later event, the events of its own bucket included
_STARTS = [a - 0.5 for a in range(8)] + [
    float((4 + b % 4) << (b // 4 - 1)) - 0.5 for b in range(8, _BUCKETS)]
_AGES_ARRAY = np.array(_AGES)
_STARTS_ARRAY = np.array(_STARTS)


class _Row(Protocol):
    """A histogram's row: a float per age bucket."""

    def __getitem__(self, bucket: int, /) -> float: ...
    def __setitem__(self, bucket: int, count: float, /) -> None: ...
    def __iter__(self) -> Iterator[float]: ...


def _histogram() -> tuple[list[_Row], np.ndarray]:
    """A table of zeros two ways over one buffer of doubles: its rows (one per class,
    indexed by the hot paths as fast as lists) and the whole as an array (read and
    written in place by a refresh)."""
    cells = array("d", bytes(8 * _CLASSES * _BUCKETS))
    whole = memoryview(cells)
    rows = [whole[klass * _BUCKETS:(klass + 1) * _BUCKETS] for klass in range(_CLASSES)]
    table = np.frombuffer(cells, dtype=np.float64).reshape(_CLASSES, _BUCKETS)
    return cast("list[_Row]", rows), table


class _Scratch(NamedTuple):
    """The arrays a refresh's densities are worked out in (``HitDensityPolicy._learn``,
    ``_work_out``), kept between refreshes: per class and bucket, the hits, events and
    events times age as the refresh found them (``sums``), each summed from the oldest
    bucket down (``above``), the lifetime and whether any event was counted at or
    above the bucket."""

    sums: np.ndarray
    above: np.ndarray
    lifetime: np.ndarray
    counted: np.ndarray


def _scratch() -> _Scratch:
    """Fresh arrays for a policy's refreshes."""
    shape = (_CLASSES, _BUCKETS)
    return _Scratch(np.zeros((3, *shape)), np.zeros((3, *shape)), np.zeros(shape),
                    np.zeros(shape, dtype=bool))


def _class(hits: int) -> int:
    """The class of a block hit ``hits`` times."""
    return _CLASS_OF_HITS[hits] if hits < len(_CLASS_OF_HITS) else _CLASSES - 1


class _Entry:
    """What the policy remembers of one tracked item."""

    __slots__ = ("hits", "klass", "stamp", "tick", "pinned", "kids", "parent", "up")

    def __init__(self, hits: int, klass: int, stamp: int) -> None:
        self.hits = hits
        self.klass = klass
        self.stamp = stamp  # the clock at its last reference
        self.tick = -1  # the eviction tick of its last counted hit
        self.pinned = False
        self.kids = 0  # tracked items that name it as parent: while any, not a candidate
        self.parent: object = None  # its parent item, tracked when it was inserted
        self.up: _Entry | None = None  # that parent's entry


def _shards_of(entries: dict[T, _Entry] | ShardedDict[T, _Entry]
               ) -> tuple[list[dict[T, _Entry]], int]:
    """The dicts an order's entries are in and the modulus that picks an item's."""
    if isinstance(entries, ShardedDict):
        return entries.shards, entries.modulus
    return [entries], 1


def _parent_attribute(item: object) -> object:
    return getattr(item, "parent", None)


class _HandOverCalls(Generic[T]):
    """Hit density's calls for a hand-over in slices to it or from it (``handover``):
    its lists emptied coldest first, and a chain's children passed on before their
    parent linked to it once it comes."""

    _entries: dict[T, _Entry] | ShardedDict[T, _Entry]
    _queues: list[Queue[T]]
    _aside: dict[T, _Entry] | ShardedDict[T, _Entry]
    _later: dict[object, list[T]]
    parent_of: Callable[[T], object]

    def remove(self, item: T) -> None:
        raise NotImplementedError  # the order's

    def coldest(self) -> T | None:
        """The next item ``evictable`` lists (None if none): the class lists' oldest
        of the oldest stamp, the first class on a tie."""
        entries, best, stamp = self._entries, None, 0
        queues = self._queues
        linked = isinstance(queues[0], LinkedOrder)
        for q in queues:
            head = (cast("LinkedOrder[T]", q).oldest() if linked else next(iter(q), None))
            if head is not None and (best is None or entries[head].stamp < stamp):
                best, stamp = head, entries[head].stamp
        return best

    def link_late(self, items: Iterable[T], waiting: dict[object, list[T]]) -> None:
        """``items``, just inserted, linked to their parents as one call of them all
        would have (a hand-over in slices passes a chain's colder children before their
        parents, and its pinned items last): each item's children that came before it
        (``waiting``, by parent) counted now, and each item whose parent is not tracked
        yet left waiting for it.  ``waiting`` is the caller's, dropped when it ends."""
        entries, parent_of = self._entries, self.parent_of
        for item in items:
            entry = entries.get(item)
            if entry is None:
                continue
            for child in waiting.pop(item, ()):
                kid = entries.get(child)
                if kid is not None and kid.up is None:
                    kid.parent, kid.up = item, entry
                    entry.kids += 1
            if entry.up is None and (parent := parent_of(item)) is not None \
                    and parent not in entries:
                waiting.setdefault(parent, []).append(item)

    def link_later(self, waiting: dict[object, list[T]]) -> None:
        """The items a hand-over in slices passed before their parents, linked if those
        come before the next victim or hit (see ``_later``): one that ends within a call
        leaves the rest of its items to this order, a chain's parents perhaps.  After
        that, the parents that did not come are not tracked: their children stay
        unlinked, as in one call."""
        if not self._later:
            self._later = waiting
            return
        for parent, children in waiting.items():
            self._later.setdefault(parent, []).extend(children)

    def set_aside(self, item: T) -> None:
        """``remove`` for a while: an item a hand-over takes out of this order and
        passes on again later (hit, or pinned, meanwhile).  Its entry is kept for its
        return (``insert``), with its children's links to it: a chain's head counted
        as their parent again, as it would have stayed (its children, passed on
        before, are linked to that entry, and a new one would count none)."""
        entry = self._entries.get(item)
        if entry is not None:
            self.remove(item)
            entry.parent, entry.up = None, None  # its own parent's, made again
            aside = self._aside
            if type(aside) is dict and not aside and isinstance(self._entries, ShardedDict):
                # the store's order: sharded too (a hand-over to it at a million blocks
                # set aside up to 95k entries, and one dict of them grew in single
                # calls of 2.5 ms: ``benchmarks/eviction_cost.py --handover 1M``); made
                # here, and a dict again at ``end_aside``, so that the inserts' test of
                # it is a dict's, in C, but while a hand-over runs
                aside = self._aside = ShardedDict()
            aside[item] = entry

    def end_aside(self) -> None:
        """Forget the entries set aside and not back (their items left)."""
        self._aside = {}

    def _back(self, item: T, hits: int, klass: int, stamp: int) -> _Entry:
        """The entry of an item inserted: the one set aside for it, as new but for
        its children, or a new one."""
        entry = self._aside.pop(item, None)
        if entry is None:
            return _Entry(hits, klass, stamp)
        entry.hits, entry.klass, entry.stamp, entry.tick = hits, klass, stamp, -1
        entry.pinned = False
        return entry


class HitDensityPolicy(_HandOverCalls[T], EvictionPolicy[T]):
    """Victims by lowest learned hit density among each class's oldest blocks (see the
    module docstring).  O(1) per insert, hit, pin and removal; O(classes + skipped) per
    victim; O(classes * buckets) per refresh, every ``refresh`` references.

    ``ghost`` bounds the ghost history: at most that many times the cache size keys,
    none older than that many times the cache size references (its horizon: a block
    not back by then counts as one that would have gone unused).

    Only leaves are candidates: the policy counts each item's tracked children
    (``parent_of``: a block's ``parent`` by default) and passes over a parent without
    asking the store, whose ``allowed`` has the last word on the others.  A class whose
    oldest ``skip`` items are all refused (the old shared heads of the most-hit classes)
    yields to the next best."""

    name = "density"

    def __init__(self, *, refresh: int = 4096, keep: float = 0.9, ghost: float = 4.0,
                 skip: int = 2) -> None:
        if refresh < 1 or skip < 1 or not 0.0 <= keep < 1.0 or ghost <= 0.0:
            raise ValueError("refresh and skip must be >= 1, keep in [0, 1), ghost > 0; "
                             f"got {refresh}, {skip}, {keep}, {ghost}")
        self.refresh = refresh
        self.keep = keep
        self.ghost_ratio = ghost
        self.skip = skip
        self.parent_of: Callable[[T], object] = _parent_attribute
        self._entries: dict[T, _Entry] | ShardedDict[T, _Entry] = {}
        self._pinned = 0
        # per class, LRU first: in tables, or all in the items' links (``links``)
        self._queues: list[Queue[T]] = [OrderedDict() for _ in range(_CLASSES)]
        # evicted keys -> (hits, class, clock at the last reference)
        self._ghost: (OrderedDict[Hashable, tuple[int, int, int]]
                      | FifoMap[Hashable, tuple[int, int, int]]) = OrderedDict()
        # Per class, per age bucket: the hits, the evictions and the densities learned
        # from them, as rows of one buffer each, which a refresh reads and writes as
        # arrays in place while the hot paths index the rows as lists (as fast).
        self._hits, self._hit_table = _histogram()
        self._evictions, self._eviction_table = _histogram()
        self._learned, self._learned_table = _histogram()
        self._densities: list[_Row] | None = None  # none learned yet: LRU
        self._unworked = False  # a refresh's densities not worked out yet (``_learn``)
        self._scratch: _Scratch | None = None  # a refresh's arrays, made at the first
        self._now = 0  # references so far: the clock ages are counted in
        self._tick = 0  # inserts and evictions so far (a hit counts once per tick)
        self._next_refresh = refresh
        self._size = 0  # the most items tracked at once: the cache size, once full
        self.refreshes = 0
        # items out for a while (``set_aside``), their entries kept for their return
        self._aside: dict[T, _Entry] | ShardedDict[T, _Entry] = {}
        # Items inserted since the last victim or hit whose parents were not tracked, by
        # parent, linked if those come (``link_late``): a duel splits an insert at its
        # sampled keys, and a hand-over in slices leaves the rest of its call here.
        self._later: dict[object, list[T]] = {}

    @property
    def links(self) -> str | None:
        """The attributes its class queues live in (``LinkedOrder``), None for tables.

        A duel's density miniature keeps them in its sampled keys' links, as the other
        miniatures do (the real order, when density is in charge, keeps tables): a
        first hit moves a key between two class queues, in tables a probe of each, cold
        at millions of blocks, and an ``OrderedDict`` node unlinked.  At 1M blocks under
        ``auto`` a chain's first 64-key lookup 53.4 -> 51.9 us of CPU (median; p99
        136 -> 116 us; alternated, three runs each), and 400 -> 387 bytes a block
        (``benchmarks/index_scale.py``)."""
        return links_of(self._queues[0])

    @links.setter
    def links(self, links: str | None) -> None:
        if self._entries:
            raise ValueError("an order's links are chosen while it is empty")
        self._queues = [queue(links) for _ in range(_CLASSES)]

    def spread(self) -> None:
        """Keep the entries in a ``ShardedDict`` and the ghosts in a ``FifoMap``: the
        order in charge of a cache of millions of blocks, whose dict and ``OrderedDict``
        grew by rebuilds of their whole tables (a hand-over to it at a million blocks
        passed 64 items in 15 to 64 ms where its dict and class tables grew,
        ``benchmarks/eviction_cost.py --handover 1M``; an ``OrderedDict`` of 600k
        ghosts rebuilds in about 210 ms, see ``FifoMap``).  A miniature's few keys keep
        the dicts (their hot paths' C calls)."""
        if self._entries or self._ghost:
            raise ValueError("an order's tables are spread while it is empty")
        self._entries = ShardedDict()
        self._ghost = FifoMap()

    def release(self) -> None:
        release_links(*self._queues)

    def insert(self, item: T) -> None:
        """``insert_many`` of one item, without its loops (a duel's miniature inserts
        every sampled key it has not got one by one)."""
        entries = self._entries
        if item in entries:
            return
        self._tick += 1
        now = self._now = self._now + 1
        ghost = self._ghost
        remembered = ghost.pop(self.ghost_key(item), None) if ghost else None
        hits = 0
        if remembered is not None:
            hits, klass, stamp = remembered
            self._hits[klass][age_bucket(now - stamp)] += 1.0
            hits += 1
        klass = _CLASS_OF_HITS[hits] if hits < len(_CLASS_OF_HITS) else _CLASSES - 1
        entries[item] = entry = (self._back(item, hits, klass, now) if self._aside
                                 else _Entry(hits, klass, now))
        self._queues[klass][item] = None
        parent_of = self.parent_of
        parent = (getattr(item, "parent", None) if parent_of is _parent_attribute
                  else parent_of(item))
        up = entries.get(parent) if parent is not None else None  # type: ignore[arg-type]
        if up is not None:
            entry.parent, entry.up = parent, up
            up.kids += 1
        if (up is None and parent is not None) or self._later:
            self.link_late((item,), self._later)
        if len(entries) > self._size:
            self._size = len(entries)
        if now >= self._next_refresh:
            self._learn()

    def insert_many(self, items: Iterable[T]) -> None:
        entries, ghost, key, queues = self._entries, self._ghost, self.ghost_key, self._queues
        aside = self._aside
        fresh: list[tuple[T, _Entry]] = []
        for item in items:
            if item in entries:
                continue
            self._tick += 1
            self._now += 1
            remembered = ghost.pop(key(item), None) if ghost else None
            hits = 0
            if remembered is not None:
                # Back after its eviction: a hit it would have had, had it stayed; it
                # starts again as a block hit that often.
                hits, klass, stamp = remembered
                self._hits[klass][age_bucket(self._now - stamp)] += 1.0
                hits += 1
            klass = _class(hits)
            entries[item] = entry = (self._back(item, hits, klass, self._now) if aside
                                     else _Entry(hits, klass, self._now))
            queues[klass][item] = None
            fresh.append((item, entry))
        parent_of = self.parent_of
        late = False  # a parent not tracked (yet)
        for item, entry in fresh:  # linked once all are in: a put's deepest comes first
            parent = parent_of(item)
            up = entries.get(parent) if parent is not None else None  # type: ignore[arg-type]
            if up is not None:
                entry.parent, entry.up = parent, up
                up.kids += 1
            elif parent is not None:
                late = True
        if late or self._later:  # the rest of a call split in two, perhaps
            self.link_late([item for item, _ in fresh], self._later)
        if len(entries) > self._size:
            self._size = len(entries)
        # (a request's new blocks are one call in the store and in the replay alike)
        if self._now >= self._next_refresh:
            self._learn()

    def access(self, item: T) -> None:
        self.access_many((item,))

    def access_many(self, items: Iterable[T]) -> None:
        if self._later:  # another call's (see ``_later``)
            self._later = {}
        queues, tick = self._queues, self._tick
        shards, modulus = _shards_of(self._entries)  # the entries' get, inline
        for item in items:
            entry = shards[hash(item) % modulus].get(item)
            if entry is None or entry.tick == tick:
                continue  # unknown, or already counted in this tick (lookup, then acquire)
            entry.tick = tick
            now = self._now = self._now + 1
            old = entry.klass
            age = now - entry.stamp  # age_bucket and _class inline: a hit's hot path
            if age < 8:
                bucket = age
            else:
                bits = age.bit_length()
                bucket = min(_BUCKETS - 1, 4 * (bits - 2) + ((age >> (bits - 3)) & 3))
            self._hits[old][bucket] += 1.0
            hits = entry.hits = entry.hits + 1
            entry.klass = new = (_CLASS_OF_HITS[hits] if hits < len(_CLASS_OF_HITS)
                                 else _CLASSES - 1)
            entry.stamp = now
            if not entry.pinned:
                if old == new:  # (one call: a queue in links makes each in Python)
                    queues[new].move_to_end(item)
                else:
                    del queues[old][item]
                    queues[new][item] = None
            if now >= self._next_refresh:  # at the same hit however the hits are grouped
                self._learn()  # (the store reports a chain's in one call, the replay each)

    def pin(self, item: T) -> None:
        entry = self._entries.get(item)
        if entry is not None and not entry.pinned:
            entry.pinned = True
            self._pinned += 1
            del self._queues[entry.klass][item]

    def unpin(self, item: T) -> None:
        entry = self._entries.get(item)
        if entry is not None and entry.pinned:
            entry.pinned = False
            self._pinned -= 1
            self._queues[entry.klass][item] = None

    def remove(self, item: T) -> None:
        entry = self._entries.pop(item, None)
        if entry is None:
            if self._aside:  # it left while set aside
                self._aside.pop(item, None)
        else:
            if entry.pinned:
                self._pinned -= 1
            else:
                del self._queues[entry.klass][item]
            self._unlink(entry)

    @staticmethod
    def _unlink(entry: _Entry) -> None:
        """An item left: its parent has one child fewer."""
        if entry.up is not None:
            entry.up.kids -= 1

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        self._tick += 1
        if self._later:  # another call's (see ``_later``)
            self._later = {}
        density, entries, now = self._density, self._entries, self._now
        # Each class is ranked by its oldest block (lowest density first; the oldest on
        # a tie, so LRU before anything is learned); the victim is the first block the
        # store allows in the best class, or the next one.  Ranking before asking spares
        # the walk past the old shared heads (never leaves) of the most-hit classes.
        # each class's oldest, None if it has none (in links: a read, no generator)
        queues = self._queues
        heads: list[T | None]
        if isinstance(queues[0], LinkedOrder):
            heads = [queue.oldest() for queue in cast("list[LinkedOrder[T]]", queues)]
        else:
            heads = [next(iter(queue), None) for queue in queues]
        ranked: list[tuple[float, int, int]] = []
        for klass, head in enumerate(heads):
            if head is not None:
                age = now - entries[head].stamp
                if density is None:
                    ranked.append((0.0, -age, klass))
                    continue
                if age < 8:  # age_bucket, inline: this loop is the policy's hot path
                    bucket = age
                else:
                    bits = age.bit_length()
                    bucket = 4 * (bits - 2) + ((age >> (bits - 3)) & 3)
                    if bucket >= _BUCKETS:
                        bucket = _BUCKETS - 1
                ranked.append((density[klass][bucket], -age, klass))
        ranked.sort()
        best: T | None = None
        skip = self.skip
        for _, _, klass in ranked:
            # a parent of a tracked item is no leaf: no need to ask the store
            head = cast(T, heads[klass])  # ranked: not None
            if not entries[head].kids and allowed(head):  # the oldest, most often
                best = head
                break
            for item in islice(queues[klass], 1, skip):  # then the next few
                if not entries[item].kids and allowed(item):
                    best = item
                    break
            if best is not None:
                break
        if best is None:  # every class's oldest few refused: the first allowed leaf
            # (a parent only where the store allows no leaf: a chain's head kept, as
            # the oldest few's are)
            best = next((i for q in queues for i in q
                         if not entries[i].kids and allowed(i)), None)
            if best is None:
                best = next((i for q in queues for i in q if allowed(i)), None)
            if best is None:
                return None
        entry = entries.pop(best)
        del queues[entry.klass][best]
        if entry.up is not None:  # ``_unlink``, inline: one call a victim the less
            entry.up.kids -= 1
        # Its fate is learned when its ghost comes back (a hit at that age) or is
        # forgotten (an eviction at that age): what keeping it would have earned.
        ghost = self._ghost
        ghost[self.ghost_key(best)] = (entry.hits, entry.klass, entry.stamp)
        horizon = self.ghost_ratio * self._size
        while ghost:
            _, klass, stamp = (ghost.oldest()[1] if isinstance(ghost, FifoMap)
                               else next(iter(ghost.values())))
            if len(ghost) <= horizon and now - stamp <= horizon:
                break
            ghost.popitem(last=False)
            self._evictions[klass][age_bucket(now - stamp)] += 1.0
        return best

    def adopt_tuning(self, learned: EvictionPolicy[T], scale: float) -> None:
        """The histograms ``learned`` has (a miniature's, on a sample of this traffic),
        its ages ``scale`` times longer here, in place of those of the hand-over's own
        inserts and hits; densities from them at once (a cold order would be LRU until
        its first refresh, and learn from ages the hand-over made up)."""
        if not isinstance(learned, HitDensityPolicy):
            return
        moved = [age_bucket(int(age * scale + 0.5)) for age in _AGES]
        self._hit_table.fill(0.0)
        self._eviction_table.fill(0.0)
        for mine, theirs in ((self._hits, learned._hits),
                             (self._evictions, learned._evictions)):
            for table, counts in zip(mine, theirs):
                for bucket, count in enumerate(counts):
                    table[moved[bucket]] += count
        if learned._density is not None:
            self._learn()

    def _learn(self) -> None:
        """A refresh: the histograms as they stand are what the next densities are
        learned from, then they decay.

        The densities themselves are worked out from a copy when first asked for
        (``_density``: the next eviction, or a hand-over), not here: a refresh falls on
        whichever reference reaches it, as often a lookup's hit as a miss, and under
        ``auto`` (its density miniature refreshes every 512 sampled references) one
        lookup in a hundred at 3M blocks reached one.  The copy and the decay are four
        calls into numpy: such a refresh in a lookup 66 -> 29 us of CPU (medians of 34;
        numpy's code and the arrays cold between refreshes; warm, 17.5 -> 2.3 us), a
        lookup holding one 123-128 -> 87-88 us.  The densities are the same floats,
        from the same counts (the refreshes between two evictions but the last are
        never worked out: nothing reads them)."""
        self._next_refresh = self._now + self.refresh
        self.refreshes += 1
        if self._scratch is None:
            self._scratch = _scratch()
        sums = self._scratch.sums
        hits, evictions = self._hit_table, self._eviction_table
        np.copyto(sums[0], hits)
        np.add(hits, evictions, out=sums[1])
        hits *= self.keep
        evictions *= self.keep
        self._unworked = True

    @property
    def _density(self) -> list[_Row] | None:
        """The densities of the latest refresh (None: none yet, LRU)."""
        if self._unworked:
            self._work_out()
        return self._densities

    def _work_out(self) -> None:
        """The densities from the counts of the latest refresh (``_learn``'s copy).

        In arrays over the rows' buffers (5 classes of 112 buckets: a loop of Python
        here was the longest call of a lookup under ``auto``): each running sum from
        the oldest bucket down is a cumulative sum of the reversed row, added in the
        same order as a loop would, so the densities are the same floats."""
        assert self._scratch is not None, "worked out after a refresh"
        sums, above, lifetime, counted = self._scratch
        np.multiply(sums[1], _AGES_ARRAY, out=sums[2])  # events times their age
        # hits, events and their ages summed from the oldest bucket down, in one call
        np.cumsum(sums[:, :, ::-1], axis=2, out=above[:, :, ::-1])
        hits_above, events_above, age_sum_above = above
        np.multiply(_STARTS_ARRAY, events_above, out=lifetime)
        np.subtract(age_sum_above, lifetime, out=lifetime)
        np.not_equal(events_above, 0.0, out=counted)
        density = self._learned_table
        density.fill(0.0)
        np.divide(hits_above, lifetime, out=density, where=counted)
        self._densities = self._learned
        self._unworked = False

    def evictable(self) -> Iterator[T]:
        """The unpinned items, least recently referenced first, as the other orders list
        theirs: a hand-over to one of them (``Duel``, the store's policy switch) keeps
        their recency.  The class lists merged by each one's oldest (``coldest``, one
        by one: what a hand-over in slices takes); each list is in the order of its
        items' last references but for an item unpinned since, which went last with its
        older stamp, and stays there."""
        entries = self._entries
        return iter(list(heapq.merge(*self._queues, key=lambda item: entries[item].stamp)))

    def __len__(self) -> int:
        return len(self._entries) - self._pinned

    def __repr__(self) -> str:
        classes = "/".join(str(len(queue)) for queue in self._queues)
        pinned = len(self._entries) - len(self)
        return (f"HitDensityPolicy(classes={classes}, pinned={pinned}, "
                f"ghost={len(self._ghost)}, refreshes={self.refreshes})")
