"""The store's switch of eviction policy (SIGHUP) in process: what the new order is
handed (the daemon-level switch is in tests/integration/test_policy_switch.py)."""

from __future__ import annotations

import pytest
from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Plan

IDENT = make_identity()


@pytest.mark.parametrize("at_once", [True, False])
def test_a_switch_hands_the_new_order_every_block_in_one_call(at_once: bool) -> None:
    """A chain's head hit after its tails is listed after them by LRU: handed over one
    block a call, hit density linked no tail to it (its head counted no children).
    In steps (``at_once`` false, as the daemon switches), the same."""
    slot = IDENT.block_bytes
    store = BlockStore(8 * slot, 8 * slot)
    ns = store.open_namespace(IDENT)
    bt = IDENT.block_tokens
    keys = chain_keys(ns.id, list(range(3 * bt)), bt)
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
    pin = store.acquire("o", ns, keys[:1], 0.0)  # the head: hit last, and held
    store.set_eviction_policy("density", at_once=at_once)
    while store.switch_step(1):
        store.check_invariants()
    order = ns.dram.policy(ns.cls)
    entries = order.inner._entries  # type: ignore[attr-defined]
    assert [entries[ns.blocks[k]].kids for k in keys] == [1, 1, 0]
    store.release("o", pin.id)  # type: ignore[union-attr]
    assert len(order) == 3
    store.check_invariants()


def test_auto_let_go_and_taken_again_tracks_every_block_afresh() -> None:
    """``auto`` keeps each block's state in the block: a switch away unsets every one
    (pinned blocks' too), so a later ``auto`` takes the same blocks as new rather than
    skipping them as tracked (its order then lacked them: 0 of 6 listed)."""
    slot = IDENT.block_bytes
    store = BlockStore(8 * slot, 8 * slot, eviction_policy="auto")
    ns = store.open_namespace(IDENT)
    bt = IDENT.block_tokens
    keys = chain_keys(ns.id, list(range(6 * bt)), bt)
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
    pin = store.acquire("o", ns, keys[:2], 0.0)  # held through both switches
    assert all(ns.blocks[k].dram_duel is not None for k in keys)
    store.set_eviction_policy("lru")
    while store.switch_step(2):
        store.check_invariants()
    assert all(ns.blocks[k].dram_duel is None for k in keys)
    store.check_invariants()
    store.set_eviction_policy("auto")
    while store.switch_step(2):
        store.check_invariants()
    store.release("o", pin.id)  # type: ignore[union-attr]
    assert len(ns.dram.policy(ns.cls)) == len(keys)
    assert all(ns.blocks[k].dram_duel is not None for k in keys)
    store.check_invariants()


def test_an_admission_count_a_block_cannot_reach_is_refused() -> None:
    from kvstore.errors import ConfigError

    for most in (0, 8):
        with pytest.raises(ConfigError, match="ssd_admit_after"):
            BlockStore(8 * IDENT.block_bytes, 8 * IDENT.block_bytes, ssd_admit_after=most)


@pytest.mark.parametrize("policy", ["slru", "arc", "density", "auto"])
@pytest.mark.parametrize("hit", ["lookup", "acquire"])
def test_a_block_being_demoted_and_hit_during_a_switch_stays_off_the_order(
        policy: str, hit: str) -> None:
    """A block whose write to SSD is under way is off every order; a lookup's hit on
    it while a switch went was taken into the switch's order: the block was a victim
    again while its first write ran (a second write of it, whose end failed the
    store's assertions), and one pinned meanwhile stayed evictable."""
    slot, slots = 4096, 16
    store = BlockStore(slots * slot, slots * slot, eviction_policy="lru",
                       clock=lambda: 0.0, ssd_capacity=4 * slots * slot,
                       ssd_slab_bytes=slots * slot)
    ns = store.open_namespace(make_identity(num_layers=1, num_kv_heads=1, head_dim=8))
    bt = ns.identity.block_tokens
    full = chain_keys(ns.id, [1] * (bt * slots), bt)  # fills DRAM
    r = store.reserve("s", ns, full, None, 0.0)
    store.commit("s", r.id, 0.0)  # type: ignore[union-attr]
    store.lookup(ns, full)  # seen twice: admitted to SSD when evicted
    store.set_eviction_policy(policy)  # SIGHUP: carried through in steps
    plan = store.reserve("s", ns, chain_keys(ns.id, [2] * (bt * 4), bt), None, 0.0)
    assert isinstance(plan, Plan) and plan.demote, plan
    first, _ = store.ssd_copies.reserve(plan.demote)  # the write to SSD under way
    assert store.switches, "the switch is still under way"
    pin = None
    if hit == "lookup":
        store.lookup(ns, full)
    else:
        pin = store.acquire("s", ns, full, 0.0)
    store.check_invariants()
    later = store.reserve("s", ns, chain_keys(ns.id, [3] * (bt * 4), bt), None, 0.0)
    if isinstance(later, Plan):
        assert not set(later.demote) & set(plan.demote), "a block demoted twice at once"
        store.ssd_copies.reserve(later.demote)
    store.ssd_copies.finish_write(first, [object()] * len(first.blocks))
    store.check_invariants()
    if pin is not None:
        store.release("s", pin.id)  # type: ignore[union-attr]
    while store.switch_step(4):
        store.check_invariants()
    store.check_invariants()
