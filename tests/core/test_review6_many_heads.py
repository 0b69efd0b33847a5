"""One first key heading chains in many namespaces (keys of a client's own making).

The map of first blocks keeps every head, grouped by tenant: adding or removing one
takes constant work however many there are (a tuple copied at each change made a key
of thousands of heads cost thousands of steps a commit or eviction of any of them); a
probe looks at the tenants its session sees, its own first.  Each case leaves the
store's invariants whole, the map's among them; restores from an SSD index keep every
namespace under a key too."""

from __future__ import annotations

import os
import random

from kvtest import make_identity

from kvstore.first_blocks import Heads, also_heads, headed_by, no_longer_heads, visible_head
from kvstore.store import BlockStore, Namespace, Reservation

IDENT = make_identity()
SLOT = IDENT.block_bytes
KEY = b"k" * 16


def commit(store: BlockStore, ns: Namespace, keys: list[bytes]) -> None:
    r = store.reserve("w", ns, keys, None, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)


def test_a_key_of_many_heads_keeps_them_all_as_they_come_and_go() -> None:
    store = BlockStore(512 * SLOT, 64 * SLOT)
    spaces = [store.open_namespace(make_identity(tenant=f"t{i % 3}", model=f"m{i}"))
              for i in range(120)]
    for ns in spaces:
        commit(store, ns, [KEY, os.urandom(16)])
    store.check_invariants()
    assert set(headed_by(store.roots, KEY)) == set(spaces)
    # each tenant sees its own first head, whoever came before it
    for t in ("t2", "t1", "t0"):
        assert visible_head(store.roots, KEY, [t]) is spaces[int(t[1])]
    assert visible_head(store.roots, KEY, ["t9", "t1", "t0"]) is spaces[1]
    assert visible_head(store.roots, KEY, ["t9"]) is None
    left = list(spaces)
    random.Random(6).shuffle(left)
    while len(left) > 1:
        ns = left.pop()
        store.drop_subtree(ns, [ns.blocks[KEY]], [])
        store.check_invariants()
        assert set(headed_by(store.roots, KEY)) == set(left)
    assert store.roots[KEY] is left[0]  # one head: the common case's form again
    store.drop_subtree(left[0], [left[0].blocks[KEY]], [])
    assert KEY not in store.roots
    store.check_invariants()


def test_adding_a_head_twice_and_removing_one_never_there_change_nothing() -> None:
    store = BlockStore(8 * SLOT, 8 * SLOT)
    a, b, c = (store.open_namespace(make_identity(tenant=t, model=m))
               for t, m in (("a", "m1"), ("a", "m2"), ("b", "m1")))
    assert len({a, b, c}) == 3
    roots: dict[bytes, Heads] = {}
    for ns in (a, b, a, c, b):
        if roots.setdefault(KEY, ns) is not ns:
            also_heads(roots, KEY, ns)
    assert headed_by(roots, KEY) == (a, b, c)
    no_longer_heads(roots, KEY, store.open_namespace(make_identity(tenant="z")))
    no_longer_heads(roots, b"x" * 16, a)
    assert headed_by(roots, KEY) == (a, b, c)
    no_longer_heads(roots, KEY, a)
    no_longer_heads(roots, KEY, c)
    assert roots[KEY] is b


def test_restores_keep_one_first_key_of_two_namespaces() -> None:
    store = BlockStore(8 * SLOT, 8 * SLOT, ssd_capacity=64 * SLOT, ssd_slab_bytes=16 * SLOT)
    a = store.open_namespace(make_identity(tenant="a"))
    b = store.open_namespace(make_identity(tenant="b"))
    c = store.open_namespace(make_identity(tenant="c"))
    tail = [os.urandom(16) for _ in range(3)]
    # fresh namespaces, every record made; then one with a gap; then one with blocks
    assert store.ssd_copies.restore_columns(a, [KEY, *tail], [0, 1, 1, 1],
                                            [i * SLOT for i in range(4)], [0] * 4) == [True] * 4
    assert store.ssd_copies.restore_columns(b, [KEY, tail[0], tail[1]], [0, 1, -1],
                                            [i * SLOT for i in range(4, 7)], [0] * 3) == [
        True, True, False]
    commit(store, c, [os.urandom(16)])
    assert store.ssd_copies.restore_columns(c, [KEY], [0], [8 * SLOT], [0]) == [True]
    store.check_invariants()
    assert headed_by(store.roots, KEY) == (a, b, c)
    store.drop_subtree(b, [b.blocks[KEY]], [])
    store.check_invariants()
    assert headed_by(store.roots, KEY) == (a, c)
