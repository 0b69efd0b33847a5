"""How well ``auto``'s miniatures stand for the orders they judge.

    python benchmarks/miniature_fidelity.py [--trace PATH ...] [--workloads conversations,scan]
        [--requests 4000] [--capacities 0.05,0.1] [--at 0.33]

An election is only as good as the miniatures' ranking, and a hand-over to hit density
only as warm as the densities its miniature learned.  Both are judged here against the
real cache, apart from when elections come (``policy_sweep.py``) and what a hand-over
passes on (``handover_warmth.py``):

- ``ranking``: ``auto`` held on LRU for a whole replay (no election, no reality
  check), each candidate's miniature hits summed over the replay, over LRU's
  miniature's (``mini``); beside it each candidate alone's block hits over LRU
  alone's (``real``).  A miniature that reads a candidate's gain too low keeps it out
  of charge where it pays; one that reads it too high elects it where it loses.
- ``densities``: at ``--at`` of the replay, hit density's learned densities per class
  of hits at a few ages (multiples of the cache's size in references): those its
  miniature would hand over (``adopt_tuning``, ages scaled by the sample) and those
  of ``density`` alone at the same point.  Only their ratios across classes decide a
  victim.

Deterministic: hit counts and learned tables, not timings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.bench.replay import (
    PolicyCache,
    TraceRequest,
    cacheable,
    load_trace,
    replay,
    unique_blocks,
)
from kvstore.scheduler.density import HitDensityPolicy, age_bucket
from kvstore.scheduler.eviction import POLICIES, AutoPolicy

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # after the path: benchmarks/ is no package

# the ages the densities are shown at, as multiples of the cache's size in references
AGES = (0.1, 0.5, 1.0, 2.0, 4.0)


def held_duel() -> AutoPolicy[Any]:
    """``auto`` that keeps LRU in charge: no margin is ever met, no reality check."""
    duel: AutoPolicy[Any] = AutoPolicy()
    duel.margin = float("inf")
    duel.reality.z = None
    return duel


def miniature_hits(trace: Sequence[TraceRequest], capacity: int) -> dict[str, int]:
    """Each candidate's miniature hits over the whole replay, ``auto`` held on LRU
    (the real cache is LRU's: every miniature sees the same references)."""
    duel = held_duel()
    totals = [0] * len(duel._minis)
    elect = duel._elect

    def counted(*then: Any) -> None:  # an election folds the epoch's hits into scores
        for at, mini in enumerate(duel._minis):
            totals[at] += mini.hits
        elect(*then)

    setattr(duel, "_elect", counted)
    replay(trace, PolicyCache(duel, capacity))
    return {mini.order.name: total + mini.hits
            for mini, total in zip(duel._minis, totals)}


def ranking_rows(label: str, trace: Sequence[TraceRequest], capacity: int,
                 share: float) -> list[str]:
    """Per candidate, its miniature's hits over LRU's beside its real hits over LRU's."""
    minis = miniature_hits(trace, capacity)
    real = {name: replay(trace, PolicyCache(POLICIES[name](), capacity)).hit_blocks
            for name in minis}
    rows = []
    for name in minis:
        mini = minis[name] / minis["lru"] if minis["lru"] else 1.0
        alone = real[name] / real["lru"] if real["lru"] else 1.0
        rows.append(f"{label:<24} {share:>4.0%} {name:<8} {minis[name]:>8} {mini:>7.4f} "
                    f"{real[name]:>9} {alone:>7.4f}")
    return rows


def handed_densities(trace: Sequence[TraceRequest], capacity: int,
                     cut: int) -> tuple[list[list[float]] | None, list[list[float]] | None]:
    """After ``cut`` requests, the densities a hand-over from ``auto`` held on LRU would
    give hit density (its miniature's tables, ages scaled by the sample), and those of
    ``density`` alone (None: nothing learned yet)."""
    duel = held_duel()
    replay(trace[:cut], PolicyCache(duel, capacity))
    learned = next(mini.order for mini in duel._minis if mini.order.name == "density")
    handed: HitDensityPolicy[Any] = HitDensityPolicy()
    handed.adopt_tuning(learned, duel._size / max(1, duel._size >> duel.sample_shift))
    alone = HitDensityPolicy()
    replay(trace[:cut], PolicyCache(alone, capacity))
    return handed._density, alone._density


def density_rows(label: str, trace: Sequence[TraceRequest], capacity: int, share: float,
                 at: float) -> list[str]:
    """Per class, the handed and the real densities at ``AGES`` (per million refs)."""
    handed, alone = handed_densities(trace, capacity, int(len(trace) * at))
    buckets = [age_bucket(max(1, int(capacity * age))) for age in AGES]
    rows = []
    for who, tables in (("miniature", handed), ("alone", alone)):
        if tables is None:
            rows.append(f"{label:<24} {share:>4.0%} {who:<9} nothing learned yet")
            continue
        for klass, table in enumerate(tables):
            shown = " ".join(f"{table[b] * 1e6:>8.2f}" for b in buckets)
            rows.append(f"{label:<24} {share:>4.0%} {who:<9} {klass:>5} {shown}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", type=Path, action="append", default=[],
                        help="a JSON-lines trace to replay as it is (repeatable)")
    parser.add_argument("--workloads", default="conversations,scan,documents",
                        help="comma-separated generators of benchmarks/workloads.py "
                             "('' for traces only)")
    parser.add_argument("--requests", type=int, default=4000,
                        help="requests per generated workload")
    parser.add_argument("--capacities", default="0.05,0.1")
    parser.add_argument("--at", type=float, default=1 / 3,
                        help="the share of the requests replayed before the densities "
                             "are compared")
    args = parser.parse_args(argv)
    shares = [float(c) for c in args.capacities.split(",") if c]
    workloads = [w for w in args.workloads.split(",") if w]
    if [w for w in workloads if w not in WORKLOADS]:
        parser.error(f"workloads are {sorted(WORKLOADS)}")
    if not 0.0 < args.at < 1.0:
        parser.error("--at must be between 0 and 1")
    missing = [str(t) for t in args.trace if not t.is_file()]
    if missing:
        parser.error(f"no trace at {', '.join(missing)}")
    traces = [(path.stem, cacheable(load_trace(path))) for path in args.trace]
    traces += [(w, cacheable(TraceRequest(*r) for r in WORKLOADS[w](args.requests)))
               for w in workloads]
    print("ranking: each candidate's miniature hits over LRU's miniature's (auto held on "
          "LRU), and its hits alone over LRU alone's")
    print(f"{'workload':<24} {'cap':>4} {'order':<8} {'mini':>8} {'/lru':>7} "
          f"{'real':>9} {'/lru':>7}")
    for label, trace in traces:
        unique = unique_blocks(trace)
        for share in shares:
            for row in ranking_rows(label, trace, max(1, round(share * unique)), share):
                print(row, flush=True)
    ages = " ".join(f"{f'{age:g}x':>8}" for age in AGES)
    print(f"\ndensities at {args.at:.0%} of each replay, hits per million references of "
          "room, per class of hits, at ages in multiples of the cache's size:")
    print(f"{'workload':<24} {'cap':>4} {'from':<9} {'class':>5} {ages}")
    for label, trace in traces:
        unique = unique_blocks(trace)
        for share in shares:
            capacity = max(1, round(share * unique))
            for row in density_rows(label, trace, capacity, share, args.at):
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
