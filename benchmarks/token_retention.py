"""What the token ids of big commits cost once most of each commit is evicted.

Commits ``--commits`` chains of ``--blocks`` blocks each with their token ids (as a
client sends them while someone subscribes to the event stream), evicts all but each
commit's first block, and prints the memory still held (tracemalloc), in all and per
block left.  ``--beside DIR`` runs the same in a process importing the kvstore package
in DIR (another version), for a side-by-side figure.

    python benchmarks/token_retention.py [--blocks 2048] [--commits 20] [--beside DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tracemalloc


def measure(blocks: int, commits: int) -> tuple[int, float]:
    from kvstore.identity import Identity
    from kvstore.keys import chain_keys
    from kvstore.store import BlockStore
    from kvstore.tier_changes import TierChanges
    from kvstore.token_ids import encode_chain

    identity = Identity(model="tiny-llama", model_revision="r1", tenant="acme",
                        kv_dtype="float16", num_layers=2, num_kv_heads=2, head_dim=32,
                        block_tokens=16)
    bt, slot = identity.block_tokens, identity.block_bytes
    store = BlockStore(2 * blocks * slot, 2 * blocks * slot)
    changes = TierChanges(lambda: None)
    store.record_changes(changes)
    ns = store.open_namespace(identity)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for c in range(commits):
        tokens = [c * 10**6 + i for i in range(blocks * bt)]
        keys = chain_keys(ns.id, tokens, bt)
        r = store.reserve("o", ns, keys, None, 0.0)
        store.commit("o", r.id, 0.0, tokens=encode_chain(tokens, blocks, bt))  # type: ignore[union-attr]
        store.index.evict(ns, keys[1:])
        changes.drain()
        del tokens, keys, r
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    left = sum(len(n.blocks) for n in store.namespaces.values())
    return left, held / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--commits", type=int, default=20)
    parser.add_argument("--beside", metavar="DIR")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    left, mb = measure(args.blocks, args.commits)
    if args.one:
        print(left, mb)
        return
    rows = [("this code", left, mb)]
    if args.beside:
        env = dict(os.environ, PYTHONPATH=args.beside)
        out = subprocess.run([sys.executable, __file__, "--one", "--blocks", str(args.blocks),
                              "--commits", str(args.commits)], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
        rows.append(("--beside's code", int(out[0]), float(out[1])))
    print(f"{args.commits} commits of {args.blocks} blocks with token ids, all but each "
          f"one's first block evicted:")
    for name, blocks, held in rows:
        print(f"  {name:16} {blocks} blocks left, {held:.2f} MB held, "
              f"{held * 1e3 / max(blocks, 1):.1f} kB a block")


if __name__ == "__main__":
    main()
