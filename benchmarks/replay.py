"""Replay a serving trace with prefix-block ids against the eviction policies.

    python benchmarks/replay.py [--trace PATH] [--capacities 0.02,0.05] [--policies lru,s3fifo]
    python benchmarks/replay.py --workload all [--touches 2]
    python benchmarks/replay.py --mode daemon [--requests 1000] [--ssd [SHARE]]

``--trace`` may be given more than once (any JSON-lines trace of the shared format);
``--workload`` replays a synthetic workload of benchmarks/workloads.py instead
(``conversations``, ``agents``, ``tenants``, ``scan``, ``documents``, ``bursty_chat``,
``coding_agents``, ``rag_drift``, ``tenant_mix``, ``diurnal``), or ``all``: the
traces, then each of them, so that a policy tuned to one trace is seen on workloads of
other shapes.  The run ends with one summary table of every workload, capacity and
policy (block and token hit rates, ratios to LRU and to Belady); ``--detail`` prints
each workload's full table (bounds, evictions, the daemon's counters) before it, and
``--plot FILE.png`` draws the summary (matplotlib: the ``plot`` extra).

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

``--mode sim`` drives the simulators of benchmarks/replay_sim.py; ``replay`` drives any
object with ``lookup`` and ``insert`` (and reports its ``evictions`` if it has them).
``--touches 2`` makes the simulator report each hit twice, as the daemon does (lookup,
then acquire); a policy that counts hits must give the same rows.

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

The simulator calls a policy as the store does: a put reserves (evicts) room for all
its blocks before it commits any, deepest first, and a block cached again after its
eviction is the same item to the policy (its ghost history knows it).  So the daemon's
rows give the simulator's hits for every policy (``-sim`` in the summary: the daemon's
block hits minus the simulator's, in points).  ``auto``'s miniatures sample names by
their hash: in daemon mode the simulator replays the trace under the daemon's keys,
hashed as the store hashes them (their digest's bytes, the same in every process), so
both sample the same blocks.  Lookup and acquire each report a hit; the policies count
it once (see ``--touches``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from kvstore.bench.replay import (  # the daemon's side of the replay lives in the package
    DAEMON_IDENTITY,
    SLAB_BYTES,
    SLAB_SLOTS,
    SLOT_BYTES,
    DaemonCache,
    KeyChains,
    daemon_capacity,
)
from kvstore.bench.harness import Daemon
from kvstore.client import Client
from kvstore.blocks import key_hash
from kvstore.scheduler.eviction import POLICIES, make_policy

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
# after the path: benchmarks/ is no package
from replay_sim import (
    BLOCK_TOKENS,
    BeladyCache,
    InfiniteCache,
    OracleCache,
    PolicyCache,
    RateOracleCache,
    ReplayStats,
    TraceError,
    TraceRequest,
    cacheable,
    load_trace,
    replay,
    synthetic,
    unique_blocks,
)
from workloads import WORKLOADS

DEFAULT_TRACE = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "traces"
    / "mooncake_synthetic_trace.jsonl"
)
DEFAULT_CAPACITIES = (0.02, 0.05, 0.10, 0.25)


# -- the real daemon ------------------------------------------------------------------------

def sim_capacity(share: float, unique: int) -> int:
    return max(1, round(share * unique))


def replay_daemon_process(workdir: Path, policy: str, dram_blocks: int,
                          ssd_blocks: int = 0) -> Daemon:
    """A daemon for the replay: DRAM (and SSD, 0 for none) of whole slots of the
    replay's block size, in whole slabs, evicting by ``policy``."""
    return Daemon(workdir, dram=str(dram_blocks * SLOT_BYTES), ssd=str(ssd_blocks * SLOT_BYTES),
                  extra=["--slab-size", str(SLAB_BYTES), "--eviction-policy", policy],
                  env={"KVSTORE_SSD_SLAB_SIZE": str(SLAB_BYTES)})  # whole slabs of any SSD capacity


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
        replay_daemon_process(Path(tmp), policy, capacity, ssd_blocks) as daemon,
        Client(daemon.endpoint, tenant=DAEMON_IDENTITY.tenant) as client,
    ):
        ns = client.namespace(DAEMON_IDENTITY)
        dram = client.stats()["tiers"]["dram"]
        assert dram["capacity"] == capacity * SLOT_BYTES, dram
        for request in trace:  # every key made before the clock starts
            chains(ns, request.hash_ids)
        cache = DaemonCache(ns, chains, capacity, hold=hold)
        started, cpu = time.perf_counter(), daemon.cpu_seconds()
        stats = replay(trace, cache)
        stats.seconds = time.perf_counter() - started
        stats.daemon_cpu = daemon.cpu_seconds() - cpu
        tiers: dict[str, dict[str, int]] = client.stats()["tiers"]
    stats.tiers = tiers
    stats.tier_hits = cache.tier_hits
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
            if not daemon:
                cache = PolicyCache(POLICIES[name](), capacity, touches)
                rows.append((share, capacity, name, replay(trace, cache)))
                continue
            started = time.perf_counter()
            stats = replay_daemon(
                trace, name, capacity, chains, ssd_blocks=ssd_blocks, hold=hold
            )
            # the simulator names blocks by the daemon's keys, hashed as the store does:
            # a duel's sample is the daemon's (see the module docstring)
            cache = PolicyCache(make_policy(name, name_hash=key_hash), capacity, touches)
            rows.append((share, capacity, name, replay(chains.keyed(trace), cache)))
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


