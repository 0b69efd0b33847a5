"""How long a reserve that must evict holds the daemon's loop, per victim, in-process.

    python benchmarks/evict_hold.py [--blocks 64k] [--sizes 64,1024,4096]
                                    [--policies auto,lru] [--setups dram,clean,dirty]
                                    [--events both] [--repeat 15] [--profile SETUP]

A ``BlockStore`` of ``--blocks`` DRAM slots is filled with 64-block chains, then each
timed round reserves and commits a new chain of N blocks, which evicts N cold ones.
The figures are the thread's CPU time (``time.thread_time``: other processes on the
machine do not lengthen it), medians of ``--repeat`` rounds: the whole round
(``total``), each loop turn the daemon would run it in (``reserve``: the reserve that
gets its slots; ``commit``; ``plan`` and ``written``, see ``dirty`` below), and the
round less its commit divided by N: microseconds per victim (``evict_us/victim``: what
making room costs, the new slots' taking included).  Setups:

- ``dram``: no tier below; each victim is a cold leaf that leaves the cache.
- ``clean``: an SSD tier under DRAM holds a copy of every block (written through, or
  written back ahead of need as the daemon does): each victim's DRAM copy just goes.
- ``dirty``: an SSD tier, no copies yet: the reserve returns a plan to demote the N
  victims; the round times the plan, the SSD slots taken for the write, the write's
  end (``finish_write``: the DRAM copies go) and the reserve again and commit, as the
  daemon does them in separate loop turns (``plan``: the reserve refused with a plan
  and the SSD slots taken; ``written``: the write's end).

With events on, a ``TierChanges`` records every change, and the round includes its
drain (once per loop turn in the daemon).  As in the daemon, ``auto``'s sampled
references past a request's share wait for the turns after it
(``kvstore.scheduler.duel_samples``): ``later`` is their work in all, ``slice`` the
longest turn of it (``--samples-now``: each taken in its request, as before).  ``--profile SETUP`` runs cProfile over the
rounds of the first policy and size instead and prints the top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from collections.abc import Callable, Iterator

from kvstore.identity import Identity
from kvstore.plans import Plan
from kvstore.store import Block, BlockStore, Namespace, Reservation
from kvstore.tier_changes import TierChanges

CHAIN = 64
SLOT = 4096


def count(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1000, "m": 1000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def _keys() -> Iterator[list[bytes]]:
    i = 0
    while True:
        yield [(i * 100_000 + j).to_bytes(16, "little") for j in range(CHAIN)]
        i += 1


class Bench:
    """A full store, and one timed round after another."""

    def __init__(self, blocks: int, policy: str, setup: str, events: bool,
                 samples_later: bool = True) -> None:
        self.setup = setup
        ssd = blocks * SLOT * 4 if setup != "dram" else 0
        self.store = BlockStore(blocks * SLOT, 1 << 20, eviction_policy=policy,
                                ssd_capacity=ssd, ssd_slab_bytes=1 << 20,
                                samples_later=samples_later)
        self.changes = TierChanges() if events else None
        if self.changes is not None:
            self.store.record_changes(self.changes)
        ident = Identity(model="evict", model_revision="r", tenant="t", kv_dtype="float16",
                         num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=64)
        assert ident.block_bytes == SLOT, ident.block_bytes
        self.ns: Namespace = self.store.open_namespace(ident)
        self.keys = (k for chain in _keys() for k in chain)
        self.marks: dict[str, float] = {}
        for _ in range(blocks // CHAIN):
            self._write_through(self._round(CHAIN))

    def _take(self, n: int) -> list[bytes]:
        return [next(self.keys) for _ in range(n)]

    def _round(self, n: int) -> list[Block]:
        """Reserve and commit ``n`` new blocks (and settle what that asks for): the
        blocks committed.  Marks the thread's CPU clock at each loop turn's end
        (``marks``: the plan, the write's end, the reserve, the commit)."""
        store, ns = self.store, self.ns
        keys = self._take(n)
        marks = self.marks = {"start": time.thread_time()}
        r = store.reserve("w", ns, keys, None, 0.0)
        if isinstance(r, Plan):
            assert r.demote and not r.to_remote, r
            t, _ = store.ssd_copies.reserve(list(r.demote))
            marks["plan"] = time.thread_time()
            store.ssd_copies.finish_write(t, [None] * len(t.blocks))
            marks["written"] = time.thread_time()
            r = store.reserve("w", ns, keys, None, 0.0)
        marks["reserved"] = time.thread_time()
        self._next_request()
        assert isinstance(r, Reservation), r
        fresh = store.commit("w", r.id, 0.0).blocks
        if self.changes is not None:
            self.changes.drain()
        marks["committed"] = time.thread_time()
        self._next_request()
        # the sampled references left over, a slice a turn, as the daemon takes them
        marks["later"] = marks["slice"] = 0.0
        backlogs = store.backlogs
        while backlogs is not None and backlogs.waiting:
            started = time.thread_time()
            backlogs.catch_up()
            took = time.thread_time() - started
            marks["later"] += took
            marks["slice"] = max(marks["slice"], took)
        return fresh

    def _next_request(self) -> None:
        if self.store.backlogs is not None:
            self.store.backlogs.next_request()

    def _write_through(self, fresh: list[Block]) -> None:
        """A copy below for every block (the ``clean`` setup), outside the timing."""
        if self.setup == "clean":
            t, _ = self.store.ssd_copies.reserve(fresh)
            self.store.ssd_copies.finish_write(t, [None] * len(t.blocks))
            if self.changes is not None:
                self.changes.drain()

    def timed(self, n: int) -> dict[str, float]:
        """One round of ``n`` blocks: the CPU seconds of each loop turn of it."""
        fresh = self._round(n)
        self._write_through(fresh)
        m = self.marks
        turns = {"total": m["committed"] - m["start"],
                 "reserve": m["reserved"] - m.get("written", m["start"]),
                 "commit": m["committed"] - m["reserved"],
                 "later": m["later"], "slice": m["slice"],
                 "plan": m["plan"] - m["start"] if "plan" in m else 0.0,
                 "written": m["written"] - m["plan"] if "plan" in m else 0.0}
        turns["evict"] = turns["total"] - turns["commit"]  # what making room cost
        return turns


def measure(blocks: int, policy: str, setup: str, events: bool, sizes: list[int],
            repeat: int, samples_later: bool = True) -> dict[int, dict[str, float]]:
    """Median CPU seconds of each turn of a round, per size."""
    bench = Bench(blocks, policy, setup, events, samples_later)
    out: dict[int, dict[str, float]] = {}
    gc.collect()
    gc.disable()
    try:
        for n in sizes:
            rounds = [bench.timed(n) for _ in range(repeat)]
            out[n] = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
        bench.store.check_invariants()
    finally:
        gc.enable()
    return out


def profile(blocks: int, policy: str, setup: str, events: bool, n: int, repeat: int) -> None:
    bench = Bench(blocks, policy, setup, events)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeat):
        bench.timed(n)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--blocks", default="64k")
    parser.add_argument("--sizes", default="64,1024,4096")
    parser.add_argument("--policies", default="auto,lru")
    parser.add_argument("--setups", default="dram,clean,dirty")
    parser.add_argument("--events", default="both", choices=("off", "on", "both"))
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--profile", default="", help="a setup to profile instead")
    parser.add_argument("--samples-now", action="store_true",
                        help="auto's sampled references all taken in their request")
    args = parser.parse_args()
    blocks = count(args.blocks)
    sizes = [count(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    events = {"off": [False], "on": [True], "both": [False, True]}[args.events]
    if args.profile:
        profile(blocks, policies[0], args.profile, events[-1], sizes[-1], args.repeat)
        return
    print(f"{'policy':6} {'setup':6} {'events':6} {'N':>5} {'total_ms':>8} {'reserve':>8} "
          f"{'commit':>8} {'plan':>8} {'written':>8} {'evict_us/victim':>15} "
          f"{'later':>8} {'slice':>8}")
    for policy in policies:
        for setup in args.setups.split(","):
            for ev in events:
                figures = measure(blocks, policy, setup, ev, sizes, args.repeat,
                                  not args.samples_now)
                for n, f in figures.items():
                    print(f"{policy:6} {setup:6} {'on' if ev else 'off':6} {n:5d} "
                          f"{f['total'] * 1e3:8.2f} {f['reserve'] * 1e3:8.2f} "
                          f"{f['commit'] * 1e3:8.2f} {f['plan'] * 1e3:8.2f} "
                          f"{f['written'] * 1e3:8.2f} {f['evict'] / n * 1e6:15.2f} "
                          f"{f['later'] * 1e3:8.2f} {f['slice'] * 1e3:8.2f}",
                          flush=True)


if __name__ == "__main__":
    main()
