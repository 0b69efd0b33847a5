"""What the key index costs from 10k to 10M committed blocks, and how long the loop is held.

Builds the pure store's index (no arena, no sockets: a slab pool's capacity is only a
number, so 10M blocks need no 40 GB of memory) by reserve+commit of 1024-key chains, as
clients send them, settling the heap once a second as the daemon does, and prints:

- bytes per committed block (RSS delta over the build, keys included) and where they go
  (``sys.getsizeof`` of the big per-block structures, per block);
- ingest, blocks/s (time spent in reserve+commit only), and blocks per CPU-second
  (the same calls' thread time: on a shared machine the wall figure also counts the
  time the process was not running);
- lookup of a 64-key chain, p50 and p99, as the index passes 10k, 100k, 1M, 10M blocks,
  in wall time and in the thread's CPU time (on a shared machine a wall p99 of 4 ms is
  a scheduler tick the process waited out, not the lookup); and the CPU of a chain's
  first lookup at that size apart from its lookups again (``first``/``repeat``, and
  the first ones' share in percent): under ``auto`` a first lookup's sampled keys are
  hit in each of the duel's four miniatures, a repeat's are not (a hit counts once per
  tick, and no commit falls between the lookups), and as the chains outnumber the 2000
  lookups the mix moves from repeats to first lookups (at 10k blocks 10 chains, at 3M
  2930);
- the longest stall of the loop: the longest single reserve+commit (one request's hold
  of the event loop; the five longest with their CPU time and the collector's pauses in
  them, for on a shared machine a commit's wall time also counts the time the process
  was not running), the longest heap settle, the longest collector pause during the
  build (wall, and CPU), a full collection afterwards, and the longest
  ``stats``/``evict`` of one leaf;
- warm restart of an SSD index of as many blocks: the LMDB index is written (in a
  process of its own, not timed), then another process opens the SSD tier and restores
  every block into a fresh store as the daemon does at start-up (timed: seconds, and
  records/s), and the memory that took (RSS, split into the process's own and the
  index pages LMDB mapped, and the peak).

Every part runs in a fresh process, so that its memory is its own.

Where the bytes go, and what 150 B a block would take.  At 10M blocks (auto, one
namespace) the index costs 312 B a block by RSS (393 while the duel's miniatures took
an eighth of the keys at any size, about 29 B a block in nodes of 176 B; now at most
8192 keys each; 430 while the duel kept a map of its tracked items, 33 B a block; their
states are now in the entries' ``dram_duel`` slot, the one ``seen`` left when it moved
into ``marks``): the entry (``Block``, 18 slots, 176 B), its key (a 16-byte ``bytes``,
49 B), its DRAM offset (an int object, 32 B), the key map (34 B), the rest allocator
slack.  The LRU order
itself costs nothing apart (its links are 24 B of the entry's slots per tier).  Objects
cannot get to 150 B: the entry and its key alone are 225 B.  A struct-of-arrays index
could: blocks as int ids into numpy columns (key 16 B, parent id 4, DRAM slot 4, SSD
slot 4, refs 4, seen and flags 2, checksum 8, LRU links 2 x 4 per tier = 16), an
open-addressing table of ids keyed by the first 8 bytes of the key at half load (8 B),
the duel's tracked set a bit per id and its sample kept as it is (at most 8192 keys a
miniature; at one key in eight, about 10 B a block in arrays): about 75 B a block, grown by doubling columns in slices
between loop turns.
The cost is that every part of the store that holds a ``Block`` would hold an id.

Why lookup grows with the index.  A lookup walks its chain by child links (one key-map
probe at the head), and that walk is nearly flat: 6-13 us for 64 keys from 10k to 3M
blocks (a probe per key, before: 9-48 us, the map's tables' cache and TLB misses).
With the LRU order the whole lookup is 10 us at 10k and 15 us at 3M; with ``auto`` (the
duel) it was 20 us at 10k and about 140 us (CPU) at 10M: the duel's per-hit probe of
its tracked-items map and its sampled keys' miniature updates, random reads over maps
as big as the index, were what grew.  Measured in one process, lookups alone, with the
order's ``access_many`` replaced by nothing.  With the states in the entries (no map),
the benchmark's 64-key lookup under ``auto`` is 68 us p50, 274 us p99 of CPU at 10M
against 122 and 401 with the map (one run each): the miniatures' work on sampled keys
is what still grew, and with miniatures of at most 8192 keys (one key in 2048 at 10M)
25 us p50 and 89 p99 at 10M, 20 and 59-75 at 1M, 11 and 17-27 at 10k.

    python benchmarks/index_scale.py --blocks 1M
    python benchmarks/index_scale.py --blocks 10M --restart-blocks 10M
    python benchmarks/index_scale.py --skip-index --restart-blocks 1M --restart-repeats 5
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_stalls import (  # noqa: E402
    CHAIN, SLOT, GcPauses, chains, parse_count, pct, rss_bytes)

CHECKPOINTS = (10_000, 100_000, 1_000_000, 10_000_000)
SSD_BLOCK = 4096  # the smallest SSD slot: 10M of them fit a 64 GB disk
SSD_SLAB = 64 << 20


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def identity(block_bytes_layers: int = 1) -> Any:
    from kvstore.identity import Identity

    return Identity(model="scale", model_revision="r", tenant="t", kv_dtype="float16",
                    num_layers=block_bytes_layers, num_kv_heads=1, head_dim=8,
                    block_tokens=16)


def breakdown(store: Any, ns: Any, n: int) -> dict[str, float]:
    """Bytes per block of the big structures (containers with at least n/16 entries
    reachable from the store in a few steps, and one block entry with its key)."""
    from kvstore.blocks import Block

    out: dict[str, float] = {}
    seen: set[int] = set()

    def walk(name: str, obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 10 or isinstance(obj, Block):
            return
        seen.add(id(obj))
        shards = getattr(obj, "shards", None)  # a map split into sub-dicts
        if isinstance(shards, list) and sum(map(len, shards)) >= n // 16:
            out[name] = sum(map(sys.getsizeof, shards)) / n
            return
        if isinstance(obj, (dict, set, list)) and len(obj) >= n // 16:
            out[name] = out.get(name, 0.0) + sys.getsizeof(obj) / n
            return
        if isinstance(obj, dict):
            for k, v in list(obj.items())[:64]:
                walk(f"{name}[{type(k).__name__}]", v, depth + 1)
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj[:8]):
                walk(f"{name}[{i}]", v, depth + 1)
            return
        attrs = getattr(obj, "__dict__", None)
        if attrs is not None:
            for k, v in attrs.items():
                walk(f"{name}.{k}", v, depth + 1)
        for k in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, k):
                walk(f"{name}.{k}", getattr(obj, k), depth + 1)

    walk("store", store, 0)
    block = next(iter(ns.blocks.values()))
    out["Block entry (object)"] = sys.getsizeof(block)
    out["key (bytes object)"] = sys.getsizeof(block.key)
    return out


class GcCpu:
    """The longest collector pause in CPU time (the thread's: on a shared machine a
    pause's wall time also counts the turns other processes took meanwhile, a
    scheduler tick of 4 ms at a time)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.longest = max(self.longest, time.thread_time() - self._start)

    def __enter__(self) -> GcCpu:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


