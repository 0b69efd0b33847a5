"""The longest single insert into each per-block container of the index, at its growth point.

A dict (and an OrderedDict) rebuilds its whole table when it passes two thirds full, in
one insert, on the event loop.  This times the inserts around that point for the
containers the index keeps one entry per block in: the key map as a plain dict and as
``kvstore.block_map.BlockMap``, and the eviction order's containers (an OrderedDict of
entries, a dict keyed by int hashes) beside what replaced them (the order in the
entries' own links, ``kvstore.scheduler.linked.LinkedOrder``; the int-keyed dict split
as it grows, ``kvstore.scheduler.sharded.ShardedDict``).  Each kind is built in a fresh process, in turn,
``--repeats`` times; medians are printed side by side.

    python benchmarks/dict_growth.py --entries 5.6M --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from typing import Any

KINDS = ("dict", "blockmap", "ordereddict", "linkedorder", "intdict", "shardeddict")


class Entry:
    __slots__ = ("key", "o_order", "o_older", "o_newer")

    def __init__(self) -> None:
        self.o_order = self.o_older = self.o_newer = None


def growth_point(entries: int) -> int:
    """The size at which the next insert grows a dict of about ``entries``."""
    slots = 8
    while slots * 2 // 3 < entries:
        slots *= 2
    return slots * 2 // 3


def longest_insert(kind: str, n: int) -> float:
    from kvstore.block_map import BlockMap
    from kvstore.scheduler.linked import LinkedOrder
    from kvstore.scheduler.sharded import ShardedDict

    gc.disable()
    keys = [os.urandom(16) for _ in range(n + 64)]
    made: list[Any]
    if kind in ("ordereddict", "linkedorder"):
        made = [Entry() for _ in keys]
        container: Any = OrderedDict() if kind == "ordereddict" else LinkedOrder("o")
    elif kind in ("intdict", "shardeddict"):
        made = [hash(k) for k in keys]
        container = {} if kind == "intdict" else ShardedDict()
    else:
        made = keys
        container = BlockMap() if kind == "blockmap" else {}
    for item in made[:n - 32]:
        container[item] = None
    worst = 0.0
    for item in made[n - 32:]:
        start = time.perf_counter()
        container[item] = None
        worst = max(worst, time.perf_counter() - start)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", default="5.6M", help="about how many entries (e.g. 700k)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    text = args.entries.lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    n = growth_point(int(float(text.rstrip("km")) * scale))
    if args.one:
        print(longest_insert(args.one, n))
        return
    runs: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.repeats):
        for kind in KINDS:
            out = subprocess.run([sys.executable, __file__, "--entries", str(n), "--one", kind],
                                 capture_output=True, text=True, check=True)
            runs[kind].append(float(out.stdout))
    print(f"longest insert around {n:,} entries (median of {args.repeats}):")
    base = statistics.median(runs["dict"])
    for kind, times in runs.items():
        ms = statistics.median(times) * 1e3
        print(f"  {kind:12} {ms:10.1f} ms   {ms / (base * 1e3):6.3f} of a plain dict")


if __name__ == "__main__":
    main()
