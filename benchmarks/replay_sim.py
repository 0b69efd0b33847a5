"""The offline half of benchmarks/replay.py: the caches it drives in-process (no daemon,
no sockets), beside the trace and the replay loop of ``kvstore.bench.replay`` (imported
here, and from here by benchmarks/replay.py).

``PolicyCache`` runs a registered eviction policy the way the store calls it; the
bounds (``BeladyCache``, ``RateOracleCache``, ``OracleCache``, ``InfiniteCache``) are
the rows it is compared with.  benchmarks/replay.py's docstring says what each one is and
how the replay counts hits.
"""

from __future__ import annotations

import bisect
import heapq
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path

from kvstore.bench.replay import (  # noqa: F401 - handed on to benchmarks/replay.py
    BLOCK_TOKENS,
    InfiniteCache,
    PolicyCache,
    PrefixCache,
    ReplayStats,
    TraceError,
    TraceRequest,
    cacheable,
    load_trace,
    replay,
    unique_blocks,
)
from kvstore.scheduler.eviction import EvictionPolicy, LRUPolicy

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # after the path: benchmarks/ is no package

def synthetic(name: str, requests: int = 0) -> list[TraceRequest]:
    """A synthetic workload of benchmarks/workloads.py (its default size, or ``requests``)."""
    generate = WORKLOADS[name]
    made = generate(requests) if requests > 0 else generate()
    return [TraceRequest(*request) for request in made]


class OracleAdmitLRU(LRUPolicy[Hashable]):
    """LRU that is told which blocks the trace never asks for again: those go to the cold
    end at once.  Not an online policy: a bound on what knowing *whether* a block is
    reused (but not when) buys an LRU order, for comparison with Belady, who knows when."""

    def __init__(self, last_use: dict[Hashable, int], clock: list[int]) -> None:
        super().__init__()
        self._last_use = last_use
        self._clock = clock  # [index of the request being replayed]

    def _dead(self, item: Hashable) -> bool:
        return self._last_use.get(item, -1) <= self._clock[0]

    def _settle(self, item: Hashable) -> None:
        if item in self._order and self._dead(item):
            self._order.move_to_end(item, last=False)

    def insert(self, item: Hashable) -> None:
        super().insert(item)
        self._settle(item)

    def access(self, item: Hashable) -> None:
        super().access(item)
        self._settle(item)

    def unpin(self, item: Hashable) -> None:
        super().unpin(item)
        self._settle(item)


def use_times(trace: Sequence[TraceRequest]) -> dict[Hashable, list[int]]:
    """Each block id's requests (their indexes in the trace), in order, once each."""
    uses: dict[Hashable, list[int]] = {}
    for index, request in enumerate(trace):
        for key in request.hash_ids:
            times = uses.setdefault(key, [])
            if not times or times[-1] != index:
                times.append(index)
    return uses


class _OracleCache(PolicyCache):
    """A PolicyCache over a policy that reads the trace's future: it keeps the index of
    the request being replayed in ``clock[0]``, which the policy shares."""

    def __init__(self, policy: Callable[[list[int]], EvictionPolicy[Hashable]],
                 capacity: int) -> None:
        self._clock = [-1]
        super().__init__(policy(self._clock), capacity)

    def lookup(self, keys: Sequence[int]) -> int:
        self._clock[0] += 1
        return super().lookup(keys)


class OracleCache(_OracleCache):
    """A PolicyCache over :class:`OracleAdmitLRU`."""

    def __init__(self, trace: Sequence[TraceRequest], capacity: int) -> None:
        last_use = {key: times[-1] for key, times in use_times(trace).items()}
        super().__init__(lambda clock: OracleAdmitLRU(last_use, clock), capacity)


