"""The SSD tier's storage layer: block bytes in one data file, a durable index in LMDB.

The daemon's slab pool decides which offset holds which block; ``SSDStore`` writes bytes
at those offsets durably, reads them back verified, and keeps the index that lets the
daemon come back warm after a restart or a crash.

On disk, under the tier's directory::

    blocks.dat   the flat offset space: layout offset o is file byte o; slab i is the
                 range [i * slab_bytes, (i + 1) * slab_bytes)
    index/       LMDB: block records, namespaces, layout metadata
    lock         flock'd while a store has the directory open

A block is visible (in the index) only once its bytes are on disk as the sync policy
says and its record is committed; every read checks length and xxh3_64 checksum, so a
torn, stale or corrupt block is a miss, never served.

Sync policies:

- ``always``: bytes are fdatasync'd, then the index commit is fully synced; a returned
  ``write_blocks`` survives power loss.
- ``batch``: bytes are fdatasync'd before the commit; the index's meta page is synced
  with the next commit, so a power loss may forget the last batch (a miss, not a bad read).
- ``none``: nothing is synced until ``sync()``/``close()``; survives a process crash, not
  a power loss (records that then point at lost bytes fail their checksum).

Claiming the directory, opening these files and the warm-restart scan live in
``ssd_directory``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvstore.errors import BackendError, CapacityError, ConfigError, MalformedError

from .ssd_directory import SSDDirectory
from .ssd_index import SSDIndex, SyncPolicy
from .ssd_io import DataFile, Span
from .ssd_layout import (
    ID_BYTES,
    IO_ALIGN,
    BlockRecord,
    SlabLayout,
)
from .ssd_rows import RowsPlan

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["BlockId", "BlockRecord", "SSDStore", "SyncPolicy", "directory_missing"]

BlockId = tuple[bytes, bytes]
"""(namespace id, block key), 16 bytes each."""

_SYNC_POLICIES = ("always", "batch", "none")
_TOUCH_FLUSH_AT = 65536


class _WriteResult(msgspec.Struct):
    records: list[BlockRecord]
    io_seconds: float
    index_seconds: float


class _ReadResult(msgspec.Struct):
    ok: list[bool]
    bytes_read: int
    checksum_failures: int
    read_errors: int
    index_errors: int = 0  # bad records the index could not drop (a full disk)


def _byte_view(buffer: ReadableBuffer) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise MalformedError("block buffers must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_id(block: BlockId) -> bytes:
    namespace, key = block
    if len(namespace) != ID_BYTES or len(key) != ID_BYTES:
        raise MalformedError("namespace id and block key must be 16 bytes each")
    return namespace + key


def _check_namespace(namespace: bytes) -> bytes:
    if len(namespace) != ID_BYTES:
        raise MalformedError("namespace id must be 16 bytes")
    return namespace


def _check_write(
    layout: SlabLayout, records: Sequence[BlockRecord], datas: Sequence[ReadableBuffer]
) -> list[Span]:
    """The spans to write, once the batch fits the layout, matches its data and does not
    overlap itself; MalformedError otherwise."""
    if len(records) != len(datas):
        raise MalformedError(f"{len(records)} records but {len(datas)} data buffers")
    spans: list[Span] = []
    seen: set[bytes] = set()
    for record, data in zip(records, datas):
        problem = layout.problem(record)
        if problem is not None:
            raise MalformedError(f"block {record.key.hex()}: {problem}")
        view = _byte_view(data)
        if len(view) != record.length:
            raise MalformedError(
                f"block {record.key.hex()}: {len(view)} data bytes, record says {record.length}"
            )
        if record.index_key in seen:
            raise MalformedError(f"block {record.key.hex()} appears twice in one batch")
        seen.add(record.index_key)
        spans.append(Span(record.offset, view))
    ordered = sorted(records, key=lambda r: r.offset)
    for before, after in zip(ordered, ordered[1:]):
        if after.offset < before.end:
            raise MalformedError(
                f"blocks {before.key.hex()} and {after.key.hex()} overlap at {after.offset}"
            )
    return spans


def _check_read(
    layout: SlabLayout, records: Sequence[BlockRecord], buffers: Sequence[WriteableBuffer]
) -> list[Span]:
    """The spans to read into, once the batch fits the layout and every buffer is
    writable and large enough; MalformedError otherwise."""
    if len(records) != len(buffers):
        raise MalformedError(f"{len(records)} records but {len(buffers)} buffers")
    spans: list[Span] = []
    for record, buffer in zip(records, buffers):
        problem = layout.problem(record)
        if problem is not None:
            raise MalformedError(f"block {record.key.hex()}: {problem}")
        view = _byte_view(buffer)
        if view.readonly:
            raise MalformedError("read buffers must be writable")
        if len(view) < record.length:
            raise MalformedError(
                f"block {record.key.hex()} needs {record.length} bytes, buffer has {len(view)}"
            )
        spans.append(Span(record.offset, view[: record.length]))
    return spans


class SSDStore:
    """Block bytes on local disk at caller-chosen offsets, with a crash-safe LMDB index.

    Async methods run their blocking work in the store's own thread pool, one hop per
    call.  Not for use from several event loops at once.
    """

    def __init__(
        self,
        path: Path,
        capacity_bytes: int,
        *,
        slab_bytes: int,
        sync: SyncPolicy = "batch",
        direct_io: bool = True,
        map_size: int | None = None,
        preallocate: bool = True,
        io_threads: int = 4,
    ) -> None:
        """Open (or create) the tier in directory ``path``.

        ``capacity_bytes`` must be a whole number of slabs and ``slab_bytes`` a multiple of
        4 KiB.  ``map_size`` bounds the index (default: 1/8 of the capacity, at least
        1 GiB of address space; LMDB only uses what it needs).  ``preallocate`` reserves the
        whole capacity on disk now instead of slab by slab on first write.

        Raises ConfigError for a bad configuration, a directory that cannot be written, too
        little free space, a directory another store holds, or an index written with a
        different layout; CapacityError when preallocation runs out of space.
        """
        self.path = Path(path)
        self.sync_policy: SyncPolicy = sync
        self.layout = SlabLayout(capacity_bytes, slab_bytes)
        self._check_config(capacity_bytes, slab_bytes, sync, io_threads)
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "writes", "write_batches", "bytes_written", "reads", "bytes_read",
                "checksum_failures", "read_errors", "removed", "dropped_invalid",
                "dropped_overlapping", "dropped_orphans", "index_errors",
            ),
            0,
        )
        self._timers = {"io_seconds": 0.0, "index_seconds": 0.0}
        self._touches: dict[bytes, float] = {}
        self._background: set[Future[None]] = set()
        # index deletes submitted and not yet seen done: a write commits after them
        self._deleting: set[Future[int]] = set()
        self._closed = False
        self._directory: SSDDirectory | None = None
        self._pool: ThreadPoolExecutor | None = None
        try:
            self._directory = SSDDirectory(
                self.path,
                self.layout,
                sync=sync,
                direct_io=direct_io,
                # a record takes about 330 bytes of index (3M records filled 1 GiB), so
                # 1/8 of the capacity holds one per 4 KiB slot, the smallest there is
                map_size=map_size if map_size is not None else max(1 << 30, capacity_bytes // 8),
                preallocate=preallocate,
            )
            self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-ssd")
        except BaseException:
            self._release()
            raise

    # opening

    @staticmethod
    def _check_config(capacity_bytes: int, slab_bytes: int, sync: str, io_threads: int) -> None:
        if slab_bytes <= 0 or slab_bytes % IO_ALIGN:
            raise ConfigError(f"ssd slab_bytes={slab_bytes} must be a positive multiple of 4096")
        if capacity_bytes <= 0 or capacity_bytes % slab_bytes:
            raise ConfigError(
                f"ssd capacity_bytes={capacity_bytes} must be a positive multiple of "
                f"slab_bytes={slab_bytes}"
            )
        if sync not in _SYNC_POLICIES:
            raise ConfigError(f"ssd sync={sync!r} must be one of {', '.join(_SYNC_POLICIES)}")
        if io_threads <= 0:
            raise ConfigError(f"ssd io_threads={io_threads} must be positive")

    # writes

    async def write_blocks(
        self, records: Sequence[BlockRecord], datas: Sequence[ReadableBuffer],
        namespaces: Mapping[bytes, bytes] | None = None,
    ) -> list[BlockRecord]:
        """Write each block's bytes at its record's offset, make them durable per the sync
        policy, then publish the records in one index commit (with ``namespaces``'
        identity bytes, as ``put_namespace``: records of the blocks' namespaces not yet
        in the index).  Returns the records as committed, with checksums filled in.

        The batch is all or nothing: on error no record of it is published.  Raises
        MalformedError for records that do not fit the layout, overlap each other or
        disagree with their data's length; CapacityError when the disk is full;
        BackendError for other I/O failures.  If the caller is cancelled, the write
        finishes in the background and its records are withdrawn again.  The buffers must
        not change until the call returns.
        """
        spans = _check_write(self.layout, records, datas)
        if not spans:
            return []
        touches, self._touches = self._touches, {}
        pool = self._open_pool()
        loop = asyncio.get_running_loop()
        deletes = list(self._deleting)
        for namespace in namespaces or ():
            _check_namespace(namespace)
        future = loop.run_in_executor(
            pool, self._write_batch, records, spans, touches, deletes, namespaces)
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._withdraw_cancelled_write)
            self._merge_touches(touches)
            raise
        except BaseException:
            self._merge_touches(touches)
            raise
        self._counters["writes"] += len(records)
        self._counters["write_batches"] += 1
        self._counters["bytes_written"] += sum(len(span.view) for span in spans)
        self._timers["io_seconds"] += result.io_seconds
        self._timers["index_seconds"] += result.index_seconds
        return result.records

    def _write_batch(
        self, records: Sequence[BlockRecord], spans: Sequence[Span],
        touches: dict[bytes, float], deletes: Sequence[Future[int]],
        namespaces: Mapping[bytes, bytes] | None = None,
    ) -> _WriteResult:
        data, index = self._parts()
        started = time.perf_counter()
        digests = data.write(spans, sync=self.sync_policy != "none")
        committed = [msgspec.structs.replace(record, checksum=digest)
                     for record, digest in zip(records, digests)]
        io_done = time.perf_counter()
        self._after_deletes(deletes)
        index.commit(committed, touches, namespaces)
        return _WriteResult(committed, io_done - started, time.perf_counter() - io_done)

    @staticmethod
    def _after_deletes(deletes: Sequence[Future[int]]) -> None:
        """Wait (on a pool thread) for the index deletes asked for before this write.

        Without it a delete of key K (an evicted copy) still running on another pool
        thread could land after the commit of K written again, and take the new record
        with it: K's SSD copy would then be missing after a restart.  The same order
        keeps an old record naming a slot from outliving the commit of the block written
        into that slot again.  It cannot deadlock: the pool takes jobs first in, first
        out, so every delete submitted before this write has a thread or is done."""
        if deletes:
            wait(deletes)

    def _withdraw_cancelled_write(self, future: asyncio.Future[_WriteResult]) -> None:
        if future.cancelled() or future.exception() is not None or self._closed:
            return
        try:
            self._parts()[1].delete_if_current(future.result().records)
        except BackendError:  # the records stay; load() and reads still check their bytes
            self._counters["index_errors"] += 1

    # reads

    async def read_into(self, record: BlockRecord, buffer: WriteableBuffer) -> bool:
        """Read the block's bytes into the start of ``buffer`` and check length and checksum.

        Returns False on a miss (truncated, corrupt, stale or unreadable bytes); the record
        is then dropped from the index and the failure counted.
        """
        return (await self.read_many([record], [buffer]))[0]

    async def read_many(
        self, records: Sequence[BlockRecord], buffers: Sequence[WriteableBuffer]
    ) -> list[bool]:
        """``read_into`` for a batch, in one hop; one bool per record."""
        spans = _check_read(self.layout, records, buffers)
        pool = self._open_pool()
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(pool, self._read_batch, records, spans)
        self._counters["reads"] += len(records)
        self._counters["bytes_read"] += result.bytes_read
        self._counters["checksum_failures"] += result.checksum_failures
        self._counters["read_errors"] += result.read_errors
        self._counters["index_errors"] += result.index_errors
        return result.ok

    def _read_batch(self, records: Sequence[BlockRecord], spans: Sequence[Span]) -> _ReadResult:
        data, index = self._parts()
        got = data.read_hashed(spans)
        ok: list[bool] = []
        bad: list[BlockRecord] = []
        errors = index_errors = 0
        for record, (n, digest) in zip(records, got):
            good = n == record.length and digest == record.checksum
            ok.append(good)
            if not good:
                bad.append(record)
                errors += n < 0
        if bad:
            try:
                index.delete_if_current(bad)
            except (BackendError, CapacityError):  # (a full index) the verdicts stand:
                index_errors = 1  # the records stay; reads and load() check their bytes
        return _ReadResult(
            ok, sum(n for n, _ in got if n > 0), len(bad) - errors, errors, index_errors
        )

    # index upkeep

    async def remove(self, blocks: Iterable[BlockId]) -> int:
        """Withdraw blocks from the index (their bytes stay until overwritten); returns how
        many were there.

        Index changes keep the order they were asked in: a ``write_blocks`` called after
        this (of the same keys, or into the slots they held) commits after the delete,
        whether or not this call was awaited first.  If the caller is cancelled, the
        delete still runs."""
        index_keys = [_check_id(block) for block in blocks]
        for index_key in index_keys:
            self._touches.pop(index_key, None)
        job = self._open_pool().submit(self._parts()[1].delete, index_keys)
        self._deleting.add(job)
        done = asyncio.wrap_future(job)
        done.add_done_callback(lambda f: self._delete_done(job, f))
        removed = await asyncio.shield(done)
        self._counters["removed"] += removed
        return removed

    def _delete_done(self, job: Future[int], done: asyncio.Future[int]) -> None:
        self._deleting.discard(job)
        if not done.cancelled():
            done.exception()  # retrieved: a cancelled caller's failure is not logged twice

    def touch(self, blocks: Iterable[BlockId], when: float) -> None:
        """Note that blocks were used at ``when``; buffered in memory and written with the
        next batch, ``sync()`` or ``close()`` (a crash may lose the latest touches)."""
        if self._closed:
            raise BackendError(f"SSD store {self.path} is closed")
        for block in blocks:
            index_key = _check_id(block)
            if when > self._touches.get(index_key, -1.0):
                self._touches[index_key] = when
        if len(self._touches) >= _TOUCH_FLUSH_AT:
            touches, self._touches = self._touches, {}
            future = self._open_pool().submit(self._flush_touches, touches)
            self._background.add(future)
            future.add_done_callback(self._background.discard)

    def _flush_touches(self, touches: dict[bytes, float]) -> None:
        try:
            self._parts()[1].apply_touches(touches)
        except BackendError:  # last-access times are advice; losing some is harmless
            self._counters["index_errors"] += 1

    def _merge_touches(self, touches: dict[bytes, float]) -> None:
        for index_key, when in touches.items():
            if when > self._touches.get(index_key, -1.0):
                self._touches[index_key] = when

    async def sync(self) -> None:
        """Make every write and touch so far durable, whatever the sync policy."""
        touches, self._touches = self._touches, {}
        pool = self._open_pool()
        await asyncio.get_running_loop().run_in_executor(pool, self._sync_all, touches)

    def _sync_all(self, touches: dict[bytes, float]) -> None:
        data, index = self._parts()
        data.datasync()
        index.apply_touches(touches)
        index.flush()

    def put_namespace(self, namespace: bytes, identity: bytes) -> None:
        """Remember a namespace's identity bytes (opaque here) across restarts."""
        if len(namespace) != ID_BYTES:
            raise MalformedError("namespace id must be 16 bytes")
        self._parts()[1].put_namespace(namespace, identity)

    async def delete_namespaces(self, namespaces: list[bytes]) -> int:
        """Forget namespaces' identity bytes, in one transaction off the caller's thread
        (how many were there): at a restart, records of their blocks still in the index
        are dropped as of no namespace."""
        ids = [_check_namespace(ns) for ns in namespaces]
        pool = self._open_pool()
        return await asyncio.get_running_loop().run_in_executor(
            pool, self._parts()[1].delete_namespaces, ids)

    def delete_namespaces_now(self, namespaces: list[bytes]) -> int:
        """``delete_namespaces`` on this thread (at start-up, before serving)."""
        return self._parts()[1].delete_namespaces([_check_namespace(ns) for ns in namespaces])

    def namespaces(self) -> dict[bytes, bytes]:
        """Every stored namespace id with its identity bytes."""
        return self._parts()[1].namespaces()

    def lookup(self, block: BlockId) -> BlockRecord | None:
        """The committed record of a block, or None."""
        return self._parts()[1].get(_check_id(block))

    # warm restart

    def load(self) -> list[BlockRecord]:
        """Scan the index and return the records the daemon can trust, parents before
        children, after dropping (from the index too) records that do not fit the layout,
        overlapping records whose bytes do not verify, and orphans, until prefix-closed.

        Blocking; call it once at startup, before serving.  Stale bytes under a surviving
        record are caught by the checksum when the block is read.
        """
        plan = self._open_directory().restore()
        self._counters["dropped_invalid"] += len(plan.invalid)
        self._counters["dropped_overlapping"] += len(plan.overlapping)
        self._counters["dropped_orphans"] += len(plan.orphans)
        return plan.survivors

    def load_rows(self) -> RowsPlan:
        """``load`` in columns (``ssd_rows.RowsPlan``): the same records kept, in the
        same order, and the same dropped, with no object per record but its key."""
        plan, slow = self._open_directory().restore_rows()
        if slow is not None:
            self._counters["dropped_invalid"] += len(slow.invalid)
            self._counters["dropped_overlapping"] += len(slow.overlapping)
            self._counters["dropped_orphans"] += len(slow.orphans)
        else:
            self._counters["dropped_invalid"] += len(plan.invalid)
            self._counters["dropped_orphans"] += len(plan.orphans)
        return plan

    # state

    def stats(self) -> dict[str, int | float]:
        """Counters since open, time spent in data I/O and index commits on writes, and the
        number of records now in the index."""
        out: dict[str, int | float] = dict(self._counters)
        out.update(self._timers)
        out["records"] = self._parts()[1].count()
        out["pending_touches"] = len(self._touches)
        return out

    @property
    def direct_io(self) -> bool:
        """Whether aligned blocks bypass the page cache (False where the filesystem refuses)."""
        return self._directory is not None and self._directory.direct_io

    def __repr__(self) -> str:
        if self._closed:
            return f"<SSDStore {self.path} closed>"
        c = self._counters
        return (
            f"<SSDStore {self.path} capacity={self.layout.capacity_bytes} "
            f"slab={self.layout.slab_bytes} sync={self.sync_policy} direct={self.direct_io} "
            f"records={self._parts()[1].count()} writes={c['writes']} reads={c['reads']} "
            f"checksum_failures={c['checksum_failures']}>"
        )

    # lifecycle

    def _open_directory(self) -> SSDDirectory:
        if self._closed or self._directory is None:
            raise BackendError(f"SSD store {self.path} is closed")
        return self._directory

    def _parts(self) -> tuple[DataFile, SSDIndex]:
        return self._open_directory().parts()

    def _open_pool(self) -> ThreadPoolExecutor:
        self._parts()
        assert self._pool is not None, "an open store has a thread pool"
        return self._pool

    def close(self) -> None:
        """Wait for in-flight work, write pending touches, sync data and index, and
        release the directory.  Idempotent."""
        if self._closed:
            return
        try:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._directory is not None:
                data, index = self._directory.parts()
                index.apply_touches(self._touches)
                self._touches = {}
                data.datasync()
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._directory is not None:
            self._directory.release()

    def __enter__(self) -> SSDStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def directory_missing(store: SSDStore) -> str | None:
    """What of ``store``'s directory is no longer at its path (``SSDDirectory.missing``),
    or None; blocks (a few stats).  BackendError once the store is closed."""
    return store._open_directory().missing()
