"""The store's verbs cost what they touch, not the namespace: evict follows child links,
figures come from counters kept as blocks change; the checker recounts both."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
from kvtest import make_identity

from kvstore.block_map import BlockMap
from kvstore.blocks import Block
from kvstore.store import BlockStore, Namespace, Reservation


class NoWalk(BlockMap[Block]):
    """A namespace's index that fails any walk over it (lookups by key still work)."""

    walking = False

    def _walk(self) -> None:
        if not NoWalk.walking:
            raise AssertionError("the namespace's blocks were walked")

    def __iter__(self) -> Iterator[bytes]:
        self._walk()
        return super().__iter__()

    def values(self) -> Any:
        self._walk()
        return super().values()

    def items(self) -> Any:
        self._walk()
        return super().items()


def _commit(store: BlockStore, ns: Namespace, keys: list[bytes],
            parent: bytes | None = None) -> None:
    r = store.reserve("w", ns, keys, parent, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)


def _check(store: BlockStore) -> None:
    NoWalk.walking = True
    try:
        store.check_invariants()
    finally:
        NoWalk.walking = False


@pytest.fixture
def store() -> BlockStore:
    ident = make_identity()
    return BlockStore(512 * ident.block_bytes, 64 * ident.block_bytes)


def test_evict_stats_and_lookup_never_walk_the_namespace(store: BlockStore) -> None:
    ns = store.open_namespace(make_identity())
    ns.blocks = NoWalk()
    chains = [[os.urandom(16) for _ in range(8)] for _ in range(20)]
    for keys in chains:
        _commit(store, ns, keys)
    figures = store.stats()
    assert figures["blocks"] == 160 and figures["committed_slots"] == 160
    assert figures["committed"] == 160 * ns.cls.slot_bytes
    assert store.lookup(ns, chains[3]) == ["dram"] * 8
    # a middle key: it and what hangs below it go, its prefix stays
    removed, _ = store.evict(ns, [chains[3][5]])
    assert removed == 3
    assert store.lookup(ns, chains[3]) == ["dram"] * 5
    assert store.stats()["blocks"] == 157
    _check(store)


def test_a_branch_point_keeps_its_children_as_they_come_and_go(store: BlockStore) -> None:
    ns = store.open_namespace(make_identity())
    root = [os.urandom(16)]
    _commit(store, ns, root)
    branches = [[os.urandom(16), os.urandom(16)] for _ in range(5)]
    for keys in branches:
        _commit(store, ns, keys, parent=root[0])
    top = ns.blocks[root[0]]
    assert top.children == 5
    assert {b.key for b in top.child_list()} == {k[0] for k in branches}
    _check(store)
    for i, keys in enumerate(branches[:4]):
        store.evict(ns, [keys[0]])
        assert top.children == 4 - i
        assert keys[0] not in ns.blocks and keys[1] not in ns.blocks
        _check(store)
    assert top.kids is ns.blocks[branches[4][0]]  # one child left: no container
    assert store.evict(ns, root)[0] == 3
    assert not ns.blocks
    _check(store)


def test_pinned_blocks_and_reservations_are_counted_as_they_change(store: BlockStore) -> None:
    ns = store.open_namespace(make_identity())
    keys = [os.urandom(16) for _ in range(6)]
    _commit(store, ns, keys)
    pin = store.acquire("r", ns, keys[:4], 0.0)
    open_r = store.reserve("w", ns, [os.urandom(16)], keys[-1], 0.0)
    assert isinstance(open_r, Reservation)
    figures = store.stats()
    assert figures["pinned_blocks"] == 5  # four acquired, and the reservation's parent
    assert figures["reserved"] == ns.cls.slot_bytes
    store.check_invariants()
    store.release("r", pin.id)  # type: ignore[union-attr]
    store.abort("w", open_r.id)
    figures = store.stats()
    assert figures["pinned_blocks"] == 0 and figures["reserved"] == 0
    assert figures["free"] == figures["capacity"] - 6 * ns.cls.slot_bytes
    store.check_invariants()


@pytest.mark.parametrize("policy", ["slru", "arc", "s3fifo"])
def test_a_block_cached_again_after_it_left_is_remembered_by_its_key(policy: str) -> None:
    ident = make_identity()
    store = BlockStore(8 * ident.block_bytes, 8 * ident.block_bytes, eviction_policy=policy)
    ns = store.open_namespace(ident)
    first = [os.urandom(16) for _ in range(4)]
    _commit(store, ns, first)
    others = [os.urandom(16) for _ in range(4)]
    for key in others:
        _commit(store, ns, [key])
    gone = ns.blocks[first[-1]]
    _commit(store, ns, [os.urandom(16)])  # full: the coldest leaf leaves the store
    assert first[-1] not in ns.blocks and gone.offset is None
    store.evict(ns, [first[0], others[0]])  # room for the chain again, with no eviction
    _commit(store, ns, first)
    again = ns.blocks[first[-1]]
    assert again is not gone  # a new entry, hashed by identity ...
    inner: Any = ns.dram.policy(ns.cls).inner  # type: ignore[attr-defined]
    remembered = {"slru": lambda: again in inner._protected,
                  "arc": lambda: again in inner._t2,
                  "s3fifo": lambda: again in inner._main}[policy]
    assert remembered()  # ... that its order knew from before, by its key
    store.check_invariants()


