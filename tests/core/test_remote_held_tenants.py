"""Write-through blocks held back for a tenant that skips the remote tier (its own calls
timed out: ``remote_health``) wait for that tenant, not for the tier.  Every commit of
any other tenant's took all of them and sent them, each found its tenant still skipping
and held again: the held blocks (up to 16384) walked on the loop at each commit, and each
counted once more in ``deferred_writes``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from kvtest import make_identity

import kvstore.remote_held
from kvstore.config import Config, RemoteConfig
from kvstore.keys import chain_keys
from kvstore.remote import RemoteTier
from kvstore.remote_held import HeldWrites
from kvstore.store import BlockStore, Namespace
from kvstore.transfers import TransferGate

SKIPPING = make_identity(tenant="acme", model="m")
OTHER = make_identity(tenant="globex", model="m")
BLOCKS = 32


def test_blocks_held_for_a_skipping_tenant_wait_for_it_and_count_once() -> None:
    async def main() -> None:
        size = SKIPPING.block_bytes
        store = BlockStore(4 * BLOCKS * size, 4 * BLOCKS * size, remote_tier=True)
        arena = bytearray(4 * BLOCKS * size)
        remote = RemoteTier(
            Config(remote=RemoteConfig(url="memory://")), store,
            lambda _ns, off: memoryview(arena)[off:off + size], TransferGate(4))
        taken = 0  # blocks of the skipping tenant's handed to a send
        put = remote.send_blocks

        async def counted(ns: Namespace, blocks: list) -> None:  # type: ignore[type-arg]
            nonlocal taken
            taken += len(blocks) if ns.tenant == "acme" else 0
            await put(ns, blocks)

        remote.send_blocks = counted  # type: ignore[method-assign]

        async def commit(ns: Namespace, first: int, n: int) -> None:
            keys = chain_keys(ns.id, list(range(first, first + n * 16)), 16)
            r = store.reserve("s1", ns, keys, None, 0.0)
            result = store.commit("s1", r.id, 0.0)  # type: ignore[union-attr]
            remote.committed(result.blocks)
            for _ in range(10):
                await asyncio.sleep(0)  # the background sends

        skipping, other = store.open_namespace(SKIPPING), store.open_namespace(OTHER)
        remote.health.tenants["acme"] = remote.health.clock() + 60  # its calls timed out
        await commit(skipping, 0, BLOCKS)
        assert remote.counters["deferred_writes"] == BLOCKS and taken == BLOCKS
        for i in range(5):  # others' commits while acme still skips
            await commit(other, 10**6 * (i + 1), 1)
        assert remote.counters["writes"] == 5
        assert remote.counters["deferred_writes"] == BLOCKS, remote.counters
        assert taken == BLOCKS, "the held blocks were taken and held again at each commit"
        del remote.health.tenants["acme"]  # its skip is over: the next commit sends them
        await commit(other, 10**7, 1)
        assert remote.counters["writes"] == 6 + BLOCKS, remote.counters
        assert all(b.remote for b in skipping.blocks.values())
        await remote.close()

    asyncio.run(main())


class Held:  # what the hold reads of a block: its namespace's tenant
    def __init__(self, ns: SimpleNamespace) -> None:
        self.ns = ns


def test_past_the_bound_the_tenant_holding_most_lets_its_oldest_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvstore.remote_held, "DEFERRED_MOST", 4)
    counters = {"deferred_writes": 0, "unsent_writes": 0}
    held = HeldWrites(counters)
    a = [Held(SimpleNamespace(tenant="a")) for _ in range(5)]
    b = Held(SimpleNamespace(tenant="b"))
    held.hold([b])  # type: ignore[list-item]
    held.hold(a)  # type: ignore[arg-type]
    assert len(held) == 4 and counters == {"deferred_writes": 6, "unsent_writes": 2}
    assert held.take(lambda tenant: tenant == "b") == [b]  # another's flood kept it
    assert held.take(lambda tenant: True) == a[2:] and len(held) == 0
