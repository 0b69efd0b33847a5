"""How long a slab handed from one tenant's arena to another's holds the daemon's loop.

    python benchmarks/arena_hand_over.py [--capacity 1GiB] [--slab 64MiB] [--block 256KiB]

Per-tenant arenas (sparse anonymous memory files, as the daemon makes them) under one
budget: tenant a fills the whole capacity, then tenant b writes up to its share, each
slab it gets one a's arena gives up (its blocks evicted, the survivors moved, its memory
given back, ``kvstore.slab_moves.SlabMoves.from_other_arenas``) and its own new slabs'
memory allocated (``kvstore.arena_budget.ArenaBudget.back``).  The store's calls run on
an asyncio loop as the daemon makes them (a plan of a turn: the loop serves others, then
the call is made again); a ticker on the same loop records the longest time it waited
for a turn.  Printed: the longest store call, the longest loop stall seen by the ticker,
the calls and turns b's puts took, and the slabs handed over.  (b's blocks are not
written: a client, another process, writes them, holding no lock of the daemon's.)  Run it on two trees to
compare them side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kvstore.arena_budget import budget_slab_bytes
from kvstore.config import parse_size
from kvstore.identity import Identity
from kvstore.keys import chain_keys
from kvstore.plans import Plan
from kvstore.store import BlockStore, Namespace
from kvstore.tiers.dram import Arenas


def identity(tenant: str, block_bytes: int) -> Identity:
    return Identity(model="m", model_revision="r", tenant=tenant, kv_dtype="float16",
                    num_layers=2, num_kv_heads=2, head_dim=block_bytes // 256,
                    block_tokens=16)


class Run:
    def __init__(self, capacity: int, slab: int) -> None:
        slab = budget_slab_bytes(slab, capacity)
        self.store = BlockStore(capacity, slab, per_tenant=True)
        self.arenas = Arenas(capacity, "/dev/shm", populate=False, memfd=True,
                             budget=self.store.dram_budget)
        self.store.move_bytes = lambda ns, s, t: self.arenas.get(ns.tenant).move(
            s, t, ns.block_bytes)
        self.longest_call = 0.0
        self.calls = self.turns = 0

    async def put(self, ns: Namespace, first: int, count: int, write: bool = True) -> None:
        keys = chain_keys(ns.id, list(range(first * 16, (first + count) * 16)), 16)
        arena = self.arenas.get(ns.tenant)
        while True:
            t0 = time.perf_counter()
            r = self.store.reserve(ns.tenant, ns, keys, None, 0.0)
            self.longest_call = max(self.longest_call, time.perf_counter() - t0)
            self.calls += 1
            if not isinstance(r, Plan):
                break
            assert r.turn, r
            self.turns += 1
            wait = getattr(r, "wait", None)  # (as the daemon's pipeline carries it out)
            await (wait() if wait is not None else asyncio.sleep(0))
            r.let_go()

        for offset in r.offsets if write else ():  # in place, as a client does
            arena.slot(offset, ns.block_bytes)[:] = b"\x01" * ns.block_bytes
        self.store.commit(ns.tenant, r.id, 0.0)


async def main(capacity: int, slab: int, block: int) -> None:
    run = Run(capacity, slab)
    stall = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal stall
        while not stop:
            t0 = time.perf_counter()
            await asyncio.sleep(0)
            stall = max(stall, time.perf_counter() - t0)

    a = run.store.open_namespace(identity("a", block))
    b = run.store.open_namespace(identity("b", block))
    per_put = 64
    fill = capacity // block // per_put
    for i in range(fill):  # a: the whole capacity
        await run.put(a, i * per_put, per_put)
    run.longest_call, run.calls, run.turns = 0.0, 0, 0
    tick = asyncio.create_task(ticker())
    per_put = 2 * budget_slab_bytes(slab, capacity) // block
    for i in range(2):  # b: two slabs a put, up to its share
        await run.put(b, 10_000 + i * per_put, per_put, write=False)
    stop = True
    await tick
    budget = run.store.dram_budget
    assert budget is not None
    print(f"capacity {capacity >> 20} MiB, slab {budget_slab_bytes(slab, capacity) >> 20} "
          f"MiB, block {block >> 10} KiB: b's 2 puts of 2 slabs: {run.calls} calls, "
          f"{run.turns} turns; longest call {run.longest_call * 1e3:.1f} ms, longest "
          f"loop stall {stall * 1e3:.1f} ms; slabs taken {budget.taken}, released "
          f"{budget.released}")
    run.arenas.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="1GiB")
    parser.add_argument("--slab", default="64MiB")
    parser.add_argument("--block", default="256KiB")
    args = parser.parse_args()
    asyncio.run(main(parse_size(args.capacity, "--capacity"), parse_size(args.slab, "--slab"),
                     parse_size(args.block, "--block")))