SUMMARY_BOUNDS = ("belady",)


def format_summary(
    workloads: Sequence[tuple[str, Sequence[tuple[float, int, str, ReplayStats]]]],
) -> str:
    """One table of every workload: per capacity and policy, block and token hit rates,
    the ratio to the simulated LRU's block hits and to Belady's (the offline optimum).

    A daemon row (``<policy>@daemon``) also gives its block hits minus its simulator
    row's, in points (``-sim``; its DRAM hits, with an SSD tier beneath, whose
    promotions then change what DRAM holds): what the daemon does differently;
    the requests it served per second, and the CPU time the daemon spent per request
    (steadier than the rate on a busy machine); with an SSD tier, the share of block
    references hit in DRAM and in SSD.
    """
    width = max([10, *(len(w) for w, _ in workloads)])
    pwidth = max([10, *(len(n) for _, rows in workloads for _, _, n, _ in rows)])
    daemon = any(s.tiers is not None for _, rows in workloads for _, _, _, s in rows)
    ssd = any(s.tiers is not None and "ssd" in s.tiers
              for _, rows in workloads for _, _, _, s in rows)
    header = (
        f"{'workload':<{width}} {'capacity':>14}  {'policy':<{pwidth}} {'block hit':>9} "
        f"{'token hit':>9} {'/lru':>6} {'/belady':>7}"
    )
    if daemon:
        header += f" {'-sim':>7} {'req/s':>7} {'cpu us/req':>10}"
    if ssd:
        header += f" {'dram hit':>8} {'ssd hit':>8}"
    lines = [header]
    for title, rows in workloads:
        by_name = {(share, name): stats for share, _, name, stats in rows}
        for share, capacity, name, stats in rows:
            if name in ("belady-ins", "rate+oracle", "lru+oracle", "infinite"):
                continue
            lru = by_name.get((share, "lru"))
            best = by_name[(share, "belady")]
            to_lru = (f"{stats.hit_blocks / lru.hit_blocks:>6.3f}" if lru and lru.hit_blocks
                      else "")
            to_best = stats.hit_blocks / best.hit_blocks if best.hit_blocks else 0.0
            line = (
                f"{title:<{width}} {share:>5.0%} {capacity:>7}b  {name:<{pwidth}} "
                f"{stats.block_hit_rate:>9.4f} {stats.token_hit_rate:>9.4f} "
                f"{to_lru:>6} {to_best:>7.3f}"
            )
            sim = by_name.get((share, name.removesuffix("@daemon")))
            if daemon and name.endswith("@daemon") and sim is not None:
                rate = stats.requests / stats.seconds if stats.seconds else 0.0
                cpu = 1e6 * stats.daemon_cpu / max(1, stats.requests)
                hit = stats.block_hit_rate
                if stats.tier_hits is not None and "ssd" in (stats.tiers or {}):
                    hit = stats.tier_hits.get("dram", 0) / max(1, stats.blocks)  # DRAM's own
                line += (f" {100 * (hit - sim.block_hit_rate):+7.2f}"
                         f" {rate:>7.0f} {cpu:>10.0f}")
                if ssd and stats.tier_hits is not None and stats.blocks:
                    line += "".join(f" {stats.tier_hits.get(t, 0) / stats.blocks:>8.4f}"
                                    for t in ("dram", "ssd"))
            lines.append(line)
    return "\n".join(lines)


