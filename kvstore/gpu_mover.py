"""The GPU tier in the daemon: the device pool and the copies that fill it.

The daemon owns one pool on a device (``kvstore.tiers.gpu.DevicePool``).  Blocks that
are committed, and blocks that are acquired without a GPU copy, are copied from their
DRAM slots into pool slots in the background (as write-back class transfers), with their
DRAM copies pinned meanwhile; the store's ``GpuCopies`` decides which slots.  Colocated
clients map the pool through the handle ``GpuAttach`` returns, and an acquire reply
names each block's pool slot, so they reload device to device.  Where the device is
missing the tier is off and the daemon serves as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgspec

from kvstore.config import Config
from kvstore.gpu_copies import GpuCopies
from kvstore.scheduler.queues import TransferKind
from kvstore.store import Block, BlockStore, Namespace
from kvstore.transfers import Background, TransferGate, TurnBatch

log = logging.getLogger("kvstore.gpu")


class GpuMover:
    """Owns the device pool and copies DRAM blocks into it."""

    def __init__(self, config: Config, store: BlockStore,
                 slot: Callable[[Namespace, int], memoryview], gate: TransferGate,
                 freed: Callable[[], None], arena: Any = None) -> None:
        """Make the pool (UnavailableError where the device is missing) and page-lock
        ``arena`` (the shared DRAM arena's mmap, if any) for CUDA in the background;
        ``freed`` is called when a copy's DRAM copies are unpinned (requests waiting for
        DRAM room may go on)."""
        from kvstore.tiers.gpu import DevicePool

        name = config.gpu.device
        device: int | Literal["cpu"] = "cpu" if name == "cpu" else int(name)
        capacity, slab = config.gpu_capacity, config.gpu_slab_bytes
        self.pool = DevicePool.create(device, capacity, slab_bytes=slab,
                                      directory=config.dram.directory)
        self.handle = msgspec.msgpack.encode(self.pool.export())
        store.use_gpu(GpuCopies(capacity, min(slab, capacity)))
        self.store = store
        self.slot = slot
        self.gate = gate
        self.errors = 0
        self._freed = freed
        self._background = Background()
        # own context: background work, not part of the request that asked (whose
        # transfer class, a reload say, would otherwise be inherited)
        self._wanted: TurnBatch[Block] = TurnBatch(self._background, self._copy_in,
                                                   own_context=True)
        self._registration: Any = None
        if arena is not None and self.pool.device.type == "cuda":
            from kvstore.kernels.pinned import register_in_background

            self._registration = register_in_background(arena)

    def describe(self) -> str:
        return f"{self.pool!r}"

    def wanted(self, blocks: Iterable[Block]) -> None:
        """Blocks that should have a GPU copy (committed, or just used): copy them soon."""
        self._wanted.add(b for b in blocks if b.gpu_offset is None)

    async def _copy_in(self, batch: list[Block]) -> None:
        batch = [b for b in batch if b.offset is not None]
        if not batch:
            return
        nbytes = sum(b.ns.block_bytes for b in batch)
        async with self.gate.slot(nbytes, TransferKind.WRITEBACK, batch[0].ns.tenant):
            # planned once its turn has come: the DRAM copies are pinned only while read
            plan = self.store.gpu_begin(batch)
            if not plan:
                return
            ok = False
            try:
                items = [(self.slot(b.ns, b.offset), off)  # type: ignore[arg-type]
                         for b, off in plan]
                await asyncio.to_thread(self._copy, items)
                ok = True
                for view, _ in items:
                    try:
                        view.release()
                    except BufferError:
                        pass  # a tensor over it is still being collected; the GC frees it
            except Exception as exc:  # noqa: BLE001 - a failed copy only loses GPU copies
                self.errors += 1
                log.warning("copying %d blocks into the gpu tier failed: %s", len(plan), exc)
            finally:
                self.store.gpu_end(plan, ok)
                self._freed()

    def _copy(self, items: list[tuple[memoryview, int]]) -> None:
        """DRAM slots into pool slots; returns when the bytes are there."""
        import torch

        from kvstore.tiers.gpu import CopyFence

        for view, offset in items:
            source = torch.frombuffer(view, dtype=torch.uint8)
            self.pool.slot_tensor(offset, len(view)).copy_(source, non_blocking=True)
            del source
        CopyFence.record(self.pool.device).wait()

    async def drain(self) -> None:
        await self._background.drain()

    def close(self) -> None:
        """Unpin the arena and free the pool (clients keep mappings until they close)."""
        if self._registration is not None:
            self._registration.unregister()
            self._registration = None
        self.pool.close()

    def stats(self) -> dict[str, Any]:
        return {"device": str(self.pool.device), "errors": self.errors,
                "arena_pinned_bytes": (self._registration.pinned_bytes
                                       if self._registration is not None else 0)}
