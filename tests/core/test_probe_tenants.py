"""A probe searches only the namespaces of the tenants its session may see: another
tenant's namespaces, however many, are never looked at (that tenant's count would
otherwise be every other client's loop time)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvtest import make_identity

from kvstore import protocol as p
from kvstore.auth import Auth
from kvstore.block_map import BlockMap
from kvstore.blocks import Block
from kvstore.config import AuthConfig, Config
from kvstore.routing import RoutingVerbs
from kvstore.sessions import Session
from kvstore.store import BlockStore, Namespace, Reservation


class Untouchable(BlockMap[Block]):
    """A namespace's blocks that count every look at them."""

    looks = 0

    def __contains__(self, key: object) -> bool:
        Untouchable.looks += 1
        return super().__contains__(key)

    def get(self, key: bytes, default: Any = None) -> Any:
        Untouchable.looks += 1
        return super().get(key, default)


class Daemon:
    """What the routing verbs use of the daemon, without its sockets."""

    def __init__(self, config: Config) -> None:
        ident = make_identity()
        self.config = config
        self.store = BlockStore(512 * ident.block_bytes, 64 * ident.block_bytes)
        self.auth = Auth(config)
        self.ssd = None
        self.transfers = None
        self.events = None
        self.max_keys = config.server.max_keys_per_request


def commit(store: BlockStore, ns: Namespace, keys: list[bytes]) -> None:
    r = store.reserve("w", ns, keys, None, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)


def probe(verbs: RoutingVerbs, tenant: str, keys: list[bytes]) -> p.ProbeReply:
    reply, _ = verbs.table()[p.Probe](Session("s", tenant), p.Probe(1, keys), [])
    assert isinstance(reply, p.ProbeReply)
    return reply


def crowd(daemon: Daemon, tenant: str, count: int) -> list[bytes]:
    """``count`` namespaces of ``tenant``, each one block; the keys of the blocks."""
    keys = []
    for i in range(count):
        ns = daemon.store.open_namespace(make_identity(tenant=tenant, model=f"m{i}"))
        ns.blocks = Untouchable()
        keys.append(os.urandom(16))
        commit(daemon.store, ns, keys[-1:])
    return keys


def test_a_probe_never_looks_at_another_tenants_namespaces() -> None:
    daemon = Daemon(Config())
    verbs = RoutingVerbs(daemon)  # type: ignore[arg-type]
    crowd(daemon, "crowd", 500)
    mine = daemon.store.open_namespace(make_identity(tenant="acme"))
    chain = [os.urandom(16) for _ in range(3)]
    commit(daemon.store, mine, chain)
    Untouchable.looks = 0
    assert probe(verbs, "acme", chain).tier_runs == [("dram", 3)]
    assert probe(verbs, "acme", [os.urandom(16)]).tier_runs == []  # a miss
    assert probe(verbs, "nobody", chain).tier_runs == []  # a tenant with no namespace
    assert Untouchable.looks == 0


def test_a_probe_still_finds_what_a_tenant_shares_with_the_session() -> None:
    config = Config(auth=AuthConfig(shared_tenants={"crowd": ["acme"]}))
    daemon = Daemon(config)
    verbs = RoutingVerbs(daemon)  # type: ignore[arg-type]
    keys = crowd(daemon, "crowd", 50)
    daemon.store.open_namespace(make_identity(tenant="acme"))
    assert probe(verbs, "acme", keys[17:18]).tier_runs == [("dram", 1)]
    assert probe(verbs, "other", keys[17:18]).tier_runs == []  # not shared with it


def test_a_probe_finds_what_a_tenant_lets_the_session_write_too() -> None:
    """A grantee named only in ``shared_writers`` may open (and so probe) the owner's
    namespaces as one in ``shared_tenants`` does."""
    config = Config(auth=AuthConfig(shared_writers={"crowd": ["acme"]}))
    daemon = Daemon(config)
    verbs = RoutingVerbs(daemon)  # type: ignore[arg-type]
    keys = crowd(daemon, "crowd", 50)
    daemon.store.open_namespace(make_identity(tenant="acme"))
    assert probe(verbs, "acme", keys[17:18]).tier_runs == [("dram", 1)]
    assert probe(verbs, "other", keys[17:18]).tier_runs == []


def test_the_invariant_check_holds_the_namespaces_grouped_by_tenant() -> None:
    """Every namespace is in its tenant's group and no group holds another: the check
    finds a namespace filed under the wrong tenant, or missing from its group."""
    ident = make_identity(tenant="acme")
    store = BlockStore(64 * ident.block_bytes, 8 * ident.block_bytes)
    ns = store.open_namespace(ident)
    store.check_invariants()
    store.tenant_namespaces["acme"].pop(ns.id)
    store.tenant_namespaces.setdefault("globex", {})[ns.id] = ns
    with pytest.raises(AssertionError, match="by tenant"):
        store.check_invariants()


def test_a_probe_looks_at_one_namespace_however_many_its_tenant_has() -> None:
    """The chain's namespace comes from the store's map of first blocks: a tenant's own
    thousand namespaces are not asked one by one (at 100k, 12 ms of the loop a probe),
    for a hit nor for a miss; the map follows the first blocks as they go."""
    daemon = Daemon(Config())
    verbs = RoutingVerbs(daemon)  # type: ignore[arg-type]
    keys = crowd(daemon, "acme", 1000)
    Untouchable.looks = 0
    assert probe(verbs, "acme", keys[700:701]).tier_runs == [("dram", 1)]
    assert Untouchable.looks == 1  # the one namespace's block, read once
    assert probe(verbs, "acme", [os.urandom(16)]).tier_runs == []  # a miss: none asked
    assert Untouchable.looks == 1
    store = daemon.store
    ns = store.roots[keys[700]]
    store.evict(ns, [keys[700]])
    assert keys[700] not in store.roots
    assert probe(verbs, "acme", keys[700:701]).tier_runs == []
    store.check_invariants()
    store.roots[keys[3]] = ns  # a first block filed under another namespace: found
    with pytest.raises(AssertionError, match="first blocks"):
        store.check_invariants()
