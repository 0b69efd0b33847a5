"""Where a duel keeps the state of each item it tracks: in a map, or in the item itself.

``Duel`` notes, per tracked item, whether it was hit since it entered and, for one in
its sample, its name's hash (``Duel._items``).  In a map keyed by the items that costs
33-50 bytes an item, and a probe of a table as big as the cache per hit and per
insert, random reads that grow with it.  Items that offer an attribute for it (the
store's blocks: ``dram_duel``, beside the ``dram_*`` links their LRU order lives in)
keep the state there (``SlotStates``): no table, no probe, the state read in C by an
``attrgetter``.  At 3M blocks under ``auto`` (``benchmarks/index_scale.py``, medians of
three): 474 -> 422 bytes a block, ingest 288k -> 349k blocks per CPU-second, a 64-key
lookup 100 -> 65 us of CPU (p50), 356 -> 277 (p99); at 10M (one run each) 430 -> 393
bytes, 292k -> 370k blocks per CPU-second, 122 -> 68 us (p50), 401 -> 274 (p99).
Plain items (the replay's ints) stay in the map (``MapStates``).  Both answer the
same calls, so the duel's decisions are the same either way
(``tests/scheduler/test_scheduler_duel_slots.py``).

A state is never None: None is an item not tracked, in both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from itertools import repeat
from operator import attrgetter, contains, is_not, mod, setitem
from typing import Any, TypeVar

from kvstore.scheduler.sharded import ShardedDict

T = TypeVar("T", bound=Hashable)
State = bool | int  # out of the sample: hit since it entered; in it: the name's hash << 1 | hit
_drain = deque[Any](maxlen=0).extend  # runs an iterator (of ``map``) to its end, in C


class MapStates(ShardedDict[Any, State]):
    """The states in a map keyed by the items (split as it grows: no stall)."""

    __slots__ = ()

    def put(self, item: Any, state: State) -> None:
        """Set ``item``'s state, not counted: a new item is counted by ``grown``."""
        self.shards[hash(item) % self.modulus][item] = state

    def _homes(self, batch: list[Any]) -> list[dict[Any, State]]:
        """Each item's shard (``ShardedDict``'s choice), in a loop in C."""
        shards, modulus = self.shards, self.modulus
        if modulus == 1:
            return [shards[0]] * len(batch)
        return list(map(shards.__getitem__, map(mod, map(hash, batch), repeat(modulus))))

    def all_new(self, batch: list[Any]) -> bool:
        """No item of ``batch`` is tracked, and none is in it twice."""
        return not any(map(contains, self._homes(batch), batch)) and len(set(batch)) == len(batch)

    def put_all(self, batch: list[Any], states: list[State]) -> None:
        """Set each new item's state (``all_new``), not counted."""
        _drain(map(setitem, self._homes(batch), batch, states))

    def forget(self, items: Iterable[Any]) -> None:
        """Nothing to undo in the items: the map is dropped with the duel's state."""


class SlotStates:
    """The states in the items' attribute ``attr`` (None: not tracked), and their count.

    The item reserves that attribute for one duel at a time, as it reserves its
    ``<links>_*`` attributes for one ``LinkedOrder``: a duel let go of
    (``AutoPolicy.release``) sets it back to None in every item it tracked."""

    __slots__ = ("attr", "get", "_len")

    def __init__(self, attr: str) -> None:
        if not attr.isidentifier():
            raise ValueError(f"attr must name an attribute, got {attr!r}")
        self.attr = attr
        # the state of an item, None if not tracked: a read in C, no Python frame
        self.get: Callable[[Any], State | None] = attrgetter(attr)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, item: object) -> bool:
        return self.get(item) is not None

    def put(self, item: Any, state: State) -> None:
        """Set ``item``'s state, not counted: a new item is counted by ``grown``."""
        setattr(item, self.attr, state)

    def grown(self, added: int) -> None:
        """Count ``added`` new items whose states ``put`` set."""
        self._len += added

    def pop(self, item: Any, default: Any = None) -> Any:
        """Stop tracking ``item``: its state, or ``default`` if it was not tracked."""
        state = self.get(item)
        if state is None:
            return default
        setattr(item, self.attr, None)
        self._len -= 1
        return state

    def __delitem__(self, item: Any) -> None:
        if self.pop(item) is None:
            raise KeyError(item)

    def all_new(self, batch: list[Any]) -> bool:
        """No item of ``batch`` is tracked, and none is in it twice."""
        return (not any(map(is_not, map(self.get, batch), repeat(None)))
                and len(set(batch)) == len(batch))

    def put_all(self, batch: list[Any], states: list[State]) -> None:
        """Set each new item's state (``all_new``), not counted."""
        _drain(map(setattr, batch, repeat(self.attr), states))

    def forget(self, items: Iterable[Any]) -> None:
        """Set ``items`` (every one tracked) back to untracked, the count to 0."""
        attr = self.attr
        _drain(map(setattr, items, repeat(attr), repeat(None)))
        self._len = 0

    def __repr__(self) -> str:
        return f"SlotStates({self.attr}, items={self._len})"


States = MapStates | SlotStates


def states_for(item: object, attr: str | None) -> States:
    """Where a duel keeps its states: in ``item``'s attribute ``attr`` if it has one (an
    item of the kind it is about to track), else in a map."""
    if attr is not None and hasattr(item, attr):
        return SlotStates(attr)
    return MapStates()
