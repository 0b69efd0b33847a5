"""Sweep the eviction policies over the family of each synthetic workload, not one draw.

    python benchmarks/policy_sweep.py [--seeds 3] [--requests 3000] [--trace PATH ...]
        [--workloads conversations,scan] [--policies lru,slru,arc,s3fifo,density,auto]
        [--capacities 0.02,0.05,0.1,0.25] [--subject auto] [--worst 20] [--jobs 1]
        [--trace-requests N] [--variants conversations/flat-docs,scan] [--elections]

A policy chosen on one trace, or one seed of one generator, may lose on its neighbours.
This replays every generator of benchmarks/workloads.py over ``--seeds`` seeds and over
variants of the parameters each documents (session lengths and think times, tenants and
their skew, document popularity, scan share and length, prefix and loop lengths), and
each ``--trace`` as it is (a user's own trace: any JSON-lines trace of the shared
format), at every capacity (a share of the replay's unique blocks), in the simulator
(``benchmarks/replay.py``'s ``PolicyCache``: the store's calls, one touch per hit).

Per cell (workload variant, seed, capacity) it prints the subject policy's block hits
over LRU's (``/lru``) and over the best of the others' (``/best``, and which was best),
then per variant the worst and mean of both, the cells where the subject is behind LRU
and those more than 2% behind the best, and the ``--worst`` worst cells over all.
The k-th seed of a generator is its default seed in ``benchmarks/workloads.py``
(``DEFAULT_SEEDS``) plus 1000 k: the first seed's default variant is the workload
``benchmarks/replay.py --workload`` replays, and every run replays the same requests.

To look into the losing cells without replaying them all: ``--variants`` keeps only
the generated variants named (``workload/variant``, or a whole ``workload``), and
``--elections`` prints, per cell, each hand-over of a duelling subject (``auto``): when
(its tick, inserts and evictions so far), from which order to which, why (an election,
or the reality check: the real cache behind LRU's miniature), the real cache's sampled
references ahead of and behind LRU's miniature since the last hand-over, and the
miniatures' scores then.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
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
from kvstore.scheduler.dueling import Duel
from kvstore.scheduler.eviction import POLICIES

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS  # after the path: benchmarks/ is no package

# Per generator, its default and variants of its documented parameters, each a step
# to one side of the default on one axis (or two that go together).
VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "conversations": [
        ("default", {}),
        ("short-think", {"think_ms": 5_000}),
        ("long-think", {"think_ms": 60_000, "think_sigma": 1.0}),
        ("long-sessions", {"follow": 0.95}),
        ("short-sessions", {"follow": 0.5}),
        ("busy", {"every_ms": 100}),
        ("flat-docs", {"document_skew": 0.6, "prompt_skew": 0.8}),
    ],
    "agents": [
        ("default", {}),
        ("long-loops", {"steps_shape": 0.9}),
        ("short-loops", {"steps_shape": 2.0}),
        ("busy", {"every_ms": 500}),
        ("slow-steps", {"step_ms": 6_000}),
        ("short-prefix", {"prefix_blocks": 6}),
    ],
    "tenants": [
        ("default", {}),
        ("few", {"count": 60}),
        ("many-flat", {"count": 2000, "skew": 0.7}),
        ("skewed", {"skew": 1.4}),
        ("long-prompts", {"longest": 48}),
    ],
    "scan": [
        ("default", {}),
        ("heavy-scan", {"scan_share": 0.08}),
        ("light-scan", {"scan_share": 0.01}),
        ("flat-hot", {"hot_skew": 0.5, "hot_chains": 3000}),
        ("skewed-hot", {"hot_skew": 1.1}),
        ("long-scans", {"scan_blocks": 120}),
    ],
    "documents": [
        ("default", {}),
        ("flat", {"skew": 0.6}),
        ("skewed", {"skew": 1.2}),
        ("small-library", {"library": 800}),
        ("long-docs", {"longest": 80}),
    ],
    "bursty_chat": [
        ("default", {}),
        ("poisson", {"burst": 1.0}),
        ("long-chats", {"turns_median": 6.0}),
        ("long-pastes", {"user_tokens": 800}),
        ("short-think", {"think_ms": 8_000}),
    ],
    "coding_agents": [
        ("default", {}),
        ("few-repos", {"repositories": 3}),
        ("wide-branches", {"branch": 0.3, "fan_out": 8}),
        ("churny", {"churn": 0.5}),
        ("big-repos", {"repo_blocks": 160}),
        ("busy", {"every_ms": 2_000}),
    ],
    "rag_drift": [
        ("default", {}),
        ("static", {"trending": 0.0}),
        ("fast-drift", {"trending": 0.1}),
        ("flat", {"skew": 0.7}),
        ("one-doc", {"second": 0.0}),
    ],
    "tenant_mix": [
        ("default", {}),
        ("chat-heavy", {"chat_share": 0.7, "batch_share": 0.1}),
        ("batch-heavy", {"chat_share": 0.2, "batch_share": 0.6}),
        ("many-templates", {"templates": 400, "template_skew": 0.8}),
    ],
    "diurnal": [
        ("default", {}),
        ("two-days", {"days": 2.0}),
        ("flat", {"skew": 0.7, "prefixes": 1000}),
        ("overlapping", {"overlap": 0.5}),
    ],
}

DEFAULT_SEEDS = {"conversations": 1, "scan": 2, "documents": 3, "agents": 4, "tenants": 5,
                 "bursty_chat": 6, "coding_agents": 7, "rag_drift": 8, "tenant_mix": 9,
                 "diurnal": 10}


@dataclass
class Cell:
    """One replay setting's block hits per policy."""

    workload: str  # generator/variant, or the trace's name
    seed: int  # -1 for a trace
    share: float
    capacity: int
    hits: dict[str, int]
    leader: str = ""  # the subject's order in charge at the end, if it duels
    handovers: list[str] = field(default_factory=list)  # the subject's (``--elections``)


