"""A block's ``announced`` bits and ``remote`` flag share one slot: each reads back what
was set, whatever the other holds, and the entry stays within the allocator's 176-byte
class (one slot more makes it 192)."""

from __future__ import annotations

import sys
from itertools import product

import pytest

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


def test_seen_stops_at_its_most_and_leaves_the_other_bits() -> None:
    """A block committed and hit many times counts to SEEN_MOST and no further, so that
    ``marks`` stays a small int Python keeps (a hot block's count was an int object of
    its own from its 8th hit), with its announced bits and remote flag as they were."""
    from kvtest import make_identity

    from kvstore.blocks import SEEN_MOST
    from kvstore.keys import chain_keys
    from kvstore.store import BlockStore

    ident = make_identity(tenant="acme", model="m")
    store = BlockStore(8 * ident.block_bytes, 8 * ident.block_bytes)
    ns = store.open_namespace(ident)
    keys = chain_keys(ns.id, list(range(ident.block_tokens * 3)), ident.block_tokens)
    r = store.reserve("s1", ns, keys, None, 0.0)
    store.commit("s1", r.id, 0.0)  # type: ignore[union-attr]
    block = ns.blocks[keys[0]]
    block.announced, block.remote = 0b0101, True
    seen = [block.seen]
    for _ in range(3 * SEEN_MOST):
        assert store.lookup(ns, keys) == ["dram"] * 3
        seen.append(block.seen)
    assert seen == [min(i + 1, SEEN_MOST) for i in range(len(seen))]
    assert all(ns.blocks[k].seen == SEEN_MOST for k in keys)
    assert block.marks <= 255 and (block.announced, block.remote) == (0b0101, True)
    block.seen = 100  # set by hand: held to the most as well
    assert block.seen == SEEN_MOST and (block.announced, block.remote) == (0b0101, True)


@pytest.mark.parametrize("admit_after", [0, 8])
def test_an_admission_count_the_blocks_cannot_reach_is_refused(admit_after: int) -> None:
    from kvstore.config import Config, SsdConfig
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"ssd.admit_after: must be in \[1, 7\]"):
        Config(ssd=SsdConfig(admit_after=admit_after)).validate()
    Config(ssd=SsdConfig(admit_after=7)).validate()
