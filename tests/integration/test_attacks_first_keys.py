"""A chain's first key may head chains in several namespaces when clients send keys of
their own making: the store's map of first blocks held one namespace a key, so another
tenant committing a block under acme's first key (known, as of a shared system prompt)
took acme's place there, and acme's routers found nothing cached; dropping it then
left the map without acme's entry (an invariant broken)."""

from __future__ import annotations

from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.blocks import Namespace
from kvstore.first_blocks import also_heads, headed_by, no_longer_heads
from kvstore.store import BlockStore

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")  # 64 KiB
GLOBEX = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="globex")
TOKENS = list(range(5000, 5000 + IDENT.block_tokens * 8))


def test_another_tenants_block_under_my_first_key_hides_nothing(daemon_factory: Any) -> None:
    d = daemon_factory(tcp=True)
    with Client(d.endpoint, tenant="acme") as acme, Client(d.endpoint, tenant="globex") as globex:
        mine = acme.namespace(IDENT)
        keys = mine.keys(TOKENS)
        mine.put(keys, [bytes([i]) * IDENT.block_bytes for i in range(len(keys))])
        assert acme.route(keys, [d.tcp_endpoint], deadline=2.0)[0].hits == 8
        theirs = globex.namespace(GLOBEX)
        theirs.put(keys[:1], [b"\x66" * IDENT.block_bytes])  # acme's first key, raw
        assert acme.route(keys, [d.tcp_endpoint], deadline=2.0)[0].hits == 8
        assert globex.route(keys[:1], [d.tcp_endpoint], deadline=2.0)[0].hits == 1
        theirs.drop()
        assert acme.route(keys, [d.tcp_endpoint], deadline=2.0)[0].hits == 8
        assert acme.stats()["invariant_violations"] == 0
        mine.drop()
        assert acme.route(keys, [d.tcp_endpoint], deadline=2.0)[0].hits == 0


def test_the_map_keeps_every_namespace_a_key_heads() -> None:
    store = BlockStore(64 * IDENT.block_bytes, 64 * IDENT.block_bytes)
    a = store.open_namespace(make_identity(tenant="a"))
    b = store.open_namespace(make_identity(tenant="b"))
    c = store.open_namespace(make_identity(tenant="c"))
    roots: dict[bytes, Any] = {}
    key = b"k" * 16
    for ns in (a, b, c, b):
        if roots.setdefault(key, ns) is not ns:
            also_heads(roots, key, ns)
    assert headed_by(roots, key) == (a, b, c)
    no_longer_heads(roots, key, b)
    assert headed_by(roots, key) == (a, c)
    no_longer_heads(roots, key, a)
    assert roots[key] is c and headed_by(roots, key) == (c,)
    no_longer_heads(roots, key, a)  # not a head: nothing changes
    no_longer_heads(roots, key, c)
    assert key not in roots and headed_by(roots, key) == ()
    assert isinstance(a, Namespace)


def test_drop_of_one_namespace_keeps_the_others_first_block() -> None:
    store = BlockStore(64 * IDENT.block_bytes, 64 * IDENT.block_bytes)
    a = store.open_namespace(make_identity(tenant="a"))
    b = store.open_namespace(make_identity(tenant="b"))
    key = b"k" * 16
    for owner, ns in (("sa", a), ("sb", b)):
        r = store.reserve(owner, ns, [key], None, 0.0)
        store.commit(owner, r.id, 0.0)  # type: ignore[union-attr]
    assert set(headed_by(store.roots, key)) == {a, b}
    store.drop_subtree(b, [b.blocks[key]], [])
    store.check_invariants()
    assert headed_by(store.roots, key) == (a,)