class RateOracle(EvictionPolicy[Hashable]):
    """Evicts the block with the fewest references left per request left in the trace,
    as of its last use (ties: the least recently used).  Not an online policy: a bound on
    what a perfect predictor of each block's *popularity* (but not of when it comes back)
    buys.  Leaf-first as the store asks: blocks it may not take yet are passed over."""

    def __init__(self, uses: dict[Hashable, list[int]], requests: int,
                 clock: list[int]) -> None:
        self._uses = uses
        self._requests = requests
        self._clock = clock
        self._priority: dict[Hashable, tuple[float, int]] = {}  # resident blocks
        self._pinned: set[Hashable] = set()
        self._heap: list[tuple[float, int, Hashable]] = []
        self._tick = 0

    def _rank(self, item: Hashable) -> None:
        now = self._clock[0]
        uses = self._uses[item]
        left = len(uses) - bisect.bisect_right(uses, now)
        self._tick += 1
        key = (left / max(1, self._requests - now), self._tick)
        self._priority[item] = key
        if item not in self._pinned:
            heapq.heappush(self._heap, (*key, item))

    def insert(self, item: Hashable) -> None:
        self._rank(item)

    def access(self, item: Hashable) -> None:
        if item in self._priority:
            self._rank(item)

    def pin(self, item: Hashable) -> None:
        self._pinned.add(item)

    def unpin(self, item: Hashable) -> None:
        self._pinned.discard(item)
        if item in self._priority:
            heapq.heappush(self._heap, (*self._priority[item], item))

    def remove(self, item: Hashable) -> None:
        self._priority.pop(item, None)
        self._pinned.discard(item)

    def pop_victim(self, allowed: Callable[[Hashable], bool]) -> Hashable | None:
        passed = []
        victim = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            rate, tick, item = entry
            if self._priority.get(item) != (rate, tick) or item in self._pinned:
                continue  # stale
            if allowed(item):
                victim = item
                break
            passed.append(entry)
        for entry in passed:
            heapq.heappush(self._heap, entry)
        if victim is not None:
            del self._priority[victim]
        return victim

    def evictable(self) -> Iterator[Hashable]:
        return iter([i for i in self._priority if i not in self._pinned])

    def __len__(self) -> int:
        return len(self._priority) - len(self._pinned & self._priority.keys())


class RateOracleCache(_OracleCache):
    """A PolicyCache over :class:`RateOracle`."""

    def __init__(self, trace: Sequence[TraceRequest], capacity: int) -> None:
        uses = use_times(trace)
        super().__init__(lambda clock: RateOracle(uses, len(trace), clock), capacity)


class BeladyCache:
    """The offline optimum (see the module docstring); must see the trace it replays."""

    def __init__(
        self, trace: Sequence[TraceRequest], capacity: int, *, bypass: bool = True
    ) -> None:
        self.capacity = capacity
        self.bypass = bypass
        self.evictions = 0
        never = len(trace)
        last_seen: dict[int, int] = {}
        self._next_use: list[list[int]] = [[] for _ in trace]
        for r in range(len(trace) - 1, -1, -1):
            keys = trace[r].hash_ids
            self._next_use[r] = [last_seen.get(key, never) for key in keys]
            for key in keys:
                last_seen[key] = r
        self._request = -1
        self._cached: dict[int, int] = {}  # key -> its next use
        self._heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), lazy
        self._pinned: set[int] = set()

    def lookup(self, keys: Sequence[int]) -> int:
        self._request += 1
        cached = self._cached
        next_use = self._next_use[self._request]
        hits = 0
        for depth, key in enumerate(keys):
            if key not in cached:
                break
            cached[key] = next_use[depth]
            heapq.heappush(self._heap, (-next_use[depth], -depth, key))
            hits += 1
        self._pinned = set(keys[:hits])
        return hits

    def insert(self, keys: Sequence[int], hits: int) -> None:
        next_use = self._next_use[self._request]
        for depth in range(hits, len(keys)):
            key = keys[depth]
            if len(self._cached) >= self.capacity:
                victim = self._pop_farther_than(next_use[depth] if self.bypass else -1)
                if victim is None:
                    break  # caching this block (and its children) cannot pay off
                del self._cached[victim]
                self.evictions += 1
            self._cached[key] = next_use[depth]
            heapq.heappush(self._heap, (-next_use[depth], -depth, key))
            self._pinned.add(key)
        self._pinned = set()

    def _pop_farther_than(self, use: int) -> int | None:
        """Take the unpinned block used farthest ahead if that is after ``use``."""
        heap = self._heap
        held: list[tuple[int, int, int]] = []
        victim: int | None = None
        while heap:
            neg_use, _, key = heap[0]
            if self._cached.get(key) != -neg_use:
                heapq.heappop(heap)  # stale: used again or evicted since it was pushed
            elif key in self._pinned:
                held.append(heapq.heappop(heap))
            else:
                if -neg_use > use:
                    heapq.heappop(heap)
                    victim = key
                break
        for entry in held:
            heapq.heappush(heap, entry)
        return victim
