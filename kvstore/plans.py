"""What the store asks the daemon to do before a call can go on.

Raised by the store (for now: they are to become plans returned as data) and carried out
by the daemon's movers, after which the call runs again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.blocks import Block


class DemotionNeeded(Exception):
    """Not an error: DRAM slots free up only after these blocks are written to SSD (and
    those of ``remote`` to the remote store, in its write-back mode).  With neither, room
    is on its way from writes already under way: wait a little, then retry."""

    def __init__(self, blocks: list[Block], remote: list[Block] | None = None) -> None:
        super().__init__(f"{len(blocks)} blocks to demote first")
        self.blocks = blocks
        self.remote = remote or []


class PromotionNeeded(Exception):
    """Not an error: these blocks are only on SSD and must be read into DRAM first."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__(f"{len(blocks)} blocks to promote first")
        self.blocks = blocks
