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
