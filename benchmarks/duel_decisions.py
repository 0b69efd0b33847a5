"""The duel's decisions over the replay's traces, as digests to compare across versions.

    python benchmarks/duel_decisions.py [--out FILE] [--quick]

Replays the shared trace, the chat trace (if present) and the synthetic workloads at
four capacities through ``PolicyCache`` with ``auto`` and each of its candidates, each
hit reported twice as the daemon's lookup and acquire do, on int ids and on the store's
16-byte keys hashed as the store hashes them (``auto`` only); per cell, the hits, the
victim sequence's digest, the switches and the final scores.  Two versions of the duel
make the same decisions if their outputs are identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import msgspec
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay import DEFAULT_TRACE, key_hash, sim_capacity  # noqa: E402
from replay_sim import PolicyCache, load_trace, replay, synthetic, unique_blocks  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from kvstore.scheduler.eviction import POLICIES, make_policy  # noqa: E402

CHAT_TRACE = Path(__file__).resolve().parent.parent.parent / "traces" / "conversation_trace.jsonl"
CAPACITIES = (0.02, 0.05, 0.10, 0.25)


class Recorder:
    """A policy's calls passed on, its victims hashed in order."""

    def __init__(self, policy: object) -> None:
        self.policy = policy
        self.digest = hashlib.sha256()
        self.victims = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.policy, name)

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("policy", "digest", "victims"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.policy, name, value)

    def pop_victim(self, allowed: object) -> object:
        victim = self.policy.pop_victim(allowed)  # type: ignore[attr-defined]
        self.digest.update(repr(victim).encode() + b";")
        self.victims += 1
        return victim


class BatchedCache(PolicyCache):
    """``PolicyCache`` with a lookup's hits one ``access_many`` per touch, as the store
    reports them."""

    def lookup(self, keys: list) -> int:
        hits = self.cached_prefix(keys)
        for _ in range(self.touches):
            self.policy.access_many(list(reversed(keys[:hits])))
        for key in keys[:hits]:
            self.policy.pin(key)
        return hits


def cell(trace: list, capacity: int, name: str, keyed: bool,
         batched: bool = False) -> dict[str, object]:
    policy = make_policy(name, name_hash=key_hash) if keyed else POLICIES[name]()
    recorder = Recorder(policy)
    kind = BatchedCache if batched else PolicyCache
    cache = kind(recorder, capacity, touches=2)  # type: ignore[arg-type]
    stats = replay(trace, cache)
    out: dict[str, object] = {"hits": stats.hit_blocks, "victims": recorder.victims,
                              "sequence": recorder.digest.hexdigest()[:16]}
    if hasattr(policy, "switches"):
        out["switches"] = policy.switches
        out["scores"] = {k: round(v, 9) for k, v in policy.scores().items()}
        out["leader"] = policy.leader
    return out


def keyed(trace: list) -> list:
    """``trace`` with each block id a 16-byte key (a digest, as the store's are)."""
    def key(block: int) -> bytes:
        return hashlib.blake2b(block.to_bytes(8, "little"), digest_size=16).digest()
    return [msgspec.structs.replace(r, hash_ids=[key(h) for h in r.hash_ids]) for r in trace]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="synthetic workloads only")
    args = parser.parse_args()
    traces: dict[str, list] = {name: synthetic(name) for name in WORKLOADS}
    if not args.quick:
        traces["shared"] = load_trace(DEFAULT_TRACE)
        if CHAT_TRACE.exists():
            traces["chat"] = load_trace(CHAT_TRACE)
    results: dict[str, object] = {}
    for trace_name, trace in traces.items():
        unique = unique_blocks(trace)
        for share in CAPACITIES:
            capacity = sim_capacity(share, unique)
            for name in ("auto", "lru", "slru", "arc", "density"):
                results[f"{trace_name}/{share}/{name}"] = cell(trace, capacity, name, False)
            results[f"{trace_name}/{share}/auto@keys"] = cell(
                keyed(trace), capacity, "auto", True)
            results[f"{trace_name}/{share}/auto@many"] = cell(
                trace, capacity, "auto", False, True)
            print(trace_name, share, results[f"{trace_name}/{share}/auto"], flush=True)
    text = json.dumps(results, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
