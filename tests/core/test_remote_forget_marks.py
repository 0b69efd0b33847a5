"""The marks of blocks the remote store holds, taken back in slices once it lost them
(``remote_copies.ForgetMarks``): every mark goes, each step within its budget, the
blocks with a DRAM copy handed back to be written again, and a mark set on a block the
walk has passed (by a write to the store as it is now) left as it is."""

from __future__ import annotations

from kvtest import make_identity

from kvstore.blocks import REMOTE_MARK
from kvstore.keys import chain_keys
from kvstore.remote_copies import ForgetMarks
from kvstore.store import BlockStore

BLOCKS = 10_000  # past block_map.SPLIT_AT: a namespace of many shards


def test_every_mark_goes_a_bounded_slice_at_a_time() -> None:
    ident = make_identity(tenant="acme", model="m")
    store = BlockStore(BLOCKS * ident.block_bytes, BLOCKS * ident.block_bytes,
                       remote_tier=True)
    ns = store.open_namespace(ident)
    other = store.open_namespace(make_identity(tenant="acme", model="m2"))
    for space, count in ((ns, BLOCKS - 100), (other, 100)):
        for start in range(0, count, 500):
            tokens = list(range(start * 16, (start + 500) * 16))
            keys = chain_keys(space.id, tokens, ident.block_tokens)
            r = store.reserve("s1", space, keys, None, 0.0)
            store.commit("s1", r.id, 0.0)  # type: ignore[union-attr]
    blocks = [*ns.blocks.values(), *other.blocks.values()]
    assert len(blocks) == BLOCKS and len(ns.blocks.shards) > 1
    for b in blocks:
        b.remote = True
    walk = ForgetMarks(store)
    handed: list[object] = []
    steps = 0
    done = False
    while not done:
        before = walk.count
        done, in_dram = walk.step(1000, 10.0)
        assert walk.count - before <= 1000
        handed += in_dram
        steps += 1
        if steps == 3:
            passed = next(b for b in blocks if not b.marks & REMOTE_MARK)
            passed.remote = True  # written to the store as it is now, after the walk
    assert steps >= BLOCKS // 1000
    assert walk.count == BLOCKS
    assert len(handed) == BLOCKS and set(map(id, handed)) == set(map(id, blocks))
    assert [b for b in blocks if b.remote] == [passed]
