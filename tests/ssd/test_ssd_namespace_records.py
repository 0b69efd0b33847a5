"""The SSD index's namespace records follow the store: a forgotten namespace's record goes
(in one transaction off the loop), one opened again before or while that runs keeps it,
and a restore forgets the namespaces that come back with no block."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvtest import make_identity

from kvstore.config import load_config
from kvstore.identity import Identity
from kvstore.store import BlockStore, Namespace
from kvstore.tiering import SsdMover
from kvstore.transfers import TransferGate

IDENT = make_identity(tenant="acme", model="m")


def mover(path: Path) -> tuple[BlockStore, SsdMover]:
    config = load_config(overrides={
        "dram": {"capacity": 4 << 20},
        "ssd": {"path": str(path), "capacity": 16 << 20, "slab_size": 1 << 20,
                "direct_io": False, "preallocate": False}})
    store = BlockStore(config.dram_capacity, 1 << 20, ssd_capacity=config.ssd_capacity,
                       ssd_slab_bytes=config.ssd_slab_bytes)
    ssd = SsdMover(config, store, lambda ns, offset: memoryview(b""), TransferGate(4))
    ssd.restore()
    store.on_forget = ssd.forget_namespace
    return store, ssd


def opened(store: BlockStore, ssd: SsdMover, identity: Identity) -> Namespace:
    """As a session's open does: the record first, then the namespace."""
    if identity.namespace_id not in store.namespaces:
        ssd.remember_namespace(identity)
    return store.open_namespace(identity)


def test_records_of_namespaces_forgotten_reopened_and_forgotten_again(tmp_path: Path) -> None:
    others = [make_identity(tenant="acme", model=f"other-{i}") for i in range(3)]

    async def scenario() -> set[bytes]:
        store, ssd = mover(tmp_path / "ssd")
        gate = asyncio.Event()
        delete = ssd.engine.delete_namespaces

        async def slow_delete(ids: list[bytes]) -> int:
            await gate.wait()  # the delete is under way: the loop goes on meanwhile
            return await delete(ids)

        ssd.engine.delete_namespaces = slow_delete  # type: ignore[method-assign]
        ns = opened(store, ssd, IDENT)
        spaces = [opened(store, ssd, o) for o in others]
        assert store.close_namespace(ns)  # forgotten: its record is to go
        assert store.close_namespace(spaces[0])
        await asyncio.sleep(0)  # the delete of both is under way
        opened(store, ssd, IDENT)  # opened again meanwhile: its record written again
        # forgotten again after it was opened again: gone by the next delete
        assert store.close_namespace(opened(store, ssd, others[0]))
        # forgotten and opened again before its delete began: that delete is void
        assert store.close_namespace(spaces[1])
        again = opened(store, ssd, others[1])
        gate.set()
        await ssd.drain()
        records = set(ssd.engine.namespaces())
        assert again.id in store.namespaces
        ssd.close()
        return records

    records = asyncio.run(scenario())
    assert records == {IDENT.namespace_id, others[1].namespace_id, others[2].namespace_id}


def test_a_restore_forgets_namespaces_with_no_block_back(tmp_path: Path) -> None:
    store, ssd = mover(tmp_path / "ssd")
    for i in range(5):
        opened(store, ssd, make_identity(tenant="acme", model=f"empty-{i}"))
    ssd.close()  # the daemon stopped with five empty namespaces open
    store, ssd = mover(tmp_path / "ssd")
    assert store.namespaces == {}
    assert ssd.engine.namespaces() == {}
    ssd.close()
