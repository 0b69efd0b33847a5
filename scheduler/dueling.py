"""Policy duelling: judge several eviction orders on a sample of the keys and evict by
the one that would have hit most lately.

A cache's best order depends on its traffic and its size (on a multi-turn chat trace
plain LRU is best at a quarter of the blocks and a segmented LRU at a fiftieth; on a
scan a scan-resistant order wins everywhere), so rather than guess, ``Duel`` measures
them.  One candidate orders the cached items; each runs a miniature cache (Waldspurger et
al., "Cache Modeling and Optimization using Miniature Simulations", USENIX ATC 2017):
the references to a hashed sample of the keys (one in ``2 ** sample_shift``, thinner in
a cache so big that a miniature would hold more than ``MINIATURE_MOST`` keys:
``expect``) replayed against a cache of that share of the real one's size. Every epoch
(as many sampled references as the miniatures hold keys, within ``[shortest, epoch]``)
the candidate whose miniature hit most (its counts multiplied by ``keep`` per ``epoch``
references, so old traffic fades) becomes the one that picks victims; the one in charge
keeps it unless another beats it by ``margin`` and by a quarter of a percent of
``epoch`` references, and ties go to the first candidate, so with LRU first the duel
falls back to LRU wherever nothing else pays.  A small cache's miniatures turn over many
times in ``epoch`` references: with elections every 512, the duel stayed LRU long after
SLRU's miniature led (the replay's scan workload at 10% of its blocks: 5.3% behind SLRU,
3.4% once elections follow the miniatures' size). A hand-over passes the items to the
new candidate in the order the old one lists them, then hits again those hit since they
entered and those back since their eviction (so a segmented order starts with its
protected segment, not as LRU: SLRU handed the scan workload's flat-hot order at 10% of
its blocks ended with 1264 blocks protected against SLRU alone's 1722, 1300 once those
back count too), and the new candidate takes the settings its miniature adapted to, at
the real cache's scale (``adopt_tuning``: a segment's target), and the names of the
cache's latest victims (twice as many as it holds, as SLRU keeps its own) as its ghosts
(``recall``). Started cold, a segmented order stayed behind for the rest of a replay:
its protected segment grows only as items are hit again (SLRU, handed the order a
quarter into the scan workload, ended 7% behind SLRU alone), and with its protected
segment but not its target, ARC handed the chat trace's order at 10% of its blocks ended
below LRU.  Without ghosts, an SLRU handed a cache that LRU let scans flush takes the hot
blocks coming back as new, on probation, where the next scan flushes them again: the
duel lags where its election comes late (a forced hand-over to SLRU at the first
eviction matches SLRU alone exactly on the scan workload's flat-hot variant at 10%; the
election, a third into the trace, got 40% of SLRU's gain over LRU).

The miniatures are judged against each other, never against what the real cache got
with its hand-overs, and a detour to a candidate whose miniature led by a few hits
could cost more than it won.  So the duel also checks reality: on the sampled
references since the order in charge took over, it counts those the real cache hit
and the first candidate's (LRU's) miniature missed, and the other way round; where the
real cache is behind by more than ``check`` standard deviations of chance (a sign test
on those discordant references), LRU takes over again (``policy_sweep.py --seeds 2``
with the chat trace, 236 cells: 70 -> 68 cells more than 2% behind the best, worst
0.980 -> 0.989 of LRU, 11 cells gain up to 1.1%, none lose more than 0.03%; holding
LRU after such a hand-over until a candidate won two elections in a row changed no
cell).

Every reference a prefix cache sees reaches its policy: a hit as ``access``, a miss as
``insert`` of the new block.  The store reports one hit twice (lookup, then acquire);
a miniature counts a key at most once per tick of a clock that advances on ``insert``
and ``pop_victim`` (as S3-FIFO does).  The candidates do the same on their own.

Pure.  A call costs the one candidate's own call plus, for a sampled key, each
miniature's.  The module knows the candidates through ``Order``, the interface of
``kvstore.scheduler.eviction.EvictionPolicy``, which it cannot import (that module
registers the duel among its policies); hit density, which learns on a clock of its own
references, by name, to set how often its miniature learns (``_sample_one_in``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from functools import partial
from itertools import chain
from operator import attrgetter
from typing import Any, Generic, Protocol, TypeVar

from kvstore.scheduler.density import HitDensityPolicy
from kvstore.scheduler.duel_samples import ASK, Backlogs, Kept, keep, kept_whole, refer, take
from kvstore.scheduler.handover import Handover, hand_over_at_once, start_handover
from kvstore.scheduler.sampling import GOLDEN, MASK64, new_states, sampled_in
from kvstore.scheduler.sharded import ShardedDict
from kvstore.scheduler.tracked import MapStates, States, states_for

T = TypeVar("T", bound=Hashable)


# The most victims' names a hand-over passes on as ghosts: at a million-block cache and
# past it, the latest 256k (about 15 MiB of names), not two names per cached block.
RECALL_MOST = 1 << 18
# Below that, twice as many as the cache holds: as many as SLRU, the candidate that takes
# them, keeps of its own (its ``ghost``).  Handed only as many as the cache holds, an SLRU
# elected late took the hot blocks coming back from further back as new, on probation,
# where the next scan flushed them again (``policy_sweep.py --seeds 2`` with the chat
# trace, 236 cells: 119 change, 91 gain up to 2.4%, 28 lose up to 1.9%; mean 0.9864 ->
# 0.9871 of the best, cells more than 2% behind it 53 -> 51; the scan's flat-hot
# variant at 10% 0.920 -> 0.942 of SLRU).
RECALL_SHARE = 2
# Up to this many items a hand-over passes them all in one call (2.2 to 3.6 ms at 8192
# between linked orders); past it, a few with the traffic (``handover.py``).  At 2048,
# hand-overs of 2k-8k items in slices moved 36 of the replay's 196 cells, -2.2% to +0.9%
# (``duel_decisions.py``); at 8192, 12 of them, -0.4% to +0.75%.
HANDOVER_AT_ONCE = 8192
# The most keys a miniature holds.  Of a cache of more items than 8 times this, the
# miniatures see one key in 16, 32, ... (``Duel.expect``) rather than one in 8: every
# miniature of the replay's cells holds fewer (its largest, the chat trace at a quarter
# of its blocks, 5.3k keys), where miniatures of 1k keys chose as well as of 2k and of
# 270-530 at times kept LRU in charge (the chat trace at 5% and 10%); at a million blocks
# one in eight was 125k nodes a miniature, each 64-key lookup of a new chain 8 sampled
# keys referenced in four of them.
MINIATURE_MOST = 8192
EIGHTH = 3  # the sample's shift up to ``MINIATURE_MOST << 3`` items: one key in eight


def sample_shift_for(capacity: int, least: int = EIGHTH) -> int:
    """The sample (one key in ``2 ** shift``, ``least`` at the least, 16 at the most)
    whose miniatures of a cache of ``capacity`` items hold at most ``MINIATURE_MOST``."""
    shift = least
    while capacity >> shift > MINIATURE_MOST and shift < 16:
        shift += 1
    return shift


class Order(Protocol[T]):
    """What the duel needs of a candidate (``EvictionPolicy``'s methods)."""

    name: str

    def insert(self, item: T) -> None: ...
    def insert_many(self, items: Iterable[T]) -> None: ...
    def access(self, item: T) -> None: ...
    def access_many(self, items: Iterable[T]) -> None: ...
    def pin(self, item: T) -> None: ...
    def unpin(self, item: T) -> None: ...
    def remove(self, item: T) -> None: ...
    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None: ...
    def pop_victims(self, allowed: Callable[[T], bool], count: int,
                    take: Callable[[T], object]) -> list[T]: ...
    def adopt_tuning(self, learned: Any, scale: float) -> None: ...
    def recall(self, names: Iterable[Hashable]) -> None: ...
    def evictable(self) -> Iterator[T]: ...
    def __len__(self) -> int: ...


def _parent_attribute(item: Any) -> Any:
    return getattr(item, "parent", None)


def _itself(item: Hashable) -> Hashable:
    return item


class _Sampled:
    """A sampled key as the miniatures hold it (their items): the key, the tick of its
    last reference, how many miniatures hold it, and per miniature ``m<i>_*`` slots (see
    ``sampled_class``).  Small objects with links rather than a table per order: nothing
    grows by one big rebuild, and an eighth of a cache of millions costs no table."""

    __slots__ = ("key", "last", "held")

    def __init__(self, key: int, last: int) -> None:
        self.key = key
        self.last = last
        self.held = 0


_sampled_key: Callable[[_Sampled], int] = attrgetter("key")  # in C: no Python frame


_SAMPLED: dict[int, type[_Sampled]] = {}


def sampled_class(miniatures: int) -> type[_Sampled]:
    """``_Sampled`` with, for each miniature ``i``, the links of its order
    (``m<i>_order``, ``_older``, ``_newer``: see ``LinkedOrder``), its parent's key if the
    miniature held the parent then (``m<i>_up``) and its children held (``m<i>_kids``;
    None while that miniature does not hold it)."""
    cls = _SAMPLED.get(miniatures)
    if cls is None:
        slots = tuple(f"m{i}_{part}" for i in range(miniatures)
                      for part in ("order", "older", "newer", "up", "kids"))
        source = "def __init__(self, key, last):\n    self.key = key\n    self.last = last\n" \
                 "    self.held = 0\n" + "".join(f"    self.{slot} = None\n" for slot in slots)
        methods: dict[str, Any] = {}
        exec(compile(source, f"<_Sampled{miniatures}>", "exec"), {}, methods)
        cls = _SAMPLED[miniatures] = type(f"_Sampled{miniatures}", (_Sampled,),
                                          {"__slots__": slots, **methods})
    return cls


class _Miniature:
    """One candidate's miniature cache of the sampled keys, leaf first as the store is:
    a key whose parent it holds counts as that parent's child, and only keys with no
    child held are victims (with every key sampled, it is the whole cache replayed).
    Its order holds ``_Sampled`` items, in their ``m<index>_*`` links where it can.

    ``_leaf`` is compiled per index (``_MINIATURE``), naming the node's slots in the
    code; a reference to a sampled key, per count of miniatures (``_referencer``).
    """

    __slots__ = ("order", "add", "touch", "held", "hits", "score")

    def __init__(self, order: Order[Any], index: int) -> None:
        self.order = order
        # a key it inserts is one it does not hold: the order's insert that skips the
        # lookups, where it has one (``insert_new``)
        self.add: Callable[[Any], None] = getattr(order, "insert_new", order.insert)
        # a key it holds, hit: ``access_many`` of that one (``access`` each, as ``Order``
        # has it), a frame less than ``access``, which for most candidates calls it
        self.touch: Callable[[Iterable[Any]], None] = order.access_many
        if isinstance(getattr(type(order), "links", None), property):
            order.links = f"m{index}"  # type: ignore[attr-defined]
        if hasattr(order, "ghost_key"):
            order.ghost_key = _sampled_key  # ghosts by key: a key sampled again is known
        self.held = 0  # keys held
        self.hits = 0  # in the current epoch
        self.score = 0.0  # hits of past epochs, each weighing ``keep`` times the next

    def _leaf(self, node: _Sampled) -> bool:
        """No child of ``node`` is held."""
        raise NotImplementedError  # compiled per index


# ``{k}``: the node's children held in this miniature (None: not held).
_MINIATURE = """
def _leaf(self, node):
    return node.{k} == 0
"""

_MINIATURES: dict[int, type[_Miniature]] = {}


def _miniature(order: Order[Any], index: int) -> _Miniature:
    """The miniature of candidate ``index``, its methods naming its slots."""
    cls = _MINIATURES.get(index)
    if cls is None:
        methods: dict[str, Any] = {}
        source = _MINIATURE.format(k=f"m{index}_kids")
        exec(compile(source, f"<_Miniature {index}>", "exec"), {}, methods)
        cls = _MINIATURES[index] = type(f"_Miniature{index}", (_Miniature,),
                                        {"__slots__": (), **methods})
    return cls(order, index)


# One miniature's part of a reference (``_referencer``): ``{i}``, its index; ``{k}``,
# the node's children held in it (None: not held); ``{u}``: the node's parent's key, if
# it held the parent when the node came.
_REFERENCE = """
    mini = minis[{i}]
    if node.{k} is not None:
        mini.hits += 1
        mini.touch((node,))
    else:
        order = mini.order
        # Room first, then the insert, as the store does: a candidate sizes its ghost
        # history by the most items it has tracked at once.
        while mini.held >= capacity:
            victim = order.pop_victim(mini._leaf)
            if victim is None:
                break
            victim.{k} = None
            mini.held -= 1
            victim.held -= 1
            if not victim.held:
                dropped.append(victim)
            held = victim.{u}
            if held is not None:
                victim.{u} = None
                # by key: the parent may have left every miniature and come back since
                was = nodes.get(held)
                if was is not None and was.{k} is not None:
                    was.{k} -= 1
        if parent is not None and parent.{k} is not None:
            parent.{k} += 1
            node.{u} = parent.key
        node.{k} = 0
        mini.held += 1
        node.held += 1
        mini.add(node)
"""

_Referencer = Callable[[Sequence[_Miniature], _Sampled, "_Sampled | None", int,
                        ShardedDict[int, _Sampled], list[_Sampled]], None]
_REFERENCERS: dict[int, _Referencer] = {}


def _referencer(miniatures: int) -> _Referencer:
    """``reference(minis, node, parent, capacity, nodes, dropped)``: ``node`` referenced
    in each of ``miniatures`` miniatures in turn (``parent``: its parent's node, if
    sampled); the keys that none holds any more are added to ``dropped``.  Compiled
    per count, each miniature's part naming its slots: one call a sampled key, not one
    per miniature (a slot store by name is five times faster than ``setattr``, see
    ``kvstore.scheduler.linked``)."""
    made = _REFERENCERS.get(miniatures)
    if made is None:
        source = "def reference(minis, node, parent, capacity, nodes, dropped):\n    pass\n" \
            + "".join(_REFERENCE.format(i=i, k=f"m{i}_kids", u=f"m{i}_up")
                      for i in range(miniatures))
        methods: dict[str, Any] = {}
        exec(compile(source, f"<reference {miniatures}>", "exec"), {}, methods)
        made = _REFERENCERS[miniatures] = methods["reference"]
    return made


class _Reality:
    """The reality check's counts: the miniatures are judged against each other, never
    against what the real cache got, hand-overs and all.  On the sampled references
    since the order in charge took over, those the real cache hit and the first
    candidate's miniature missed (``ahead``) and the other way round (``behind``); past
    ``z`` standard deviations behind (a sign test on those discordant references, half
    each way by chance), the first candidate takes over again (``checks`` counts it)."""

    __slots__ = ("z", "ahead", "behind", "checks")

    def __init__(self, z: float | None) -> None:
        self.z = z
        self.ahead = self.behind = self.checks = 0

    def lags(self) -> bool:
        ahead, behind = self.ahead, self.behind
        return self.z is not None and behind - ahead > self.z * math.sqrt(ahead + behind)


class Duel(Generic[T]):
    """Victims from the candidate in charge; the others judged by their miniatures.

    ``ghost_key`` names an item across its evictions (``EvictionPolicy``'s: the store
    sets the block's key, a block cached again being a new entry): the miniatures sample
    and hold these names, so a key asked for again after the real cache dropped it is
    the same key to them, and each candidate's ghosts use it too.
    """

    ghost_key: Callable[[Hashable], Hashable] = staticmethod(_itself)
    # a name's hash, which decides its sample: the same in every process for a run to be
    # replayed (the store's names are keys, digests already: their bytes are the hash;
    # ``hash`` of bytes is seeded per process)
    name_hash: Callable[[Any], int] = staticmethod(hash)

    def __init__(
        self,
        factories: Sequence[Callable[[], Order[Any]]],
        *,
        parent_of: Callable[[T], T | None] | None = None,
        most: Sequence[int | None] = (),
        sample_shift: int = 3,
        epoch: int = 512,
        shortest: int = 64,
        margin: float = 0.01,
        keep: float = 0.9,
        check: float | None = 2.0,
    ) -> None:
        if not factories:
            raise ValueError("a duel needs at least one candidate")
        if not 0 <= sample_shift <= 16:
            raise ValueError(f"sample_shift must be in [0, 16], got {sample_shift}")
        if epoch < 1 or shortest < 1 or margin < 0.0 or not 0.0 <= keep < 1.0:
            raise ValueError("epoch and shortest must be >= 1, margin >= 0 and keep in [0, 1)")
        self._factories = list(factories)
        if len(most) > len(self._factories):
            raise ValueError(f"most bounds {len(most)} candidates; there are "
                             f"{len(self._factories)}")
        # per candidate, the most items it may order (None: no bound); over its bound an
        # order that keeps tables is not elected, and hands over if in charge
        self._most = [*most, *[None] * (len(self._factories) - len(most))]
        self._order: Order[T] = self._keyed(self._factories[0]())
        # Miniatures hold the sampled keys (hashes of ``ghost_key``: the same for a block
        # cached again), each one ``_Sampled`` while held or referenced this tick.
        self._minis = [_miniature(make(), i) for i, make in enumerate(self._factories)]
        self._node = sampled_class(len(self._minis))
        self._reference = _referencer(len(self._minis))
        self._nodes: ShardedDict[int, _Sampled] = ShardedDict()
        self._lingering: list[_Sampled] = []  # held by none, but referenced this tick
        # references kept for the miniatures to take later, and the store's duels
        # with some (None: each taken at once; ``defer_to``)
        self._backlog: deque[Kept] = deque()
        self._backlogs: Backlogs | None = None
        self.sample_shift = self._unsampled = self._sample_mask = 0  # (set next)
        _sample_one_in(self, sample_shift)
        # sampled references to the next election: as many as the miniatures hold, within
        # [shortest, longest] (a small cache's miniatures turn over, and so learn, faster)
        self.longest = epoch
        self.shortest = shortest
        self.epoch = min(shortest, epoch)
        self.margin = margin
        self.keep = keep
        self._leader = 0
        self.reality = _Reality(check)
        # every tracked item -> its state: out of the sample, hit since it entered (True)
        # or not (False); in it, its name's hash << 1, | 1 once hit.  In a map, or in
        # the items' ``state_attr`` where they have one (``kvstore.scheduler.tracked``).
        self._items: States = MapStates()
        # the tracked items pinned, in the order pinned (a set listed blocks by address,
        # so a hand-over passed them on in another order each run)
        self._pinned: dict[T, None] = {}
        self._size = 0  # the most items tracked at once: the cache size, once full
        self._tick = 0  # inserts and evictions so far
        self._sampled = 0  # sampled references in the current epoch
        self.switches = 0
        self._evicted = False  # whether the order in charge gave up an item yet
        # the latest victims' names, oldest first, about twice the cache's size (made at
        # the first eviction, remade as it doubles): a new order's ghosts (``recall``)
        self._gone: deque[Hashable] = deque(maxlen=1)
        self._aside: deque[Hashable] | None = None  # the later ones, while a hand-over reads
        # The store's blocks know their parent; other items (the replay's ids) have it
        # set here by their cache.
        self.parent_of: Callable[[T], T | None] = parent_of or _parent_attribute

    # the attribute of the items their states live in, if they have it (None: a map)
    state_attr: str | None = None

    def expect(self, capacity: int) -> None:
        """Up to ``capacity`` items (a class sharing a tier: all of it), ``sample_shift_for``."""
        if (shift := sample_shift_for(capacity, self.sample_shift)) != self.sample_shift:
            if self._size or len(self._items):
                raise RuntimeError("a duel's sample is set before its first item")
            _sample_one_in(self, shift)

    def _track_like(self, item: T) -> None:
        """No item is tracked: keep the states where ``item``, the next, can hold them."""
        if type(self._items) is not type(states := states_for(item, self.state_attr)):
            self._items = states

    def _keyed(self, order: Order[T]) -> Order[T]:
        """The order, its ghosts named by this duel's ``ghost_key`` (read at each call:
        the store sets it after the duel is made)."""
        if hasattr(order, "ghost_key"):
            order.ghost_key = self._name_of
        return order

    def _let_go(self, order: Order[T]) -> None:
        """``order`` is being replaced, its items listed: let go of anything it keeps in
        them (an order in their links) before the next one takes them."""

    def _name_of(self, item: Hashable) -> Hashable:
        return self.ghost_key(item)

    @property
    def leader(self) -> str:
        """The name of the candidate that picks victims now."""
        return self._order.name

    def scores(self) -> dict[str, float]:
        """Each candidate's miniature hits, recent epochs weighing most."""
        return {m.order.name: m.score + m.hits for m in self._minis}

    def _sample(self, key: int, item: T, hit: bool = False) -> None:
        """A reference to a sampled key (its mixed hash's top ``sample_shift`` bits
        zero; the callers test that inline, most keys being out of the sample); ``hit``:
        whether the real cache held it.  Taken by the miniatures at once, or kept for a
        later turn (``kvstore.scheduler.duel_samples``)."""
        backlogs = self._backlogs
        if backlogs is not None:
            if self._backlog or backlogs.allowance <= 0:
                keep(self, backlogs, key, item, hit)  # (after those kept before it)
                return
            backlogs.allowance -= 1
        refer(self, key, item, ASK, hit, self._tick, self._size, len(self._items),
              self._evicted)

    def parent_of_item(self, item: T) -> T | None:
        get = self.parent_of  # the default inline: a frame less a key
        return getattr(item, "parent", None) if get is _parent_attribute else get(item)

    def defer_to(self, backlogs: Backlogs | None) -> None:
        """Sampled references past ``backlogs``' allowance wait in a backlog of this
        duel's until ``backlogs.catch_up`` (the daemon's loop, a slice a turn); None:
        each taken at once from now on, those waiting let go."""
        self._backlogs = backlogs
        if backlogs is None:
            self._backlog.clear()  # (its store lets go of it at its next ``catch_up``)

    def catch_up(self, most: int) -> int:
        """Up to ``most`` of the references kept taken by the miniatures: how many."""
        return take(self, most)

    def _elect(self, size: int | None = None, count: int | None = None,
               evicted: bool | None = None) -> None:
        """An election, the cache's figures as of the reference that ends the epoch
        (its most items so far, items now, whether it evicted yet: those now if None)."""
        size = self._size if size is None else size
        count = len(self._items) if count is None else count
        evicted = self._evicted if evicted is None else evicted
        # ``keep`` is per ``longest`` references; the noise threshold is in hits
        keep = self.keep ** (self._sampled / self.longest)
        self._sampled = 0
        for mini in self._minis:
            mini.score = mini.score * keep + mini.hits
            mini.hits = 0
        # the items held now, not the most ever: a cache that shrank may elect again
        eligible = [i for i, bound in enumerate(self._most) if bound is None or count <= bound]
        outgrown = bool(eligible) and self._leader not in eligible
        if not eligible:  # every candidate over its bound: the one in charge stays
            eligible = [self._leader]
        best = max(eligible, key=lambda i: (self._minis[i].score, -i))
        lead = self._minis[best].score - self._minis[self._leader].score
        # Ahead by the margin and by more hits than noise (a quarter of a percent of the
        # longest epoch's references; README: the floors measured), and not while the
        # cache fills (until its first victim the miniatures' few hits are noise).
        # A leader over its bound hands over to the best of the others, however they did.
        if outgrown or (evicted
                        and lead > self.margin * self._minis[self._leader].score
                        and lead > 0.0025 * self.longest):
            self._take_over(best)
        if self._leader != 0 and evicted and self.reality.lags() and self._take_over(0):
            self.reality.checks += 1
        self.epoch = min(self.longest, max(self.shortest, size >> self.sample_shift))

    def _take_over(self, best: int) -> bool:
        """The candidate ``best`` orders the items from now on (False: a hand-over is
        under way): they pass to it as ``handover.hand_over_at_once`` says, past
        ``HANDOVER_AT_ONCE`` items a few at a time (``Handover``), and it takes the
        settings its miniature adapted to (keeping every candidate's order all along
        costs more per call than the hand-overs save, and did no better in the replay)."""
        if isinstance(self._order, Handover):
            return False  # one under way: the next election decides again once it is done
        order: Order[T] = self._keyed(self._factories[best]())
        scale = self._size / max(1, self._size >> self.sample_shift)  # the miniature's
        learned = self._minis[best].order
        tune = partial(order.adopt_tuning, learned, scale)
        pinned = list(self._pinned)  # no table of every item: at millions, a spike of its size
        # in slices: the names read where they are, later victims' kept aside meanwhile
        self._aside = deque() if len(self._order) > HANDOVER_AT_ONCE else None
        sliced = None if self._aside is None else start_handover(
            self._order, order, pinned, self._items.get, self._gone, self.ghost_key, tune,
            partial(setattr, self, "_order"), self._names_read)  # (in charge once it
        if sliced is None:                                     # holds every item)
            self._aside = None
            hand_over_at_once(self._order, order, pinned, self._items.get, self._gone,
                              self.ghost_key, self._let_go, tune)
        self._order = order if sliced is None else sliced
        self._leader = best
        self.switches += 1
        self.reality.ahead = self.reality.behind = 0
        return True

    def insert(self, item: T) -> None:
        tracked = self._items
        if not len(tracked):
            self._track_like(item)
            tracked = self._items
        elif tracked.get(item) is not None:
            return
        self._tick += 1
        name = self.name_hash(self.ghost_key(item))
        sampled = not (name * GOLDEN) & self._sample_mask
        tracked.put(item, name << 1 if sampled else False)
        tracked.grown(1)
        if len(tracked) > self._size:
            self._size = len(tracked)
        self._order.insert(item)
        if sampled:
            self._sample(name, item)

    def insert_many(self, items: Iterable[T]) -> None:
        """``insert`` each, in order, as one call per run of unsampled items to the
        candidate in charge (a commit's blocks are one call, not one per block); a batch
        of new items (a commit's) at once, in loops in C, with ``_insert_each``'s calls
        in its order (see ``new_states``)."""
        batch = items if type(items) is list else list(items)
        if not batch:
            return
        tracked = self._items
        if not len(tracked):
            self._track_like(batch[0])
            tracked = self._items
        if not tracked.all_new(batch):
            _insert_each(self, batch)
            return
        spots, names = sampled_in(batch, self.name_hash, self.ghost_key, self._sample_mask)
        tracked.put_all(batch, new_states(len(batch), spots, names))
        tick, before, order = self._tick, len(tracked), self._order
        handing = isinstance(order, Handover)
        sent = 0  # items given to the order in charge (and counted by the map)
        for at, name in zip(spots, names):
            done = at + 1
            self._tick = tick + done
            if before + done > self._size:
                self._size = before + done
            if (self._sampled + 1 < self.epoch or kept_whole(self)) and not handing:
                self._sample(name, batch[at])  # no election: the run goes on
                continue
            # An election may hand the order over: the one in charge holds all so far
            # (a hand-over in slices reads the miniatures as one call an item left them).
            order.insert_many(batch[sent:done])
            tracked.grown(done - sent)
            sent = done
            self._sample(name, batch[at])
            order = self._order
            handing = isinstance(order, Handover)
        if sent < len(batch):
            order.insert_many(batch[sent:] if sent else batch)
        tracked.grown(len(batch) - sent)
        self._tick = tick + len(batch)
        self._size = max(self._size, len(tracked))

    def access(self, item: T) -> None:
        tracked = self._items
        state = tracked.get(item)
        if state is None:
            return
        if state is not True:  # hit since it entered: set before the order's call, in
            tracked.put(item, True if state is False else state | 1)  # which a hand-over
        self._order.access(item)  # in slices reads it
        if state is not True and state is not False:
            self._sample(state >> 1, item, True)

    def access_many(self, items: Iterable[T]) -> None:
        """``access`` each, in order, as one call per run of unsampled items to the
        candidate in charge (a lookup's hits are one call, not one per block)."""
        order, tracked = self._order, self._items
        # a lookup's every hit passes here: nothing below adds to or takes from the
        # tracked items (an item's state: in C where the items hold it)
        state_of, put = tracked.get, tracked.put
        run: list[T] = []
        add = run.append
        # hit for the first time, out of the sample: set True together (``put_all``, in
        # C), before the order's call and any election (a hand-over reads them)
        first: list[T] = []
        handing = isinstance(order, Handover)  # (see ``insert_many``)
        for item in items:
            state = state_of(item)
            if state is True:  # out of the sample, hit before: nothing to note
                add(item)
                continue
            if state is False:
                add(item)
                first.append(item)  # hit since it entered
                continue
            if state is None:
                continue
            add(item)  # in the sample: ``state`` is its name's hash, shifted
            put(item, state | 1)
            if (self._sampled + 1 < self.epoch or kept_whole(self)) and not handing:
                self._sample(state >> 1, item, True)  # no election: the run goes on
                continue
            # An election may hand the order over: the one in charge has all so far.
            tracked.put_all(first, [True] * len(first))
            first = []
            order.access_many(run)
            run = []
            add = run.append
            self._sample(state >> 1, item, True)
            order = self._order
            handing = isinstance(order, Handover)
        if first:
            tracked.put_all(first, [True] * len(first))
        if run:
            order.access_many(run)

    def pin(self, item: T) -> None:
        if self._items.get(item) is not None:
            self._pinned[item] = None
            self._order.pin(item)

    def unpin(self, item: T) -> None:
        self._pinned.pop(item, None)
        self._order.unpin(item)

    def remove(self, item: T) -> None:
        if self._items.pop(item, None) is not None:
            self._pinned.pop(item, None)
            self._order.remove(item)

    def pop_victim(self, allowed: Callable[[T], bool]) -> T | None:
        self._tick += 1
        victim = self._order.pop_victim(allowed)
        if victim is not None:
            self._items.pop(victim)
            self._remember((victim,))
        return victim

    def _remember(self, victims: Sequence[T]) -> None:
        """The victims' names among the latest (about twice the cache's size); aside
        while a hand-over reads those before them."""
        gone = self._gone
        share = RECALL_SHARE * self._size
        if gone.maxlen is not None and gone.maxlen < min(share, RECALL_MOST):
            # the first eviction, or a cache that doubled: a copy, once per doubling
            most = min(1 << (share - 1).bit_length(), RECALL_MOST)
            gone = self._gone = deque(gone, maxlen=most)
        (gone if self._aside is None else self._aside).extend(map(self.ghost_key, victims))
        self._evicted = True

    def _names_read(self) -> None:
        """The hand-over has read the names: those kept aside meanwhile join them."""
        aside, self._aside = self._aside, None
        if aside:
            self._gone.extend(aside)

    def pop_victims(self, allowed: Callable[[T], bool], count: int,
                    take: Callable[[T], object]) -> list[T]:
        """``pop_victim`` up to ``count`` times: the order's in one call, then the notes."""
        victims = self._order.pop_victims(allowed, count, take)
        self._tick += len(victims) + (len(victims) < count)  # (the last call: none)
        if not victims:
            return victims
        items_pop = self._items.pop
        for victim in victims:
            items_pop(victim)
        self._remember(victims)
        return victims

    def evictable(self) -> Iterator[T]:
        return self._order.evictable()

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        scores = ", ".join(f"{name}={score:.0f}" for name, score in self.scores().items())
        return (f"{type(self).__name__}(leader={self.leader}, evictable={len(self)}, "
                f"pinned={len(self._pinned)}, switches={self.switches}, scores: {scores})")


def _sample_one_in(duel: Duel[Any], shift: int) -> None:
    """``duel`` samples one key in ``2 ** shift``.  A miniature's order that learns
    every ``refresh`` of its references (hit density) learns as often in the cache's
    references as the order would: every ``refresh >> shift`` of its own; in a sample
    thinner than one in eight, every ``refresh >> 3`` (what it learns from between two
    refreshes, decayed by ``keep`` at each, would shrink with the sample: 2 references
    at one key in 2048)."""
    duel.sample_shift = shift
    duel._unsampled = 64 - shift  # a key is sampled if its top bits are zero
    # those bits as a mask: ``not (name * GOLDEN) & mask`` is the same test
    duel._sample_mask = MASK64 ^ ((1 << duel._unsampled) - 1)
    for mini, make in zip(duel._minis, duel._factories):
        order = mini.order
        if isinstance(order, HitDensityPolicy):
            fresh = make()  # (its refresh as made, not as scaled before)
            assert isinstance(fresh, HitDensityPolicy)
            order.refresh = order._next_refresh = max(1, fresh.refresh >> min(shift, EIGHTH))


def _insert_each(duel: Duel[T], items: Iterable[T]) -> None:
    """``Duel.insert_many`` item by item (the reference; a batch with items tracked,
    or twice)."""
    tracked, order = duel._items, duel._order
    ghost_key, name_hash, mask = duel.ghost_key, duel.name_hash, duel._sample_mask
    state_of, put = tracked.get, tracked.put  # set here, counted by ``grown``
    added, tick = 0, duel._tick
    run: list[T] = []
    for item in items:
        if state_of(item) is not None:
            continue
        tick += 1
        added += 1
        run.append(item)
        name = name_hash(ghost_key(item))
        if (name * GOLDEN) & mask:
            put(item, False)
        else:
            put(item, name << 1)
            duel._tick = tick
            if len(tracked) + added > duel._size:
                duel._size = len(tracked) + added
            if duel._sampled + 1 < duel.epoch or kept_whole(duel):
                duel._sample(name, item)  # no election: the run goes on
                continue
            # An election may hand the order over: the one in charge holds all so far.
            order.insert_many(run)
            run = []
            tracked.grown(added)
            added = 0
            duel._sample(name, item)
            order = duel._order
    if run:
        order.insert_many(run)
    tracked.grown(added)
    duel._tick = tick
    if len(tracked) > duel._size:
        duel._size = len(tracked)
