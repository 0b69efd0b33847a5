"""Keys that more than one namespace may hold, so that the event stream's removals hold.

The stream names a block by its key alone, as vLLM's events do, and routers keep a set
per key and tier; the store keys blocks per namespace.  Keys made by the client library
are chained from their namespace id, so two namespaces never share one; but a client may
send keys of its own making, and a tenant that knows another's keys (a shared system
prompt's) may store them in a namespace of its own.  Its copies going must not announce
the other's gone (every router would stop sending the other's requests here): a removal
of a key from a tier is announced only when no other namespace still holds the key in
that tier (``KeyCounts.sieve``, at the drain).

Asking every namespace for every removed key would cost the drain O(namespaces) a key,
and a map of every key daemon-wide a dict entry a block.  ``KeyCounts`` is a counting
filter over the keys of every namespace's map instead: one byte a slot, the slot of a
key from its hash (``hash(bytes)``: seeded per process, so a client that chooses its
keys' bytes cannot choose where they fall), counted up when an entry enters a map and
down when it leaves (the store does it, inline where it makes and forgets entries).  A
removed key whose counter says no other entry may hold it is announced at once, one read;
only otherwise (a key held by two namespaces, or another key in the same slot) are the
other namespaces asked.  A counter that reaches 255 stays there (counted neither up nor
down): its keys are asked about for good, never announced wrongly.  Kept only while the
event stream is on (``StoreCore.record_changes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvstore.blocks import Block, Namespace, TierSlots
from kvstore.tier_changes import TIER_BITS, Removed, TierChanges, holdings

# Slots of the filter, at most: 16 MiB, about 1.7 bytes a block at 10M blocks, where a
# removed key of no other namespace's finds its slot empty (or its own entry's only)
# about half the time; fewer for a store whose tiers hold fewer blocks (``slot_bits_for``)
SLOT_BITS = 24
LEAST_BITS = 12
# The block size a store's slots are reckoned by, the smallest a slot is: twice as many
# slots as blocks of it fit in its DRAM and SSD tiers, up to ``SLOT_BITS`` (past that,
# or with copies on the remote store only, the filter fills: more keys asked about,
# none announced wrongly)
BLOCK_BYTES = 4096
# A key's slot: bits of its hash above those that pick its shard (``block_map``)
SHIFT = 32
FULL = 255  # a counter that stays
# Namespaces one drain asks about removed keys, at most (a few ms of the loop): past it
# the removals left are announced unasked, as before the filter.  Unbounded, a tenant
# that held a key of each of 4096 another evicted, in the last of 2002 namespaces, held
# one drain 1.7 s.  Keys the client library makes never share one (they are chained
# from their namespace's id), so what goes unasked is only ever a key a client made up.
ASK_BUDGET = 8_000  # (about 0.4 us a namespace asked on a slow machine: 3.3 ms)

_BIT_OF = dict(TIER_BITS)


def slot_bits_for(capacity_bytes: int) -> int:
    """The filter's size (bits of a slot's index) for tiers of ``capacity_bytes`` in all."""
    return max(LEAST_BITS, min(SLOT_BITS, (2 * capacity_bytes // BLOCK_BYTES).bit_length()))


class KeyCounts:
    """A counting filter over the keys in ``namespaces``' maps (see the module
    docstring); ``counts``, ``SHIFT`` and ``mask`` are read inline by the store's hot
    loops (``slot = hash(key) >> SHIFT & mask``)."""

    __slots__ = ("namespaces", "counts", "mask", "asked", "kept", "unsure", "budget")

    def __init__(self, namespaces: Mapping[bytes, Namespace], bits: int = SLOT_BITS) -> None:
        self.namespaces = namespaces
        self.counts = bytearray(1 << bits)
        self.mask = (1 << bits) - 1
        self.asked = 0  # removed keys the other namespaces were asked about
        self.kept = 0   # removals not announced: another namespace holds the key there
        self.unsure = 0  # removals announced unasked, past a drain's ``ASK_BUDGET``
        self.budget = ASK_BUDGET  # namespaces this drain may still ask (``sieve``)

    def add(self, key: bytes) -> None:
        """An entry of ``key`` entered a namespace's map."""
        counts, slot = self.counts, hash(key) >> SHIFT & self.mask
        n = counts[slot]
        if n != FULL:
            counts[slot] = n + 1

    def discard(self, key: bytes) -> None:
        """An entry of ``key`` left a namespace's map."""
        counts, slot = self.counts, hash(key) >> SHIFT & self.mask
        n = counts[slot]
        if 0 < n < FULL:  # (0: a key never counted; the checker says so, no request fails)
            counts[slot] = n - 1

    def add_all(self, namespaces: Iterable[Namespace]) -> None:
        """Count every entry of ``namespaces`` (once, as the stream starts)."""
        for ns in namespaces:
            for key in ns.blocks:
                self.add(key)

    def count(self, key: bytes) -> int:
        """The counter of ``key``'s slot (at least the entries of ``key``)."""
        return self.counts[hash(key) >> SHIFT & self.mask]

    def held_elsewhere(self, ns: Namespace, key: bytes, tier: str) -> bool:
        """Whether a namespace other than ``ns`` holds ``key`` in ``tier`` now."""
        n = self.counts[hash(key) >> SHIFT & self.mask]
        if not n:
            return False
        if n == 1 and ns.blocks.get(key) is not None:
            return False  # the one entry counted is ``ns``'s own
        if self.budget < len(self.namespaces):
            self.unsure += 1  # (the drain's budget spent: announced, as before the filter)
            return False
        self.budget -= len(self.namespaces)
        self.asked += 1
        bit = _BIT_OF[tier]
        for other in self.namespaces.values():
            if other is not ns:
                block = other.blocks.get(key)
                if block is not None and holdings(block) & bit:
                    # the stream keeps the key in the tier for this copy now: its going
                    # is announced, even a copy stored and never announced itself
                    block.marks |= bit
                    return True
        return False

    def sieve(self, removed: Iterable[Removed]) -> list[Removed]:
        """The removals to announce: each without the keys another namespace still
        holds in its tier, and a key that two namespaces' copies left in one turn once
        (a removal left with no key goes)."""
        out: list[Removed] = []
        firsts: dict[str, Removed] = {}  # each tier's first removal
        announced: dict[str, set[bytes]] = {}  # ... and its keys, once a second comes
        counts, mask = self.counts, self.mask
        self.budget = ASK_BUDGET
        for change in removed:
            tier, ns = change.tier, change.ns
            # (the first test of ``held_elsewhere`` inline: most keys' slots are empty)
            keys = [key for key in change.keys
                    if not counts[hash(key) >> SHIFT & mask]
                    or not self.held_elsewhere(ns, key, tier)]
            self.kept += len(change.keys) - len(keys)
            first = firsts.setdefault(tier, change)
            if first is not change:  # another namespace's removals in the tier
                done = announced.get(tier)
                if done is None:
                    done = announced[tier] = set(first.keys)
                keys = [key for key in keys if key not in done]
                done.update(keys)
            change.keys = keys
            if keys:
                out.append(change)
        return out

    def check(self) -> None:
        """Each counter short of ``FULL`` the number of entries of its slot; a full one
        stays as its entries go, down to none (for tests and the invariant checker)."""
        real: dict[int, int] = {}
        for ns in self.namespaces.values():
            for key in ns.blocks:
                slot = hash(key) >> SHIFT & self.mask
                real[slot] = real.get(slot, 0) + 1
        counts = self.counts
        for slot, n in real.items():  # (a full counter stays: fewer entries may be left)
            assert counts[slot] == FULL or counts[slot] == n, (
                f"slot {slot}: counted {counts[slot]}, its entries {n}")
        extra = (len(counts) - counts.count(0) - counts.count(FULL)
                 - sum(1 for slot in real if counts[slot] != FULL))
        assert not extra, f"{extra} slots of no entry counted"

    def __repr__(self) -> str:
        return (f"KeyCounts(slots={len(self.counts)}, asked={self.asked}, kept={self.kept}, "
                f"unsure={self.unsure})")


def counted_keys(namespaces: Mapping[bytes, Namespace], changes: TierChanges,
                 dram_bytes: int, ssd: TierSlots | None) -> KeyCounts:
    """A filter over every entry of ``namespaces`` now, sized for tiers of ``dram_bytes``
    and ``ssd``, that ``changes``' drains sieve their removals by (the stream begins)."""
    counts = KeyCounts(namespaces, slot_bits_for(
        dram_bytes + (ssd.pool.capacity_bytes if ssd is not None else 0)))
    counts.add_all(namespaces.values())
    changes.sieve = counts.sieve
    return counts


def unmap(block: Block, counts: KeyCounts | None) -> None:
    """Take ``block``'s entry out of its namespace's map (and out of ``counts``)."""
    del block.ns.blocks[block.key]
    if counts is not None:
        counts.discard(block.key)
