"""What the store asks the daemon to do before a call can succeed: plans, as data.

A store call that cannot finish with bookkeeping alone returns a ``Plan`` instead of its
result, having changed nothing it would have to undo but the marks the plan names (its
victims are marked demoting, its promotion's DRAM slots are reserved).  The daemon's
mover pipeline carries the plan out, every part of it, and makes the call again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.blocks import Block, Namespace, Transfer
    from kvstore.pool import Slab, SlabClass, SlabPool

# Plans of a turn (``Plan.turn``) one call may go through besides its other rounds: each
# comes after progress (a slab taken), so this only bounds a call others outrun for good.
MAX_TURNS = 10_000


@dataclass(eq=False)
class Plan:
    """The moves a call waits on.

    ``demote``: DRAM copies to write to SSD, after which they leave DRAM (unless pinned
    meanwhile); ``to_remote``: the same, to the remote store (its write-back mode).
    ``promote``: a transfer of SSD copies into DRAM slots the store reserved for them;
    ``reads``: blocks that other requests are promoting already, to wait for.
    ``room_coming``: nothing to do but wait a little: writes under way will free room.
    ``fetch``: keys of a namespace to bring in from the remote store (the daemon's verbs
    plan these: the store knows nothing of the remote store's contents).
    ``defer_until``: wait for room, in order, until then (the daemon's pressure step).
    ``turn``: nothing to wait on; let the loop serve others for a turn, then call again
    (a request that needs several slabs takes one a turn, and empties a big one in
    steps), ``earmarks`` (pool, class, slabs) set aside for the call meanwhile and
    ``drains`` (pool, class, slab) being emptied for it, let go when it is made again
    or abandoned; ``wait``: what the turn waits for instead of one turn of the loop (a
    slab's memory being allocated on the daemon's thread, ``SlabMoves.wait_for_memory``).
    """

    demote: list[Block] = field(default_factory=list)
    to_remote: list[Block] = field(default_factory=list)
    promote: Transfer | None = None
    reads: list[Block] = field(default_factory=list)
    room_coming: bool = False
    fetch: tuple[Namespace, list[bytes]] | None = None
    defer_until: float | None = None
    expired: bool = False  # a deferral whose deadline passed: the last attempt runs
    ticket: int = 0        # a deferral's place in line, kept while it retries
    turn: bool = False
    earmarks: list[tuple[SlabPool, SlabClass, int]] = field(default_factory=list)
    drains: list[tuple[SlabPool, SlabClass, Slab]] = field(default_factory=list)
    wait: Callable[[], Awaitable[None]] | None = None

    def let_go(self) -> None:
        """The slabs set aside for the call go back to every class, and those being
        emptied for it to their own (once)."""
        for pool, cls, count in self.earmarks:
            pool.release(cls, count)
        self.earmarks.clear()
        for pool, cls, slab in self.drains:
            pool.undrain(cls, slab)
        self.drains.clear()

    def __repr__(self) -> str:
        promote = len(self.promote.blocks) if self.promote is not None else 0
        return (f"Plan(demote={len(self.demote)}, to_remote={len(self.to_remote)}, "
                f"promote={promote}, reads={len(self.reads)}, "
                f"room_coming={self.room_coming}, fetch={self.fetch is not None}, "
                f"defer_until={self.defer_until}, turn={self.turn})")
