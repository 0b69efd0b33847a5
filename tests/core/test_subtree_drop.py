"""Subtrees dropped in steps (``kvstore.core.SubtreeDrop``) against the pure store: an
evict whose key heads a big subtree, and the sweep below a hollow entry.

Between steps the store goes on changing, as the daemon's loop serves other clients.
Each step must leave the invariants whole, remove leaves before their parents (a lookup
sees chains shortened from their ends, never a hole), keep what is pinned and what was
committed after the drop began (and their prefixes), and end with what the one-go
``evict`` leaves.
"""

from __future__ import annotations

import random

from kvtest import make_identity

from kvstore.core import SWEEP_SLICE
from kvstore.store import BlockStore, Namespace, Pin, Reservation
from kvstore.core import SubtreeDrop

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks


def commit(store: BlockStore, ns: Namespace, keys: list[bytes], parent: bytes | None) -> None:
    r = store.reserve("w", ns, keys, parent, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)


def tree(store: BlockStore, ns: Namespace, rng: random.Random, branches: int,
         length: int) -> list[list[bytes]]:
    """A trunk of ``length`` keys, and ``branches`` chains hanging off points along it
    (and off each other): every chain, from the trunk's first key."""
    trunk = [rng.randbytes(16) for _ in range(length)]
    commit(store, ns, trunk, None)
    out = [trunk]
    for _ in range(branches):
        base = rng.choice(out)
        at = rng.randrange(1, len(base))
        more = [rng.randbytes(16) for _ in range(rng.randint(1, length))]
        commit(store, ns, more, base[at - 1])
        out.append(base[:at] + more)
    return out


def new_store() -> tuple[BlockStore, Namespace]:
    store = BlockStore(64 << 20, 1 << 20)
    return store, store.open_namespace(IDENT)


def no_hole(ns: Namespace) -> None:
    for block in ns.blocks.values():
        assert block.parent is None or ns.blocks.get(block.parent.key) is block.parent


def test_an_evict_in_small_steps_ends_as_the_one_go_evict() -> None:
    rng = random.Random(5)
    a, ns_a = new_store()
    b, ns_b = new_store()
    chains = tree(a, ns_a, random.Random(1), 60, 80)
    tree(b, ns_b, random.Random(1), 60, 80)
    other = [rng.randbytes(16) for _ in range(50)]  # another root: not evicted
    commit(a, ns_a, other, None)
    commit(b, ns_b, other, None)
    held = chains[7][:len(chains[7]) - 3]
    assert isinstance(a.acquire("reader", ns_a, held, 0.0), Pin)
    assert isinstance(b.acquire("reader", ns_b, held, 0.0), Pin)
    before = len(ns_a.blocks)
    drop = SubtreeDrop(a, ns_a, [chains[0][0], rng.randbytes(16)])  # (a key not there)
    steps = 0
    hits = [len(a.lookup(ns_a, c)) for c in chains]
    while not drop.step(rng.randint(1, 200)):
        steps += 1
        a.check_invariants()
        no_hole(ns_a)
        now = [len(a.lookup(ns_a, c)) for c in chains]
        assert all(n <= h for n, h in zip(now, hits)), "a chain grew back"
        hits = now
    assert steps > 20, "the steps were not small"
    count, _ = b.evict(ns_b, [chains[0][0]])
    assert drop.count == count == before - len(held) - len(other)
    assert sorted(ns_a.blocks) == sorted(ns_b.blocks) == sorted(held + other)
    a.check_invariants()


def test_a_long_chain_goes_in_bounded_steps_from_its_end() -> None:
    store, ns = new_store()
    rng = random.Random(3)
    chain = [rng.randbytes(16) for _ in range(5000)]
    commit(store, ns, chain, None)
    drop = SubtreeDrop(store, ns, [chain[0]])
    steps = 0
    while not drop.step(256):
        steps += 1
        assert drop.visits <= 256
        left = len(store.lookup(ns, chain))
        assert left == len(ns.blocks) > 0  # what is left is a prefix of the chain
    assert steps > 20 and drop.count == 5000 and not ns.blocks
    store.check_invariants()


def test_what_changes_between_steps_is_taken_as_found() -> None:
    store, ns = new_store()
    rng = random.Random(4)
    chains = tree(store, ns, rng, 40, 60)
    drop = SubtreeDrop(store, ns, [chains[0][0]])
    drop.keep_commits()
    assert not drop.step(150)
    # meanwhile: a commit onto a block of the subtree, a part evicted by another, a pin
    onto = next(c for c in chains[1:] if len(store.lookup(ns, c)) == len(c))
    more = [rng.randbytes(16) for _ in range(5)]
    commit(store, ns, more, onto[10])
    gone, _ = store.evict(ns, [c[-2] for c in chains if ns.blocks.get(c[-2]) is not None])
    assert gone
    pinned = next(c for c in chains if len(store.lookup(ns, c)) > 30)[:30]
    pin = store.acquire("reader", ns, pinned, 0.0)
    assert isinstance(pin, Pin)
    while not drop.step(rng.randint(1, 100)):
        store.check_invariants()
        no_hole(ns)
    # kept: the commit with its prefix, and the pinned blocks with theirs
    assert len(store.lookup(ns, onto[:11] + more)) == 16
    assert len(store.lookup(ns, pinned)) == 30
    assert set(ns.blocks) == set(onto[:11] + more) | set(pinned)
    assert "dropping" not in repr(store.dropping) and not store.dropping
    store.release("reader", pin.id)
    count, _ = store.evict(ns, [chains[0][0]])
    assert count == len(set(onto[:11] + more) | set(pinned)) and not ns.blocks
    store.check_invariants()


