"""The remote store's generation, watched: a store that lost what it held is noticed, and
what the daemon believed it held is forgotten.

The store marks the blocks the remote store holds (``Block.remote``: a write there
succeeded, or the value was read from there), and DRAM lets a marked block go without
writing it back, as SSD eviction takes marked copies first.  A Redis that came back
empty (restarted without persistence, flushed, failed over to an empty replica) left
those marks standing: the daemon dropped the blocks as if Redis held them, and they
were lost.  Now every ``remote.check_seconds`` (and once more before the stop's last
write-back) the daemon asks the backend for the store's generation
(``StorageBackend.generation``, a token the backend keeps in the store); when it is
another than the last one seen, the marks are taken back (``ForgetMarks``, a slice a
loop turn), the blocks still in DRAM written again (write-through; write-back writes
them as they leave), and sends and reads under way when it changed mark nothing
(``RemoteTier.epoch``).  A store restarted with its data keeps its token, and the daemon
its marks.  Between the loss and the next check, blocks may still leave unwritten:
the check bounds that window, nothing closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from kvstore.blocks import Block
from kvstore.core import StoreCore
from kvstore.errors import KVStoreError
from kvstore.plugins import GuardedBackend
from kvstore.remote_copies import ForgetMarks
from kvstore.remote_shares import TenantShares

log = logging.getLogger("kvstore.remote")

# Marks taken back per loop turn, at most, and the time a slice may take (as a
# namespace's drop in slices: ``removals.DROP_SLICE``)
FORGET_SLICE = 4096
FORGET_SLICE_SECONDS = 0.001

# A stop's wait for the watch's tasks to end, at most, and between its cancels
STOP_SECONDS = 2.0
STOP_RETRY_SECONDS = 0.05


class WatchedTier(Protocol):
    """What the watch uses of the remote tier (``remote.RemoteTier``)."""

    backend: GuardedBackend
    counters: dict[str, int]
    epoch: int
    shares: TenantShares

    @property
    def store(self) -> StoreCore: ...

    @property
    def healthy(self) -> bool: ...

    def failed(self, what: str, exc: Exception, began: float | None = None) -> None: ...

    def write_again(self, blocks: list[Block]) -> None: ...

    def send_held(self) -> None: ...


class GenerationWatch:
    """Checks the remote store's generation every ``interval`` seconds (while the tier
    is healthy), and forgets the tier's marks when it changed; after each check the tier
    sends the write-throughs it held back, if it takes them now."""

    def __init__(self, tier: WatchedTier, interval: float) -> None:
        self.tier = tier
        self.interval = interval
        self.token: bytes | None = None  # the generation last seen (None: not yet asked)
        self._task: asyncio.Task[None] | None = None
        self._forgetting: ForgetMarks | None = None
        self._forget_task: asyncio.Task[None] | None = None
        self._stopping = False
        # one check at a time (the periodic one, the stop's): an answer read before a
        # loss and handled after another check saw it was taken for a second loss
        self._checking = asyncio.Lock()
        # called once every mark is forgotten (the SSD copies to the remote store: those
        # nearest eviction, unmarked now, go before SSD evicts them, not at its next write)
        self.on_forgotten: Callable[[], None] | None = None

    def start(self) -> None:
        """Begin checking (on the daemon's loop), the first time at once."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """End the checks and the forgetting, within ``STOP_SECONDS``.  A cancel a call
        inside a check swallowed (Python 3.11's ``asyncio.wait_for`` loses one that comes
        as its call ends; so may a backend's client library) left the loop checking on,
        and the stop waited for it forever: the loop now ends at its next turn, each
        task is cancelled again until it ends, and one that does not is left behind
        (logged), not waited for."""
        self._stopping = True
        until = time.monotonic() + STOP_SECONDS
        await self._end(self._task, until)
        # (read once the checks ended: a check that swallowed a cancel may have found a
        # new generation and begun forgetting, which ran on after the stop)
        await self._end(self._forget_task, until)
        self._task = self._forget_task = None

    @staticmethod
    async def _end(task: asyncio.Task[None] | None, until: float) -> None:
        """Cancel ``task`` until it ends, or leave it behind (logged) at ``until``."""
        while task is not None and not task.done():
            task.cancel()
            left = until - time.monotonic()
            if left <= 0:
                log.error("the remote store's generation watch did not end within "
                          "%g s of the stop; left behind", STOP_SECONDS)
                break
            await asyncio.wait({task}, timeout=min(left, STOP_RETRY_SECONDS))
        if task is not None and task.done() and not task.cancelled():
            with contextlib.suppress(Exception):
                task.result()  # (its exception, if any, retrieved: not logged again)

    @property
    def forgetting(self) -> bool:
        """Whether marks are being taken back."""
        return self._forgetting is not None

    async def _run(self) -> None:
        while not self._stopping:
            if self.tier.healthy:
                await self.check()
                self.tier.send_held()  # (held back: sent though no commit comes)
            await asyncio.sleep(self.interval)

    async def check(self) -> bool:
        """Ask the store's generation; whether it changed since the last answer (the
        marks are being forgotten then).  A failed call counts as the tier's failure,
        unless it timed out while the store answered others (``kvstore.remote_health``)."""
        tier = self.tier
        began = time.monotonic()
        try:
            async with self._checking:
                token = await tier.backend.generation()
                return self._answered(token)
        except KVStoreError as exc:
            tier.failed("generation check", exc, began)
            return False

    def _answered(self, token: bytes | None) -> bool:
        """The store's generation is ``token``: whether it changed (see ``check``)."""
        self.tier.counters["generation_checks"] += 1
        if token is None or token == self.token:
            return False
        known, self.token = self.token, token
        if known is None:
            return False  # the first answer: what was marked so far went to this store
        self.lost()
        return True

    def lost(self) -> None:
        """The store lost what it held: forget every mark (again from the start, if a
        round is under way: what it passed may be marked from the old store since)."""
        tier = self.tier
        tier.epoch += 1
        tier.counters["generations_lost"] += 1
        tier.shares.forget()  # (each tenant's values there with it)
        log.warning("the remote store lost what it held (its generation changed): "
                    "forgetting which blocks it holds; those still cached here are "
                    "written to it again")
        self._forgetting = ForgetMarks(tier.store)
        if self._forget_task is None:
            self._forget_task = asyncio.get_running_loop().create_task(self._forget())

    async def _forget(self) -> None:
        try:
            while (walk := self._forgetting) is not None:
                before = walk.count
                done, in_dram = walk.step(FORGET_SLICE, FORGET_SLICE_SECONDS)
                self.tier.counters["marks_forgotten"] += walk.count - before
                if in_dram:
                    self.tier.write_again(in_dram)
                if done and self._forgetting is walk:
                    self._forgetting = None
                    if self.on_forgotten is not None:
                        self.on_forgotten()
                    break
                await asyncio.sleep(0)  # a loop turn for everyone else
        finally:
            self._forget_task = None

    async def forgotten(self) -> None:
        """Wait until no marks are being forgotten (the stop's last write-back)."""
        while self._forget_task is not None:
            await asyncio.wait({self._forget_task})
