"""The store's eviction decisions under pressure, as digests to compare across versions.

    python benchmarks/evict_decisions.py [--rounds 400] [--policies auto,lru,...]
                                         [--setups dram,ssd,quota,solo,solo-ssd]

Drives a ``BlockStore`` whose DRAM tier is small against its traffic through a
seeded mix of reserves and commits (chains that share prefixes and branch, in two
namespaces of two tenants, so that tenants over their share are taken first, or of
one, ``solo``), lookups (hits that reorder the eviction order), keep-warm soft pins
and acquires held for a while, in these set-ups: DRAM alone, an SSD tier under it
(some blocks admitted and demoted, some written through, some dropped), a tenant
quota, one tenant alone with and without the SSD tier, and one with the SSD tier and
the pressure steps evict and demote apart (``apart-ssd``: the evict pass runs dry on
blocks only demotion can take).  Events are recorded.  After
each round it hashes what the store holds: every entry's key and its DRAM and SSD
slot, the eviction order of every class (and the state of ``auto``'s duel), the
pool's free slots and the tenants'
bytes, the counters and the drained tier changes.  Two versions of the store make
the same decisions (the same victims, in the same order, into the same slots) if
their digests are identical.
"""

from __future__ import annotations

import argparse
import hashlib
import random

from kvstore.identity import Identity
from kvstore.plans import Plan
from kvstore.store import BlockStore, Namespace, Pin, Reservation
from kvstore.tier_changes import Removed, TierChanges

SLOT = 4096
SETUPS = ("dram", "ssd", "quota", "solo", "solo-ssd", "apart-ssd")


def _store(setup: str, policy: str, clock: list[float]) -> BlockStore:
    ssd = 6000 * SLOT if setup.endswith("ssd") else 0
    store = BlockStore(1500 * SLOT, 64 * SLOT, eviction_policy=policy, ssd_capacity=ssd,
                       ssd_slab_bytes=64 * SLOT, ssd_admit_after=2,
                       tenant_quota=900 * SLOT if setup == "quota" else 0,
                       tenant_weights={"a": 2.0, "b": 1.0}, clock=lambda: clock[0])
    store.record_changes(TierChanges())
    return store


def _digest(store: BlockStore, spaces: list[Namespace], h: "hashlib._Hash") -> None:
    for ns in spaces:
        # in key order: a split key map lists its entries by the keys' seeded hashes
        for key, b in sorted(ns.blocks.items()):
            h.update(key + repr((b.offset, b.ssd_offset, b.refs, b.marks)).encode())
    for dram in store.drams.values():
        for size, policy in dram.policies.items():
            inner = getattr(policy, "inner", policy)  # (the duel's clock, scores, leader)
            h.update(repr((size, policy, getattr(inner, "_tick", None))).encode())
            for b in policy.evictable():
                h.update(b.key)
        h.update(repr(sorted(dram.used.items())).encode())
        pool = dram.pool
        h.update(repr(pool._empty).encode())
        for cls in pool.classes.values():
            h.update(repr((cls.free_slots, list(cls._with_room))).encode())
    h.update(repr((store.committed_slots, store.committed_bytes, store.reserved_slots,
                   vars(store.counters))).encode())
    assert store.changes is not None
    for change in store.changes.drain():
        keys = change.keys if isinstance(change, Removed) else [b.key for b in change.blocks]
        h.update(change.tier.encode() + b"".join(keys))


