"""The offline half of benchmarks/replay.py: the trace, the replay loop, and the caches
it drives in-process (no daemon, no sockets).

``PolicyCache`` runs a registered eviction policy the way the store calls it; the
bounds (``BeladyCache``, ``RateOracleCache``, ``OracleCache``, ``InfiniteCache``) are
the rows it is compared with.  benchmarks/replay.py's docstring says what each one is and
how the replay counts hits.
"""

from __future__ import annotations

import bisect
import heapq
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from kvstore.scheduler.eviction import EvictionPolicy, LRUPolicy

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # after the path: benchmarks/ is no package

BLOCK_TOKENS = 512


class TraceRequest(msgspec.Struct):
    """One line of the trace."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: Path) -> list[TraceRequest]:
    """Every request of a JSON-lines trace, in order."""
    decoder = msgspec.json.Decoder(TraceRequest)
    with path.open("rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]


def synthetic(name: str, requests: int = 0) -> list[TraceRequest]:
    """A synthetic workload of benchmarks/workloads.py (its default size, or ``requests``)."""
    generate = WORKLOADS[name]
    made = generate(requests) if requests > 0 else generate()
    return [TraceRequest(*request) for request in made]


def cacheable(trace: Iterable[TraceRequest], partial: bool = False) -> list[TraceRequest]:
    """The trace with each request's ids cut to its full blocks, the only ones with keys
    (all of them, the partial last block as well, with ``partial``)."""
    if partial:
        return list(trace)
    return [
        msgspec.structs.replace(r, hash_ids=r.hash_ids[: r.input_length // BLOCK_TOKENS])
        for r in trace
    ]


class PrefixCache(Protocol):
    """What ``replay`` drives: one lookup and one insert per request, in trace order.

    An ``evictions`` attribute, where the cache has one, is reported too.
    """

    def lookup(self, keys: Sequence[int]) -> int:
        """How many leading keys are cached; they stay pinned until ``insert``."""
        ...

    def insert(self, keys: Sequence[int], hits: int) -> None:
        """Cache ``keys[hits:]`` as far as room allows, then release the request's pins."""
        ...


@dataclass
class ReplayStats:
    """Totals of one replay."""

    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    rejects: int = 0  # puts refused with CapacityError (daemon only)
    tiers: dict[str, dict[str, int]] | None = None  # the daemon's per-tier counters
    tier_hits: dict[str, int] | None = None  # the daemon's hit blocks by the tier they hit
    seconds: float = 0.0  # wall time of a daemon replay
    daemon_cpu: float = 0.0  # CPU seconds the daemon spent in it

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0


def replay(trace: Iterable[TraceRequest], cache: PrefixCache) -> ReplayStats:
    """Run every request through ``cache``; count hit blocks and tokens.

    A hit block is 512 tokens, except a partial last block (kept by ``cacheable`` with
    ``partial``), which holds the rest of ``input_length``.
    """
    stats = ReplayStats()
    for request in trace:
        keys = request.hash_ids
        hits = cache.lookup(keys)
        stats.requests += 1
        stats.blocks += len(keys)
        stats.hit_blocks += hits
        stats.tokens += request.input_length
        stats.hit_tokens += min(hits * BLOCK_TOKENS, request.input_length)
        cache.insert(keys, hits)
    stats.evictions = getattr(cache, "evictions", 0)
    stats.rejects = getattr(cache, "rejects", 0)
    return stats


class PolicyCache:
    """A block store in miniature: a fixed number of slots, prefix closure, one policy.

    Calls the policy as the real store does: ``access`` deepest block first on a hit
    (``touches`` times: the daemon's lookup and acquire make two), ``pin``/``unpin``
    around the request, ``insert`` on commit, and ``pop_victim`` with a test that passes
    only blocks without a cached child.
    """

    def __init__(
        self, policy: EvictionPolicy[Hashable], capacity: int, touches: int = 1
    ) -> None:
        self.policy = policy
        self.capacity = capacity
        self.touches = touches
        self.evictions = 0
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, int] = {}  # cached children per cached block
        if hasattr(policy, "parent_of"):  # a policy that reads the chains (auto)
            policy.parent_of = self._parent.get

    def _is_leaf(self, key: Hashable) -> bool:
        return self._children[key] == 0  # type: ignore[index]

    def lookup(self, keys: Sequence[int]) -> int:
        children = self._children
        hits = 0
        for key in keys:
            if key not in children:
                break
            hits += 1
        policy = self.policy
        for _ in range(self.touches):
            for key in reversed(keys[:hits]):
                policy.access(key)
        for key in keys[:hits]:
            policy.pin(key)
        return hits

    def insert(self, keys: Sequence[int], hits: int) -> None:
        # As the store does: reserve (evict) room for every new block first, then
        # commit them deepest first, then release the request's pins deepest first, so
        # that parents end up warmer than their children.
        policy = self.policy
        children = self._children
        room = self.capacity - len(children)
        want = len(keys) - hits
        while room < want and self._evict_one():
            room += 1
        stored = hits + max(0, min(want, room))
        for i in range(hits, stored):
            key = keys[i]
            parent = keys[i - 1] if i else None
            children[key] = 0
            self._parent[key] = parent
            if parent is not None:
                children[parent] += 1
        for key in reversed(keys[hits:stored]):
            policy.insert(key)
        for key in reversed(keys[:hits]):
            policy.unpin(key)

    def _evict_one(self) -> bool:
        victim = self.policy.pop_victim(self._is_leaf)
        if victim is None:
            return False
        assert isinstance(victim, int) and self._children[victim] == 0, (
            f"policy returned {victim!r}, which is not a cached leaf"
        )
        del self._children[victim]
        parent = self._parent.pop(victim)
        if parent is not None:
            self._children[parent] -= 1
        self.evictions += 1
        return True


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


class InfiniteCache:
    """Never evicts: the bound of a cache as large as the trace."""

    evictions = 0

    def __init__(self) -> None:
        self._cached: set[int] = set()

    def lookup(self, keys: Sequence[int]) -> int:
        hits = 0
        for key in keys:
            if key not in self._cached:
                break
            hits += 1
        return hits

    def insert(self, keys: Sequence[int], hits: int) -> None:
        self._cached.update(keys[hits:])


def unique_blocks(trace: Iterable[TraceRequest]) -> int:
    """How many distinct block ids the trace references."""
    return len({key for request in trace for key in request.hash_ids})
