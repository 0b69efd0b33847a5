"""What each eviction policy costs per request, side by side, in-process.

    python benchmarks/eviction_cost.py [--trace PATH | --workload NAME] [--capacity 0.1]
                                       [--policies lru,slru,arc,s3fifo,density,auto]
                                       [--repeat 5] [--handover 200k [--ghosts 2]]
                                       [--memory 100k] [--ingest 500k]
                                       [--switch 1M [--path auto,lru,auto,...]]

Replays the trace through the simulator of benchmarks/replay_sim.py (the policy called
as the store calls it, each hit reported twice as the daemon's lookup and acquire do)
``--repeat`` times per policy, the policies taking turns so that a busy machine slows
them alike, and prints the median microseconds per request and its ratio to the first
policy's.  The daemon's own work per request (sockets, framing, the store's
bookkeeping) comes on top: compare the difference with the replay's requests per
second through the daemon (benchmarks/replay.py --mode daemon).

``--handover N`` times instead ``auto``'s hand-over of its order (``Duel._take_over``)
to each candidate in turn, on N store-like items (a key, a parent, links) inserted 16
at a time, every other 64-item chain hit once and one item in 97 pinned, in one call
and in slices (``kvstore.scheduler.handover``, carried by 64-item lookups): the
switch's CPU, the longest lookup while one was under way, how many lookups it took and
their extra CPU, and the CPU seconds per million items in all.  With ``--ghosts R``,
before each hand-over R times N misses go through the order in charge (a victim and a
new item each), so that the order handed over has its ghosts to let go.

``--ingest N`` times instead what each policy costs the store's ingest: N store-like
items (a 16-byte key, a parent, links; named and sampled as the store's blocks are)
inserted as 1024-item chains, deepest first, one ``insert_many`` a chain as a commit
makes, no eviction: the median CPU microseconds per item over ``--repeat`` runs (the
policies taking turns), and its ratio to the first policy's.

``--switch N`` times instead a change of the store's eviction policy (a SIGHUP that names
another ``dram.eviction_policy``) on a ``BlockStore`` of N committed blocks (1024-block
chains, one pinned, one kept warm), along ``--path`` (each policy to the next): in one
call (``at_once``, as before) and in steps (``kvstore.scheduler.switch``: 256 blocks a
loop turn, as the daemon passes them, and a 64-key lookup of a random chain between two
steps, as traffic would come): the one call's seconds; in steps, the longest step and
the longest lookup in the thread's CPU time, the 99.9th percentile of both, the longest
of either by the wall clock (which a busy machine lengthens), the steps and the CPU
seconds in all.  The heap is settled once a
second, as the daemon's is (``kvstore.heap``).

``--memory N`` measures instead what the order in charge of ``auto`` keeps of its own
per cached block (entries, queues, ghosts: what it frees when let go), with each
candidate in charge of N items through 3N misses, three in ten hit once after.
"""

from __future__ import annotations

import argparse
import gc
import random
import tracemalloc
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any
from pathlib import Path

from functools import partial
from operator import attrgetter

from kvstore.scheduler import dueling
from kvstore.scheduler.eviction import POLICIES, AutoPolicy, make_policy
from kvstore.scheduler.handover import Handover

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_sim import PolicyCache, cacheable, load_trace, replay, synthetic, unique_blocks

