"""A reservation of no keys, open beside others of its session's tenant: ending the
two in either order, by abort, commit or lease expiry, leaves the tenant's count of
reserved slots exact (the protocol fuzz found an abort answered ``internal``: the
empty one's end deleted the count the other one still held)."""

from __future__ import annotations

import itertools

import pytest
from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.store import BlockStore

IDENT = make_identity(tenant="acme", model="m")
SLOT = IDENT.block_bytes


@pytest.mark.parametrize("empty_made_first, empty_ends_first, ends", itertools.product(
    [True, False], [True, False], itertools.product(["abort", "commit"], repeat=2)))
def test_an_empty_reservation_never_upsets_the_tenants_count(
        empty_made_first: bool, empty_ends_first: bool, ends: tuple[str, str]) -> None:
    store = BlockStore(8 * SLOT, 8 * SLOT)
    ns = store.open_namespace(IDENT)
    keys = chain_keys(ns.id, list(range(IDENT.block_tokens * 2)), IDENT.block_tokens)
    made = {}
    for k in ([], keys) if empty_made_first else (keys, []):
        r = store.reserve("s1", ns, k, None, 0.0)
        assert not isinstance(r, list)
        made[bool(k)] = r
    state = store.leases.state("s1")
    assert state.reserved_in == {"acme": 2}
    order = [made[False], made[True]] if empty_ends_first else [made[True], made[False]]
    for r, end in zip(order, ends):
        if end == "abort":
            store.abort("s1", r.id)
        else:
            store.commit("s1", r.id, 0.0)
        still_open = made[True].id in state.reservations
        assert state.reserved_in == ({"acme": 2} if still_open else {})
    assert not state.reservations and store.reserved_slots == 0
    store.check_invariants()


def test_an_empty_reservation_ended_after_the_other_one() -> None:
    store = BlockStore(8 * SLOT, 8 * SLOT)
    ns = store.open_namespace(IDENT)
    keys = chain_keys(ns.id, list(range(IDENT.block_tokens * 2)), IDENT.block_tokens)
    empty = store.reserve("s1", ns, [], None, 0.0)
    full = store.reserve("s1", ns, keys, None, 0.0)
    assert not isinstance(empty, list) and not isinstance(full, list)
    store.abort("s1", full.id)
    store.abort("s1", empty.id)  # was KeyError('acme')
    assert store.leases.state("s1").reserved_in == {}
    store.check_invariants()
