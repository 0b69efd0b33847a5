"""What each eviction policy costs per request, side by side, in-process.

    python benchmarks/eviction_cost.py [--trace PATH | --workload NAME] [--capacity 0.1]
                                       [--policies lru,slru,arc,s3fifo,density,auto]
                                       [--repeat 5]

Replays the trace through the simulator of benchmarks/replay_sim.py (the policy called
as the store calls it, each hit reported twice as the daemon's lookup and acquire do)
``--repeat`` times per policy, the policies taking turns so that a busy machine slows
them alike, and prints the median microseconds per request and its ratio to the first
policy's.  The daemon's own work per request (sockets, framing, the store's
bookkeeping) comes on top: compare the difference with the replay's requests per
second through the daemon (benchmarks/replay.py --mode daemon).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvstore.scheduler.eviction import POLICIES

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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
