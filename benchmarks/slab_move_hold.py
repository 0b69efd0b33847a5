"""How long one slab handed to another block size holds the daemon's loop.

    python benchmarks/slab_move_hold.py [--slab 64MiB] [--slabs 16] [--repeats 3]

Fills an arena (anonymous memory, touched first, as the daemon's is) with chains of 64
blocks of one size, warms every other chain by a lookup, then times the one reserve of
another size that takes a slab: the donor's coldest slab's worth of blocks evicted (by
its own order), the chosen slab's survivors copied into the freed slots, the slab
handed over (``kvstore.slab_moves``).  Beside it, the same number of evictions made by
the donor for itself (the part any reserve that evicts a slab's worth would cost) and a
bare memmove of the bytes moved.  Medians of ``--repeats`` fresh stores, CPU time of the
calling thread; per donor block size and eviction policy.  A slab of more blocks than a
step (``kvstore.slab_moves.STEP_BLOCKS`` and ``STEP_BYTES``) is emptied a step a turn of
the loop: the reserve is answered with a plan of a turn and made again (as the daemon
makes it after the turn), and the longest call is what holds the loop.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from collections.abc import Sequence

from kvstore import heap
from kvstore.config import parse_size
from kvstore.identity import Identity
from kvstore.keys import chain_keys
from kvstore.plans import Plan
from kvstore.store import BlockStore


def identity(model: str, block_bytes: int) -> Identity:
    return Identity(model=model, model_revision="r", tenant="bench", kv_dtype="float16",
                    num_layers=2, num_kv_heads=2, head_dim=block_bytes // 256,
                    block_tokens=16)


def one(slab: int, slabs: int, block: int, policy: str, self_evict: bool
        ) -> tuple[float, float, int, int, int]:
    """(CPU seconds of the timed reserve's longest call, of all its calls, its turns,
    blocks moved, blocks evicted).  A reserve answered with a plan of a turn (a slab
    emptied a step a turn) is made again, as the daemon does after the turn."""
    arena = mmap.mmap(-1, slab * slabs)
    arena.write(b"\1" * (slab * slabs))
    store = BlockStore(slab * slabs, slab, eviction_policy=policy)
    store.move_bytes = lambda ns, s, d: arena.move(d, s, ns.block_bytes)
    donor = store.open_namespace(identity("donor", block))
    other = store.open_namespace(identity("other", 4096 if block != 4096 else 8192))
    chains = []
    for i in range(0, slab * slabs // block, 64):
        keys = chain_keys(donor.id, list(range(i * 16, (i + 64) * 16)), 16)
        r = store.reserve("w", donor, keys, None, 0.0)
        store.commit("w", r.id, 0.0)
        chains.append(keys)
    for keys in chains[1::2]:
        store.lookup(donor, keys)
    if self_evict:  # the donor's own reserve of a slab's worth: evictions alone
        ns, count = donor, slab // block
    else:
        ns, count = other, 1
    keys = chain_keys(ns.id, list(range(10**8, 10**8 + 16 * count)), 16)
    heap.settle(full=True)  # as the daemon's heap is kept: no full collection mid-call
    calls: list[float] = []
    while True:
        started = time.thread_time()
        r = store.reserve("w", ns, keys, None, 0.0)
        calls.append(time.thread_time() - started)
        if not isinstance(r, Plan):
            break
        assert r.turn, r
        r.let_go()
    stats = store.stats()
    arena.close()
    return (max(calls), sum(calls), len(calls) - 1, stats["slab_moved_blocks"],
            stats["evictions"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slab", default="64MiB", help="slab size (the daemon's default)")
    parser.add_argument("--slabs", type=int, default=16, help="slabs in the arena")
    parser.add_argument("--blocks", default="16KiB,256KiB,2MiB",
                        help="the donor's block sizes, comma-separated")
    parser.add_argument("--policies", default="lru,auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    slab = parse_size(args.slab, "--slab")
    if args.slabs < 2 or args.repeats < 1:
        parser.error("--slabs at least 2, --repeats at least 1")
    print(f"{'donor block':>11} {'policy':>6} {'longest call ms':>15} {'all calls ms':>12} "
          f"{'turns':>5} {'moved':>6} {'evicted':>7} {'evictions alone ms':>18} "
          f"{'memmove ms':>10}")
    for text in args.blocks.split(","):
        block = parse_size(text, "--blocks")
        for policy in args.policies.split(","):
            runs = [one(slab, args.slabs, block, policy, False) for _ in range(args.repeats)]
            alone = [one(slab, args.slabs, block, policy, True)[1]
                     for _ in range(args.repeats)]
            moved = runs[0][3]
            buf = mmap.mmap(-1, 2 * slab)
            buf.write(b"\1" * (2 * slab))
            started = time.thread_time()
            buf.move(slab, 0, moved * block)
            copy = time.thread_time() - started
            buf.close()
            print(f"{text:>11} {policy:>6} {statistics.median(r[0] for r in runs) * 1e3:15.1f} "
                  f"{statistics.median(r[1] for r in runs) * 1e3:12.1f} {runs[0][2]:5d} "
                  f"{moved:6d} {runs[0][4]:7d} {statistics.median(alone) * 1e3:18.1f} "
                  f"{copy * 1e3:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