def run(setup: str, policy: str, rounds: int, seed: int = 7) -> tuple[str, str]:
    """The digest of a run, and what it went through (evictions, demotions, ...)."""
    rng = random.Random(seed)
    clock = [0.0]  # the store's clock: soft pins end as the rounds go by
    store = _store(setup, policy, clock)
    spaces = []
    if setup == "apart-ssd":  # evict and demote as passes of their own: the first runs dry
        store.pressure = ("evict", "defer", "demote", "reject")  # type: ignore[assignment]
    for tenant in ("a", "b") if setup in ("dram", "ssd", "quota") else ("a", "a"):
        ident = Identity(model=f"m{len(spaces)}", model_revision="r", tenant=tenant, kv_dtype="float16",
                         num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=64)
        spaces.append(store.open_namespace(ident))
    chains: list[tuple[Namespace, list[bytes]]] = []
    pins: list[Pin] = []
    h = hashlib.sha256()
    now = 0.0
    for i in range(rounds):
        now += 1.0
        clock[0] = now
        ns = spaces[0] if rng.random() < 0.6 else spaces[1]
        if chains and rng.random() < 0.5:  # a branch off a cached chain's prefix
            base_ns, base = rng.choice(chains)
            if base_ns is ns:
                cut = rng.randrange(1, len(base) + 1)
                keys = base[:cut] + [rng.randbytes(16) for _ in range(rng.choice((4, 32, 200)))]
            else:
                keys = [rng.randbytes(16) for _ in range(rng.choice((8, 64, 300)))]
        else:
            keys = [rng.randbytes(16) for _ in range(rng.choice((8, 64, 300)))]
        chains.append((ns, keys))
        cached = len(store.lookup(ns, keys))
        parent = keys[cached - 1] if cached else None
        todo = keys[cached:]
        if todo:
            for _ in range(4):
                try:
                    r = store.reserve("w", ns, todo, parent, now)
                except Exception as exc:  # refused: part of the decisions
                    h.update(type(exc).__name__.encode())
                    break
                if isinstance(r, Plan):
                    _carry_out(store, r, rng)
                    continue
                assert isinstance(r, Reservation)
                store.commit("w", r.id, now)
                if store.ssd is not None and rng.random() < 0.3:  # written through
                    fresh = [b for k in todo if (b := ns.blocks.get(k)) is not None
                             and b.offset is not None and b.ssd_offset is None
                             and not b.demoting and b.refs == 0]
                    if fresh:
                        t, _ = store.ssd_copies.reserve(fresh)
                        store.ssd_copies.finish_write(t, [None] * len(fresh))
                break
        for _ in range(3):  # hits on older chains
            hns, hkeys = rng.choice(chains)
            store.lookup(hns, hkeys[: rng.randrange(1, len(hkeys) + 1)])
        if rng.random() < 0.2:
            wns, wkeys = rng.choice(chains)
            store.keep_warm(wns, wkeys[:8], now + rng.choice((0.5, 5.0, 50.0)))
        if rng.random() < 0.15:
            ans, akeys = rng.choice(chains)
            got = len(store.lookup(ans, akeys))
            if got:
                try:
                    pin = store.acquire("r", ans, akeys[:got], now, promote=False)
                except Exception as exc:
                    h.update(type(exc).__name__.encode())
                else:
                    if isinstance(pin, Pin):
                        pins.append(pin)
        while pins and (len(pins) > 4 or rng.random() < 0.3):
            store.release("r", pins.pop(0).id)
        _digest(store, spaces, h)
        if i % 50 == 0:
            store.check_invariants()
    c = store.counters
    seen = (f"evictions {c.evictions}, demotions {c.demotions}, dropped "
            f"{c.dropped_on_eviction}, refused {c.capacity_rejects}")
    return h.hexdigest()[:16], seen


def _carry_out(store: BlockStore, plan: Plan, rng: random.Random) -> None:
    """The writes a plan names, as the daemon's would end (one in ten fails)."""
    if plan.demote:
        t, _ = store.ssd_copies.reserve(list(plan.demote))
        ok = rng.random() >= 0.1
        store.ssd_copies.finish_write(t, [None] * len(t.blocks) if ok else None)
    if plan.to_remote:
        store.finish_remote_write(list(plan.to_remote), [True] * len(plan.to_remote))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--policies", default="auto,lru,slru,arc,s3fifo,density")
    parser.add_argument("--setups", default=",".join(SETUPS))
    args = parser.parse_args()
    for policy in args.policies.split(","):
        for setup in args.setups.split(","):
            digest, seen = run(setup, policy, args.rounds)
            print(f"{policy:8} {setup:6} {digest}  ({seen})", flush=True)


if __name__ == "__main__":
    main()
