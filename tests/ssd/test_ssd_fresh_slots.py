"""A warm restart's blocks made by slot stores (``_made_fresh``, no ``Block.__init__``)
hold in every slot what a block made by ``Block(...)`` and then given its SSD copy
holds: a default changed in ``Block.__init__`` and not there fails here."""

from __future__ import annotations

from kvtest import make_identity

from kvstore.blocks import Block
from kvstore.keys import chain_keys
from kvstore.ssd_copies import _made_fresh
from kvstore.store import BlockStore

IDENT = make_identity(tenant="acme", model="m")


def test_fresh_blocks_hold_what_the_constructor_gives() -> None:
    store = BlockStore(8 * IDENT.block_bytes, IDENT.block_bytes)
    ns = store.open_namespace(IDENT)
    other = store.open_namespace(make_identity(tenant="acme", model="n"))
    keys = chain_keys(ns.id, list(range(IDENT.block_tokens * 4)), IDENT.block_tokens)
    side = chain_keys(ns.id, list(range(9, 9 + IDENT.block_tokens)), IDENT.block_tokens,
                      parent=keys[1])
    # rows: a chain of four, a branch off its second block, a second root
    rows = keys + side + chain_keys(ns.id, [7] * IDENT.block_tokens, IDENT.block_tokens)
    backs = [0, 1, 1, 1, 3, 0]
    offsets = [i * 4096 for i in range(len(rows))]
    checksums = [1000 + i for i in range(len(rows))]
    made = _made_fresh(ns, rows, backs, offsets, checksums, 2, {})
    parents: list[Block | None] = [None]
    for i in range(1, len(rows)):
        parents.append(made[i - backs[i]] if backs[i] else None)
    for i, block in enumerate(made):
        want = Block(rows[i], other, None)
        want.ssd_offset, want.checksum, want.seen = offsets[i], checksums[i], 2
        for name in Block.__slots__:
            got, expected = getattr(block, name), getattr(want, name)
            if name == "ns":
                assert got is ns
            elif name == "parent":
                assert got is parents[i]
            elif name == "kids":
                kids = [] if got is None else [got] if isinstance(got, Block) else list(got)
                assert [k.key for k in kids] == [rows[j] for j in range(len(rows))
                                                if parents[j] is block]
            else:
                assert got == expected, name
        assert ns.blocks.get(rows[i]) is block
