"""A block's ``announced`` bits and ``remote`` flag share one slot: each reads back what
was set, whatever the other holds, and the entry stays within the allocator's 176-byte
class (one slot more makes it 192)."""

from __future__ import annotations

import sys
from itertools import product

from kvstore.blocks import Block


def test_announced_and_remote_are_independent() -> None:
    block = Block(b"k" * 16, None, None)  # type: ignore[arg-type]
    assert block.announced == 0 and block.remote is False
    for bits, remote in product(range(16), (False, True)):
        block.announced = bits
        block.remote = remote
        assert (block.announced, block.remote) == (bits, remote)
        block.announced &= ~1  # as the event stream clears the DRAM bit
        assert (block.announced, block.remote) == (bits & ~1, remote)
        block.remote = not remote
        assert (block.announced, block.remote) == (bits & ~1, not remote)


def test_an_entry_is_176_bytes() -> None:
    assert sys.getsizeof(Block(b"k" * 16, None, None)) <= 176  # type: ignore[arg-type]
