"""What one first key heading chains in many namespaces costs the store.

    python benchmarks/first_key_heads.py [--against OTHER_CHECKOUT] [--rounds 5]

Keys of a client's own making may put one key at the head of a chain in many
namespaces (a tenant's own, thousands of them if it opens so many).  The store's map of
first blocks keeps every one (``kvstore.first_blocks``); this program times, in process
CPU, a tenant making one key head ``HEADS`` of its namespaces (a commit each), another
tenant's commit and drop of a block under that key (``cycle_us``, each), and the
evictions of the many (``drop_all_s``), with the store's pure core (no daemon, no
sockets).  ``--against`` alternates rounds with another checkout: before and after.
"""

from __future__ import annotations

import sys
import time

HEADS = 5000
CYCLES = 300


def figures() -> dict[str, float]:
    from kvtest import make_identity

    from kvstore.store import BlockStore, Reservation

    ident = make_identity()
    store = BlockStore(2 * HEADS * ident.block_bytes, 64 * ident.block_bytes)
    key = b"k" * 16
    spaces = [store.open_namespace(make_identity(tenant="crowd", model=f"m{i}"))
              for i in range(HEADS)]
    acme = make_identity(tenant="acme")

    def commit(ns: object) -> None:
        r = store.reserve("w", ns, [key], None, 0.0)  # type: ignore[arg-type]
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)

    t0 = time.process_time()
    for ns in spaces:
        commit(ns)
    t1 = time.process_time()
    for _ in range(CYCLES):
        victim = store.open_namespace(acme)  # (anew: forgotten once empty)
        commit(victim)
        store.drop_subtree(victim, [victim.blocks[key]], [])
    t2 = time.process_time()
    for ns in spaces:
        store.drop_subtree(ns, [ns.blocks[key]], [])
    t3 = time.process_time()
    assert key not in store.roots
    return {"build_s": t1 - t0, "cycle_us": (t2 - t1) / CYCLES * 1e6, "drop_all_s": t3 - t2}


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    from alternated import main

    sys.exit(main(__file__, __doc__ or "", figures))
