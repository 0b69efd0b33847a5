"""Decode a captured kvstore event stream with vLLM's own event classes (run in the vLLM
test environment) and rebuild the index a router would hold.

Input (a JSON file): ``payloads``, the batches in order as [seq, hex payload] (seq -1:
the daemon restarted), and ``chains``, key chains (hex) to look up.  Output (the last
line, JSON): ``entries``, every (key, parent, tier) the events leave cached, and
``lookups``, each chain's leading cached keys' fastest tiers.
"""

from __future__ import annotations

import json
import sys

import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

TIERS = {("GPU", None): "gpu", ("CPU", None): "dram", ("STORAGE", "LOCAL"): "ssd",
         ("STORAGE", "REMOTE"): "remote"}
ORDER = ["gpu", "dram", "ssd", "remote"]


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    tiers: dict[bytes, set[str]] = {}
    parents: dict[bytes, bytes | None] = {}
    counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    expected = 0
    for seq, payload in spec["payloads"]:
        if seq < 0:
            expected = 0
            continue
        assert seq == expected, f"batch {seq} where {expected} was due"
        expected += 1
        batch = decoder.decode(bytes.fromhex(payload))
        for e in batch.events:
            counts[type(e).__name__] += 1
            if isinstance(e, AllBlocksCleared):
                tiers.clear()
                parents.clear()
            elif isinstance(e, BlockStored):
                tier = TIERS[(e.medium, e.locality)]
                assert e.token_ids == [] or len(e.token_ids) == len(e.block_hashes) * e.block_size
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    tiers.setdefault(h, set()).add(tier)
                    parents[h] = parent
                    parent = h
            else:
                assert isinstance(e, BlockRemoved)
                tier = TIERS[(e.medium, e.locality)]
                for h in e.block_hashes:
                    tiers[h].remove(tier)
                    if not tiers[h]:
                        del tiers[h]
    lookups = []
    for chain in spec["chains"]:
        out = []
        for key in map(bytes.fromhex, chain):
            held = tiers.get(key)
            if not held:
                break
            out.append(next(t for t in ORDER if t in held))
        lookups.append(out)
    entries = sorted([k.hex(), parents[k].hex() if parents[k] else None, t]
                     for k, ts in tiers.items() for t in ts)
    print(json.dumps({"entries": entries, "lookups": lookups, "counts": counts}))


if __name__ == "__main__":
    main()
