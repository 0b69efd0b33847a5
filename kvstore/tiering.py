"""The SSD tier's mover: writes, reads and index changes with the SSD engine.

The store decides (which blocks to demote, promote or write through, which SSD copies
go) and the mover pipeline (``kvstore.moves``) asks; this module does each move with
the SSD tier's engine and reports to the store, on the daemon's event loop.  A block becomes visible on SSD only once its bytes are durable
and its index record is committed; a read that fails its checksum is a miss.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import msgspec
import numpy as np

from kvstore.config import Config
from kvstore.errors import BackendError, CapacityError, KVStoreError
from kvstore.heap import paused
from kvstore.identity import Identity
from kvstore.scheduler.queues import TransferKind
from kvstore.ssd_lost import LostCopies
from kvstore.ssd_watch import SsdDirectoryWatch
from kvstore.store import Block, BlockStore, Namespace, Transfer
from kvstore.tiers.ssd import BlockRecord, SSDStore, directory_missing
from kvstore.transfers import Background, TransferGate

log = logging.getLogger("kvstore.tiering")

# why a warm restart drops index records the engine kept (``SsdMover._restore``), as
# its log line says it: before, none of these was logged, and blocks went unannounced
_NO_NAMESPACE = "of a namespace whose record is missing or unreadable"
_OTHER_SIZE = "sized for another block size or slot layout"
_UNPLACED = "whose parent or slot could not be restored"
_WRITE_COOLDOWN = 5.0  # seconds without SSD writes after one failed (disk full, I/O error)


class SsdMover:
    """Owns the SSD engine and runs demotions, promotions and write-through copies."""

    def __init__(self, config: Config, store: BlockStore,
                 slot: Callable[[Namespace, int], memoryview],
                 gate: TransferGate) -> None:
        self.store = store
        self.slot = slot
        self.gate = gate
        self.write_through = config.ssd.write_policy == "write-through"
        self.engine = SSDStore(
            config.ssd_path, config.ssd_capacity, slab_bytes=config.ssd_slab_bytes,
            sync=config.ssd.sync,  # type: ignore[arg-type]
            direct_io=config.ssd.direct_io, preallocate=config.ssd.preallocate)
        self._promoting: dict[Block, asyncio.Future[None]] = {}
        self._background = Background()
        self._pending_removals: list[tuple[bytes, bytes]] = []
        self._removing: set[asyncio.Future[int]] = set()  # withdrawals under way
        self._forgotten: set[bytes] = set()  # namespaces whose records are to go
        # namespaces whose records are in the index: a namespace's goes in with its first
        # blocks' (``write``), not when it is opened (an LMDB commit on the loop, each
        # fsynced: 0.3-1.1 ms a new namespace here, and a disk's sync time on a slow one)
        self._recorded: set[bytes] = set()
        self._forgetting = False  # a task is taking them out
        self.errors = 0
        self.reads = 0            # promotions, their bytes and time: the load bandwidth
        self.read_bytes = 0
        self.read_seconds = 0.0
        self.metrics: Any = None  # the daemon's Metrics, for transfer bytes and latency
        self.lost: str | None = None  # what happened to the directory, once it is gone
        self.dropping: LostCopies | None = None  # its copies' drop, while under way
        self._drop_next: asyncio.Handle | None = None  # the drop's next slice
        self.drop_slices = 0  # the slices (loop turns) its drop took so far
        self._dropped: dict[str, int] = {}  # what the restore dropped, by reason
        self.watch = SsdDirectoryWatch(partial(directory_missing, self.engine), self.lose)

    # -- start-up --------------------------------------------------------------------------
    def restore(self) -> int:
        """Rebuild the SSD tier's blocks from the durable index (warm restart)."""
        with paused():  # all it builds lives on: nothing for the collector to find
            restored = self._restore()
        _log_dropped(self.engine.stats(), self._dropped)
        return restored

    def _restore(self) -> int:
        self._dropped = dict.fromkeys((_NO_NAMESPACE, _OTHER_SIZE, _UNPLACED), 0)
        namespaces = {}
        for ns_id, blob in self.engine.namespaces().items():
            try:
                identity = msgspec.msgpack.decode(blob, type=Identity)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                continue
            if identity.namespace_id == ns_id:
                namespaces[ns_id] = self.store.open_namespace(identity)
                self._recorded.add(ns_id)
        # Each namespace's records in the order loaded (parents first), restored in one
        # go; records whose namespace is gone, or sized for another configuration, go.
        plan = self.engine.load_rows()
        rows, order, keys = plan.rows, plan.order, plan.keys  # keys: ``order``'s, in it
        opened = [namespaces.get(ns_id) for ns_id in rows.spaces]
        length = np.full(len(opened), -1, dtype=np.int64)  # what each namespace's have
        size = np.full(len(opened), -1, dtype=np.int64)
        for i, ns in enumerate(opened):
            if ns is not None and ns.ssd_cls is not None:
                length[i], size[i] = ns.block_bytes, ns.ssd_cls.slot_bytes
        space = rows.space[order]
        fit = (rows.length[order] == length[space]) & (rows.size_class[order] == size[space])
        if not fit.all():
            lost = np.flatnonzero(~fit).tolist()
            unread = int((length[space[lost]] < 0).sum())
            self._dropped[_NO_NAMESPACE] = unread
            self._dropped[_OTHER_SIZE] = len(lost) - unread
            self._pending_removals.extend(
                zip(map(rows.spaces.__getitem__, space[lost].tolist()),
                    map(keys.__getitem__, lost)))
            order, space = order[fit], space[fit]
            keys = list(itertools.compress(keys, fit.tolist()))
        restored = 0
        place = np.full(len(rows), -1, dtype=np.int64)  # a row's position in its group
        for ns_id, within in _runs(rows.spaces, space):
            group = order[within]
            at = np.arange(len(group))
            place[group] = at
            parent = plan.parent[group]
            # how far back each one's parent is: 0 for a root, -1 for one not in the group
            above = place[parent]
            back = np.where(parent < 0, 0, np.where(above < 0, -1, at - above)).tolist()
            del at, above, parent
            mine = _picked(keys, within)
            ok = self.store.ssd_copies.restore_columns(
                namespaces[ns_id], mine, back, rows.offset[group].tolist(),
                rows.checksum[group].tolist())
            back = sum(ok)
            restored += back
            if back < len(ok):
                self._dropped[_UNPLACED] += len(ok) - back
                self._pending_removals.extend(
                    (ns_id, key) for key, good in zip(mine, ok) if not good)
        # opened here; with no block back, forgotten (before serving: at once)
        empty = [ns.id for ns in namespaces.values() if self.store.close_namespace(ns)]
        self._recorded.difference_update(empty)
        if empty:
            try:
                self.engine.delete_namespaces_now(empty)
            except KVStoreError as exc:  # (a full index): they come back, empty, next time
                log.warning("forgetting %d empty namespaces in the ssd index failed: %s",
                            len(empty), exc)
        return restored

    def remember_namespace(self, identity: Identity) -> None:
        """Write a namespace's record now (the blocks' writes carry it otherwise)."""
        if self.lost is not None:
            return
        self._forgotten.discard(identity.namespace_id)  # (its delete, if queued, is void)
        self.engine.put_namespace(identity.namespace_id, msgspec.msgpack.encode(identity))
        self._recorded.add(identity.namespace_id)

    def forget_namespace(self, ns: Namespace) -> None:
        """The store forgot ``ns`` (nothing of it is cached, nothing uses it): its record
        goes soon, with the others forgotten meanwhile, in one transaction off the loop
        (one each on the loop stalled every client for seconds when a session of a
        thousand namespaces ended).  A record whose namespace is opened again before or
        while it goes is kept or written again (``_flush_forgotten``); its blocks'
        records still to be removed, if any, are dropped at a restart with no namespace.
        One that never had a block on SSD has no record: nothing goes."""
        if ns.id not in self._recorded:
            return
        self._recorded.discard(ns.id)
        self._forgotten.add(ns.id)
        if not self._forgetting:
            self._forgetting = True
            self._background.spawn(self._flush_forgotten())

    async def _flush_forgotten(self) -> None:
        try:
            while self._forgotten:
                ids, self._forgotten = self._forgotten, set()
                try:
                    await self.engine.delete_namespaces(list(ids))
                except KVStoreError as exc:  # they come back, empty, at a restart
                    log.warning("forgetting %d namespaces in the ssd index failed: %s",
                                len(ids), exc)
                for ns_id in ids:  # opened again while the delete ran: written again
                    ns = self.store.namespaces.get(ns_id)
                    if ns is not None:
                        try:
                            self.remember_namespace(ns.identity)
                        except KVStoreError as exc:  # its SSD blocks go at a restart
                            self._recorded.discard(ns_id)  # (the next write tries again)
                            log.warning("writing a namespace's ssd record again failed: "
                                        "%s", exc)
        finally:
            self._forgetting = False

    # -- moves the pipeline asks for --------------------------------------------------
    async def write(self, blocks: list[Block],
                    evict: bool | Callable[[Block], bool] = True) -> None:
        """Write DRAM copies to SSD (demotion or write-through) and report to the store;
        CapacityError if the SSD tier could not take them (the store knows; ``evict``:
        whether cold SSD copies may make room)."""
        try:
            if self.lost is not None:
                raise CapacityError("the ssd tier is off: its directory is gone")
            t, removed = self.store.ssd_copies.reserve(blocks, evict)
        except CapacityError:
            self.store.ssd_copies.abort_demotion(blocks)
            raise
        ok = False
        try:
            if self._pending_removals:
                # a key written again: its new record replaces the old one, and its
                # withdrawal, still waiting, would take the new one
                writing = {(b.ns.id, b.key) for b in t.blocks}
                self._pending_removals = [i for i in self._pending_removals
                                          if i not in writing]
            await self._flush_removals(removed)
            records = [_record(b, off, b.ns.ssd_cls.slot_bytes if b.ns.ssd_cls else 0)
                       for b, off in zip(t.blocks, t.offsets)]
            assert all(b.offset is not None for b in t.blocks)
            datas = [self.slot(b.ns, b.offset) for b in t.blocks]  # type: ignore[arg-type]
            nbytes = sum(len(d) for d in datas)
            async with self.gate.slot(nbytes, default_tenant=t.blocks[0].ns.tenant):
                started = time.perf_counter()
                fresh = {b.ns.id: b.ns.identity for b in t.blocks
                         if b.ns.id not in self._recorded}
                written = await self.engine.write_blocks(
                    records, datas, {ns_id: msgspec.msgpack.encode(identity)
                                     for ns_id, identity in fresh.items()})
                self._recorded.update(fresh)
                self._forgotten.difference_update(fresh)  # (a delete still queued: void)
            if self.lost is not None:  # (written to files no longer there)
                raise BackendError("its directory is gone")
            if self.metrics is not None:
                self.metrics.observe_transfer("demote", "ssd", nbytes,
                                              time.perf_counter() - started)
            for view in datas:
                view.release()
            self.store.ssd_copies.finish_write(t, written)
            ok = True
        except KVStoreError as exc:
            self.errors += 1
            log.warning("writing %d blocks to ssd failed: %s; ssd writes pause for %gs, "
                        "dram evicts without writing back meanwhile", len(t.blocks), exc,
                        _WRITE_COOLDOWN)
            self._pause_writes()
            raise CapacityError(f"the ssd tier could not take the blocks: {exc}") from None
        finally:
            if not ok and t.id in self.store.transfers:
                self.store.ssd_copies.finish_write(t, None)

    def _pause_writes(self) -> None:
        self.store.ssd_writable = False
        asyncio.get_running_loop().call_later(_WRITE_COOLDOWN, self._resume_writes)

    def _resume_writes(self) -> None:
        self.store.ssd_writable = self.lost is None

    def lose(self, what: str) -> None:
        """The tier's directory was removed or replaced under the daemon (``ssd_watch``):
        the tier is off until a restart, as a failed disk's writes pause, for good; its
        copies go from the store (a restart finds none), a slice a loop turn
        (``LostCopies``: none is a hit or read meanwhile), their records are not
        withdrawn (the files are no longer the tier's), and DRAM and the remote tier
        serve on.  Once: a second call changes nothing."""
        if self.lost is not None:
            return
        self.lost = what
        self.store.ssd_writable = False
        self._pending_removals.clear()
        self._recorded.clear()  # (nothing of them to forget there either)
        self.dropping = LostCopies(self.store)
        log.error("ssd tier directory %s: %s under the running daemon; the ssd tier is off "
                  "until the daemon restarts: its %d ssd copies are dropped (and what only "
                  "hung from them), dram and the remote tier serve on", self.engine.path,
                  what, self.dropping.left)
        self._drop_slice()  # (the first at once: a small tier is gone in it)

    def _drop_slice(self) -> None:
        """A slice of the lost copies' drop, then another loop turn; copies reads held
        are dropped once the reads end (looked at again every 0.1 s)."""
        self._drop_next = None
        drop = self.dropping
        if drop is None:
            return
        loop = asyncio.get_running_loop()
        self.drop_slices += 1
        if not drop.step():
            self._drop_next = loop.call_soon(self._drop_slice)
            return
        held = [b for b in drop.held if b.ssd_offset is not None]
        if held:
            self.dropping = LostCopies(self.store, held)
            self._drop_next = loop.call_later(0.1, self._drop_slice)
            return
        self.dropping = None
        log.info("ssd tier directory %s: its ssd copies are dropped", self.engine.path)

    async def wait_reads(self, blocks: list[Block]) -> None:
        """Wait for the promotions under way of these blocks (other requests' reads)."""
        waits = [self._promoting[b] for b in blocks if b in self._promoting]
        if waits:
            await asyncio.gather(*waits)

    async def read(self, t: Transfer) -> None:
        """Read a promotion's SSD copies into the DRAM slots the store reserved, and
        report (a copy that fails its checksum is a miss, and its SSD copy goes)."""
        loop = asyncio.get_running_loop()
        for b in t.blocks:
            self._promoting[b] = loop.create_future()
        ok: list[bool] | None = None  # the reads' verdicts, once they came
        try:
            if self.lost is not None:  # the tier is off: a miss, its files never read
                return
            views = [self.slot(b.ns, off) for b, off in zip(t.blocks, t.offsets)]
            nbytes = sum(len(v) for v in views)
            async with self.gate.slot(nbytes, default_kind=TransferKind.RELOAD,
                                      default_tenant=t.blocks[0].ns.tenant):
                started = time.perf_counter()
                ok = await self.engine.read_many([_stored(b) for b in t.blocks], views)
            self.reads += 1
            self.read_bytes += nbytes
            self.read_seconds += time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.observe_transfer("promote", "ssd", nbytes,
                                              time.perf_counter() - started)
            for view in views:
                view.release()
        except KVStoreError as exc:
            self.errors += 1
            log.warning("reading %d blocks from ssd failed: %s", len(t.blocks), exc)
        finally:
            if ok is None:  # no verdict (the batch failed as a whole): a miss this time,
                # the copies stay on SSD (condemned as corrupt, all went with their
                # subtrees when one record could not be dropped from a full index)
                self.store.ssd_copies.abort_promotion(t)
            else:
                self.removed(self.store.ssd_copies.finish_promotion(t, ok))
            for b in t.blocks:
                future = self._promoting.pop(b)
                if not future.done():
                    future.set_result(None)

    async def read_copies(self, blocks: list[Block],
                          views: list[memoryview]) -> Sequence[bool | None]:
        """Read held SSD copies into ``views`` (buffers of the caller's, not DRAM slots),
        as a write-back transfer; which reads succeeded (False: a bad copy; None: no
        verdict, the batch failed as a whole)."""
        if self.lost is not None:  # the tier is off: no verdict, its files never read
            return [None] * len(blocks)
        nbytes = sum(len(v) for v in views)
        try:
            async with self.gate.slot(nbytes, default_kind=TransferKind.WRITEBACK,
                                      default_tenant=blocks[0].ns.tenant):
                return await self.engine.read_many([_stored(b) for b in blocks], views)
        except KVStoreError as exc:
            self.errors += 1
            log.warning("reading %d blocks from ssd failed: %s", len(blocks), exc)
            return [None] * len(blocks)

    # -- the SSD index -------------------------------------------------------------------
    def removed(self, ids: list[tuple[bytes, bytes]]) -> None:
        """SSD copies the store dropped: withdraw them from the index soon."""
        if ids and self.lost is None:
            self._pending_removals.extend(ids)
            self._background.spawn(self._flush_pending())

    async def _flush_pending(self) -> None:
        try:
            await self._flush_removals([])
        except KVStoreError as exc:  # (a full index) kept, tried again with the next
            log.warning("withdrawing %d records from the ssd index failed: %s; tried "
                        "again with the next", len(self._pending_removals), exc)

    async def _flush_removals(self, more: list[tuple[bytes, bytes]]) -> None:
        """Withdraw the records waiting and ``more``; those that fail to go wait again
        (a restart would otherwise find them and restore copies the store dropped)."""
        ids = self._pending_removals + more
        self._pending_removals = []
        if ids:
            removing = asyncio.ensure_future(self.engine.remove(ids))
            self._removing.add(removing)
            removing.add_done_callback(self._removing.discard)
            try:
                await removing
            except BaseException:
                self._pending_removals[:0] = ids
                raise

    async def withdrawn(self) -> None:
        """Until the records of every copy the store dropped so far are out of the index
        (what an evict's or a drop's reply waits for).  A withdrawal that fails (a full
        index) waits for the next, as in the background, and is not waited for."""
        try:
            await self._flush_removals([])
        except Exception as exc:  # (the index's own errors too: the removal is done,
            # its reply no internal error)
            log.warning("withdrawing %d records from the ssd index failed: %s; tried "
                        "again with the next", len(self._pending_removals), exc)
        if self._removing:  # (taken by another call, under way)
            await asyncio.wait(list(self._removing))

    def touch(self, blocks: Iterable[Block]) -> None:
        ids = [(b.ns.id, b.key) for b in blocks if b.ssd_offset is not None]
        if ids and self.lost is None:
            self.engine.touch(ids, time.time())

    async def drain(self) -> None:
        """Finish queued writes and removals, then make everything durable."""
        await self._background.drain()
        if self.lost is not None:  # (the files are no longer the tier's)
            return
        await self._flush_removals([])
        if self._forgotten and not self._forgetting:
            await self._flush_forgotten()
        await self.engine.sync()

    def close(self) -> None:
        self.watch.close()
        if self._drop_next is not None:  # (stopped mid-drop: the rest goes with the process)
            self._drop_next.cancel()
            self._drop_next = None
        if self.dropping is not None:
            self.dropping.close()
            self.dropping = None
        self.engine.close()

    def stats(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = dict(self.engine.stats())
        out["errors"] = self.errors
        out["healthy"] = int(self.lost is None)
        if self.lost is not None:  # (its records went with the directory)
            out["records"] = 0
            out["lost"] = self.lost
            out["lost_dropping"] = int(self.dropping is not None)  # its copies' drop
            out["lost_slices"] = self.drop_slices  # (a loop turn each)
        return out


def _log_dropped(engine: dict[str, int | float], dropped: dict[str, int]) -> None:
    """One line for the records a warm restart dropped, how many for each reason (a
    stop that lost their parents, a namespace record unread, ...); none if none."""
    why = {"their parents were not on it": engine.get("dropped_orphans", 0),
           "outside the tier's layout": engine.get("dropped_invalid", 0),
           "in a slot another block's bytes hold": engine.get("dropped_overlapping", 0),
           **dropped}
    if any(why.values()):
        log.warning("ssd tier: %d blocks dropped at restore: %s", sum(why.values()),
                    ", ".join(f"{n} {reason}" for reason, n in why.items() if n))


def _runs(spaces: list[bytes], space: np.ndarray) -> Iterator[tuple[bytes, np.ndarray]]:
    """Each namespace's positions in the restore's order (``space`` is the namespace of
    each), ascending, the namespaces in the order each first comes."""
    if len(spaces) == 1:
        if len(space):
            yield spaces[0], np.arange(len(space))
        return
    by_space = np.argsort(space, kind="stable")
    found, starts = np.unique(space[by_space], return_index=True)
    ends = np.append(starts[1:], len(by_space))
    for k in np.argsort(by_space[starts], kind="stable").tolist():
        yield spaces[int(found[k])], by_space[starts[k]:ends[k]]


def _picked(keys: list[bytes], within: np.ndarray) -> list[bytes]:
    """``keys`` at the ascending positions ``within``: a slice where they are a run (one
    namespace's, as the plan orders them), else one by one."""
    if len(within) and int(within[-1]) - int(within[0]) + 1 == len(within):
        return keys[int(within[0]):int(within[-1]) + 1]
    return list(map(keys.__getitem__, within.tolist()))


def _stored(block: Block) -> BlockRecord:
    """The SSD tier's record of a block's copy there, as written (what a read checks the
    bytes against): made again from the block when read, not kept on every block."""
    assert block.ssd_offset is not None and block.ns.ssd_cls is not None
    return BlockRecord(
        namespace=block.ns.id, key=block.key,
        parent=block.parent.key if block.parent is not None else None,
        offset=block.ssd_offset, length=block.ns.block_bytes, checksum=block.checksum,
        size_class=block.ns.ssd_cls.slot_bytes)


def _record(block: Block, offset: int, slot_bytes: int) -> BlockRecord:
    return BlockRecord(
        namespace=block.ns.id, key=block.key,
        parent=block.parent.key if block.parent is not None else None,
        offset=offset, length=block.ns.block_bytes, last_access=time.time(),
        size_class=slot_bytes)
