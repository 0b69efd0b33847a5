"""Lookup walks a chain by its child links and probes the key map only where the links
do not name the next key (a chain's head, a branch point, keys that are no chain): the
answer is the one a probe per key gives, with fewer probes."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kvtest import make_identity

from kvstore.blocks import DRAM
from kvstore.store import BlockStore, Namespace, Reservation


class CountingShard(dict[bytes, Any]):
    """A key map shard that counts the probes of it (``get``)."""

    probes = 0

    def get(self, key: bytes, default: Any = None) -> Any:
        CountingShard.probes += 1
        return super().get(key, default)


def _commit(store: BlockStore, ns: Namespace, keys: list[bytes],
            parent: bytes | None = None) -> None:
    r = store.reserve("w", ns, keys, parent, 0.0)
    assert isinstance(r, Reservation), r
    store.commit("w", r.id, 0.0)


def _store(blocks: int = 512) -> tuple[BlockStore, Namespace]:
    ident = make_identity()
    store = BlockStore(blocks * ident.block_bytes, 64 * ident.block_bytes)
    return store, store.open_namespace(ident)


def _counted(ns: Namespace) -> None:
    ns.blocks.shards = [CountingShard(s) for s in ns.blocks.shards]


def _keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i:03}".encode().ljust(16, b".") for i in range(n)]


def test_a_chain_costs_one_probe_and_a_branch_point_one_more() -> None:
    store, ns = _store()
    a = _keys("a", 10)
    b = _keys("b", 3)
    _commit(store, ns, a)
    _commit(store, ns, b, parent=a[4])  # a[4] is a branch point now: two children
    _counted(ns)

    CountingShard.probes = 0
    assert store.lookup(ns, a) == [DRAM] * 10
    assert CountingShard.probes == 2  # the head, and a[5] below the branch point

    CountingShard.probes = 0
    assert store.lookup(ns, a[:5] + b) == [DRAM] * 8
    assert CountingShard.probes == 2  # the head, and b[0] below the branch point

    CountingShard.probes = 0
    assert store.lookup(ns, a[:3]) == [DRAM] * 3
    assert CountingShard.probes == 1


def test_keys_that_are_no_chain_are_probed_one_by_one() -> None:
    store, ns = _store()
    a = _keys("a", 6)
    _commit(store, ns, a)
    _counted(ns)
    CountingShard.probes = 0
    # present, though a[2] is no child of a[0]: lookup counts leading present keys
    assert len(store.lookup(ns, [a[0], a[2], a[5], b"missing".ljust(16)])) == 3
    assert CountingShard.probes == 4


def test_a_child_evicted_ends_the_walk_where_a_probe_would() -> None:
    store, ns = _store()
    a = _keys("a", 8)
    _commit(store, ns, a)
    evicted, _ = store.evict(ns, [a[5]])
    assert evicted == 3  # a[5] and what depends on it
    assert store.lookup(ns, a) == [DRAM] * 5
    _commit(store, ns, a[5:], parent=a[4])  # committed again: the links name them again
    assert store.lookup(ns, a) == [DRAM] * 8


def _probe_per_key(ns: Namespace, keys: list[bytes]) -> int:
    """The longest cached prefix as a probe per key finds it (the model)."""
    hits = 0
    for key in keys:
        block = ns.blocks.get(key)
        if block is None or not block.present:
            break
        hits += 1
    return hits


def test_lookups_of_random_trees_agree_with_a_probe_per_key() -> None:
    rng = random.Random(7)
    for _ in range(20):
        store, ns = _store(4096)
        paths: list[list[bytes]] = []
        for t in range(rng.randrange(1, 12)):
            base = rng.choice(paths) if paths and rng.random() < 0.7 else []
            cut = rng.randrange(len(base) + 1)
            fresh = _keys(f"t{t}.", rng.randrange(1, 20))
            _commit(store, ns, fresh, parent=base[cut - 1] if cut else None)
            paths.append(base[:cut] + fresh)
        for path in rng.sample(paths, min(3, len(paths))):
            store.evict(ns, [rng.choice(path)])
        every = [k for p in paths for k in p]
        for _ in range(40):
            roll = rng.random()
            if roll < 0.6:
                keys = list(rng.choice(paths))
            elif roll < 0.8:  # a chain, then another chain's keys
                keys = rng.choice(paths)[:rng.randrange(1, 8)] + rng.choice(paths)
            else:
                keys = rng.sample(every, min(len(every), 6))
            if keys and rng.random() < 0.3:
                keys[rng.randrange(len(keys))] = b"absent".ljust(16, b".")
            copies = [bytes(bytearray(k)) for k in keys]  # as decoded from a request
            assert len(store.lookup(ns, copies)) == _probe_per_key(ns, copies)
        store.check_invariants()


def test_a_lookup_told_later_reaches_the_orders_at_its_settle() -> None:
    """``lookup(later=True)`` answers as a plain lookup does and tells the eviction
    orders at ``settle`` (or at the next lookup): until then the store's own check
    says so; after, the victims are those of a lookup told at once."""
    from kvstore.keys import chain_keys

    store, ns = _store(blocks=64)  # room for four 16-block chains
    chains = [chain_keys(ns.id, range(1000 * i, 1000 * i + 256), 16) for i in range(4)]
    for keys in chains:
        _commit(store, ns, keys)
    assert store.lookup(ns, chains[0], later=True) == [DRAM] * 16
    with pytest.raises(AssertionError, match="never settled"):
        store.check_invariants()
    store.index.settle()
    store.check_invariants()
    store.lookup(ns, chains[1], later=True)
    store.lookup(ns, chains[2])  # the one before is told first
    store.check_invariants()
    _commit(store, ns, chain_keys(ns.id, range(9000, 9256), 16))
    # the chain never looked up went: the three looked up stay
    assert [len(store.lookup(ns, keys)) for keys in chains] == [16, 16, 16, 0]
