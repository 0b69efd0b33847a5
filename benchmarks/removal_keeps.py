"""What keeping commits costs removals in slices, on the pure store, side by side with
another checkout (the code before a change).

    python benchmarks/removal_keeps.py [--against OTHER_CHECKOUT] [--rounds 7]

Four figures, each a median over rounds of the best of ``REPEATS`` runs, each round a
fresh process per checkout, the checkouts alternated so that a noisy machine hits both
alike:

- ``commit_none_us_per_block``: reserve + commit of 16-block chains, no removal open;
- ``commit_open_us_per_block``: the same while a removal of the namespace is open
  (every fresh block is marked as kept);
- ``evict_slices_us_per_block``: an evict that keeps commits (``SubtreeDrop`` with
  ``keep_commits``) of a 50k-block subtree, in slices of ``DROP_SLICE`` entries;
- ``drop_slices_us_per_block``: a ``NamespaceDrop`` of a 50k-block namespace, the same.

With ``--against``, the last column is this checkout's median over the other's (below
1: this one is faster).  Only the APIs both sides have are used.
"""

from __future__ import annotations

import time
from typing import Any

import alternated

CHAINS = 1500
TEETH = 100
TOOTH = 500  # 100 x 500 + 100 = 50_100 blocks
REPEATS = 3  # a round's figure: the best of these (the machine's noise adds, never takes)


def figures() -> dict[str, float]:
    """One round's figures, in this process (imports the checkout on ``sys.path``)."""
    import random

    from kvtest import make_identity

    from kvstore.core import SubtreeDrop
    from kvstore.index import NamespaceDrop
    from kvstore.removals import DROP_SLICE
    from kvstore.store import BlockStore, Reservation

    ident = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)
    rng = random.Random(1)

    def commit(store: Any, ns: Any, keys: list[bytes], parent: bytes | None) -> None:
        r = store.reserve("w", ns, keys, parent, 0.0)
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)

    def subtree(store: Any, ns: Any) -> list[bytes]:
        trunk = [rng.randbytes(16) for _ in range(TEETH)]
        commit(store, ns, trunk, None)
        for key in trunk:
            commit(store, ns, [rng.randbytes(16) for _ in range(TOOTH)], key)
        return trunk

    out: dict[str, float] = {}
    best: dict[str, float] = {}
    for _ in range(REPEATS):  # the two alternated, each on a store of its own
        for name in ("commit_none_us_per_block", "commit_open_us_per_block"):
            store = BlockStore(1 << 30, 1 << 20)
            ns = store.open_namespace(ident)
            head = [rng.randbytes(16)]
            commit(store, ns, head, None)
            if name == "commit_open_us_per_block":
                SubtreeDrop(store, ns, head).keep_commits()  # a removal open meanwhile
            chains = [[rng.randbytes(16) for _ in range(16)] for _ in range(CHAINS)]
            start = time.perf_counter()
            for keys in chains:
                commit(store, ns, keys, None)
            took = (time.perf_counter() - start) / (CHAINS * 16) * 1e6
            best[name] = min(best.get(name, took), took)
    out.update(best)

    for name in ("evict_slices_us_per_block", "drop_slices_us_per_block"):
        least = float("inf")
        for _ in range(REPEATS):
            store = BlockStore(1 << 30, 1 << 20)
            ns = store.open_namespace(ident)
            trunk = subtree(store, ns)
            n = len(ns.blocks)
            start = time.perf_counter()
            if name == "evict_slices_us_per_block":
                evict = SubtreeDrop(store, ns, [trunk[0]])
                evict.keep_commits()
                while not evict.step(DROP_SLICE):
                    pass
            else:
                drop = NamespaceDrop(store, ns)
                while not drop.step(DROP_SLICE):
                    pass
            least = min(least, (time.perf_counter() - start) / n * 1e6)
            assert not ns.blocks
        out[name] = least
    return out


if __name__ == "__main__":
    raise SystemExit(alternated.main(__file__, __doc__.splitlines()[0], figures))
