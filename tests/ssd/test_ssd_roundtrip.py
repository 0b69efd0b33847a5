"""Writing, reading, reopening and index upkeep of the SSD tier."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import xxhash

from ssd_helpers import (
    MiB,
    KiB,
    StoreFactory,
    aligned_buffer,
    block_bytes,
    chain,
    read_ok,
    run,
    write,
)
from kvstore.errors import BackendError, MalformedError
from kvstore.tiers import ssd
from kvstore.tiers.ssd import BlockRecord
from kvstore.tiers.ssd_io import DataFile


@pytest.mark.parametrize("length", [256 * KiB, 2 * MiB])
@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("sync", ["always", "batch", "none"])
def test_round_trip_random_bytes(
    open_store: StoreFactory, length: int, direct_io: bool, sync: str
) -> None:
    store = open_store(direct_io=direct_io, sync=sync)
    namespace = os.urandom(16)
    records = chain(namespace, 12, length, 0)
    # every other block lands in a gap, so the batch has runs and singles
    records = [r for i, r in enumerate(records) if i % 3 != 1]
    datas = [os.urandom(length) for _ in records]
    committed = run(store.write_blocks(records, datas))

    assert [r.checksum for r in committed] == [xxhash.xxh3_64_intdigest(d) for d in datas]
    aligned = [aligned_buffer(length) for _ in committed]
    plain = [bytearray(length + 100) for _ in committed]  # larger than the block is fine
    assert run(store.read_many(committed, aligned)) == [True] * len(committed)
    assert run(store.read_many(committed, plain)) == [True] * len(committed)
    for data, a, p in zip(datas, aligned, plain):
        assert a[:] == data
        assert bytes(p[:length]) == data
    stats = store.stats()
    assert stats["writes"] == len(records) and stats["records"] == len(records)
    assert stats["bytes_written"] == len(records) * length
    assert stats["reads"] == 2 * len(records) and stats["bytes_read"] == 2 * len(records) * length
    assert stats["checksum_failures"] == 0


def test_unaligned_and_odd_sized_blocks(open_store: StoreFactory) -> None:
    store = open_store()
    namespace = os.urandom(16)
    records = [
        BlockRecord(namespace, os.urandom(16), None, 0, 100_003, size_class=128 * KiB),
        BlockRecord(namespace, os.urandom(16), None, 128 * KiB + 512, 4096),
    ]
    committed = write(store, records)
    assert all(read_ok(store, r) for r in committed)


def test_records_survive_reopen(open_store: StoreFactory, tmp_path: Path) -> None:
    store = open_store()
    namespace = os.urandom(16)
    store.put_namespace(namespace, b"identity-of-the-model")
    committed = write(store, chain(namespace, 6, 256 * KiB, 8 * MiB))
    store.touch([(namespace, committed[2].key)], 1234.5)
    store.close()

    reopened = open_store()
    loaded = reopened.load()
    assert {r.key for r in loaded} == {r.key for r in committed}
    assert [r.key for r in loaded] == [r.key for r in committed]  # parents first
    by_key = {r.key: r for r in loaded}
    assert by_key[committed[2].key].last_access == 1234.5
    assert reopened.namespaces() == {namespace: b"identity-of-the-model"}
    assert all(read_ok(reopened, r) for r in loaded)


def test_touch_is_buffered_then_written_with_next_batch(open_store: StoreFactory) -> None:
    store = open_store()
    namespace = os.urandom(16)
    (first,) = write(store, chain(namespace, 1, 4096, 0))
    store.touch([(namespace, first.key)], 50.0)
    store.touch([(namespace, first.key)], 40.0)  # older: ignored
    assert store.stats()["pending_touches"] == 1
    write(store, chain(namespace, 1, 4096, 4096))
    assert store.stats()["pending_touches"] == 0
    record = store.lookup((namespace, first.key))
    assert record is not None and record.last_access == 50.0


def test_remove_and_sync(open_store: StoreFactory) -> None:
    store = open_store(sync="none")
    namespace = os.urandom(16)
    committed = write(store, chain(namespace, 4, 64 * KiB, 0))
    assert run(store.remove([(namespace, committed[0].key), (namespace, os.urandom(16))])) == 1
    assert store.lookup((namespace, committed[0].key)) is None
    run(store.sync())
    assert store.stats()["records"] == 3 and store.stats()["removed"] == 1


@pytest.mark.parametrize(
    "records, lengths, message",
    [
        ([(0, 4096), (2048, 4096)], None, "overlap"),
        ([(8 * MiB - 4096, 8192)], None, "crosses a slab"),
        ([(64 * MiB, 4096)], None, "outside capacity"),
        ([(0, 4096)], [4000], "data bytes"),
        ([(0, 0)], [0], "not positive"),
    ],
)
def test_bad_batches_are_refused_before_any_io(
    open_store: StoreFactory,
    records: list[tuple[int, int]],
    lengths: list[int] | None,
    message: str,
) -> None:
    store = open_store()
    namespace = os.urandom(16)
    batch = [BlockRecord(namespace, os.urandom(16), None, o, n) for o, n in records]
    datas = [bytes(n) for n in (lengths or [n for _, n in records])]
    with pytest.raises(MalformedError, match=message):
        run(store.write_blocks(batch, datas))
    assert store.stats()["records"] == 0 and store.stats()["writes"] == 0


def test_read_buffer_checks(open_store: StoreFactory) -> None:
    store = open_store()
    (record,) = write(store, chain(os.urandom(16), 1, 8192, 0))
    with pytest.raises(MalformedError, match="writable"):
        run(store.read_into(record, bytes(8192)))
    with pytest.raises(MalformedError, match="needs 8192"):
        run(store.read_into(record, bytearray(100)))


def test_closed_store_refuses_work(open_store: StoreFactory) -> None:
    store = open_store()
    store.close()
    store.close()
    assert "closed" in repr(store)
    with pytest.raises(BackendError, match="closed"):
        write(store, chain(os.urandom(16), 1, 4096, 0))


def test_repr_shows_counts(open_store: StoreFactory) -> None:
    store = open_store()
    write(store, chain(os.urandom(16), 3, 4096, 0))
    assert "records=3" in repr(store) and "writes=3" in repr(store)


def test_bytes_follow_from_keys() -> None:
    assert block_bytes(b"a" * 16, 64) == block_bytes(b"a" * 16, 64)


def test_cancelled_write_is_withdrawn(open_store: StoreFactory) -> None:
    store = open_store(io_threads=1)
    namespace = os.urandom(16)
    (record,) = chain(namespace, 1, 2 * MiB, 0)

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(store.write_blocks([record], [os.urandom(2 * MiB)]))
        await asyncio.sleep(0)  # the batch is now in the worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.sync()  # queued behind the write on the single worker
        await asyncio.sleep(0)

    run(cancel_midway())
    assert store.lookup((namespace, record.key)) is None
    assert store.stats()["records"] == 0


def test_many_touches_flush_in_the_background(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ssd, "_TOUCH_FLUSH_AT", 3)
    store = open_store()
    namespace = os.urandom(16)
    committed = write(store, chain(namespace, 3, 4096, 0))
    store.touch([(namespace, r.key) for r in committed], 77.0)
    assert store.stats()["pending_touches"] == 0
    store.close()  # waits for the background flush
    reopened = open_store()
    assert {r.last_access for r in reopened.load()} == {77.0}


def test_buffered_fallback_where_direct_io_is_refused(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(DataFile, "_open_direct", lambda self: None)
    store = open_store(direct_io=True)
    assert not store.direct_io
    committed = write(store, chain(os.urandom(16), 4, 256 * KiB, 0))
    assert all(read_ok(store, r) for r in committed)
