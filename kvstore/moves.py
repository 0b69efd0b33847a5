"""A block's way between tiers, in one place: the mover pipeline.

The store decides and answers with plans as data (``kvstore.plans.Plan``); this pipeline
carries them out with the tiers' movers (``tiering.SsdMover``: the SSD engine;
``remote.RemoteTier``: the remote store; ``gpu_mover.GpuMover``: the GPU pool), each
copy through the weighted-fair transfer queues, and reports back to the store.  It is
the one place where

- a plan runs (``carry_out``): writes down to SSD or the remote store for room, a
  promotion's reads, a fetch from the remote store, a wait for room;
- a call that answered with a plan is made again once the plan ran (``settle``);
- freed room wakes what waits for it, in order of arrival (``RoomWaiters``: the one
  wait for room, for deferred requests and for room on its way alike);
- blocks go down on their own: to SSD as they commit (write-through) or ahead of need
  (write-back), and, in the remote store's write-back mode, SSD copies near eviction to
  the remote store before SSD evicts them.

The movers know nothing of each other: every way from one tier to another starts here.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import mmap
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

from kvstore.errors import CapacityError, KVStoreError
from kvstore.gpu_mover import GpuMover
from kvstore.plans import MAX_TURNS
from kvstore.remote import REMOTE_OWNER, RemoteTier, by_namespace
from kvstore.slab_moves import StopTrades
from kvstore.ssd_flush import (
    FLUSH_PASSES,
    flush_givers,
    flush_plan,
    flush_victim,
    whole_prefixes,
)
from kvstore.store import Block, BlockStore, Namespace, Plan
from kvstore.tiering import SsdMover
from kvstore.transfers import Background, TurnBatch

log = logging.getLogger("kvstore.moves")

T = TypeVar("T")
_ROOM_COMING_WAIT = 0.5  # seconds a request waits for writes under way to free room
_SETTLE_ROUNDS = 16      # plans one internal call may need before it is refused


def _wake_if_unpinned(room: RoomWaiters, blocks: list[Block]) -> None:
    """A send of the remote store's let its pins on ``blocks`` go: the oldest waiter for
    room is woken if one of them is evictable now (no engine pins it too)."""
    if any(not b.refs for b in blocks):
        room.freed()


class RoomWaiters:
    """The one wait for room.  Each waiter holds a ticket (its arrival), kept while it
    retries.  Whatever frees DRAM wakes the oldest waiter; a waiter that then gets its
    room passes the wake on (``freed`` again), and so does one that does not, to the
    next younger than itself (``freed(after=its ticket)``) before it waits again in its
    place: the oldest request takes room first, a request too large for the room that
    freed holds up none behind it (it held every later one until its deadline, with the
    room for them free), and a wake-up costs each waiter at most one retry.  Once the
    daemon stops (``stop``), nothing is waited for: no request that frees room is read."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._tickets = itertools.count(1)
        self._order = itertools.count()  # ties between equal tickets: first come first
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._live = 0  # waiters still waiting (the heap keeps those gone until popped)
        self.stopping = False

    def ticket(self) -> int:
        return next(self._tickets)

    async def wait(self, deadline: float, ticket: int | None = None) -> bool:
        """Until room may have freed (True) or ``deadline`` passes (False; at once when
        the daemon is stopping)."""
        remaining = deadline - self.clock()
        if remaining <= 0 or self.stopping:
            return False
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (ticket if ticket is not None else self.ticket(),
                                       next(self._order), future))
        self._live += 1
        try:
            await asyncio.wait_for(future, remaining)
            return True
        except TimeoutError:
            return False
        finally:
            self._live -= 1
            if not future.done():
                future.cancel()  # its entry stays in the heap until popped
            if len(self._waiting) > 2 * self._live + 64:
                self._waiting = [e for e in self._waiting if not e[2].done()]
                heapq.heapify(self._waiting)

    def freed(self, after: int = 0) -> None:
        """Room may have freed: wake the oldest waiter (younger than ticket ``after``)."""
        older: list[tuple[int, int, asyncio.Future[None]]] = []
        while self._waiting:
            entry = heapq.heappop(self._waiting)
            if entry[2].done():
                continue
            if entry[0] <= after:
                older.append(entry)  # (woken by another wake; its turn is its own)
                continue
            entry[2].set_result(None)
            break
        for entry in older:
            heapq.heappush(self._waiting, entry)

    def stop(self) -> None:
        """On the way out: every waiter's deadline is now (nothing that frees room will
        be read), so a deferred request runs its last steps rather than wait them out."""
        self.stopping = True
        for _, _, future in self._waiting:
            if not future.done():
                future.set_result(None)
        self._waiting.clear()

    def __len__(self) -> int:
        return self._live

    def __repr__(self) -> str:
        return f"RoomWaiters(waiting={self._live})"


