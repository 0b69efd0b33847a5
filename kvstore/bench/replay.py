"""Replaying a serving trace of prefix-block ids: the trace, the replay loop, a cache
in miniature that runs an eviction policy as the store does, and a real daemon behind
the same interface; and the ``replay`` section of ``kvstore bench``.

benchmarks/replay.py (policies side by side with their bounds) is built on this.
A trace is JSON lines of ``{"timestamp", "input_length", "output_length", "hash_ids"}``,
one id per block, chained: an id stands for its whole prefix.  Its blocks are 512 tokens
(the Mooncake traces'), unless the requests' lengths and ids fit no 512-token block and
do fit another size (``trace_block_tokens``), or a caller names the size.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import numpy as np

from kvstore.bench.harness import BenchError, Daemon, Progress, Results, Row
from kvstore.client import Client, Held, Namespace
from kvstore.errors import CapacityError
from kvstore.identity import Identity
from kvstore.scheduler.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy

BLOCK_TOKENS = 512


class TraceRequest(msgspec.Struct):
    """One line of the trace (``block_tokens``: its blocks' size, not read from the line;
    ``load_trace`` sets it for the whole trace)."""

    timestamp: float  # (milliseconds in the Mooncake traces; any number is taken)
    input_length: int
    output_length: int = 0
    hash_ids: list[int] = msgspec.field(default_factory=list)
    block_tokens: int = BLOCK_TOKENS


class TraceError(ValueError):
    """A file that is no trace of prefix-block ids, with the line that says so."""


def load_trace(path: Path, block_tokens: int | None = None) -> list[TraceRequest]:
    """Every request of a JSON-lines trace, in order, its blocks ``block_tokens`` long
    (None: ``trace_block_tokens``)."""
    decoder = msgspec.json.Decoder(TraceRequest)
    trace = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                request = decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise TraceError(f"{path}, line {number}: {exc}") from None
            if request.input_length < 0:
                raise TraceError(f"{path}, line {number}: a negative input_length")
            trace.append(request)
    size = trace_block_tokens(trace) if block_tokens is None else block_tokens
    if size < 1:
        raise TraceError(f"{path}: blocks of {size} tokens")
    if size != BLOCK_TOKENS:
        trace = [msgspec.structs.replace(r, block_tokens=size) for r in trace]
    return trace


def trace_block_tokens(trace: Sequence[TraceRequest]) -> int:
    """The tokens of a trace's block.  A request of ``n`` ids and ``L`` tokens bounds it:
    ``ceil(L / size) == n`` where its partial last block has an id (the Mooncake traces),
    ``L // size == n`` where only full blocks have one.  512 where it fits every request
    in one of the two ways (or the trace bounds no size); else, of the sizes that fit
    every request in the first way (or else the second), the smallest power of two, or
    else the smallest.  A trace that no size fits is a TraceError (name the size)."""
    fits = [_sizes_fit(trace, full_only) for full_only in (False, True)]
    if any(lo <= BLOCK_TOKENS <= hi for lo, hi in fits):
        return BLOCK_TOKENS
    for lo, hi in fits:
        if lo <= hi:
            power = 1 << (lo - 1).bit_length()
            return power if power <= hi else lo
    raise TraceError("no block size fits every request's input_length and number of ids; "
                     "name the trace's block size")


def _sizes_fit(trace: Sequence[TraceRequest], full_only: bool) -> tuple[int, int]:
    """The least and the most tokens a block may have for every request's ids to fit
    its length (empty where the least is the greater)."""
    lo, hi = 1, 1 << 62
    for r in trace:
        n, length = len(r.hash_ids), r.input_length
        if n == 0 or length == 0:
            continue
        if full_only:  # n * size <= L < (n + 1) * size
            lo, hi = max(lo, length // (n + 1) + 1), min(hi, length // n)
        else:  # (n - 1) * size < L <= n * size
            lo = max(lo, -(-length // n))
            if n > 1:
                hi = min(hi, (length - 1) // (n - 1))
        if lo > hi:
            break
    return lo, hi


def cacheable(trace: Iterable[TraceRequest], partial: bool = False) -> list[TraceRequest]:
    """The trace with each request's ids cut to its full blocks, the only ones with keys
    (all of them, the partial last block as well, with ``partial``)."""
    if partial:
        return list(trace)
    return [
        msgspec.structs.replace(r, hash_ids=r.hash_ids[: r.input_length // r.block_tokens])
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

    A hit block is ``block_tokens`` long, except a partial last block (kept by
    ``cacheable`` with ``partial``), which holds the rest of ``input_length``.
    """
    stats = ReplayStats()
    for request in trace:
        keys = request.hash_ids
        hits = cache.lookup(keys)
        stats.requests += 1
        stats.blocks += len(keys)
        stats.hit_blocks += hits
        stats.tokens += request.input_length
        stats.hit_tokens += min(hits * request.block_tokens, request.input_length)
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
        # ids, or keys (``KeyChains.keyed``)
        self._parent: dict[Hashable, Hashable | None] = {}
        self._children: dict[Hashable, int] = {}  # cached children per cached block
        if hasattr(policy, "parent_of"):  # a policy that reads the chains (auto)
            policy.parent_of = self._parent.get
        policy.expect(capacity)  # sized as the store sizes its tier's order

    def _is_leaf(self, key: Hashable) -> bool:
        return self._children[key] == 0

    def cached_prefix(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, from the first, are cached."""
        children = self._children
        hits = 0
        for key in keys:
            if key not in children:
                break
            hits += 1
        return hits

    def lookup(self, keys: Sequence[int]) -> int:
        hits = self.cached_prefix(keys)
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
        policy.insert_many(reversed(keys[hits:stored]))  # one call, as the store makes
        for key in reversed(keys[:hits]):
            policy.unpin(key)

    def _evict_one(self) -> bool:
        victim = self.policy.pop_victim(self._is_leaf)
        if victim is None:
            return False
        assert self._children.get(victim) == 0, (
            f"policy returned {victim!r}, which is not a cached leaf"
        )
        del self._children[victim]
        parent = self._parent.pop(victim)
        if parent is not None:
            self._children[parent] -= 1
        self.evictions += 1
        return True


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


# -- the real daemon ------------------------------------------------------------

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


def daemon_capacity(share: float, unique: int) -> int:
    """Blocks of a DRAM tier of whole slabs nearest ``share`` of ``unique``."""
    slabs = max(MIN_DRAM_BLOCKS // SLAB_SLOTS, round(share * unique / SLAB_SLOTS))
    return slabs * SLAB_SLOTS


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

    def keyed(self, trace: Sequence[TraceRequest]) -> list[TraceRequest]:
        """``trace`` with each block id replaced by its key (ids already seen): the
        names the store's policies see, so that a simulator sampling names by their hash
        (``auto``, with ``key_hash``) samples the blocks the daemon's sampled."""
        known = self._keys
        return [msgspec.structs.replace(r, hash_ids=[known[h] for h in r.hash_ids])
                for r in trace]


@dataclass
class DaemonCache:
    """``replay``'s cache interface over a namespace of a real daemon (see the module
    docstring); ``capacity`` is its DRAM tier in blocks."""

    ns: Namespace
    chains: KeyChains
    capacity: int
    hold: bool = True
    rejects: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    _keys: list[bytes] = field(default_factory=list)
    _held: Held | None = None

    def __post_init__(self) -> None:
        self._zeros = bytes(self.ns.block_bytes)

    def lookup(self, ids: Sequence[int]) -> int:
        self._keys = keys = self.chains(self.ns, ids)
        found = self.ns.lookup(keys)
        hits = found.blocks
        for tier in found.tiers[:hits]:
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + 1
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




# -- the bench section ----------------------------------------------------------------------

QUICK_REQUESTS = 300
QUICK_CAPACITIES = (0.05, 0.25)
CAPACITIES = (0.02, 0.05, 0.10, 0.25)


def replay_section(work: Path, path: Path, quick: bool, results: Results,
                   progress: Progress, *, block_tokens: int | None = None) -> None:
    """Replay ``path`` through a daemon per capacity (its default eviction policy)
    beside the same policy simulated in-process and an infinite cache."""
    try:
        trace = cacheable(load_trace(path, block_tokens))
    except (TraceError, UnicodeDecodeError) as exc:
        raise BenchError(f"--trace {path}: not a trace of prefix-block ids ({exc})") from exc
    if quick:
        trace = trace[:QUICK_REQUESTS]
    unique = unique_blocks(trace)
    size = trace[0].block_tokens if trace else block_tokens or BLOCK_TOKENS
    if not unique:
        raise BenchError(f"--trace {path}: no request with a full {size}-token block")
    progress.step(f"replay: {len(trace)} requests of {path.name} ({size}-token blocks)")
    infinite = replay(trace, InfiniteCache()).block_hit_rate
    chains = KeyChains()
    curve = []
    for share in QUICK_CAPACITIES if quick else CAPACITIES:
        capacity = daemon_capacity(share, unique)
        simulated = replay(trace, PolicyCache(make_policy(DEFAULT_POLICY), capacity,
                                              touches=2))
        root = work / f"replay-{share}"
        with (Daemon(root, dram=str(capacity * SLOT_BYTES),
                     extra=["--slab-size", str(SLAB_BYTES)]) as daemon,
              Client(daemon.endpoint, tenant=DAEMON_IDENTITY.tenant) as client):
            ns = client.namespace(DAEMON_IDENTITY)
            ours = replay(trace, DaemonCache(ns, chains, capacity))
        results.rows.append(Row("replay", f"hit rate at {share:.0%} of unique blocks",
                                "hit rate", ours.block_hit_rate, simulated.block_hit_rate,
                                f"{DEFAULT_POLICY} simulated", "higher", 0.95))
        curve.append({"capacity_share": share, "capacity_blocks": capacity,
                      "kvstore": ours.block_hit_rate, "policy_sim": simulated.block_hit_rate,
                      "infinite": infinite})
    results.sweeps["hit_rate"] = curve
    progress.advance()
