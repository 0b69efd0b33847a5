"""An evict or drop waits only for the get replies still being sent of its own
namespace's blocks: a peer of another tenant that asks for gets and never reads them
left every other tenant's evicts and drops waiting a second each (an attack review)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvtest import make_identity

from kvstore.store import BlockStore
from kvstore.removals import GET_OWNER, Removals


class Transport:
    def __init__(self, in_flight: list[tuple[str, int]]) -> None:
        self.in_flight = in_flight

    def sending(self) -> list[str]:
        return [tracker for tracker, _ in self.in_flight]

    def trackers_of(self, pins: set[int]) -> list[str]:
        return [tracker for tracker, pin in self.in_flight if pin in pins]


def test_only_the_namespaces_own_unsent_replies_are_waited_for() -> None:
    a, b = make_identity(tenant="acme"), make_identity(tenant="globex")
    store = BlockStore(64 * a.block_bytes, 16 * a.block_bytes)
    ns_a, ns_b = store.open_namespace(a), store.open_namespace(b)
    for ns in (ns_a, ns_b):
        keys = [bytes([ns is ns_a]) * 15 + bytes([i]) for i in range(4)]
        r = store.reserve("w", ns, keys, None, 0.0)
        store.commit("w", r.id, 0.0)
    pins = {ns: store.acquire(GET_OWNER, ns, list(ns.blocks)[:2], 0.0) for ns in (ns_a, ns_b)}
    in_flight = [(f"reply-{i}", pins[ns_a].id) for i in range(1000)]
    in_flight.append(("reply-b", pins[ns_b].id))
    daemon: Any = SimpleNamespace(store=store, transport=Transport(in_flight))
    removals = Removals(daemon)
    assert removals._sending_in(ns_b) == ["reply-b"]
    assert len(removals._sending_in(ns_a)) == 1000
    daemon.transport = Transport([])
    assert removals._sending_in(ns_a) == []


def test_only_the_asking_sessions_unsent_replies_are_waited_for() -> None:
    """A grantee reading the owner's namespace and never taking its replies does not
    hold the owner's evicts and drops (they waited a second each)."""
    ident = make_identity(tenant="public")
    store = BlockStore(64 * ident.block_bytes, 16 * ident.block_bytes)
    ns = store.open_namespace(ident)
    keys = [bytes([9]) * 15 + bytes([i]) for i in range(4)]
    r = store.reserve("w", ns, keys, None, 0.0)
    store.commit("w", r.id, 0.0)
    owner, grantee = object(), object()
    mine = store.acquire(GET_OWNER, ns, keys[:1], 0.0)
    theirs = store.acquire(GET_OWNER, ns, keys[1:3], 0.0)
    sending = {mine.id: (owner, 1), theirs.id: (grantee, 1)}
    in_flight = [("owner-reply", mine.id)] + [(f"grantee-{i}", theirs.id) for i in range(400)]
    daemon: Any = SimpleNamespace(store=store, transport=Transport(in_flight))
    removals = Removals(daemon, sending)
    assert removals._sending_in(ns, owner) == ["owner-reply"]
    assert len(removals._sending_in(ns, grantee)) == 400