def _trace_of(workload: str, variant: dict[str, Any], seed: int,
              requests: int) -> list[TraceRequest]:
    made = WORKLOADS[workload](requests, seed, **variant)
    return cacheable(TraceRequest(*request) for request in made)


def _log_handovers(duel: Duel[Any], log: list[str]) -> None:
    """Note each hand-over of ``duel`` in ``log`` as it happens (see the module's
    docstring).  The reality check hands over to the first candidate while the real
    cache lags its miniature; an election to it then is the same decision."""
    take_over = duel._take_over
    names = [mini.order.name for mini in duel._minis]

    def logged(best: int) -> None:
        reality = duel.reality
        why = "reality check" if best == 0 and reality.lags() else "election"
        scores = " ".join(f"{name}={mini.score:.1f}"
                          for name, mini in zip(names, duel._minis))
        log.append(f"tick {duel._tick}: {duel.leader} -> {names[best]} ({why}; "
                   f"vs lru's miniature +{reality.ahead}/-{reality.behind}; {scores})")
        take_over(best)

    setattr(duel, "_take_over", logged)


def replay_cells(label: str, seed: int, trace: Sequence[TraceRequest],
                 shares: Sequence[float], policies: Sequence[str],
                 elections: str = "") -> list[Cell]:
    """Every policy at every capacity over one trace; the hand-overs of the policy
    named ``elections``, if it duels."""
    unique = unique_blocks(trace)
    cells = []
    for share in shares:
        capacity = max(1, round(share * unique))
        hits: dict[str, int] = {}
        leader = ""
        log: list[str] = []
        for name in policies:
            policy = POLICIES[name]()
            if name == elections and isinstance(policy, Duel):
                _log_handovers(policy, log)
            hits[name] = replay(trace, PolicyCache(policy, capacity)).hit_blocks
            if name == "auto":
                leader = str(getattr(policy, "leader", ""))
        cells.append(Cell(label, seed, share, capacity, hits, leader, log))
    return cells


def _job(job: tuple[str, str, int, int, Sequence[float], Sequence[str], str]) -> list[Cell]:
    workload, variant, seed, requests, shares, policies, elections = job
    kwargs = dict(VARIANTS[workload])[variant]
    trace = _trace_of(workload, kwargs, seed, requests)
    return replay_cells(f"{workload}/{variant}", seed, trace, shares, policies, elections)


def _trace_job(job: tuple[Path, int, Sequence[float], Sequence[str], str]) -> list[Cell]:
    path, requests, shares, policies, elections = job
    trace = cacheable(load_trace(path))
    return replay_cells(path.stem, -1, trace[:requests] if requests else trace, shares,
                        policies, elections)


def ratios(cell: Cell, subject: str) -> tuple[float, float, str]:
    """The subject's hits over LRU's and over the best other policy's, and that one."""
    mine = cell.hits[subject]
    lru = cell.hits["lru"]
    others = {n: h for n, h in cell.hits.items() if n != subject}
    best = max(others, key=lambda n: others[n]) if others else subject
    top = others.get(best, mine)
    return (mine / lru if lru else 1.0), (mine / top if top else 1.0), best