def test_the_block_map_reads_as_a_dict_and_spreads_its_keys() -> None:
    from kvstore.block_map import SPLIT_AT

    blocks: BlockMap[int] = BlockMap()
    keys = [os.urandom(16) for _ in range(2 * SPLIT_AT)]
    for i, key in enumerate(keys):
        blocks[key] = i
    assert len(blocks) == len(keys) and blocks and keys[7] in blocks
    assert blocks[keys[7]] == 7 and blocks.get(keys[9]) == 9 and blocks.get(b"x" * 16) is None
    assert sorted(blocks.values()) == list(range(len(keys)))
    assert dict(blocks.items()) == {k: i for i, k in enumerate(keys)}
    assert blocks.mask and max(map(len, blocks.shards)) < len(keys) // 64  # split, evenly
    for key in keys:
        del blocks[key]
    assert not blocks and len(blocks) == 0 and keys[0] not in blocks
    small: BlockMap[int] = BlockMap()
    small[keys[0]] = 0
    assert len(small.shards) == 1  # a small map is one dict
    with pytest.raises(KeyError):
        del blocks[keys[0]]


def test_a_namespace_whose_map_splits_keeps_every_chain() -> None:
    from kvstore.block_map import SPLIT_AT

    ident = make_identity(head_dim=8, num_layers=1, num_kv_heads=1)
    chains = [[os.urandom(16) for _ in range(1024)] for _ in range(SPLIT_AT // 1024 + 2)]
    store = BlockStore((len(chains) + 16) * 1024 * 4096, 64 << 20)
    ns = store.open_namespace(ident)
    for keys in chains:
        _commit(store, ns, keys)
    assert len(ns.blocks.shards) > 1 and len(ns.blocks) == len(chains) * 1024
    for keys in chains:
        assert store.lookup(ns, keys) == ["dram"] * 1024
    assert store.evict(ns, [chains[0][512]])[0] == 512
    assert store.lookup(ns, chains[0]) == ["dram"] * 512
    store.check_invariants()


class FoundBlock(NamedTuple):
    """A block found on SSD (``kvstore.ssd_copies.Found``), as the tier's records say."""

    key: bytes
    parent: bytes | None
    offset: int
    checksum: int = 0


def test_restoring_in_bulk_keeps_what_one_by_one_would_and_frees_the_rest() -> None:
    ident = make_identity()
    slot = ident.block_bytes

    def fresh() -> tuple[BlockStore, Namespace]:
        store = BlockStore(8 * slot, 8 * slot, ssd_capacity=64 * slot, ssd_slab_bytes=16 * slot)
        return store, store.open_namespace(ident)

    keys = [os.urandom(16) for _ in range(8)]
    lost = os.urandom(16)  # a parent the index no longer has
    found = [
        FoundBlock(keys[0], None, 40 * slot, 1),
        FoundBlock(keys[1], keys[0], 3 * slot, 2),
        FoundBlock(keys[2], lost, 5 * slot),          # orphan: not restored, its slot free
        FoundBlock(keys[3], keys[2], 6 * slot),       # below the orphan
        FoundBlock(keys[4], keys[1], 3 * slot),       # a slot taken already
        FoundBlock(keys[5], keys[1], 7 * slot + 1),   # not a slot boundary
        FoundBlock(keys[1], keys[0], 9 * slot),       # the key again
        FoundBlock(keys[6], keys[1], 5 * slot, 3),    # the orphan's slot, free again
    ]
    bulk, ns = fresh()
    ok = bulk.ssd_copies.restore_many(ns, found)
    one, ns1 = fresh()
    assert ok == [one.ssd_copies.restore_many(ns1, [f])[0] for f in found]
    assert ok == [True, True, False, False, False, False, False, True]
    assert bulk.lookup(ns, [keys[0], keys[1], keys[6]]) == ["ssd"] * 3
    assert [ns.blocks[k].checksum for k in (keys[0], keys[1], keys[6])] == [1, 2, 3]
    committed = [s.tier_stats()["ssd"]["committed"] for s in (bulk, one)]
    assert committed == [3 * slot, 3 * slot]
    assert sorted(bulk.ssd.pool.free_offsets(ns.ssd_cls)) == sorted(  # type: ignore[union-attr]
        one.ssd.pool.free_offsets(ns1.ssd_cls))  # type: ignore[union-attr]
    bulk.check_invariants()


def test_a_blocks_rare_fields_live_in_a_side_record_only_while_set(store: BlockStore) -> None:
    ns = store.open_namespace(make_identity())
    block = Block(b"k" * 16, ns, None)
    assert (block.ssd_holds, block.demoting, block.promoting) == (0, False, False)
    assert block.gpu_offset is None and block.extra is None and block.rare is None
    block.demoting = False  # a default set on a block without the record adds none
    assert block.rare is None
    block.ssd_holds += 1
    block.gpu_offset = 0
    block.extra = {"archive": 3}
    block.promoting = True
    assert (block.ssd_holds, block.gpu_offset, block.extra, block.promoting) == (
        1, 0, {"archive": 3}, True)
    assert block.present and block.tier == "archive"
    block.ssd_holds -= 1
    block.gpu_offset = None
    block.extra = None
    assert block.rare is not None  # still promoting
    block.promoting = False
    assert block.rare is None and not block.present
