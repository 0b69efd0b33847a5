"""How warm a hand-over is: ``auto`` held on one order, then made to hand it over.

    python benchmarks/handover_warmth.py [--trace PATH ...] [--workloads conversations,scan]
        [--requests 4000] [--capacities 0.05,0.1] [--at 0.33] [--from lru]
        [--to slru,arc,density]

An election's worth is the new order's gain over LRU, less what the hand-over costs:
the new order starts from the cache LRU filled, with only what the duel passes it (the
items in LRU's order, those hit since they entered hit again, its miniature's settings,
the latest victims' names).  ``policy_sweep.py`` sees only the sum, over elections that
come when they come.  This isolates the cost: per replay and capacity, ``auto`` is held
on the candidate ``--from`` (LRU unless told; no election, no reality check) for the
first ``--at`` of the requests, then hands over to each candidate named and keeps it to
the end; the hits after that point are set beside those of the candidate alone and of
LRU alone over the same requests.  What an order passes on depends on the order: SLRU
lists its probation before its protected segment, LRU by recency alone.

``warmth`` is the handed-over order's gain over LRU after the hand-over, as a share of
the candidate alone's gain there (1: as if it had been in charge all along; 0: no
better than staying LRU; below 0: worse).  Deterministic: hit counts, not timings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial
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
from kvstore.scheduler.eviction import POLICIES, AutoPolicy, EvictionPolicy

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # after the path: benchmarks/ is no package


def hits_after(trace: Sequence[TraceRequest], capacity: int, cut: int,
               make: Callable[[], EvictionPolicy[Any]],
               then: Callable[[EvictionPolicy[Any]], None] | None = None) -> tuple[int, int]:
    """The block hits of ``make()``'s policy before and after request ``cut``
    (``then`` called on the policy between the two)."""
    policy = make()
    cache = PolicyCache(policy, capacity)
    before = replay(trace[:cut], cache).hit_blocks
    if then is not None:
        then(policy)
    return before, replay(trace[cut:], cache).hit_blocks


def held_auto(on: str = "lru") -> AutoPolicy[Any]:
    """``auto`` that keeps its candidate ``on`` in charge: no margin is ever met, no
    reality check."""
    duel: AutoPolicy[Any] = AutoPolicy()
    duel.margin = float("inf")
    duel.reality.z = None
    if on != duel.leader:
        hand_over(on)(duel)  # before any item: a plain switch
    return duel


def hand_over(to: str) -> Callable[[EvictionPolicy[Any]], None]:
    """Make a held ``auto`` hand the order to its candidate named ``to``."""
    def handed(policy: EvictionPolicy[Any]) -> None:
        assert isinstance(policy, AutoPolicy)
        names = [mini.order.name for mini in policy._minis]
        policy._take_over(names.index(to))
        assert policy.leader == to, f"{to} should be in charge, not {policy.leader}"
    return handed


def warmth_rows(label: str, trace: Sequence[TraceRequest], shares: Sequence[float],
                at: float, candidates: Sequence[str], held: str = "lru") -> list[str]:
    """One line per capacity and candidate (see the module docstring)."""
    unique = unique_blocks(trace)
    cut = int(len(trace) * at)
    rows = []
    for share in shares:
        capacity = max(1, round(share * unique))
        _, lru = hits_after(trace, capacity, cut, POLICIES["lru"])
        for name in candidates:
            _, alone = hits_after(trace, capacity, cut, POLICIES[name])
            _, handed = hits_after(trace, capacity, cut, partial(held_auto, held),
                                   hand_over(name))
            gain = alone - lru
            warmth = f"{(handed - lru) / gain:>7.2f}" if gain else f"{'-':>7}"
            rows.append(f"{label:<24} {share:>4.0%} {name:<8} {lru:>9} {alone:>9} "
                        f"{handed:>9} {warmth}")
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
                        help="the share of the requests replayed before the hand-over")
    parser.add_argument("--from", dest="held", default="lru",
                        help="the candidate of auto in charge until the hand-over")
    parser.add_argument("--to", default="slru,arc,density",
                        help="comma-separated candidates of auto to hand over to")
    args = parser.parse_args(argv)
    shares = [float(c) for c in args.capacities.split(",") if c]
    workloads = [w for w in args.workloads.split(",") if w]
    names = [mini.order.name for mini in AutoPolicy()._minis]
    candidates = [c for c in args.to.split(",") if c]
    if [c for c in [*candidates, args.held] if c not in names]:
        parser.error(f"--to takes auto's candidates: {names}")
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
    print(f"hits after {args.at:.0%} of each replay: LRU alone, the candidate alone, and "
          f"auto held on {args.held} until then and handed to the candidate")
    print(f"{'workload':<24} {'cap':>4} {'to':<8} {'lru':>9} {'alone':>9} {'handed':>9} "
          f"{'warmth':>7}")
    for label, trace in traces:
        for row in warmth_rows(label, trace, shares, args.at, candidates, args.held):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