# -- the index --------------------------------------------------------------------------
def index_figures(n: int, policy: str) -> dict[str, Any]:
    from kvstore.heap import settle
    from kvstore.store import BlockStore, Reservation

    gc.collect()
    base = rss_bytes()
    store = BlockStore((n + CHAIN) * SLOT, 64 << 20, eviction_policy=policy,
                       clock=time.monotonic)
    ns = store.open_namespace(identity())
    heads: list[list[bytes]] = []
    tails: list[bytes] = []
    ingest = 0.0
    ingest_cpu = 0.0  # the same, CPU seconds: on a shared machine wall time counts others' turns
    longest_op, longest_at = 0.0, 0
    # the longest commits: (seconds, blocks before it, of which collector pauses, CPU
    # seconds: on a shared machine the rest is time the process was not running)
    top: list[tuple[float, int, float, float]] = []
    settles: list[float] = []
    lookups: dict[str, dict[str, float | None]] = {}
    marks = sorted({c for c in CHECKPOINTS if c <= n} | {n})
    rng = random.Random(2)
    done = 0
    settle()
    last_settle = time.monotonic()
    last_note = last_settle
    gc_cpu = GcCpu()
    with GcPauses() as pauses, gc_cpu:
        for keys in chains(n):
            paused, cpu = pauses.total, time.thread_time()
            start = time.perf_counter()
            r = store.reserve("w", ns, keys, None, 0.0)
            assert isinstance(r, Reservation), r
            store.commit("w", r.id, 0.0)
            spent = time.perf_counter() - start
            ingest += spent
            ingest_cpu += time.thread_time() - cpu
            if spent > longest_op:
                longest_op, longest_at = spent, done
            if len(top) < 5 or spent > top[0][0]:
                heapq.heappush(top, (spent, done, pauses.total - paused,
                                     time.thread_time() - cpu))
                if len(top) > 5:
                    heapq.heappop(top)
            done += len(keys)
            heads.append(keys[:64])
            tails.append(keys[-1])
            now = time.monotonic()
            if now - last_settle >= 1.0:  # as the daemon does, once a second
                t0 = time.perf_counter()
                settle()
                settles.append(time.perf_counter() - t0)
                last_settle = now
            if now - last_note >= 5.0:
                say(f"  index: {done:,}/{n:,} blocks, {done / ingest:,.0f} blocks/s")
                last_note = now
            while marks and done >= marks[0]:
                mark = marks.pop(0)
                looks, looks_cpu = [], []
                # CPU of a chain's first lookup at this mark and of those again (the
                # duel counts a sampled key's hit once per tick: a repeat skips its
                # miniatures' work), apart, for the mix shifts as the chains outnumber
                # the lookups
                firsts, repeats, looked = [], [], set()
                for _ in range(2000):
                    at = rng.randrange(len(heads))
                    chain = heads[at]
                    t0, c0 = time.perf_counter(), time.thread_time()
                    store.lookup(ns, chain)
                    looks.append(time.perf_counter() - t0)
                    looks_cpu.append(time.thread_time() - c0)
                    (repeats if at in looked else firsts).append(looks_cpu[-1])
                    looked.add(at)
                lookups[f"{mark:,}"] = {"p50_us": pct(looks, 0.5) * 1e6,
                                        "p99_us": pct(looks, 0.99) * 1e6,
                                        "cpu_p50_us": pct(looks_cpu, 0.5) * 1e6,
                                        "cpu_p99_us": pct(looks_cpu, 0.99) * 1e6,
                                        "first_pct": 100.0 * len(firsts) / len(looks),
                                        "cpu_first_p50_us": pct(firsts, 0.5) * 1e6 if firsts else None,
                                        "cpu_first_p99_us": pct(firsts, 0.99) * 1e6 if firsts else None,
                                        "cpu_repeat_p50_us": pct(repeats, 0.5) * 1e6 if repeats else None,
                                        "cpu_repeat_p99_us": pct(repeats, 0.99) * 1e6 if repeats else None}
    gc.collect()
    rss = rss_bytes() - base
    settle()
    t0 = time.perf_counter()
    gc.collect()
    full_gc = time.perf_counter() - t0
    stats = []
    for _ in range(5):
        t0 = time.perf_counter()
        store.stats()
        stats.append(time.perf_counter() - t0)
    evicts = []
    for key in tails[::max(1, len(tails) // 20)][:20]:
        t0 = time.perf_counter()
        store.evict(ns, [key])
        evicts.append(time.perf_counter() - t0)
    return {
        "blocks": n,
        "policy": policy,
        "bytes_per_block": rss / n,
        "ingest_blocks_per_s": n / ingest,
        "ingest_blocks_per_cpu_s": n / ingest_cpu,
        "lookup64": lookups,
        "stall_longest_commit_ms": longest_op * 1e3,
        "stall_longest_commit_at_blocks": longest_at,
        "stall_top5_commits_ms_at_blocks": {
            f"{at:,}": {"wall": ms * 1e3, "cpu": cpu_s * 1e3, "gc": gc_s * 1e3}
            for ms, at, gc_s, cpu_s in sorted(top, reverse=True)},
        "stall_longest_settle_ms": max(settles, default=0.0) * 1e3,
        "stall_longest_gc_pause_ms": max(
            (max(v) for v in pauses.pauses.values() if v), default=0.0) * 1e3,
        "stall_longest_gc_pause_cpu_ms": gc_cpu.longest * 1e3,
        "full_gc_runs_in_ingest": len(pauses.pauses[2]),
        "full_gc_after_settle_ms": full_gc * 1e3,
        "stats_ms": max(stats) * 1e3,
        "evict_one_ms": max(evicts) * 1e3,
        "breakdown_bytes_per_block": breakdown(store, ns, n),
    }


# -- warm restart of the SSD index ------------------------------------------------------
def ssd_capacity(n: int) -> int:
    return -(-(n + CHAIN) * SSD_BLOCK // SSD_SLAB) * SSD_SLAB


def write_ssd_index(path: Path, n: int) -> dict[str, Any]:
    """An SSD tier directory whose index holds ``n`` blocks in chains (no data written:
    the restart reads only the index)."""
    import msgspec

    from kvstore.tiers.ssd import BlockRecord, SSDStore

    ident = identity(SSD_BLOCK // identity().block_bytes)
    assert ident.block_bytes == SSD_BLOCK
    ns_id = ident.namespace_id
    start = time.monotonic()
    engine = SSDStore(path, ssd_capacity(n), slab_bytes=SSD_SLAB, sync="none",
                      direct_io=False, preallocate=False)
    try:
        engine.put_namespace(ns_id, msgspec.msgpack.encode(ident))
        index = engine._directory.parts()[1]  # type: ignore[union-attr]
        offset = 0
        batch: list[BlockRecord] = []
        last_note = time.monotonic()
        for keys in chains(n, seed=5):
            parent = None
            for key in keys:
                batch.append(BlockRecord(ns_id, key, parent, offset, SSD_BLOCK,
                                         checksum=offset + 1, size_class=SSD_BLOCK))
                parent = key
                offset += SSD_BLOCK
            if len(batch) >= 64 * CHAIN:
                index.commit(batch)
                batch = []
                if time.monotonic() - last_note >= 5.0:
                    say(f"  ssd index: {offset // SSD_BLOCK:,}/{n:,} records written")
                    last_note = time.monotonic()
        if batch:
            index.commit(batch)
    finally:
        engine.close()
    return {"write_s": time.monotonic() - start}


def restart_figures(path: Path, n: int, by_cursors: bool = False) -> dict[str, Any]:
    """Open the SSD tier and restore its blocks into a fresh store, as the daemon does
    at start-up (``SsdMover.restore``); ``by_cursors``: its index scanned by LMDB's
    cursors, as where its pages are not read in place (``ssd_pages``)."""
    from kvstore.config import load_config
    from kvstore.store import BlockStore
    from kvstore.tiering import SsdMover
    from kvstore.tiers.ssd_index import SSDIndex
    from kvstore.transfers import TransferGate

    if by_cursors:
        SSDIndex.scan_mapped = lambda *args, **kwargs: None  # type: ignore[method-assign]

    config = load_config(overrides={
        "dram": {"capacity": 64 << 20, "eviction_policy": "lru"},
        "ssd": {"path": str(path), "capacity": ssd_capacity(n), "slab_size": SSD_SLAB,
                "direct_io": False, "preallocate": False}})
    store = BlockStore(config.dram_capacity, config.dram_slab_bytes,
                       ssd_capacity=config.ssd_capacity, ssd_slab_bytes=config.ssd_slab_bytes)
    gc.collect()
    base, before = rss_bytes(), memory_status()
    start, cpu = time.perf_counter(), time.process_time()
    mover = SsdMover(config, store, lambda ns, offset: memoryview(b""), TransferGate(4))
    restored = mover.restore()
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    rss = rss_bytes() - base
    after = memory_status()
    mover.engine.close()
    # RSS counts the index's pages LMDB mapped as it read them (file pages, which the
    # kernel may drop: "file"), and the process's own memory ("anon"); the peak is the
    # high-water mark of both while restoring (above the RSS before it)
    return {"restored": restored, "restart_s": seconds, "restart_cpu_s": cpu, "restart_records_per_s": n / seconds,
            "restart_us_per_block": seconds / n * 1e6, "restart_cpu_us_per_block": cpu / n * 1e6,
            "restart_bytes_per_block": rss / n,
            "restart_anon_bytes_per_block": (after["RssAnon"] - before["RssAnon"]) / n,
            "restart_file_bytes_per_block": (after["RssFile"] - before["RssFile"]) / n,
            "restart_peak_bytes_per_block": (after["VmHWM"] - base) / n}


def memory_status() -> dict[str, int]:
    """The kernel's memory figures of this process, in bytes (RssAnon, RssFile, VmHWM)."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "RssFile", "VmHWM"):
                out[name] = int(rest.split()[0]) * 1024
    return out


# -- driver -----------------------------------------------------------------------------
def child(args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, *args]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(args)} failed (exit {done.returncode})")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def report(figures: dict[str, Any]) -> None:
    for key, value in figures.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                shown = (", ".join(f"{a} {'-' if b is None else f'{b:,.1f}'}"
                                   for a, b in v.items())
                         if isinstance(v, dict) else f"{v:,.1f}")
                print(f"  {k:44} {shown}")
        elif isinstance(value, float):
            print(f"{key:46} {value:,.2f}")
        else:
            print(f"{key:46} {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1M", help="blocks in the index (e.g. 1M, 10M)")
    parser.add_argument("--restart-blocks", default=None,
                        help="blocks in the SSD index restored (default: --blocks; 0: skip)")
    parser.add_argument("--restart-repeats", type=int, default=1,
                        help="restores of the one SSD index written, each in a process of "
                             "its own (medians of the figures, and each run's CPU us a block)")
    parser.add_argument("--restart-by-cursors", action="store_true",
                        help="each restore also run with the index scanned by LMDB's "
                             "cursors (not read in place), alternated: both CPU figures "
                             "and their ratio")
    parser.add_argument("--by-cursors", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-index", action="store_true",
                        help="the warm restart's figures only, no index build")
    parser.add_argument("--policy", default="auto", help="the DRAM eviction policy")
    parser.add_argument("--repeats", type=int, default=1,
                        help="index builds (medians of the scalar figures)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--part", choices=["index", "ssd-write", "restart"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = parse_count(args.blocks)
    if args.part == "index":
        print(json.dumps(index_figures(n, args.policy)))
        return
    if args.part == "ssd-write":
        print(json.dumps(write_ssd_index(Path(args.dir), n)))
        return
    if args.part == "restart":
        print(json.dumps(restart_figures(Path(args.dir), n, args.by_cursors)))
        return

    if not args.skip_index:
        say(f"index of {n:,} blocks ({args.repeats} build(s), policy {args.policy})")
    runs = [child(["--part", "index", "--blocks", str(n), "--policy", args.policy])
            for _ in range(0 if args.skip_index else args.repeats)]
    figures = runs[0] if runs else {}
    for key, value in figures.items():
        if isinstance(value, float):
            figures[key] = statistics.median(r[key] for r in runs)
    if len(runs) > 1:
        figures["ingest_blocks_per_s_runs"] = [round(r["ingest_blocks_per_s"]) for r in runs]
        figures["ingest_blocks_per_cpu_s_runs"] = [
            round(r["ingest_blocks_per_cpu_s"]) for r in runs]
    if not args.json:
        report(figures)
        figures = {}
    m = n if args.restart_blocks is None else parse_count(args.restart_blocks)
    if m:
        work = Path(tempfile.mkdtemp(prefix="kvscale-"))
        try:
            say(f"ssd index of {m:,} blocks: writing")
            written = child(["--part", "ssd-write", "--blocks", str(m), "--dir", str(work)])
            restarts, cursors = [], []
            for i in range(max(1, args.restart_repeats)):
                say(f"ssd index: warm restart {i + 1}/{max(1, args.restart_repeats)}")
                restarts.append(child(["--part", "restart", "--blocks", str(m),
                                       "--dir", str(work)]))
                if args.restart_by_cursors:
                    cursors.append(child(["--part", "restart", "--blocks", str(m),
                                          "--dir", str(work), "--by-cursors"]))
            restart = restarts[0]
            for key, value in restart.items():
                if isinstance(value, float):
                    restart[key] = statistics.median(r[key] for r in restarts)
            if len(restarts) > 1:
                restart["restart_cpu_us_per_block_runs"] = [
                    round(r["restart_cpu_us_per_block"], 2) for r in restarts]
            if cursors:
                by_cursors = statistics.median(r["restart_cpu_s"] for r in cursors)
                restart["restart_by_cursors_cpu_s"] = by_cursors
                restart["restart_by_cursors_cpu_s_runs"] = [
                    round(r["restart_cpu_s"], 2) for r in cursors]
                restart["restart_cpu_in_place_vs_cursors"] = restart["restart_cpu_s"] / by_cursors
            figures.update(restart_figures_of(restart, m, written))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(figures))
    else:
        report(figures)
        sys.stdout.flush()


def restart_figures_of(result: dict[str, Any], m: int, written: dict[str, Any]) -> dict[str, Any]:
    return {"restart_blocks": m, "ssd_index_write_s": written["write_s"], **result}


if __name__ == "__main__":
    main()