DEFAULT_TRACE = (Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
                 / "mooncake_synthetic_trace.jsonl")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--workload", default="", help="a synthetic workload instead")
    parser.add_argument("--capacity", type=float, default=0.1,
                        help="a share of the unique blocks")
    parser.add_argument("--policies", default="lru,slru,arc,s3fifo,density,auto")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--handover", default="",
                        help="time auto's hand-over on this many items (e.g. 200k)")
    parser.add_argument("--ghosts", type=float, default=0.0,
                        help="with --handover: before each, this many times the items "
                             "of misses (each a victim and a new item), filling the "
                             "order in charge's ghosts as its evictions do")
    parser.add_argument("--memory", default="",
                        help="measure the order in charge's memory on this many items")
    parser.add_argument("--ingest", default="",
                        help="time each policy's insert of this many items in chains")
    parser.add_argument("--switch", default="",
                        help="time a change of the store's policy on this many blocks")
    parser.add_argument("--path", default="auto,lru,auto,slru,density,lru,arc,auto",
                        help="with --switch: the policies switched to, one after another")
    args = parser.parse_args(argv)
    if args.switch:
        path = [p for p in args.path.split(",") if p]
        unknown = [p for p in path if p not in POLICIES]
        if unknown or len(path) < 2:
            parser.error(f"--path: two or more of {sorted(POLICIES)}, got {args.path!r}")
        return switch(_count(args.switch), path)
    if args.ingest:
        return ingest(_count(args.ingest), [p for p in args.policies.split(",") if p],
                      max(1, args.repeat))
    if args.memory:
        return memory(_count(args.memory))
    if args.handover:
        return handover(_count(args.handover), max(1, args.repeat), args.ghosts)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; registered: {sorted(POLICIES)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    trace = cacheable(synthetic(args.workload) if args.workload else load_trace(args.trace))
    capacity = max(1, round(args.capacity * unique_blocks(trace)))
    seconds: dict[str, list[float]] = {name: [] for name in policies}
    hits: dict[str, float] = {}
    for _ in range(args.repeat):
        for name in policies:
            cache = PolicyCache(POLICIES[name](), capacity, touches=2)
            started = time.perf_counter()
            stats = replay(trace, cache)
            seconds[name].append(time.perf_counter() - started)
            hits[name] = stats.block_hit_rate
    print(f"{len(trace)} requests, capacity {capacity} blocks, {args.repeat} runs each")
    print(f"{'policy':<8} {'us/request':>10} {'ratio':>6} {'block hit':>9}")
    first = statistics.median(seconds[policies[0]])
    for name in policies:
        median = statistics.median(seconds[name])
        print(f"{name:<8} {1e6 * median / len(trace):>10.1f} {median / first:>6.2f} "
              f"{hits[name]:>9.4f}")
    return 0


def _switch_store(count: int, policy: str) -> tuple[Any, Any, list[list[bytes]]]:
    """A store of ``count`` committed blocks in 1024-block chains (the first chain's
    head pinned, the second kept warm), its namespace, and each chain's first 64 keys."""
    from kvstore.keys import chain_keys
    from kvstore.store import BlockStore, Reservation
    from kvstore.identity import Identity

    identity = Identity(model="switch", model_revision="r", tenant="t", kv_dtype="float16",
                        num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16)
    slot = 4096
    store = BlockStore((count + 1024) * slot, 64 << 20, eviction_policy=policy,
                       clock=time.monotonic)
    ns = store.open_namespace(identity)
    heads: list[list[bytes]] = []
    for start in range(0, count, 1024):
        tokens = list(range(start * 16, (start + min(1024, count - start)) * 16))
        keys = chain_keys(ns.id, tokens, 16)
        r = store.reserve("w", ns, keys, None, 0.0)
        assert isinstance(r, Reservation), r
        store.commit("w", r.id, 0.0)
        heads.append(keys[:64])
    store.acquire("w", ns, heads[0][:1], 0.0)
    if len(heads) > 1:
        store.keep_warm(ns, heads[1], time.monotonic() + 3600)
    return store, ns, heads


def switch(count: int, path: list[str]) -> int:
    from kvstore.heap import settle

    rows: dict[tuple[str, str], dict[str, float]] = {}
    for at_once in (True, False):
        print(f"building a store of {count:,} blocks ({'one call' if at_once else 'in steps'})",
              file=sys.stderr, flush=True)
        store, ns, heads = _switch_store(count, path[0])
        before = len(ns.blocks)
        rng = random.Random(7)
        settle()
        for frm, to in zip(path, path[1:]):
            cpu, started = time.thread_time(), time.perf_counter()
            store.set_eviction_policy(to, at_once=at_once)
            row = rows.setdefault((frm, to), {})
            if at_once:
                row["once_s"] = time.perf_counter() - started
                row["once_cpu"] = time.thread_time() - cpu
            else:
                row["start_ms"] = (time.perf_counter() - started) * 1e3
                # the longest by the thread's CPU time (the machine's other work does
                # not lengthen it) and by the wall clock
                longest = longest_lookup = longest_wall = 0.0
                spent: list[float] = []  # each step's and lookup's CPU
                steps = 0
                settled = time.monotonic()
                more = True
                while more:
                    t, c = time.perf_counter(), time.thread_time()
                    more = store.switch_step(256)
                    spent.append(time.thread_time() - c)
                    longest = max(longest, spent[-1])
                    longest_wall = max(longest_wall, time.perf_counter() - t)
                    steps += 1
                    t, c = time.perf_counter(), time.thread_time()
                    store.lookup(ns, rng.choice(heads))
                    spent.append(time.thread_time() - c)
                    longest_lookup = max(longest_lookup, spent[-1])
                    longest_wall = max(longest_wall, time.perf_counter() - t)
                    if time.monotonic() - settled >= 1.0:
                        settle()
                        settled = time.monotonic()
                row.update(step_ms=longest * 1e3, lookup_ms=longest_lookup * 1e3,
                           wall_ms=longest_wall * 1e3, steps=steps,
                           p999_ms=sorted(spent)[int(len(spent) * 0.999)] * 1e3,
                           steps_cpu=time.thread_time() - cpu)
            settle()
            assert len(ns.blocks) == before, "a switch lost blocks"
            print(f"  {frm} -> {to}", file=sys.stderr, flush=True)
        store.check_invariants()
        del store, ns, heads
        gc.collect()
    print(f"change of eviction policy on {count:,} blocks (one pinned, 1024 kept warm)")
    print("(in steps, in ms: the longest step and lookup in CPU time, the 99.9th "
          "percentile of both, the longest of both by the wall clock; a VM's CPU time "
          "counts the time the host took the CPU away too)")
    print(f"{'switch':<18} {'one call s':>10} {'| steps':>8} {'longest step':>13} "
          f"{'longest lookup':>15} {'p99.9':>6} {'wall':>6} {'CPU s':>6}")
    for (frm, to), row in rows.items():
        print(f"{frm + ' -> ' + to:<18} {row['once_s']:>10.3f} {row['steps']:>8.0f} "
              f"{row['step_ms']:>13.2f} {row['lookup_ms']:>15.2f} {row['p999_ms']:>6.2f} "
              f"{row['wall_ms']:>6.2f} {row['steps_cpu']:>6.2f}")
    return 0


def _count(text: str) -> int:
    """``200k`` -> 200000."""
    return int(float(text.lower().rstrip("km")) * {"k": 1e3, "m": 1e6}.get(text.lower()[-1], 1))


class _Item:
    """A store block in miniature: its key, its parent, one set of links and the slot
    ``auto``'s duel keeps its state in (without it the duel keeps a map, which the
    store's blocks do not pay)."""

    __slots__ = ("key", "parent", "dram_order", "dram_older", "dram_newer", "dram_duel")

    def __init__(self, key: bytes, parent: _Item | None) -> None:
        self.key = key
        self.parent = parent
        self.dram_order = self.dram_older = self.dram_newer = self.dram_duel = None


def _handover_items(count: int) -> tuple[AutoPolicy[Any], list[_Item]]:
    rng = random.Random(5)
    policy = make_policy("auto", ghost_key=attrgetter("key"), links="dram")
    assert isinstance(policy, AutoPolicy)
    policy.expect(count)  # sized as the store sizes its order: a tier of ``count`` blocks
    policy.epoch = 1 << 62  # no election of its own
    items: list[_Item] = []
    parent: _Item | None = None
    for i in range(count):
        parent = _Item(rng.randbytes(24), None if i % 64 == 0 else parent)
        items.append(parent)
    for i in range(0, count, 16):
        policy.insert_many(items[i:i + 16])
    for i in range(0, count, 128):
        policy.access_many(items[i:i + 64])
    for item in items[::97]:
        policy.pin(item)
    return policy, items


def _churn(policy: AutoPolicy[Any], items: list[_Item], misses: int,
           rng: random.Random) -> None:
    """``misses`` misses: each a victim of the order in charge and a new item in its
    place (in ``items`` too, so that the lookups keep finding cached items), which
    fills that order's ghosts as its own evictions do (SLRU's up to twice the cache,
    ARC's two lists, hit density's up to four times)."""
    where = {id(item): i for i, item in enumerate(items)}
    for _ in range(misses):
        victim = policy.pop_victim(lambda item: True)
        if victim is None:
            return
        at = where.pop(id(victim))
        item = items[at] = _Item(rng.randbytes(24), None)
        where[id(item)] = at
        policy.insert(item)


def handover(count: int, repeat: int, ghosts: float = 0.0) -> int:
    """Each hand-over in one call (``HANDOVER_AT_ONCE`` past the items) and in slices:
    the switch's own CPU, then, in slices, the longest call of the traffic that carried
    it to its end (64-item lookups of random chains), how many calls that took, and the
    CPU they spent over the same calls with no hand-over under way.  ``ghosts``: before
    each hand-over, that many times ``count`` misses through the order in charge (its
    ghosts, which the hand-over lets go, filled)."""
    rng = random.Random(9)
    rows: dict[tuple[str, str], list[tuple[float, float, int, float]]] = {}
    for _ in range(repeat):
        for mode, at_once in (("one call", 1 << 62), ("slices", dueling.HANDOVER_AT_ONCE)):
            dueling.HANDOVER_AT_ONCE = at_once
            policy, items = _handover_items(count)
            gc.collect()
            gc.disable()
            for best in (1, 2, 3, 0):  # to SLRU, to ARC, to hit density, back to LRU
                if ghosts:
                    gc.enable()
                    _churn(policy, items, int(ghosts * count), rng)
                    gc.collect()
                    gc.disable()
                started = time.process_time()
                policy._take_over(best)
                switch = time.process_time() - started
                longest = spent = 0.0
                calls = 0
                while isinstance(policy._order, Handover):
                    at = rng.randrange(0, count - 64)
                    started = time.process_time()
                    policy.access_many(items[at:at + 64])
                    took = time.process_time() - started
                    longest, spent, calls = max(longest, took), spent + took, calls + 1
                # the same number of calls again, with no hand-over under way
                alone = 0.0
                for _ in range(calls):
                    at = rng.randrange(0, count - 64)
                    started = time.process_time()
                    policy.access_many(items[at:at + 64])
                    alone += time.process_time() - started
                rows.setdefault((policy.leader, mode), []).append(
                    (switch, longest, calls, spent - alone))
            gc.enable()
            policy.release()
    dueling.HANDOVER_AT_ONCE = at_once
    churned = f", after {ghosts:g}x its items of misses each" if ghosts else ""
    print(f"hand-over of {count} items (median of {repeat}{churned}): the switch's CPU, the "
          "longest 64-item lookup until it ended, the lookups it took, their CPU over the "
          "same lookups with none under way")
    print(f"  {'to':<8} {'mode':<9} {'switch ms':>10} {'longest ms':>11} {'lookups':>8} "
          f"{'extra ms':>9} {'s per M items':>14}")
    for (name, mode), runs in rows.items():
        switch, longest, calls, extra = (statistics.median(r[i] for r in runs)
                                         for i in range(4))
        total = switch + extra
        print(f"  {name:<8} {mode:<9} {1e3 * switch:10.2f} {1e3 * longest:11.3f} "
              f"{calls:8.0f} {1e3 * extra:9.1f} {1e6 * total / count:14.2f}")
    return 0


def ingest(count: int, policies: list[str], repeat: int) -> int:
    key_hash = partial(int.from_bytes, byteorder="little")  # the store's name hash
    seconds: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(repeat):
        for name in policies:
            rng = random.Random(3)
            policy = make_policy(name, ghost_key=attrgetter("key"), links="dram",
                                 name_hash=key_hash)
            policy.expect(count)  # as the store's tier of ``count`` blocks
            kept: list[list[_Item]] = []
            spent = 0.0
            gc.collect()
            for _ in range(0, count, 1024):
                chain: list[_Item] = []
                parent: _Item | None = None
                for key in _keys(rng, 1024):
                    parent = _Item(key, parent)
                    chain.append(parent)
                kept.append(chain)
                started = time.thread_time()
                policy.insert_many(reversed(chain))
                spent += time.thread_time() - started
            seconds[name].append(spent)
            policy.release()
    print(f"insert of {count} items in 1024-item chains, CPU us per item "
          f"(median of {repeat}):")
    first = statistics.median(seconds[policies[0]])
    for name in policies:
        median = statistics.median(seconds[name])
        print(f"  {name:<8} {1e6 * median / count:6.2f} {median / first:6.2f}")
    return 0


def _keys(rng: random.Random, n: int) -> list[bytes]:
    blob = rng.randbytes(16 * n)
    return [blob[i:i + 16] for i in range(0, 16 * n, 16)]


def memory(count: int) -> int:
    print(f"auto's order in charge of {count} items after {3 * count} misses: "
          "its own bytes per cached block")
    for best in (0, 1, 2, 3):
        rng = random.Random(1)
        tracemalloc.start()
        policy = make_policy("auto", ghost_key=attrgetter("key"), links="dram")
        assert isinstance(policy, AutoPolicy)
        policy.expect(count)  # as the store's tier of ``count`` blocks
        policy.epoch = 1 << 62  # no election of its own
        policy.insert_many([_Item(rng.randbytes(24), None) for _ in range(count)])
        policy.pop_victim(lambda _: True)
        policy._take_over(best)
        for _ in range(3 * count):
            policy.pop_victim(lambda _: True)
            item = _Item(rng.randbytes(24), None)
            policy.insert(item)
            if rng.random() < 0.3:
                policy.access(item)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        name = policy.leader
        policy._let_go(policy._order)
        policy._order = policy._factories[0]()
        gc.collect()
        freed = held - tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        print(f"  {name:<8} {freed / count:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
