"""Replay a serving trace with prefix-block ids against the eviction policies, offline.

    python benchmarks/replay.py [--trace PATH] [--capacities 0.02,0.05] [--policies lru,s3fifo]

Each request looks up the longest cached prefix of its block ids (hit blocks; hit
tokens, counting the partial last block as ``input_length - 512 * (n - 1)`` tokens),
then inserts its missing blocks, evicting leaf-first when the cache is full; the
request's own blocks stay pinned until it is done.  Every registered policy runs side by
side with these bounds at each capacity (a share of the trace's unique blocks):

- ``belady``: the offline optimum, the reference of the ratio column.  On a miss with
  a full cache it evicts the unpinned block whose next use is farthest, or skips
  caching the new block (and so the rest of the request) when that block's own next
  use is no nearer.  A child is never used without its parent, so its next use is no
  nearer than its parent's; breaking ties towards the deeper block makes the farthest
  block a leaf, so the plain Belady/MIN choice keeps prefix closure and is the optimum
  for block hits under these rules (bypass allowed).
- ``belady-ins``: the same without bypass: it must cache every block it can, as the
  policies must.
- ``infinite``: nothing is ever evicted (the share of references that repeat an id).

``--mode sim`` (the only mode for now) drives in-file simulators; ``replay`` drives any
object with ``lookup`` and ``insert`` (and reports its ``evictions`` if it has them),
so a client of the real daemon can be measured the same way.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from kvstore.scheduler.eviction import POLICIES, EvictionPolicy

BLOCK_TOKENS = 512
DEFAULT_TRACE = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "traces"
    / "mooncake_synthetic_trace.jsonl"
)
DEFAULT_CAPACITIES = (0.02, 0.05, 0.10, 0.25)


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

    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0


def replay(trace: Iterable[TraceRequest], cache: PrefixCache) -> ReplayStats:
    """Run every request through ``cache``; count hit blocks and tokens."""
    stats = ReplayStats()
    for request in trace:
        keys = request.hash_ids
        hits = cache.lookup(keys)
        stats.blocks += len(keys)
        stats.hit_blocks += hits
        stats.tokens += request.input_length
        if keys and hits == len(keys):
            stats.hit_tokens += request.input_length
        else:
            stats.hit_tokens += hits * BLOCK_TOKENS
        cache.insert(keys, hits)
    stats.evictions = getattr(cache, "evictions", 0)
    return stats


class PolicyCache:
    """A block store in miniature: a fixed number of slots, prefix closure, one policy.

    Calls the policy as the real store does: ``access`` deepest block first on a hit,
    ``pin``/``unpin`` around the request, ``insert`` on commit, and ``pop_victim`` with
    a test that passes only blocks without a cached child.
    """

    def __init__(self, policy: EvictionPolicy[Hashable], capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.evictions = 0
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, int] = {}  # cached children per cached block

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
        for key in reversed(keys[:hits]):
            policy.access(key)
        for key in keys[:hits]:
            policy.pin(key)
        return hits

    def insert(self, keys: Sequence[int], hits: int) -> None:
        policy = self.policy
        children = self._children
        stored = hits
        for i in range(hits, len(keys)):
            if len(children) >= self.capacity and not self._evict_one():
                break  # everything left is pinned or a prefix of something pinned
            key = keys[i]
            parent = keys[i - 1] if i else None
            children[key] = 0
            self._parent[key] = parent
            if parent is not None:
                children[parent] += 1
            policy.insert(key)
            policy.pin(key)
            stored += 1
        # Deepest first, as for hits: parents end up warmer than their children.
        for key in reversed(keys[:stored]):
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


def run_sim(
    trace: Sequence[TraceRequest], capacities: Sequence[float], policies: Sequence[str]
) -> list[tuple[float, int, str, ReplayStats]]:
    """Replay every policy and both bounds at every capacity; rows in print order."""
    unique = unique_blocks(trace)
    infinite = replay(trace, InfiniteCache())
    rows: list[tuple[float, int, str, ReplayStats]] = []
    for share in capacities:
        capacity = max(1, round(share * unique))
        rows.append((share, capacity, "belady", replay(trace, BeladyCache(trace, capacity))))
        must_insert = BeladyCache(trace, capacity, bypass=False)
        rows.append((share, capacity, "belady-ins", replay(trace, must_insert)))
        for name in policies:
            cache = PolicyCache(POLICIES[name](), capacity)
            rows.append((share, capacity, name, replay(trace, cache)))
        rows.append((share, capacity, "infinite", infinite))
    return rows


def format_table(rows: Sequence[tuple[float, int, str, ReplayStats]]) -> str:
    """The rows as a fixed-width table with each row's ratio to Belady's block hits."""
    header = (
        f"{'capacity':>14}  {'policy':<10} {'block hit':>9} {'token hit':>9} "
        f"{'evictions':>9} {'/belady':>7}"
    )
    lines = [header]
    belady: dict[float, ReplayStats] = {}
    for share, capacity, name, stats in rows:
        if name == "belady":
            belady[share] = stats
        best = belady.get(share)
        ratio = stats.hit_blocks / best.hit_blocks if best and best.hit_blocks else 0.0
        lines.append(
            f"{share:>5.0%} {capacity:>7}b  {name:<10} {stats.block_hit_rate:>9.4f} "
            f"{stats.token_hit_rate:>9.4f} {stats.evictions:>9} {ratio:>7.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSON-lines trace")
    parser.add_argument("--mode", choices=["sim"], default="sim", help="what replays it")
    parser.add_argument(
        "--capacities",
        default=",".join(str(c) for c in DEFAULT_CAPACITIES),
        help="comma-separated shares of the trace's unique blocks",
    )
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated registered policies"
    )
    args = parser.parse_args(argv)
    capacities = [float(c) for c in args.capacities.split(",") if c]
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; registered: {sorted(POLICIES)}")
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}; pass --trace")

    started = time.perf_counter()
    trace = load_trace(args.trace)
    references = sum(len(r.hash_ids) for r in trace)
    print(
        f"{len(trace)} requests, {references} block references, "
        f"{unique_blocks(trace)} unique blocks of {BLOCK_TOKENS} tokens"
    )
    print(format_table(run_sim(trace, capacities, policies)))
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
