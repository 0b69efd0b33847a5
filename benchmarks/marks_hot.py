"""What the event stream's bookkeeping costs a block where it reads and writes the
announced and remote bits (``Block.marks``), side by side with another checkout (the
code before a change).

    python benchmarks/marks_hot.py [--against OTHER_CHECKOUT] [--rounds 7]

Figures in ns a block, each a median over rounds of the best of ``REPEATS`` runs, each
round a fresh process per checkout, the checkouts alternated so that a noisy machine
hits both alike:

- ``touch_run_ns``: ``TierChanges.touch_run`` of 1000-block runs (a commit's mark);
- ``drain_ns``: ``drain`` of blocks marked one by one, half of them remote;
- ``settle_ns``: ``settle`` of the same;
- ``unfold_ns``: ``drain`` of commits' runs, half of them remote, each with one block
  marked alone too (``_unfold_overlaps`` clears the runs' provisional bits);
- ``remote_scan_ns``: ``holdings`` of every block, half of them remote.

With ``--against``, the last column is this checkout's median over the other's (below
1: this one is faster).  Only the APIs both sides have are used.
"""

from __future__ import annotations

import time
from typing import Any

import alternated

CHAINS = 100
LENGTH = 1000  # 100k blocks
REPEATS = 3  # a round's figure: the best of these (the machine's noise adds, never takes)


def figures() -> dict[str, float]:
    """One round's figures, in this process (imports the checkout on ``sys.path``)."""
    import random

    from kvtest import make_identity

    from kvstore.blocks import Block
    from kvstore.store import BlockStore, Reservation
    from kvstore.tier_changes import TierChanges, holdings

    ident = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)
    rng = random.Random(1)
    n = CHAINS * LENGTH

    def loaded(drained: bool = True) -> tuple[Any, list[list[Any]]]:
        store = BlockStore(1 << 30, 1 << 20)
        store.record_changes(TierChanges())
        ns = store.open_namespace(ident)
        runs = []
        for _ in range(CHAINS):
            keys = [rng.randbytes(16) for _ in range(LENGTH)]
            r = store.reserve("w", ns, keys, None, 0.0)
            assert isinstance(r, Reservation)
            store.commit("w", r.id, 0.0)
            runs.append([ns.blocks[k] for k in keys])
        if drained:
            store.changes.drain()
        for run in runs[::2]:
            for b in run:
                b.remote = True
        return store, runs

    best: dict[str, float] = {}

    def took(name: str, start: float) -> None:
        ns_ = (time.perf_counter() - start) / n * 1e9
        best[name] = min(best.get(name, ns_), ns_)

    for _ in range(REPEATS):
        runs = [[Block(rng.randbytes(16), None, None) for _ in range(LENGTH)]
                for _ in range(CHAINS)]
        changes = TierChanges()
        start = time.perf_counter()
        for run in runs:
            changes.touch_run(run)
        took("touch_run_ns", start)

        for name in ("drain_ns", "settle_ns"):
            store, runs = loaded()
            for run in runs:
                for b in run:
                    store.changed(b)
            start = time.perf_counter()
            if name == "drain_ns":
                store.changes.drain()
            else:
                store.changes.settle()
            took(name, start)

        store, runs = loaded(drained=False)
        for run in runs:  # each commit's run with one of its blocks marked alone too
            store.changed(run[0])
        start = time.perf_counter()
        store.changes.drain()
        took("unfold_ns", start)

        every = [b for run in runs for b in run]
        start = time.perf_counter()
        for b in every:
            holdings(b)
        took("remote_scan_ns", start)
    return best


if __name__ == "__main__":
    raise SystemExit(alternated.main(__file__, __doc__.splitlines()[0], figures))
