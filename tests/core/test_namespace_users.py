"""A namespace's users in the store: it is forgotten once nothing uses it and it holds no
entry, never while a reservation in it is being made or is open."""

from __future__ import annotations

from kvtest import make_identity

from kvstore.blocks import Namespace
from kvstore.keys import chain_keys
from kvstore.store import BlockStore

IDENT = make_identity(tenant="acme", model="m")
SLOT = IDENT.block_bytes
REMOTE = ("daemon", "remote")  # an owner of the daemon's own, as a fetch's


def chain(ns: Namespace, start: int, blocks: int) -> list[bytes]:
    tokens = [start * 1000 + t for t in range(IDENT.block_tokens * blocks)]
    return chain_keys(ns.id, tokens, IDENT.block_tokens)


def test_a_reservation_that_evicts_its_namespaces_last_blocks_keeps_the_namespace() -> None:
    store = BlockStore(4 * SLOT, 4 * SLOT)  # room for four blocks
    forgotten: list[Namespace] = []
    store.on_forget = forgotten.append
    ns = store.open_namespace(IDENT)
    old = chain(ns, 1, 4)
    r = store.reserve("s1", ns, old, None, 0.0)
    assert not isinstance(r, list)
    store.commit("s1", r.id, 0.0)
    assert not store.close_namespace(ns)  # its session ended: its blocks keep it
    # a fetch of another chain for nobody's session: room is made by evicting the old
    store.touch_owner(REMOTE, float("inf"))
    new = chain(ns, 2, 4)
    r = store.reserve(REMOTE, ns, new, None, 0.0)
    assert not ns.forgotten and forgotten == [] and store.namespaces[ns.id] is ns
    store.commit(REMOTE, r.id, 0.0)
    store.check_invariants()
    assert len(store.lookup(store.open_namespace(IDENT), new)) == 4  # reachable


def test_a_namespace_is_forgotten_when_its_last_user_or_entry_goes() -> None:
    store = BlockStore(4 * SLOT, 4 * SLOT)
    forgotten: list[Namespace] = []
    store.on_forget = forgotten.append
    ns = store.open_namespace(IDENT)
    keys = chain(ns, 1, 2)
    r = store.reserve("s1", ns, keys, None, 0.0)
    store.close_namespace(ns)  # the session is done with it; the reservation is not
    assert forgotten == []
    store.abort("s1", r.id)  # nothing holds it now, and it has no entry
    assert forgotten == [ns] and ns.forgotten and ns.id not in store.namespaces
    store.check_invariants()
    again = store.open_namespace(IDENT)  # made anew
    assert again is not ns and again.users == 1
    r = store.reserve("s1", again, keys, None, 0.0)
    store.commit("s1", r.id, 0.0)
    store.close_namespace(again)
    assert again.id in store.namespaces  # entries keep it
    assert store.evict(again, keys)[0] == 2  # its last entries go: forgotten
    assert forgotten == [ns, again] and again.id not in store.namespaces
    store.check_invariants()