class Moves:
    """Carries out the store's plans and every move of a block between tiers."""

    def __init__(self, store: BlockStore, clock: Callable[[], float], *,
                 ssd: SsdMover | None = None, remote: RemoteTier | None = None,
                 gpu: GpuMover | None = None) -> None:
        self.store = store
        self.clock = clock
        self.room = RoomWaiters(clock)
        self._background = Background()
        self._through: TurnBatch[Block] = TurnBatch(self._background, self._write_through)
        self._writing_back = False
        self._ssd_copier: asyncio.Task[None] | None = None
        self._ssd_retry_at = 0.0
        self._stopping = False
        self.attach(ssd=ssd, remote=remote, gpu=gpu)

    def attach(self, *, ssd: SsdMover | None = None, remote: RemoteTier | None = None,
               gpu: GpuMover | None = None) -> None:
        """The tiers' movers (the daemon makes them as it starts)."""
        self.ssd = ssd
        self.remote = remote
        self.gpu = gpu
        if remote is not None:  # (what it holds, it lets go soon: ``RoomMaker.room_coming``)
            self.store.room.movers.add(REMOTE_OWNER)
            remote.freed = partial(_wake_if_unpinned, self.room)  # (as it lets them go)
        # with an SSD tier and the remote store's write-back: SSD copies sent up
        self._send_from_ssd = ssd is not None and remote is not None and remote.write_back
        if remote is not None and self._send_from_ssd:
            remote.watch.on_forgotten = self._ssd_written  # (copies unmarked: send them)
        elif remote is not None and ssd is not None:  # write-through: those DRAM let go
            remote.from_ssd = self._through_from_ssd

    # -- plans --------------------------------------------------------------------------------
    async def carry_out(self, plan: Plan) -> None:
        """Do what ``plan`` says, all of it; every move reports back to the store.  A
        CapacityError says there was no room to move blocks into; NotFoundError, that a
        fetch found nothing.  Cancelled or failed, it leaves nothing marked."""
        if plan.turn:  # others' requests first; then the slabs set aside are the call's
            try:
                await (plan.wait() if plan.wait is not None else asyncio.sleep(0))
            finally:
                plan.let_go()
            return
        if plan.defer_until is not None:
            if not await self.room.wait(plan.defer_until, plan.ticket or None):
                plan.expired = True
            return
        if plan.fetch is not None:
            await self.fetch(*plan.fetch)
            return
        started: set[str] = set()
        parts = []

        def part(name: str, move: Callable[[], Awaitable[None]]) -> Awaitable[None]:
            async def run() -> None:
                started.add(name)  # from here the move finishes its own blocks
                await move()
            return run()

        # (the room the moves free is the caller's first: they wake no waiter, this does
        # as it returns, and the caller's next attempt runs before any waiter it woke;
        # woken by each write as it ended, a request the first had waited behind took
        # the room the first's demotions had just made, and the first was refused)
        if plan.demote:
            parts.append(part("demote", lambda: self._to_ssd(plan.demote, wake=False)))
        if plan.to_remote:
            parts.append(part("to_remote", lambda: self._to_remote(plan.to_remote)))
        if plan.promote is not None:
            parts.append(part("promote", lambda: self._promote(plan)))
        if plan.reads:
            parts.append(self._reads(plan.reads))
        if not parts:
            if plan.room_coming:  # writes under way will free room: wait a little
                # (in the request's place in line; ``expired``: not woken meanwhile)
                plan.expired = not await self.room.wait(self.clock() + _ROOM_COMING_WAIT,
                                                        plan.ticket or None)
            return
        try:
            # all at once: the room comes in one go; each move finishes its own blocks
            # either way before a failure is raised
            for result in await asyncio.gather(*parts, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
        finally:
            self.abandon(plan, started)
            if started:
                self.room.freed()  # DRAM slots freed or unpinned: the oldest waiter next

    def abandon(self, plan: Plan, started: set[str] | frozenset[str] = frozenset()) -> None:
        """The parts of a plan that never began (cancelled first, or the request was
        refused before its task ran): their marks go, as if never planned.  A part that
        began finishes its own blocks, whatever happens."""
        store = self.store
        plan.let_go()
        undone = False
        if plan.demote and "demote" not in started:
            store.ssd_copies.abort_demotion(plan.demote)
            undone = True
        if plan.to_remote and "to_remote" not in started:
            store.finish_remote_write(plan.to_remote, [False] * len(plan.to_remote))
            undone = True
        t = plan.promote
        if t is not None and "promote" not in started and t.id in store.transfers:
            store.ssd_copies.abort_promotion(t)
            undone = True
        if undone:
            self.room.freed()

    async def settle(self, attempt: Callable[[], T | Plan], *,
                     rounds: int = _SETTLE_ROUNDS) -> T:
        """Make a store call until it answers with a result rather than a plan, carrying
        out each plan in between (``rounds`` of them; a plan of a turn, which always
        comes after progress, counts only as one of ``MAX_TURNS``)."""
        turns = 0
        while True:
            result = attempt()
            if not isinstance(result, Plan):
                return result
            if result.turn and turns < MAX_TURNS:
                turns += 1
            else:
                rounds -= 1
                if rounds <= 0:
                    self.abandon(result)
                    break
            await self.carry_out(result)
        raise CapacityError("blocks kept moving between tiers; try again")

    async def _to_ssd(self, blocks: list[Block],
                      evict: bool | Callable[[Block], bool] = True, wake: bool = True) -> None:
        """Write DRAM copies to SSD (demotions, or write-through copies; ``evict``: cold
        SSD copies make room, those it passes if a test, else CapacityError where there
        is none); room frees (``wake``: waiters for room are woken, at the end)."""
        assert self.ssd is not None, "the store planned a write to ssd without an ssd tier"
        # SSD copies the store dropped since a request last ended (a put finished in a
        # task drops the stale copy of a block it commits again, and ends none): out of
        # the index before this write, which may be of the same keys and whose records a
        # withdrawal coming after would delete
        self.withdraw_dropped()
        try:
            await self.ssd.write(blocks, evict)
        except CapacityError:
            if self.store.ssd_writable:
                raise  # no room for them on SSD: the caller refuses, defers or stops
            # the ssd tier failed the write and paused: dram evicts without it meanwhile
        finally:
            if wake:
                self.room.freed()  # DRAM slots freed or unpinned: waiters may retry
            self.withdraw_dropped()  # copies the write found damaged: out of the index
        self._ssd_written()

    async def _to_remote(self, blocks: list[Block]) -> None:
        """(``carry_out`` wakes the waiters for the room it frees.)"""
        assert self.remote is not None, "the store planned a write-back without a remote"
        await self.remote.demote(blocks)

    async def _promote(self, plan: Plan) -> None:
        """(``carry_out`` wakes the waiters, a failed read having given its slots back.)"""
        assert self.ssd is not None and plan.promote is not None
        await self.ssd.read(plan.promote)

    async def _reads(self, blocks: list[Block]) -> None:
        assert self.ssd is not None
        await self.ssd.wait_reads(blocks)

    # -- bringing blocks up -------------------------------------------------------------------
    async def fetch(self, ns: Namespace, keys: list[bytes]) -> None:
        """Read the blocks of ``keys`` cached neither in DRAM nor on SSD in from the
        remote store (NotFoundError if it lacks any)."""
        assert self.remote is not None, "a fetch without a remote tier"
        want = await self.remote.to_fetch(ns, keys)
        if want is None:
            return
        missing, parent = want
        r = await self.settle(lambda: self.store.reserve(
            REMOTE_OWNER, ns, missing, parent, self.clock()))
        try:
            await self.remote.read_into(ns, missing, r)
        finally:
            self.room.freed()  # its slots hold blocks now, evictable, or are free again

    async def bring_up(self, ns: Namespace, keys: list[bytes], cached: int) -> None:
        """Promote the cached part of a chain to DRAM, then fetch the rest from the remote
        tier (a prefetch); a partial result is still a usable prefix."""
        try:
            if self.ssd is not None:
                await self.settle(lambda: self._promotion_of(ns, keys[:cached]))
            if cached < len(keys) and self.remote is not None and self.remote.healthy:
                await self.fetch(ns, keys)
        except KVStoreError as exc:
            log.debug("prefetch stopped early: %s", exc)

    def _promotion_of(self, ns: Namespace, keys: list[bytes]) -> Plan | None:
        below = [b for k in keys if (b := ns.blocks.get(k)) is not None
                 and b.offset is None and b.ssd_offset is not None]
        return self.store.ssd_copies.promotion(below) if below else None

    # -- what the verbs tell -----------------------------------------------------------------
    def committed(self, blocks: list[Block]) -> None:
        """New blocks were committed: copies go down and aside as the tiers' modes say."""
        if self.ssd is not None:
            if self.ssd.write_through:
                self._through.add(self.store.ssd_copies.write_through_candidates(blocks))
            elif (not self._writing_back and self.store.ssd_writable
                  and self.store.ssd_copies.writeback_plan(batch=1)):
                self._writing_back = True  # cold blocks copied ahead of need
                self._background.spawn(self._write_back_ahead())
        if self.remote is not None:
            self.remote.committed(blocks)
        if self.gpu is not None:
            self.gpu.wanted(blocks)

    def reused(self, blocks: list[Block]) -> None:
        """Blocks were acquired again: worth a copy on the GPU."""
        if self.gpu is not None:
            self.gpu.wanted(blocks)

    def removed(self, ids: list[tuple[bytes, bytes]]) -> None:
        """SSD copies the store dropped: withdraw them from the SSD index."""
        if ids and self.ssd is not None:
            self.ssd.removed(ids)

    async def withdrawn(self) -> None:
        """Until the SSD index holds none of the copies withdrawn so far."""
        if self.ssd is not None:
            await self.ssd.withdrawn()

    def withdraw_dropped(self) -> None:
        """Withdraw the SSD copies the store dropped and listed (``dropped_ssd``)."""
        if self.store.dropped_ssd:
            self.removed(self.store.dropped_ssd)
            self.store.dropped_ssd = []

    def freed(self) -> None:
        """A request freed DRAM (a release, an abort, a commit, an eviction...)."""
        self.room.freed()

    async def _write_through(self, batch: list[Block]) -> None:
        batch = self.store.ssd_copies.write_through_candidates(batch)  # as they are now
        if batch:
            try:
                await self._to_ssd(batch)
            except CapacityError:
                pass  # counted; the blocks stay in DRAM

    async def _write_back_ahead(self) -> None:
        try:
            # planned here, not by the caller: by the time a task runs, blocks planned
            # earlier may be demoting or gone
            while self.store.ssd_writable and (plan := self.store.ssd_copies.writeback_plan()):
                try:
                    await self._to_ssd(plan)
                except CapacityError:
                    break
        finally:
            self._writing_back = False

    # -- SSD copies to the remote store (its write-back mode) --------------------------------
    def start(self) -> None:
        """Begin background work that restored state may call for (SSD copies to send),
        and the remote store's generation checks."""
        if self.remote is not None:
            self.remote.watch.start()
        if self.ssd is not None:
            self.ssd.watch.start()  # (its directory removed under the daemon: off)
        self._ssd_written()

    def _ssd_written(self) -> None:
        """Blocks reached the SSD tier: where SSD is the last local tier before the remote
        store in write-back mode, send the SSD copies nearest eviction there first."""
        if (self._send_from_ssd and self._ssd_copier is None and not self._stopping
                and time.monotonic() >= self._ssd_retry_at):
            self._ssd_copier = asyncio.get_running_loop().create_task(self._send_ssd_copies())

    async def _send_ssd_copies(self) -> None:
        assert self.remote is not None
        try:
            while (not self._stopping and self.remote.healthy
                   and (plan := self.store.ssd_copies.ssd_write_back_plan())):
                if not await self._copy_from_ssd(plan):
                    # nothing went (a full store, unreadable copies): not again for a while
                    self._ssd_retry_at = time.monotonic() + self.remote.cooldown
                    break
        finally:
            self._ssd_copier = None

    def _through_from_ssd(self, blocks: list[Block]) -> None:
        """Write-through blocks the remote store has yet to take (held back after a
        refusal or an outage) that DRAM let go meanwhile: sent from their SSD copies.
        Skipped, they never had a remote copy."""
        held = [] if self._stopping else self.store.ssd_copies.held_to_send(blocks)
        if held:
            self._background.spawn(self._send_through(held))

    async def _send_through(self, held: list[Block]) -> None:
        await self._copy_from_ssd(held, through=True)

    async def _copy_from_ssd(self, blocks: list[Block], through: bool = False) -> int:
        """Read held SSD copies and send them to the remote store (as write-backs, or
        ``through``: write-throughs, those not taken held to be sent again); the store
        marks the sent ones and drops those that could not be read.  How many were sent."""
        assert self.ssd is not None and self.remote is not None
        sent = [False] * len(blocks)
        unreadable = [False] * len(blocks)
        epoch = self.remote.epoch  # (a namespace sent before a loss noticed at a later one's)
        try:
            for ns, indexes in by_namespace(blocks).items():
                size = ns.block_bytes
                group = [blocks[i] for i in indexes]
                # page-aligned, so the SSD tier can read into it directly (O_DIRECT)
                with mmap.mmap(-1, size * len(indexes)) as scratch:
                    whole = memoryview(scratch)
                    views = [whole[j * size:(j + 1) * size] for j in range(len(indexes))]
                    try:
                        read = await self.ssd.read_copies(group, views)
                        for i, good in zip(indexes, read):
                            unreadable[i] = good is False  # (None: not read, kept)
                        good_ones = [j for j, r in enumerate(read) if r]
                        if not good_ones:
                            continue
                        # each read checked its bytes against the block's checksum, which
                        # holds while its copy is held (a commit of other bytes over a held
                        # copy is a duplicate): they go with it, not hashed again
                        written = await self.remote.send(
                            ns, [group[j].key for j in good_ones], [views[j] for j in good_ones],
                            "write" if through else "write-back", write_back=not through,
                            checked=[group[j].checksum for j in good_ones]
                        ) if self.remote.healthy else None
                        if through:  # (those refused held, to send again)
                            serving = self.remote.health.serves(ns.tenant)
                            self.remote.held.after_send([group[j] for j in good_ones],
                                                        written, serving)
                        for j, w in zip(good_ones, written or ()):
                            sent[indexes[j]] = bool(w)
                    finally:
                        for view in (*views, whole):
                            view.release()
        finally:
            if self.remote.epoch != epoch:
                sent = [False] * len(blocks)
            self.removed(self.store.ssd_copies.ssd_write_back_done(
                blocks, sent, unreadable, write_back=not through))
        return sum(sent)

    # -- lifecycle ----------------------------------------------------------------------------
    async def stop_copying_ssd(self) -> None:
        """On the way out: no more copies from SSD (the SSD tier keeps its own); waits
        for the round under way, whose buffers a reading thread may still fill."""
        self._stopping = True
        if self._ssd_copier is not None:
            await asyncio.wait({self._ssd_copier})

    async def flush_to_ssd(self) -> int:
        """On the way out, under write-back: the blocks only DRAM holds, to the SSD tier
        (``ssd_copies.flush_plan``), a batch at a time, where there is room or in place
        of its coldest leaves (``flush_victim``: never a parent, nor a block written
        here, nor another tenant's within its share), or in slabs another size hands
        over (``StopTrades``); how many went."""
        written, planned = 0, set[Block]()  # (those of every pass: none traded away)
        assert self.store.ssd is not None, "a flush to ssd without an ssd tier"
        spare = StopTrades.spare_of(self.store.ssd.pool)
        for _ in range(FLUSH_PASSES):  # (while one writes some: ``FLUSH_PASSES``)
            plan = flush_plan(self.store.ssd_copies)
            planned |= set(plan)
            parts = [plan[i:i + 64] for i in range(0, len(plan), 64)][::-1]
            wrote = 0
            while parts:  # (the last part first out: the plan's order, parents first)
                part = parts.pop()
                batch = whole_prefixes(self.store.ssd_copies.write_through_candidates(part))
                if batch:
                    givers = flush_givers(self.store, batch)
                    victim = partial(flush_victim, planned=planned, givers=givers)
                    try:
                        await self._to_ssd(batch, evict=StopTrades(victim, spare, planned))
                    except CapacityError:
                        if len(batch) > 1:  # its first half may fit (the parents), or
                            half = len(batch) // 2  # another class's where this did not
                            parts += [batch[half:], batch[:half]]
                        continue
                    wrote += sum(b.ssd_offset is not None for b in batch)
            written += wrote
            if not wrote:
                break
            spare = dict.fromkeys(spare, 0)  # (later passes: no slab traded, ``FLUSH_PASSES``)
        return written

    async def drain(self) -> None:
        """Finish the background writes under way."""
        await self._background.drain()

    @property
    def copying_from_ssd(self) -> bool:
        """Whether a round of SSD copies to the remote store is under way."""
        return self._ssd_copier is not None

    def __repr__(self) -> str:
        tiers = [n for n, t in (("ssd", self.ssd), ("remote", self.remote),
                                ("gpu", self.gpu)) if t is not None]
        return f"Moves(tiers={tiers}, {self.room!r})"




