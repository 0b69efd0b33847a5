"""An insertion-ordered set whose links live in its items: an ``OrderedDict`` of keys
with no table, so that it costs no memory of its own per item and never grows.

An LRU order over the store's blocks was an ``OrderedDict``: at a million blocks its
table and nodes cost 91 bytes a block, and a growth past a power of two rebuilds the
whole table in one insert (195 ms at 700k blocks, about 450 ms at 5M, measured by
``benchmarks/index_scale.py``), all of it on the event loop.  ``LinkedOrder`` keeps the
same order as a doubly linked list threaded through three attributes of each item
(``<links>_order``, ``<links>_older``, ``<links>_newer``: the order holding it, and its
neighbours), which the item reserves for one order at a time.  A block carries one such
set per tier (``dram``, ``ssd``), 24 bytes in its slots, for 91 in an ``OrderedDict``;
every operation is O(1) and none allocates.  Each call is Python rather than C, about
0.2 us more per item than the ``OrderedDict`` (the same measurement).

It offers the part of ``OrderedDict``'s interface an order uses (``order[item] =
None`` appends an item not held, ``move_to_end``, ``pop``, ``del``, ``in``, iteration
oldest first, ``len``), so a policy can hold either.  The items are hashable objects
with those attributes; ints and other plain items stay in an ``OrderedDict``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from .policy import GO_ON

T = TypeVar("T", bound=Hashable)

_NONE: Any = object()


class _End:
    """The list's two ends in one: its ``newer`` is the oldest item, ``older`` the
    newest (attributes set by name, as the items' are)."""

    def __repr__(self) -> str:
        return "_End()"


class LinkedOrder(Generic[T]):
    """Items oldest first, linked through their ``<links>_*`` attributes."""

    __slots__ = ("links", "_owner", "_older", "_newer", "_end", "_len")

    def __init__(self, links: str) -> None:
        if not links.isidentifier():
            raise ValueError(f"links must name attributes, got {links!r}")
        self.links = links
        self._owner = f"{links}_order"
        self._older = f"{links}_older"
        self._newer = f"{links}_newer"
        end = self._end = _End()
        setattr(end, self._older, end)
        setattr(end, self._newer, end)
        self._len = 0

    def __del__(self) -> None:
        # The end of an empty order points at itself: let go of that here, so that an
        # order dropped (its items released: ``clear``) leaves no cycle behind, which in
        # a frozen heap the collector would never take.
        end = getattr(self, "_end", None)
        if end is not None:
            end.__dict__.clear()

    def __contains__(self, item: object) -> bool:
        return getattr(item, self._owner) is self

    def __setitem__(self, item: T, value: None) -> None:
        """Append ``item`` as the newest, unless it is held already (where it stays,
        as an ``OrderedDict``'s key does)."""
        owner = getattr(item, self._owner)
        if owner is not self:
            if owner is not None:
                raise ValueError(f"{item!r} is held by another order on these links")
            self._append(item)

    def _append(self, item: T) -> None:
        end, older, newer = self._end, self._older, self._newer
        last = getattr(end, older)
        setattr(item, self._owner, self)
        setattr(item, older, last)
        setattr(item, newer, end)
        setattr(last, newer, item)
        setattr(end, older, item)
        self._len += 1

    def extend(self, items: Iterable[T]) -> None:
        """Append each item not held, in order (as ``order[item] = None`` one by one, in
        one loop: a warm restart appends millions)."""
        end, owner, older, newer = self._end, self._owner, self._older, self._newer
        last = getattr(end, older)
        added = 0
        for item in items:
            held = getattr(item, owner)
            if held is self:
                continue
            if held is not None:  # the links appended so far stay consistent
                setattr(last, newer, end)
                setattr(end, older, last)
                self._len += added
                raise ValueError(f"{item!r} is held by another order on these links")
            setattr(item, owner, self)
            setattr(item, older, last)
            setattr(last, newer, item)
            last = item
            added += 1
        setattr(last, newer, end)
        setattr(end, older, last)
        self._len += added

    def _unlink(self, item: T) -> None:
        older, newer = self._older, self._newer
        before, after = getattr(item, older), getattr(item, newer)
        setattr(before, newer, after)
        setattr(after, older, before)
        setattr(item, self._owner, None)
        setattr(item, older, None)
        setattr(item, newer, None)
        self._len -= 1

    def move_to_end(self, item: T) -> None:
        """Make a held ``item`` the newest (KeyError if not held)."""
        if getattr(item, self._owner) is not self:
            raise KeyError(item)
        self.touch_many((item,))

    def touch_many(self, items: Iterable[T]) -> None:
        """Make each held item the newest, in turn; skip the others (``move_to_end`` of
        those held, in one loop: a lookup's hits)."""
        end, owner, older, newer = self._end, self._owner, self._older, self._newer
        for item in items:
            if getattr(item, owner) is not self:
                continue
            last = getattr(end, older)
            if last is item:
                continue
            before, after = getattr(item, older), getattr(item, newer)
            setattr(before, newer, after)
            setattr(after, older, before)
            setattr(item, older, last)
            setattr(item, newer, end)
            setattr(last, newer, item)
            setattr(end, older, item)

    def pop(self, item: T, default: Any = _NONE) -> Any:
        """Take ``item`` out: None if it was held, else ``default`` (KeyError if none)."""
        if getattr(item, self._owner) is self:
            self._unlink(item)
            return None
        if default is _NONE:
            raise KeyError(item)
        return default

    def __delitem__(self, item: T) -> None:
        if getattr(item, self._owner) is not self:
            raise KeyError(item)
        self._unlink(item)

    def clear(self) -> None:
        """Take every item out (their links unset: an order dropped with items still
        linked would leave them pointing at each other, gone ones kept alive)."""
        end, owner, older, newer = self._end, self._owner, self._older, self._newer
        item = getattr(end, newer)
        while item is not end:
            following = getattr(item, newer)
            setattr(item, owner, None)
            setattr(item, older, None)
            setattr(item, newer, None)
            item = following
        setattr(end, older, end)
        setattr(end, newer, end)
        self._len = 0

    def oldest(self) -> T | None:
        """The oldest item, None if empty (``next(iter(order), None)`` without a
        generator: an eviction reads the oldest of each queue)."""
        item = getattr(self._end, self._newer)
        return None if item is self._end else item

    def take_oldest(self, allowed: Callable[[T], bool], count: int,
                    take: Callable[[T], object]) -> list[T]:
        """Up to ``count`` times, take out the oldest item ``allowed`` passes and hand
        it to ``take`` before the next is looked for, stopping at the first look that
        finds none: the items taken, in order.  (An LRU policy's victims: what
        ``oldest``, a walk on if refused, and ``del`` do for each, in one loop.)  The
        next look starts again at the oldest, as ``take`` may have let an older item
        pass, unless ``take`` returned ``GO_ON``: then it goes on from the item taken,
        and the items refused before it are walked past once, not once per victim."""
        end, newer, owner = self._end, self._newer, self._owner
        taken: list[T] = []
        item = getattr(end, newer)
        while len(taken) < count:
            while item is not end and not allowed(item):
                item = getattr(item, newer)
            if item is end:
                break
            following = getattr(item, newer)
            self._unlink(item)
            taken.append(item)
            if take(item) is not GO_ON or (
                    following is not end and getattr(following, owner) is not self):
                following = getattr(end, newer)
            item = following
        return taken

    def __iter__(self) -> Iterator[T]:
        """Oldest first.  The item just yielded may be taken out before the next."""
        end, newer = self._end, self._newer
        item = getattr(end, newer)
        while item is not end:
            following = getattr(item, newer)
            yield item
            item = following

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __repr__(self) -> str:
        return f"LinkedOrder({self.links}, items={self._len})"


# The hot loops again, naming the attributes in the code: ``item.dram_older = x`` is a
# slot store, five times faster than ``setattr(item, "dram_older", x)`` (18 ns against 87
# for a store and a load, ``python -m timeit``), and a lookup's hits and a commit's blocks
# pass here one by one, as does every victim (``del``, ``pop``: one frame, not two, each
# eviction of an order and of a duel's miniatures).  Compiled once per set of links, as
# ``dataclasses`` compiles its methods; ``LinkedOrder``'s own are the reference (the
# tests hold the two to it).
_HOT_LOOPS = '''
def __contains__(self, item):
    return item.{o} is self

def __setitem__(self, item, value):
    held = item.{o}
    if held is not self:
        if held is not None:
            raise ValueError(f"{{item!r}} is held by another order on these links")
        end = self._end
        last = end.{p}
        item.{o} = self
        item.{p} = last
        item.{n} = end
        last.{n} = item
        end.{p} = item
        self._len += 1

def extend(self, items):
    end = self._end
    last = end.{p}
    added = 0
    for item in items:
        held = item.{o}
        if held is self:
            continue
        if held is not None:
            last.{n} = end
            end.{p} = last
            self._len += added
            raise ValueError(f"{{item!r}} is held by another order on these links")
        item.{o} = self
        item.{p} = last
        last.{n} = item
        last = item
        added += 1
    last.{n} = end
    end.{p} = last
    self._len += added

def touch_many(self, items):
    end = self._end
    last = end.{p}
    for item in items:
        if item.{o} is not self or item is last:
            continue
        before = item.{p}
        after = item.{n}
        before.{n} = after
        after.{p} = before
        item.{p} = last
        item.{n} = end
        last.{n} = item
        last = item
    end.{p} = last

def move_to_end(self, item):
    if item.{o} is not self:
        raise KeyError(item)
    self.touch_many((item,))

def __delitem__(self, item):
    if item.{o} is not self:
        raise KeyError(item)
    before = item.{p}
    after = item.{n}
    before.{n} = after
    after.{p} = before
    item.{o} = None
    item.{p} = None
    item.{n} = None
    self._len -= 1

def pop(self, item, default=_NONE):
    if item.{o} is self:
        before = item.{p}
        after = item.{n}
        before.{n} = after
        after.{p} = before
        item.{o} = None
        item.{p} = None
        item.{n} = None
        self._len -= 1
        return None
    if default is _NONE:
        raise KeyError(item)
    return default

def _unlink(self, item):
    before = item.{p}
    after = item.{n}
    before.{n} = after
    after.{p} = before
    item.{o} = None
    item.{p} = None
    item.{n} = None
    self._len -= 1

def clear(self):
    end = self._end
    item = end.{n}
    while item is not end:
        following = item.{n}
        item.{o} = None
        item.{p} = None
        item.{n} = None
        item = following
    end.{p} = end
    end.{n} = end
    self._len = 0

def oldest(self):
    item = self._end.{n}
    return None if item is self._end else item

def take_oldest(self, allowed, count, take):
    end = self._end
    taken = []
    item = end.{n}
    while len(taken) < count:
        while item is not end and not allowed(item):
            item = item.{n}
        if item is end:
            break
        following = item.{n}
        before = item.{p}
        before.{n} = following
        following.{p} = before
        item.{o} = None
        item.{p} = None
        item.{n} = None
        self._len -= 1
        taken.append(item)
        if take(item) is not _GO_ON or (following is not end and following.{o} is not self):
            following = end.{n}
        item = following
    return taken

def __iter__(self):
    end = self._end
    item = end.{n}
    while item is not end:
        following = item.{n}
        yield item
        item = following
'''

_SPECIALISED: dict[str, type[LinkedOrder[Any]]] = {}


def linked_order(links: str) -> LinkedOrder[Any]:
    """An empty ``LinkedOrder`` on ``links`` whose hot loops name its attributes."""
    cls = _SPECIALISED.get(links)
    if cls is None:
        if not links.isidentifier():
            raise ValueError(f"links must name attributes, got {links!r}")
        methods: dict[str, Any] = {}
        source = _HOT_LOOPS.format(o=f"{links}_order", p=f"{links}_older", n=f"{links}_newer")
        exec(compile(source, f"<LinkedOrder {links}>", "exec"),
             {"_NONE": _NONE, "_GO_ON": GO_ON}, methods)
        cls = _SPECIALISED[links] = type(f"LinkedOrder_{links}", (LinkedOrder,),
                                         {"__slots__": (), **methods})
    return cls(links)


Queue = OrderedDict[T, None] | LinkedOrder[T]  # an order of items: a table, or their links


def queue(links: str | None) -> Queue[T]:
    """An empty order: a table, or in the items' ``<links>_*`` attributes."""
    return OrderedDict() if links is None else linked_order(links)


def links_of(order: Queue[T]) -> str | None:
    """The attributes ``order`` lives in, None for a table."""
    return order.links if isinstance(order, LinkedOrder) else None


def release_links(*orders: Queue[T]) -> None:
    """Unlink every item of the orders kept in links (``LinkedOrder.clear``)."""
    for order in orders:
        if isinstance(order, LinkedOrder):
            order.clear()
