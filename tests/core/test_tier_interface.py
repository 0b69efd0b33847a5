"""The tier interface: the store's four tiers answer through it, and a fifth one (an
archive, defined here, the way a second SSD would be) joins with no change to a core
part: lookup finds blocks in it, DRAM lets their copies go without a write, removal
drops its copies, and stats and the invariant checker take it in."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from kvtest import make_identity

from kvstore.blocks import Block
from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Plan
from kvstore.tier import Tier

IDENT = make_identity()
SLOT = IDENT.block_bytes
ARCHIVE = "archive"


class Archive:
    """A tier of numbered slots, kept in the blocks' ``extra`` copies."""

    name = ARCHIVE

    def __init__(self, slots: int) -> None:
        self.free = list(range(slots))
        self.slots = slots
        self.drops = 0

    def take(self, block: Block) -> None:
        """The archive's own verb: a copy comes in (its mover would copy the bytes)."""
        slot = self.free.pop()
        block.extra = {**(block.extra or {}), ARCHIVE: slot}

    def holds(self, block: Block) -> bool:
        return block.extra is not None and ARCHIVE in block.extra

    def drop(self, block: Block) -> None:
        assert block.extra is not None
        self.free.append(block.extra.pop(ARCHIVE))
        if not block.extra:
            block.extra = None
        self.drops += 1

    def stats(self) -> dict[str, int]:
        return {"capacity": self.slots, "blocks": self.slots - len(self.free)}

    def check(self, blocks: Iterable[Block]) -> None:
        held = [b.extra[ARCHIVE] for b in blocks if b.extra and ARCHIVE in b.extra]
        assert len(held) + len(self.free) == self.slots, "archive slots lost"
        assert len(set(held) | set(self.free)) == self.slots, "an archive slot held twice"


def test_the_four_tiers_answer_through_the_interface() -> None:
    store = BlockStore(4 * SLOT, 4 * SLOT, ssd_capacity=4 * SLOT, ssd_slab_bytes=4 * SLOT,
                       gpu_capacity=4 * SLOT, gpu_slab_bytes=4 * SLOT, remote_tier=True)
    tiers: list[Tier] = store.tiers
    assert [t.name for t in tiers] == ["dram", "ssd", "remote", "gpu"]
    ns = store.open_namespace(IDENT)
    keys = chain_keys(ns.id, list(range(IDENT.block_tokens)), IDENT.block_tokens)
    r = store.reserve("a", ns, keys, None, 0.0)
    assert not isinstance(r, Plan)
    block = store.commit("a", r.id, 0.0).blocks[0]
    assert [t.holds(block) for t in tiers] == [True, False, False, False]
    assert set(store.tier_stats()) == {"dram", "ssd", "remote", "gpu"}
    store.check_invariants()


def test_a_fifth_tier_joins_without_touching_the_core() -> None:
    store = BlockStore(2 * SLOT, 2 * SLOT)               # DRAM alone, two slots
    archive = Archive(8)
    store.add_tier(archive)
    with pytest.raises(ValueError):
        store.add_tier(Archive(1))                        # one tier per name
    ns = store.open_namespace(IDENT)
    tokens = list(range(3 * IDENT.block_tokens))
    keys = chain_keys(ns.id, tokens, IDENT.block_tokens)
    r = store.reserve("a", ns, keys[:2], None, 0.0)
    assert not isinstance(r, Plan)
    first, second = store.commit("a", r.id, 0.0).blocks
    archive.take(first)
    archive.take(second)
    store.check_invariants()
    # DRAM is full: the third block's slot comes from a block the archive keeps, with
    # no write (a plan would be a write first)
    r = store.reserve("a", ns, keys[2:], keys[1], 0.0)
    assert not isinstance(r, Plan)
    store.commit("a", r.id, 0.0)
    assert first.offset is None and first.present and first.tier == ARCHIVE
    assert store.counters.dropped_on_eviction == 0          # not lost: it is below
    assert store.lookup(ns, keys) == [ARCHIVE, "dram", "dram"]   # found where it is
    assert store.tier_stats()[ARCHIVE] == {"capacity": 8, "blocks": 2}
    store.check_invariants()
    # the archive's slots are checked with the rest: a slot held twice is caught
    assert second.extra is not None and first.extra is not None
    own = second.extra[ARCHIVE]
    second.extra[ARCHIVE] = first.extra[ARCHIVE]
    with pytest.raises(AssertionError, match="archive"):
        store.check_invariants()
    second.extra[ARCHIVE] = own
    # removal drops its copies, leaf first, and the entries go
    count, _ = store.drop_namespace(ns)
    assert count == 3 and not ns.blocks
    assert archive.drops == 2
    store.check_invariants()
