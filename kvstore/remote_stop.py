"""The remote tier's last sends, on a clean stop.

Write-back: every block only DRAM holds, which the remote store lacks, goes (stopping
drops DRAM; before, a stop within ``remote.unhealthy_seconds`` of one timed-out call
wrote none of it back).  Write-through: the blocks held back to send later (committed
while the tier was skipped after an outage, or refused by a full store) go, those DRAM
still holds.  Before, a stop dropped them unlogged: a stop within
``remote.unhealthy_seconds`` of an outage lost every block committed since, for every
daemon of the store, where no SSD tier kept them (an SSD tier keeps its copies, but no
later start sends them).  Each is one try whatever a failure a moment ago said (a store
really down fails one send, and the rest skip it); the store's generation is asked
first, so that the marks of what it lost go and those blocks go too.
"""

from __future__ import annotations

import logging
from typing import Protocol

from kvstore.blocks import REMOTE_MARK
from kvstore.remote_health import TierHealth
from kvstore.remote_held import HeldWrites
from kvstore.remote_watch import GenerationWatch
from kvstore.store import Block, BlockStore, Namespace

log = logging.getLogger("kvstore.remote")

SEND_MOST = 64  # blocks of one send on the way out


class StoppingTier(Protocol):
    """What the last sends use of the remote tier (``remote.RemoteTier``)."""

    write_back: bool
    store: BlockStore
    health: TierHealth
    held: HeldWrites
    watch: GenerationWatch

    async def drain(self) -> None: ...

    async def send_blocks(self, ns: Namespace, blocks: list[Block]) -> None: ...


async def flush_on_stop(tier: StoppingTier) -> int:
    """Send what the remote store should have and lacks (see the module's text); how
    many blocks went.  What could not go is logged."""
    tier.health.clear()
    await tier.watch.check()
    await tier.watch.forgotten()
    tier.health.clear()
    if tier.write_back:
        wanted = [b for ns in list(tier.store.namespaces.values()) for b in ns.blocks.values()
                  if b.offset is not None and b.ssd_offset is None and not b.demoting]
        what = "only DRAM held were not written back to"
    else:
        await tier.drain()  # (those a lost generation sends again)
        wanted = tier.held.take(lambda tenant: True)
        what = "held back were not written through to"
    wanted = [b for b in wanted if b.ns.blocks.get(b.key) is b and not b.marks & REMOTE_MARK]
    by_ns: dict[Namespace, list[Block]] = {}
    for b in wanted:
        if b.offset is not None:  # (a write-through one DRAM let go is on SSD only)
            by_ns.setdefault(b.ns, []).append(b)
    for ns, blocks in by_ns.items():
        for start in range(0, len(blocks), SEND_MOST):
            await tier.send_blocks(ns, blocks[start:start + SEND_MOST])
    written = sum(1 for b in wanted if b.marks & REMOTE_MARK)
    if written < len(wanted):
        log.warning("%d blocks %s the remote store on the way out", len(wanted) - written,
                    what)
    return written
