"""The remote tier's places for backend calls: no one tenant holds them all.  A place is
handed on only when a whole call leaves, so a tenant holding every place (four heavy
readers of 64 MiB calls) made another tenant's one-block read wait for one of its whole
calls (benchmarks/remote_fairness.py: 2 ms alone, 37 ms median, 143 ms max beside them)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtest import make_identity

from kvstore.config import Config, RemoteConfig
from kvstore.keys import chain_keys
from kvstore.plugins.memory_backend import MemoryBackend
from kvstore.plugins.turns import UrgentFirst
from kvstore.remote import RemoteTier
from kvstore.store import BlockStore
from kvstore.transfers import TransferGate

HEAVY = make_identity(tenant="acme", model="m")
LIGHT = make_identity(tenant="globex", model="m")


def test_a_tenant_holds_at_most_its_most_and_the_others_come_in() -> None:
    async def scenario() -> list[str]:
        bound = UrgentFirst(4, tenant_most=3)
        order: list[str] = []
        release = asyncio.Event()

        async def call(name: str, urgent: bool, tenant: str) -> None:
            async with bound.hold(urgent, tenant):
                order.append(name)
                await release.wait()

        heavy = [asyncio.create_task(call(f"a{i}", True, "a")) for i in range(5)]
        await asyncio.sleep(0)
        assert order == ["a0", "a1", "a2"] and bound.waiting == 2
        light = asyncio.create_task(call("b", True, "b"))
        writes = [asyncio.create_task(call(f"w{i}", False, "")) for i in range(2)]
        await asyncio.sleep(0)
        assert order == ["a0", "a1", "a2", "b"]  # the place kept: another tenant's
        assert "free=0" in repr(bound) and bound.waiting == 4
        release.set()
        await asyncio.gather(*heavy, light, *writes)
        assert bound.waiting == 0 and "free=4, holding=0" in repr(bound)
        return order

    order = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert order[4:] == ["a3", "a4", "w0", "w1"], order  # reads first, then the writes


def test_another_tenants_lookup_waits_for_no_whole_call_of_a_tenant_holding_places() -> None:
    async def main() -> None:
        store = BlockStore(64 * HEAVY.block_bytes, 64 * HEAVY.block_bytes, remote_tier=True)
        heavy, light = store.open_namespace(HEAVY), store.open_namespace(LIGHT)
        remote = RemoteTier(Config(remote=RemoteConfig(url="memory://", concurrency=4)),
                            store, lambda _ns, _off: memoryview(bytearray(0)),
                            TransferGate(4))
        inner = remote.backend.inner
        assert isinstance(inner, MemoryBackend)
        exists = inner.exists
        release = asyncio.Event()
        in_call = 0

        async def slow_exists(namespace: bytes, keys: Sequence[bytes]) -> int:
            nonlocal in_call
            if namespace == heavy.id:  # a big call of the heavy tenant's, still going
                in_call += 1
                await release.wait()
            return await exists(namespace, keys)

        inner.exists = slow_exists  # type: ignore[method-assign]
        keys = [chain_keys(heavy.id, list(range(i * 16, i * 16 + 16)), 16) for i in range(6)]
        calls = [asyncio.create_task(remote.leading(heavy, k)) for k in keys]
        for _ in range(5):
            await asyncio.sleep(0)
        assert in_call == 3, in_call  # a place kept from the heavy tenant
        one = asyncio.create_task(remote.leading(
            light, chain_keys(light.id, list(range(16)), 16)))
        await asyncio.wait({one}, timeout=2)
        waited = not one.done()
        release.set()
        await asyncio.gather(one, *calls)
        assert not waited, "another tenant's lookup waited for a whole call of the heavy one"
        assert one.result() == 0 and remote.counters["lookups"] == 7
        await remote.close()

    asyncio.run(main())