def format_report(cells: Sequence[Cell], subject: str, worst: int) -> str:
    """Per cell, per variant, then the worst cells, as fixed-width text."""
    width = max([12, *(len(c.workload) for c in cells)])
    lines = [f"{'workload':<{width}} {'seed':>5} {'cap':>4} {subject + ' hits':>10} "
             f"{'/lru':>6} {'/best':>6} {'best':<8} {'leader':<8}"]
    rows = []
    for c in cells:
        to_lru, to_best, best = ratios(c, subject)
        rows.append((c, to_lru, to_best, best))
        lines.append(f"{c.workload:<{width}} {c.seed:>5} {c.share:>4.0%} "
                     f"{c.hits[subject]:>10} {to_lru:>6.3f} {to_best:>6.3f} {best:<8} "
                     f"{c.leader:<8}")
    lines += ["", f"{'variant':<{width}} {'cells':>5} {'min/lru':>7} {'mean/lru':>8} "
              f"{'min/best':>8} {'mean/best':>9} {'<lru':>4} {'<.98best':>8}"]
    groups: dict[str, list[tuple[Cell, float, float, str]]] = {}
    for row in rows:
        groups.setdefault(row[0].workload, []).append(row)
    groups["ALL"] = rows
    for name, group in groups.items():
        lrus = [r[1] for r in group]
        bests = [r[2] for r in group]
        lines.append(
            f"{name:<{width}} {len(group):>5} {min(lrus):>7.3f} "
            f"{statistics.fmean(lrus):>8.3f} {min(bests):>8.3f} "
            f"{statistics.fmean(bests):>9.3f} {sum(x < 1.0 for x in lrus):>4} "
            f"{sum(x < 0.98 for x in bests):>8}")
    lines += ["", f"the {worst} worst cells by /best:"]
    for c, to_lru, to_best, best in sorted(rows, key=lambda r: r[2])[:worst]:
        lines.append(f"  {c.workload:<{width}} seed {c.seed:>4} at {c.share:>4.0%}: "
                     f"/best {to_best:.3f} ({best}), /lru {to_lru:.3f}, leader {c.leader}")
    logged = [row for row in rows if row[0].handovers]
    if logged:
        lines += ["", f"{subject}'s hand-overs:"]
    for c, to_lru, _, _ in logged:
        lines.append(f"  {c.workload} seed {c.seed} at {c.share:.0%} (/lru {to_lru:.3f}):")
        lines += [f"    {line}" for line in c.handovers]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", type=Path, action="append", default=[],
                        help="a JSON-lines trace to replay as it is (repeatable)")
    parser.add_argument("--workloads", default=",".join(VARIANTS),
                        help="comma-separated generators to sweep ('' for traces only)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per variant")
    parser.add_argument("--requests", type=int, default=3000,
                        help="requests per generated workload")
    parser.add_argument("--trace-requests", type=int, default=0, metavar="N",
                        help="replay each trace's first N requests only (0: all)")
    parser.add_argument("--capacities", default="0.02,0.05,0.1,0.25")
    parser.add_argument("--policies", default="lru,slru,arc,s3fifo,density,auto")
    parser.add_argument("--subject", default="auto", help="the policy judged")
    parser.add_argument("--worst", type=int, default=20, help="how many worst cells to list")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--variants", default="",
                        help="comma-separated workload/variant (or workload) to keep")
    parser.add_argument("--elections", action="store_true",
                        help="print each hand-over of a duelling subject, per cell")
    args = parser.parse_args(argv)
    shares = [float(c) for c in args.capacities.split(",") if c]
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or args.subject not in policies:
        parser.error(f"policies must be registered ({sorted(POLICIES)}) and include "
                     f"--subject {args.subject!r}")
    if "lru" not in policies:
        parser.error("--policies must include lru: every cell is judged against it")
    if not workloads and not args.trace:
        parser.error("nothing to sweep: give --workloads or a --trace")
    if [w for w in workloads if w not in VARIANTS]:
        parser.error(f"workloads are {sorted(VARIANTS)}")
    missing = [str(t) for t in args.trace if not t.is_file()]
    if missing:
        parser.error(f"no trace at {', '.join(missing)}")
    if args.seeds < 1 or args.jobs < 1:
        parser.error("--seeds and --jobs must be at least 1")
    kept = [v for v in args.variants.split(",") if v]
    known = {w for w in VARIANTS} | {f"{w}/{v}" for w in VARIANTS for v, _ in VARIANTS[w]}
    if [v for v in kept if v not in known]:
        parser.error(f"--variants are workloads or workload/variant of {sorted(known)}")
    elections = args.subject if args.elections else ""
    started = time.perf_counter()
    jobs = [(w, variant, DEFAULT_SEEDS[w] + 1000 * k, args.requests, shares, policies,
             elections)
            for w in workloads for variant, _ in VARIANTS[w] for k in range(args.seeds)
            if not kept or w in kept or f"{w}/{variant}" in kept]
    trace_jobs = [(path, args.trace_requests, shares, policies, elections)
                  for path in args.trace]
    cells: list[Cell] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        # every job submitted at once: a long trace replays beside the generated ones,
        # not alone before them (the cells still come in this order)
        pending = [pool.submit(_trace_job, job) for job in trace_jobs]
        pending += [pool.submit(_job, job) for job in jobs]
        for future in pending:
            cells += future.result()
    print(format_report(cells, args.subject, args.worst))
    print(f"({len(cells)} cells, {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
