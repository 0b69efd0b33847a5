"""The daemon's side of the sweep below hollow entries (``removals.Removals``): a sweep
that stops short goes on a bounded call a loop turn, in one task, until it is over."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from kvtest import make_identity

from kvstore.core import SWEEP_SLICE
from kvstore.store import BlockStore, Pin, Reservation
from kvstore.removals import Removals

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks


def test_a_sweep_left_short_goes_on_a_loop_turn_at_a_time() -> None:
    store = BlockStore(64 << 20, 1 << 20)
    ns = store.open_namespace(IDENT)
    rng = random.Random(3)
    trunk = [rng.randbytes(16) for _ in range(100)]
    for i in range(60):  # 6100 blocks below the trunk's first key
        keys = trunk if i == 0 else [rng.randbytes(16) for _ in range(100)]
        r = store.reserve("w", ns, keys, None if i == 0 else trunk[i], 0.0)
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)
    pin = store.acquire("reader", ns, trunk[40:45], 0.0)
    assert isinstance(pin, Pin)
    root = ns.blocks[trunk[0]]
    store.drop_dram_copy(root)  # lost its last copy, as to a corrupt read: hollow
    store.hollow.add(root)

    async def run() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []

        def spawn(coro: object) -> asyncio.Task[None]:
            tasks.append(loop.create_task(coro))  # type: ignore[arg-type]
            return tasks[-1]
        daemon = SimpleNamespace(store=store, spawn=spawn,
                                 moves=SimpleNamespace(removed=lambda removed: None))
        Removals(daemon)  # type: ignore[arg-type]
        sizes = [len(ns.blocks)]
        assert not store.sweep_hollow()  # a release's sweep: one bounded call, then...
        sizes.append(len(ns.blocks))
        while tasks and not tasks[-1].done():  # ...the rest a loop turn at a time
            await asyncio.sleep(0)
            sizes.append(len(ns.blocks))
        store.check_invariants()
        return sizes, len(tasks)

    sizes, spawned = asyncio.run(run())
    assert spawned == 1, "one task went on with the sweep"
    steps = [a - b for a, b in zip(sizes, sizes[1:])]
    assert max(steps) <= SWEEP_SLICE and len([s for s in steps if s]) >= 4, steps
    # left: the hollow root and the path to what is pinned
    assert set(ns.blocks) == set(trunk[:45]) and root in store.hollow
    store.release("reader", pin.id)
    store.sweep_later = None  # (no loop now: the pure store's sweep, in one go)
    store.sweep_hollow()
    assert not ns.blocks and not store.hollow
    store.check_invariants()
