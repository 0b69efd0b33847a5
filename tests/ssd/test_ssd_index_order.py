"""Index changes of the SSD tier land in the order they were asked for, whatever pool
thread runs them: a delete of an evicted copy never takes a newer record with it.

The interleaving is forced, not hoped for: the index's delete is held on a gate that opens
only once the write has either committed (the bad order) or started waiting for that
delete (the order the store keeps).  A timeout only keeps a broken store from hanging.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import pytest

from kvstore.tiers.ssd import BlockRecord, SSDStore
from ssd_helpers import KiB, StoreFactory, block_bytes, read_ok, write

LENGTH = 256 * KiB
_HOLD = 30.0  # seconds a held delete waits at most (only a broken store reaches it)


class HeldDelete:
    """Holds the index's deletes until a write commits or waits for them."""

    def __init__(self, store: SSDStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.index = store._parts()[1]
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.left = threading.Event()  # a held delete has run
        self.seen_at_commit: list[BlockRecord | None] = []
        self.watch: bytes | None = None
        delete, commit = self.index.delete, self.index.commit
        waits: Callable[[Sequence[Future[int]]], None] | None = getattr(
            store, "_after_deletes", None)

        def held_delete(keys: Any) -> int:
            self.entered.set()
            self.gate.wait(_HOLD)
            try:
                return delete(keys)
            finally:
                self.left.set()

        def watched_commit(records: Any, touches: Any = None, namespaces: Any = None) -> None:
            commit(records, touches, namespaces)
            if self.watch is not None:  # what the index holds once the write is in
                self.seen_at_commit.append(self.index.get(self.watch))
            self.gate.set()

        def open_then_wait(deletes: Sequence[Future[int]]) -> None:
            self.gate.set()
            if waits is not None:
                waits(deletes)

        monkeypatch.setattr(self.index, "delete", held_delete)
        monkeypatch.setattr(self.index, "commit", watched_commit)
        monkeypatch.setattr(store, "_after_deletes", open_then_wait, raising=False)


async def _remove_then_write(store: SSDStore, held: HeldDelete, gone: BlockRecord,
                             new: BlockRecord) -> BlockRecord:
    removing = asyncio.create_task(store.remove([(gone.namespace, gone.key)]))
    await asyncio.to_thread(held.entered.wait, _HOLD)  # the delete runs, held
    assert held.entered.is_set()
    (written,) = await store.write_blocks([new], [block_bytes(new.key, new.length)])
    assert await removing == 1
    return written


@pytest.mark.parametrize("io_threads", [2, 4])
def test_a_delete_in_flight_does_not_take_the_key_written_again(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch, io_threads: int
) -> None:
    store = open_store(io_threads=io_threads)
    namespace, key = os.urandom(16), os.urandom(16)
    (old,) = write(store, [BlockRecord(namespace, key, None, 0, LENGTH)])
    held = HeldDelete(store, monkeypatch)
    again = BlockRecord(namespace, key, None, 2 * LENGTH, LENGTH)  # another slot
    written = asyncio.run(_remove_then_write(store, held, old, again))
    stored = store.lookup((namespace, key))
    assert stored is not None, "the delete of the evicted copy took the new record"
    assert stored.offset == written.offset == again.offset
    assert read_ok(store, stored)


def test_a_slot_written_again_is_never_named_by_its_old_record(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    store = open_store(io_threads=2)
    namespace = os.urandom(16)
    (old,) = write(store, [BlockRecord(namespace, os.urandom(16), None, 0, LENGTH)])
    held = HeldDelete(store, monkeypatch)
    held.watch = old.index_key
    reuse = BlockRecord(namespace, os.urandom(16), None, old.offset, LENGTH)  # its slot
    asyncio.run(_remove_then_write(store, held, old, reuse))
    assert held.seen_at_commit == [None], "two records named one slot when it committed"
    store.close()
    again = SSDStore(tmp_path / "ssd", 64 << 20, slab_bytes=8 << 20)
    try:
        assert [r.key for r in again.load()] == [reuse.key]
    finally:
        again.close()


def test_a_cancelled_remove_still_deletes_before_the_next_write(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(io_threads=4)
    namespace, key = os.urandom(16), os.urandom(16)
    (old,) = write(store, [BlockRecord(namespace, key, None, 0, LENGTH)])
    held = HeldDelete(store, monkeypatch)
    again = BlockRecord(namespace, key, None, LENGTH, LENGTH)

    async def go() -> None:
        removing = asyncio.create_task(store.remove([(namespace, key)]))
        await asyncio.to_thread(held.entered.wait, _HOLD)
        removing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await removing
        await store.write_blocks([again], [block_bytes(key, LENGTH)])

    asyncio.run(go())
    assert held.left.wait(_HOLD)  # the cancelled caller's delete ran all the same
    stored = store.lookup((namespace, key))
    assert stored is not None and stored.offset == again.offset
    assert old.offset != stored.offset