def test_the_sweep_below_a_hollow_entry_goes_in_bounded_calls() -> None:
    store, ns = new_store()
    rng = random.Random(6)
    chains = tree(store, ns, rng, 60, 100)
    root = ns.blocks[chains[0][0]]
    pin = store.acquire("reader", ns, chains[3][10:15], 0.0)  # (not the root)
    assert isinstance(pin, Pin)
    # the root loses its last copy (as to a corrupt read): hollow, what is below stays
    store.drop_dram_copy(root)
    store.hollow.add(root)
    asked: list[int] = []
    store.sweep_later = lambda: asked.append(len(ns.blocks))
    size = len(ns.blocks)
    assert size > 4 * SWEEP_SLICE // 2
    store.check_invariants()
    calls = 0
    while not store.sweep_hollow():  # the daemon's loop turns, one call each
        calls += 1
        assert size - len(ns.blocks) <= SWEEP_SLICE, "a call went through too much"
        size = len(ns.blocks)
        assert len(asked) == calls, "a call stopped short without asking for another"
        store.check_invariants()
        no_hole(ns)
    assert calls >= 2
    # the hollow root and the path to what is pinned stay until the pin goes
    assert set(ns.blocks) == set(chains[3][:15]) and root in store.hollow
    store.release("reader", pin.id)  # a release sweeps again: nothing below is in use
    while store._sweeping is not None or store._sweeps:
        store.sweep_hollow()
    assert not ns.blocks and not store.hollow
    store.check_invariants()


def test_a_release_sweeps_once_for_the_whole_pin() -> None:
    store, ns = new_store()
    rng = random.Random(7)
    chain = [rng.randbytes(16) for _ in range(600)]
    commit(store, ns, chain, None)
    pin = store.acquire("reader", ns, chain[100:600], 0.0)
    assert isinstance(pin, Pin)
    root = ns.blocks[chain[0]]
    store.drop_dram_copy(root)
    store.hollow.add(root)
    store.sweep_hollow()  # what is not in use goes: nothing here (all below is pinned)
    assert len(ns.blocks) == 600
    sweeps: list[int] = []
    sweep = store.sweep_hollow

    def counted() -> bool:
        sweeps.append(len(ns.blocks))
        return sweep()
    store.sweep_hollow = counted  # type: ignore[method-assign]
    store.release("reader", pin.id)
    # one sweep after the whole pin went (a sweep a block walked the chain 500 times)
    assert sweeps == [600] and not ns.blocks and not store.hollow
    store.check_invariants()


def _revivable_store() -> tuple[BlockStore, Namespace, list[bytes], list[bytes]]:
    """A root with two chains below it; the first block of the second is on SSD only."""
    ident = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)
    store = BlockStore(64 << 20, 1 << 20, ssd_capacity=4096 * 4096, ssd_slab_bytes=1 << 20)
    ns = store.open_namespace(ident)
    rng = random.Random(1)
    root = [rng.randbytes(16)]
    a = [rng.randbytes(16) for _ in range(200)]
    b = [rng.randbytes(16) for _ in range(100)]
    for keys, parent in ((root, None), (a, root[0]), (b, root[0])):
        r = store.reserve("w", ns, keys, parent, 0.0)
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)
    x = ns.blocks[b[0]]
    t, _ = store.ssd_copies.reserve([x])
    store.ssd_copies.finish_write(t, [object()])
    store.drop_dram_copy(x)
    return store, ns, root + a, b


def test_a_block_given_a_copy_again_mid_evict_is_kept_and_what_hung_below_it_goes() -> None:
    """A commit that gives an SSD-only block a DRAM copy again keeps it (the store lists
    it as committed meanwhile), wherever the walk stands; the blocks that hung below it
    before the evict go, as a namespace drop takes them (a second reader found both
    left wrong: the block dropped on the climb, or the walk never entering it)."""
    for steps_before in (1, 50, 250):
        store, ns, trunk, b = _revivable_store()
        drop = SubtreeDrop(store, ns, [trunk[0]])
        drop.keep_commits()
        assert not drop.step(steps_before)
        r = store.reserve("w", ns, [b[0]], trunk[0], 0.0)  # revives b[0]
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)
        while not drop.step(7):
            store.check_invariants()
        store.check_invariants()
        assert b[0] in ns.blocks and trunk[0] in ns.blocks, steps_before
        assert sum(k in ns.blocks for k in b[1:] + trunk[1:]) == 0, steps_before
        assert len(ns.blocks) == 2
