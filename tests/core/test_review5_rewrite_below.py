"""A block whose copies are all below DRAM, committed again with other bytes, takes the
new checksum and loses its SSD copy (``BlockStore.rewritten``); a copy in a tier beyond
the four (``StoreCore.add_tier``: an archive, a second SSD) stayed, of the old bytes,
under the new checksum: the block left DRAM without a write (its copy below) and that
copy was read back as the new bytes.  Over such a copy the commit is a duplicate."""

from __future__ import annotations

from kvtest import make_identity
from test_tier_interface import Archive

from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Plan

IDENT = make_identity()
SLOT = IDENT.block_bytes


def test_other_bytes_over_an_added_tiers_copy_keep_its_checksum() -> None:
    store = BlockStore(2 * SLOT, 2 * SLOT)
    archive = Archive(4)
    store.add_tier(archive)
    ns = store.open_namespace(IDENT)
    key = chain_keys(ns.id, list(range(IDENT.block_tokens)), IDENT.block_tokens)[0]
    r = store.reserve("a", ns, [key], None, 0.0)
    assert not isinstance(r, Plan)
    block = store.commit("a", r.id, 0.0, checksums=[111]).blocks[0]
    archive.take(block)
    store.drop_dram_copy(block)                      # only in the archive now
    assert block.offset is None and archive.holds(block)
    r = store.reserve("b", ns, [key], None, 0.0)
    assert not isinstance(r, Plan)
    store.commit("b", r.id, 0.0, checksums=[222])    # another run's bytes
    assert not archive.holds(block) or block.checksum == 111, (
        "the archive's copy of the first bytes stands under the second's checksum")
    store.check_invariants()
