"""KnownChains (kvstore.integrations.vllm_chains): a request's keys taken over from an
earlier request's chain by vLLM's block hashes, without vLLM (requests stand in)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from kvstore.integrations.vllm_chains import KnownChains
from kvstore.keys import chain_keys

BLOCK = 4
NS = os.urandom(16)


@dataclass
class FakeRequest:
    """What KnownChains reads of a vLLM request: its tokens and vLLM's chained block
    hashes (sha256 of the parent's hash and the block's tokens, as vLLM's)."""

    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        parent = b"root"
        for j in range(len(self.all_token_ids) // BLOCK):
            block = self.all_token_ids[j * BLOCK:(j + 1) * BLOCK]
            parent = hashlib.sha256(parent + repr(block).encode()).digest()
            self.block_hashes.append(parent)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def keys_of(known: KnownChains, request: FakeRequest, space: object = "g0") -> list[bytes]:
    """The request's every full block's key, as the connector extends them."""
    keys: list[bytes] = []
    known.extend(space, request, keys, request.num_tokens // BLOCK, BLOCK, lambda: NS)
    return keys


def test_a_conversations_next_request_takes_the_keys_of_the_one_before() -> None:
    known = KnownChains(True)
    first = FakeRequest(list(range(3, 3 + 5 * BLOCK + 2)))
    assert keys_of(known, first) == chain_keys(NS, first.all_token_ids, BLOCK)
    second = FakeRequest(first.all_token_ids + [7] * (2 * BLOCK))
    hashes = known.hashes(second, BLOCK)
    assert len(known.prefix("g0", hashes, 7)) == 5  # the first request's 5 blocks
    assert keys_of(known, second) == chain_keys(NS, second.all_token_ids, BLOCK)
    # Another space (group, variant) shares nothing; an edit within the prefix changes
    # every hash from there, and the blocks before it end no remembered chain: nothing
    # is taken over, and every key is hashed again (to the same keys).
    assert known.prefix("g1", hashes, 7) == []
    edited = FakeRequest(first.all_token_ids[:2 * BLOCK] + [9] + second.all_token_ids[
        2 * BLOCK + 1:])
    assert known.prefix("g0", known.hashes(edited, BLOCK), 7) == []
    assert keys_of(known, edited) == chain_keys(NS, edited.all_token_ids, BLOCK)


def test_nothing_is_taken_over_when_disabled_unhashed_or_forgotten() -> None:
    off = KnownChains(False)
    request = FakeRequest(list(range(3, 3 + 3 * BLOCK)))
    assert keys_of(off, request) == chain_keys(NS, request.all_token_ids, BLOCK)
    assert off.hashes(request, BLOCK) == () and len(off) == 0
    on = KnownChains(True, max_keys=5)
    request.block_hashes.pop()  # hashed by blocks of another size: not one a block
    assert on.hashes(request, BLOCK) == ()
    assert keys_of(on, request) == chain_keys(NS, request.all_token_ids, BLOCK)
    chains = [FakeRequest([100 * i + t for t in range(2 * BLOCK)]) for i in range(3)]
    for c in chains:
        assert keys_of(on, c) == chain_keys(NS, c.all_token_ids, BLOCK)
    assert on.prefix("g0", on.hashes(chains[0], BLOCK), 2) == []  # the least recent
    assert on.prefix("g0", on.hashes(chains[2], BLOCK), 2) == keys_of(on, chains[2])
    assert on.keys == 4 and len(on) == 2  # 6 keys do not fit in 5: a chain forgotten


def test_a_chain_grown_step_by_step_is_remembered_once_and_counted_by_its_keys() -> None:
    """The connector extends a request's chain as its blocks fill: the chain moves to
    where it ends now, rather than each end keeping it remembered."""
    known = KnownChains(True, max_keys=12)
    grown = FakeRequest(list(range(3, 3 + 8 * BLOCK)))
    keys: list[bytes] = []
    for blocks in range(1, 9):
        known.extend("g0", grown, keys, blocks, BLOCK, lambda: NS)
        assert len(known) == 1 and known.keys == blocks
    assert keys == chain_keys(NS, grown.all_token_ids, BLOCK)
    assert known.prefix("g0", known.hashes(grown, BLOCK), 8) == keys
    other = FakeRequest([7] * (6 * BLOCK))  # 8 + 6 keys do not fit in 12
    assert keys_of(known, other) == chain_keys(NS, other.all_token_ids, BLOCK)
    assert len(known) == 1 and known.keys == 6
    assert known.prefix("g0", known.hashes(grown, BLOCK), 8) == []
    # A chain longer than the bound is not remembered at all.
    assert keys_of(known, FakeRequest([5] * (13 * BLOCK)))
    assert len(known) == 0 and known.keys == 0