def plot_summary(
    workloads: Sequence[tuple[str, Sequence[tuple[float, int, str, ReplayStats]]]],
    path: Path,
) -> None:
    """The summary as a PNG: one panel per workload, block hit rate by capacity, one
    line per policy and for Belady."""
    import matplotlib  # only when plotting: an optional extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(workloads)
    columns = min(3, count)
    rows_n = -(-count // columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(5 * columns, 3.6 * rows_n),
                             squeeze=False)
    for ax, (title, rows) in zip(axes.flat, workloads):
        lines: dict[str, tuple[list[float], list[float]]] = {}
        for share, _, name, stats in rows:
            if name in ("belady-ins", "rate+oracle", "lru+oracle", "infinite"):
                continue
            xs, ys = lines.setdefault(name, ([], []))
            xs.append(share * 100)
            ys.append(stats.block_hit_rate)
        for name, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", linestyle="--" if name == "belady" else "-",
                    label=name)
        ax.set_title(title)
        ax.set_xscale("log")
        ax.minorticks_off()  # the log axis's own minor labels crowd the shares out
        ax.set_xticks([2, 5, 10, 25], ["2%", "5%", "10%", "25%"])
        ax.set_xlabel("capacity (share of unique blocks)")
        ax.set_ylabel("block hit rate")
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--trace",
        type=Path,
        action="append",
        default=None,
        help="JSON-lines trace (repeatable; the shared Mooncake trace if none)",
    )
    parser.add_argument(
        "--block-tokens", type=int, default=None, metavar="N",
        help="the traces' tokens per block (default: 512, or the size their lengths and "
             "ids fit)",
    )
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
        help="the --trace files, a synthetic workload of benchmarks/workloads.py, or all",
    )
    parser.add_argument(
        "--detail",
        action="store_true",
        help="print each workload's full table (bounds, evictions) before the summary",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png",
        help="also draw the summary as a PNG (needs matplotlib: the 'plot' extra)",
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
    traces: list[Path] = args.trace or [DEFAULT_TRACE]
    missing = [str(t) for t in traces if not t.is_file()]
    if args.workload in ("trace", "all") and missing:
        parser.error(f"no trace at {', '.join(missing)}; pass --trace")
    if args.touches < 1:
        parser.error("--touches must be at least 1")
    if args.block_tokens is not None and args.block_tokens < 1:
        parser.error("--block-tokens must be at least 1")
    daemon = args.mode == "daemon"
    if daemon and args.partial_blocks:
        parser.error("--partial-blocks is sim mode only: the daemon keys full blocks only")
    if not daemon and (args.ssd or not args.hold):
        parser.error("--ssd and --no-hold are daemon mode only")
    if daemon and args.touches != 1:
        parser.error("--touches is sim mode only: the daemon reports hits as it does")

    started = time.perf_counter()
    workloads: list[tuple[str, str, list[TraceRequest]]] = []  # label, title, requests
    if args.workload in ("trace", "all"):
        for path in traces:
            try:
                loaded = load_trace(path, args.block_tokens)
            except TraceError as exc:
                parser.error(str(exc))
            loaded = loaded[: args.requests] if args.requests > 0 else loaded
            workloads.append((path.stem, path.name, loaded))
    if args.workload != "trace":
        names = list(WORKLOADS) if args.workload == "all" else [args.workload]
        workloads += [(name, f"synthetic workload {name!r}", synthetic(name, args.requests))
                      for name in names]
    summary: list[tuple[str, list[tuple[float, int, str, ReplayStats]]]] = []
    for label, title, trace in workloads:
        trace = cacheable(trace, args.partial_blocks)
        references = sum(len(r.hash_ids) for r in trace)
        what = "blocks (partial last blocks too)" if args.partial_blocks else "full blocks"
        print(
            f"{title}: {len(trace)} requests, {references} block references, "
            f"{unique_blocks(trace)} unique {what} of "
            f"{trace[0].block_tokens if trace else BLOCK_TOKENS} tokens",
            flush=True,
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
        if args.detail:
            print(format_table(rows))
            print()
        summary.append((label, rows))
    print()
    print(format_summary(summary))
    if args.plot is not None:
        plot_summary(summary, args.plot)
        print(f"plot written to {args.plot}")
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
