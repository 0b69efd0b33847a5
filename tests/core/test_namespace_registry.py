"""The store's namespaces by tenant: a drop that empties one takes it out of both maps,
one still in use stays, and a namespace taken out takes no new blocks."""

from __future__ import annotations

import os

import pytest
from kvtest import make_identity

from kvstore.errors import NotFoundError
from kvstore.store import BlockStore, Reservation


def test_a_drop_forgets_an_emptied_namespace_and_keeps_one_in_use() -> None:
    ident = make_identity()
    store = BlockStore(64 * ident.block_bytes, 16 * ident.block_bytes)
    ns = store.open_namespace(ident)
    other = store.open_namespace(make_identity(model="other"))
    r = store.reserve("w", ns, [os.urandom(16)], None, 0.0)
    assert isinstance(r, Reservation)
    assert store.drop_namespace(ns)[0] == 0
    assert store.namespaces[ns.id] is ns  # an open reservation would commit into it
    store.commit("w", r.id, 0.0)
    assert store.drop_namespace(ns)[0] == 1
    assert ns.id not in store.namespaces
    assert store.tenant_namespaces == {"acme": {other.id: other}}
    with pytest.raises(NotFoundError, match="dropped"):
        store.reserve("w", ns, [os.urandom(16)], None, 0.0)
    assert store.reserved_slots == 0
    store.drop_namespace(other)
    assert store.tenant_namespaces == {} and store.namespaces == {}
    again = store.open_namespace(ident)
    assert again is not ns and store.tenant_namespaces == {"acme": {ns.id: again}}
    store.check_invariants()
