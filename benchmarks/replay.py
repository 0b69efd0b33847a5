"""Replay a serving trace with prefix-block ids against the eviction policies.

    python benchmarks/replay.py [--trace PATH] [--capacities 0.02,0.05] [--policies lru,s3fifo]
    python benchmarks/replay.py --workload all [--touches 2]
    python benchmarks/replay.py --mode daemon [--requests 1000] [--ssd [SHARE]]

``--workload`` replays a synthetic workload of benchmarks/workloads.py instead of the
trace (``conversations``, ``scan``, ``documents``), or ``all``: the trace, then each of
them, so that a policy tuned to one trace is seen on workloads of other shapes.

Only a request's full blocks are cacheable, as in the store, where only full blocks get
keys: ``input_length // 512`` of its ids; the partial last block's tokens always miss
(``--partial-blocks`` counts it as a block, as this file did before; sim mode only).
Each request looks up the longest cached prefix of those ids (hit blocks; hit tokens are
512 per hit block), then inserts its missing blocks, evicting leaf-first when the cache
is full; the request's own blocks stay pinned until it is done.  Every registered policy
runs side by side with these bounds at each capacity (a share of the trace's unique
cacheable blocks):

- ``belady``: the offline optimum, the reference of the ratio column.  On a miss with
  a full cache it evicts the unpinned block whose next use is farthest, or skips
  caching the new block (and so the rest of the request) when that block's own next
  use is no nearer.  A child is never used without its parent, so its next use is no
  nearer than its parent's; breaking ties towards the deeper block makes the farthest
  block a leaf, so the plain Belady/MIN choice keeps prefix closure and is the optimum
  for block hits under these rules (bypass allowed).
- ``belady-ins``: the same without bypass: it must cache every block it can, as the
  policies must.
- ``rate+oracle``: evicts the block with the fewest references left per request left
  (as of its last use): what a perfect predictor of each block's popularity, but not of
  *when* it returns, buys.
- ``lru+oracle``: LRU told which blocks are never asked for again (they go coldest at
  once): what a perfect predictor of *whether* a block is reused, but not *when*, buys.
- ``infinite``: nothing is ever evicted (the share of references that repeat an id).

``--mode sim`` drives in-file simulators; ``replay`` drives any object with ``lookup``
and ``insert`` (and reports its ``evictions`` if it has them).  ``--touches 2`` makes the
simulator report each hit twice, as the daemon does (lookup, then acquire); a policy
that counts hits must give the same rows.

``--mode daemon`` also starts one real daemon (``python -m kvstore serve``) per policy
and capacity and replays the trace through the client library: a request's tokens are
``range(h * 512, h * 512 + 512)`` for each full-block id ``h``, keyed by ``ns.keys``;
``ns.lookup`` gives the hit, ``ns.acquire`` pins the hit blocks (as an engine reading
them back would; ``--no-hold`` skips it) and ``ns.put`` stores the missing ones, then
the pin is released.  Blocks are 16 KiB of zeros (one layer, one KV head of 8 float16
values, 512 tokens); the DRAM tier holds exactly the capacity's blocks, in 64 KiB slabs
(so capacities are rounded to 4 blocks and are at least 64 blocks, the 1 MiB minimum),
and the simulators run at those same capacities.  A put refused with CapacityError
(a request with more missing blocks than the cache has room for beside its hits) is
counted and retried with as many blocks as fit, which is what the simulator stores.
Each policy's daemon row sits under its simulator row, with the daemon's own counters
(``client.stats()``): blocks it refused, MiB committed into DRAM (new blocks and
promotions) and, with ``--ssd``, MiB written to the SSD tier and blocks promoted back.
``--ssd SHARE`` puts an SSD tier of that share of the unique blocks (1.0 if no share is
given) under DRAM; its hits count as hits, so those rows are not comparable with the
simulator's.  ``--requests N`` replays the first N requests only.

LRU's daemon rows match the simulator's exactly.  Where another policy's differ, the
store calls it differently from ``PolicyCache``: lookup and acquire each report a hit
(the policies count it once, see ``--touches``), a put reserves (evicts) all its slots before it
commits any block, and the store drops a block's entry when it is evicted, so a key
cached again is a new item to the policy and never matches its ghost (S3-FIFO's ghost
queue, ARC's B1/B2).  The last is most of the gap.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol, Self

import msgspec
import numpy as np

from kvstore.client import Client, Held, Namespace
from kvstore.errors import CapacityError
from kvstore.identity import Identity
from kvstore.scheduler.eviction import POLICIES, EvictionPolicy, LRUPolicy

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # after the path: benchmarks/ is no package

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

    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    rejects: int = 0  # puts refused with CapacityError (daemon only)
    tiers: dict[str, dict[str, int]] | None = None  # the daemon's per-tier counters

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


# -- the real daemon ------------------------------------------------------------------------

# Tiny blocks keep the arena small: 2 (K, V) * 1 layer * 1 head * 8 dims * 2 bytes * 512.
DAEMON_IDENTITY = Identity(
    model="replay",
    model_revision="1",
    tenant="replay",
    kv_dtype="float16",
    num_layers=1,
    num_kv_heads=1,
    head_dim=8,
    block_tokens=BLOCK_TOKENS,
)
SLOT_BYTES = -(-DAEMON_IDENTITY.block_bytes // 4096) * 4096  # slots are 4 KiB aligned
SLAB_BYTES = 64 << 10  # the smallest slab the daemon takes
SLAB_SLOTS = SLAB_BYTES // SLOT_BYTES
MIN_DRAM_BLOCKS = (1 << 20) // SLOT_BYTES  # the smallest DRAM tier it takes: 1 MiB


def sim_capacity(share: float, unique: int) -> int:
    return max(1, round(share * unique))


def daemon_capacity(share: float, unique: int) -> int:
    """Blocks of a DRAM tier of whole slabs nearest ``share`` of ``unique``."""
    slabs = max(MIN_DRAM_BLOCKS // SLAB_SLOTS, round(share * unique / SLAB_SLOTS))
    return slabs * SLAB_SLOTS


class Daemon:
    """``python -m kvstore serve`` in a scratch directory, from its "serving on" line to
    SIGTERM.  ``ssd_blocks`` 0 runs it without the SSD tier."""

    def __init__(self, workdir: Path, policy: str, dram_blocks: int, ssd_blocks: int = 0) -> None:
        self.workdir = workdir
        self.endpoint = f"ipc://{workdir / 'kvstore.sock'}"
        self.args = [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--endpoint",
            self.endpoint,
            "--dram-capacity",
            str(dram_blocks * SLOT_BYTES),
            "--slab-size",
            str(SLAB_BYTES),
            "--eviction-policy",
            policy,
            "--ssd-path",
            str(workdir / "ssd"),
            "--ssd-capacity",
            str(ssd_blocks * SLOT_BYTES),
            "--log-level",
            "warning",
        ]
        self.log_path = workdir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> Self:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env["KVSTORE_SSD_SLAB_SIZE"] = str(SLAB_BYTES)  # whole slabs of any SSD capacity
        self._log = self.log_path.open("ab")
        self.proc = proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=self._log, env=env
        )
        assert proc.stdout is not None
        watchdog = threading.Timer(60.0, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                if b"serving on" in line:
                    break
            else:
                raise RuntimeError(f"the daemon did not come up: {self.log().strip()}")
        except BaseException:
            self.__exit__()
            raise
        finally:
            watchdog.cancel()
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the rest
        return self

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.returncode not in (0, -signal.SIGTERM):
                print(
                    f"daemon exited with {proc.returncode}: {self.log()[-2000:]}", file=sys.stderr
                )
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class KeyChains:
    """The daemon's keys of the trace's block ids, computed once through ``ns.keys``.

    An id stands for its whole prefix, so its key (chained over the tokens
    ``range(h * 512, h * 512 + 512)`` of every id up to it) is the same in every request;
    namespaces of the same identity share them, so one instance serves every daemon.
    """

    def __init__(self) -> None:
        self._keys: dict[int, bytes] = {}
        self._offsets = np.arange(BLOCK_TOKENS, dtype=np.int64)

    def __call__(self, ns: Namespace, ids: Sequence[int]) -> list[bytes]:
        known = self._keys
        n = 0
        while n < len(ids) and ids[n] in known:
            n += 1
        keys = [known[h] for h in ids[:n]]
        if n < len(ids):
            rest = np.asarray(ids[n:], dtype=np.int64)
            tokens = (rest[:, None] * BLOCK_TOKENS + self._offsets).ravel()
            new = ns.keys(tokens, parent=keys[-1] if keys else None)
            known.update(zip(ids[n:], new))
            keys += new
        return keys


@dataclass
class DaemonCache:
    """``replay``'s cache interface over a namespace of a real daemon (see the module
    docstring); ``capacity`` is its DRAM tier in blocks."""

    ns: Namespace
    chains: KeyChains
    capacity: int
    hold: bool = True
    rejects: int = 0
    _keys: list[bytes] = field(default_factory=list)
    _held: Held | None = None

    def __post_init__(self) -> None:
        self._zeros = bytes(self.ns.block_bytes)

    def lookup(self, ids: Sequence[int]) -> int:
        self._keys = keys = self.chains(self.ns, ids)
        hits = self.ns.lookup(keys).blocks
        if self.hold and hits:
            self._held = self.ns.acquire(keys[:hits])
        return hits

    def insert(self, ids: Sequence[int], hits: int) -> None:
        keys, ns = self._keys, self.ns
        try:
            missing = len(keys) - hits
            if not missing:
                return
            parent = keys[hits - 1] if hits else None
            try:
                ns.put(keys[hits:], [self._zeros] * missing, parent=parent)
            except CapacityError:
                # The rest of the cache cannot make room for them all; the simulator
                # stores as many as fit beside the request's hits, so do the same.
                self.rejects += 1
                room = self.capacity - hits
                if 0 < room < missing:
                    try:
                        ns.put(keys[hits : hits + room], [self._zeros] * room, parent=parent)
                    except CapacityError:
                        pass
        finally:
            if self._held is not None:
                self._held.release()
                self._held = None


def replay_daemon(
    trace: Sequence[TraceRequest],
    policy: str,
    capacity: int,
    chains: KeyChains,
    *,
    ssd_blocks: int = 0,
    hold: bool = True,
) -> ReplayStats:
    """Start a daemon, replay the trace through the client library, stop it."""
    with (
        tempfile.TemporaryDirectory(prefix="kvstore-replay-") as tmp,
        Daemon(Path(tmp), policy, capacity, ssd_blocks) as daemon,
        Client(daemon.endpoint, tenant=DAEMON_IDENTITY.tenant) as client,
    ):
        ns = client.namespace(DAEMON_IDENTITY)
        dram = client.stats()["tiers"]["dram"]
        assert dram["capacity"] == capacity * SLOT_BYTES, dram
        stats = replay(trace, DaemonCache(ns, chains, capacity, hold=hold))
        tiers: dict[str, dict[str, int]] = client.stats()["tiers"]
    stats.tiers = tiers
    stats.evictions = tiers["dram"]["evictions"]
    return stats


def run_sim(
    trace: Sequence[TraceRequest],
    capacities: Sequence[float],
    policies: Sequence[str],
    *,
    daemon: bool = False,
    ssd_share: float = 0.0,
    hold: bool = True,
    touches: int = 1,
    progress: IO[str] | None = None,
) -> list[tuple[float, int, str, ReplayStats]]:
    """Replay every policy and both bounds at every capacity; rows in print order.

    With ``daemon``, each policy's simulator row is followed by the same replay through
    a real daemon (``<policy>@daemon``), and every capacity is the daemon's.
    """
    unique = unique_blocks(trace)
    capacity_of = daemon_capacity if daemon else sim_capacity
    ssd_blocks = round(ssd_share * unique) // SLAB_SLOTS * SLAB_SLOTS if ssd_share else 0
    chains = KeyChains()
    infinite = replay(trace, InfiniteCache())
    rows: list[tuple[float, int, str, ReplayStats]] = []
    for share in capacities:
        capacity = capacity_of(share, unique)
        rows.append((share, capacity, "belady", replay(trace, BeladyCache(trace, capacity))))
        must_insert = BeladyCache(trace, capacity, bypass=False)
        rows.append((share, capacity, "belady-ins", replay(trace, must_insert)))
        rows.append((share, capacity, "rate+oracle",
                     replay(trace, RateOracleCache(trace, capacity))))
        rows.append((share, capacity, "lru+oracle", replay(trace, OracleCache(trace, capacity))))
        for name in policies:
            cache = PolicyCache(POLICIES[name](), capacity, touches)
            rows.append((share, capacity, name, replay(trace, cache)))
            if daemon:
                started = time.perf_counter()
                stats = replay_daemon(
                    trace, name, capacity, chains, ssd_blocks=ssd_blocks, hold=hold
                )
                rows.append((share, capacity, f"{name}@daemon", stats))
                if progress is not None:
                    print(
                        f"  {name} at {capacity} blocks: daemon replay "
                        f"{time.perf_counter() - started:.1f} s",
                        file=progress,
                        flush=True,
                    )
        rows.append((share, capacity, "infinite", infinite))
    return rows


def format_table(rows: Sequence[tuple[float, int, str, ReplayStats]]) -> str:
    """The rows as a fixed-width table with each row's ratio to Belady's block hits.

    Daemon rows add what the daemon counted: puts refused (``rejects``), MiB committed
    into DRAM (new blocks and promotions) and, with an SSD tier, MiB written to it and
    blocks promoted back from it.
    """
    daemon = [stats.tiers for _, _, _, stats in rows if stats.tiers is not None]
    ssd = any("ssd" in tiers for tiers in daemon)
    width = max([10, *(len(name) for _, _, name, _ in rows)])
    header = (
        f"{'capacity':>14}  {'policy':<{width}} {'block hit':>9} {'token hit':>9} "
        f"{'evictions':>9} {'/belady':>7}"
    )
    if daemon:
        header += f" {'rejects':>7} {'dram MiB':>8}"
    if ssd:
        header += f" {'ssd MiB':>8} {'promoted':>8}"
    lines = [header]
    belady: dict[float, ReplayStats] = {}
    mib = float(1 << 20)
    for share, capacity, name, stats in rows:
        if name == "belady":
            belady[share] = stats
        best = belady.get(share)
        ratio = stats.hit_blocks / best.hit_blocks if best and best.hit_blocks else 0.0
        line = (
            f"{share:>5.0%} {capacity:>7}b  {name:<{width}} {stats.block_hit_rate:>9.4f} "
            f"{stats.token_hit_rate:>9.4f} {stats.evictions:>9} {ratio:>7.3f}"
        )
        tiers = stats.tiers
        if tiers is not None:
            dram = tiers["dram"]
            line += (
                f" {stats.rejects:>7} "
                f"{(dram['commits'] + dram['promotions']) * SLOT_BYTES / mib:>8.1f}"
            )
            if "ssd" in tiers:
                line += (
                    f" {tiers['ssd']['writes'] * SLOT_BYTES / mib:>8.1f} {dram['promotions']:>8}"
                )
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSON-lines trace")
    parser.add_argument(
        "--mode",
        choices=["sim", "daemon"],
        default="sim",
        help="simulators only, or real daemons beside them",
    )
    parser.add_argument(
        "--workload",
        choices=["trace", *WORKLOADS, "all"],
        default="trace",
        help="the --trace file, a synthetic workload of benchmarks/workloads.py, or all",
    )
    parser.add_argument(
        "--requests", type=int, default=0, metavar="N", help="replay the first N requests only"
    )
    parser.add_argument(
        "--touches",
        type=int,
        default=1,
        metavar="K",
        help="sim mode: report each hit K times to the policy (the daemon reports 2)",
    )
    parser.add_argument(
        "--partial-blocks",
        action="store_true",
        help="count each request's partial last block as a cacheable block (sim mode only)",
    )
    parser.add_argument(
        "--ssd",
        type=float,
        nargs="?",
        const=1.0,
        default=0.0,
        metavar="SHARE",
        help="daemon mode: an SSD tier of SHARE of the unique blocks (1.0 if no SHARE)",
    )
    parser.add_argument(
        "--no-hold",
        dest="hold",
        action="store_false",
        help="daemon mode: do not acquire a request's hit blocks while its put runs",
    )
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
    if args.workload in ("trace", "all") and not args.trace.is_file():
        parser.error(f"no trace at {args.trace}; pass --trace")
    if args.touches < 1:
        parser.error("--touches must be at least 1")
    daemon = args.mode == "daemon"
    if daemon and args.partial_blocks:
        parser.error("--partial-blocks is sim mode only: the daemon keys full blocks only")
    if not daemon and (args.ssd or not args.hold):
        parser.error("--ssd and --no-hold are daemon mode only")
    if daemon and args.touches != 1:
        parser.error("--touches is sim mode only: the daemon reports hits as it does")

    started = time.perf_counter()
    names = [args.workload] if args.workload != "all" else ["trace", *WORKLOADS]
    for name in names:
        if name == "trace":
            trace = load_trace(args.trace)
            if args.requests > 0:
                trace = trace[: args.requests]
            title = args.trace.name
        else:
            trace = synthetic(name, args.requests)
            title = f"synthetic workload {name!r}"
        trace = cacheable(trace, args.partial_blocks)
        references = sum(len(r.hash_ids) for r in trace)
        what = "blocks (partial last blocks too)" if args.partial_blocks else "full blocks"
        print(
            f"{title}: {len(trace)} requests, {references} block references, "
            f"{unique_blocks(trace)} unique {what} of {BLOCK_TOKENS} tokens"
        )
        rows = run_sim(
            trace,
            capacities,
            policies,
            daemon=daemon,
            ssd_share=args.ssd,
            hold=args.hold,
            touches=args.touches,
            progress=sys.stderr if daemon else None,
        )
        print(format_table(rows))
        print()
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
