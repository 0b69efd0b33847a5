"""Model-based test of the block store: random operation sequences keep every invariant."""

from __future__ import annotations

from kvtest import make_identity
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvstore.errors import CapacityError, LeaseExpiredError, NotFoundError
from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Limits, Pin, Reservation

IDENTS = [make_identity(), make_identity(head_dim=64)]  # two size classes
OWNERS = ["a", "b", "c"]


def _chains(ns: bytes, block_tokens: int) -> list[list[bytes]]:
    # four token sequences of six blocks that share 0..3 leading blocks with the first
    base = list(range(6 * block_tokens))
    out = []
    for shared in range(4):
        tokens = base[: shared * block_tokens] + [10_000 * (shared + 1) + t for t in
                                                  range((6 - shared) * block_tokens)]
        out.append(chain_keys(ns, tokens, block_tokens))
    return out


class StoreMachine(RuleBasedStateMachine):
    reservations = Bundle("reservations")
    pins = Bundle("pins")

    def __init__(self) -> None:
        super().__init__()
        slot = IDENTS[0].block_bytes
        # room for 12 small blocks; the big class takes whole slabs of 4 small slots
        self.store = BlockStore(12 * slot, 4 * slot, limits=Limits(lease_seconds=5.0))
        self.ns = [self.store.open_namespace(i) for i in IDENTS]
        self.chains = [_chains(n.id, n.identity.block_tokens) for n in self.ns]
        self.now = 0.0
        self.pinned: dict[int, tuple[Pin, list[int]]] = {}  # pin id -> (pin, offsets then)

    @rule(target=reservations, owner=st.sampled_from(OWNERS), which=st.integers(0, 1),
          chain=st.integers(0, 3), extra=st.integers(0, 3), length=st.integers(1, 4))
    def reserve(self, owner: str, which: int, chain: int, extra: int,
                length: int) -> Reservation | None:
        ns, keys = self.ns[which], self.chains[which][chain]
        hit = len(self.store.lookup(ns, keys))
        start = min(max(hit - extra, 0), len(keys))  # sometimes re-reserve cached keys
        todo = keys[start:start + length]
        if not todo:
            return None
        before = (self.store.reserved_slots, self.store.committed_slots)
        try:
            return self.store.reserve(owner, ns, todo, keys[start - 1] if start else None,
                                      self.now)
        except CapacityError:
            assert self.store.reserved_slots == before[0], "a failed reserve kept slots"
            return None

    @rule(r=consumes(reservations), advance=st.floats(0, 3))
    def commit(self, r: Reservation | None, advance: float) -> None:
        if r is None:
            return
        self.now += advance
        try:
            result = self.store.commit(r.owner, r.id, self.now)
        except (NotFoundError, LeaseExpiredError):
            return  # expired or rolled back with its owner
        assert result.created + result.duplicates == len(r.keys)
        for key in r.keys:
            assert key in r.ns.blocks, "a committed key is not visible"

    @rule(r=consumes(reservations))
    def abort(self, r: Reservation | None) -> None:
        if r is None:
            return
        try:
            self.store.abort(r.owner, r.id)
        except (NotFoundError, LeaseExpiredError):
            pass

    @rule(target=pins, owner=st.sampled_from(OWNERS), which=st.integers(0, 1),
          chain=st.integers(0, 3), length=st.integers(1, 6))
    def acquire(self, owner: str, which: int, chain: int, length: int) -> int | None:
        ns, keys = self.ns[which], self.chains[which][chain]
        want = keys[:length]
        present = all(k in ns.blocks for k in want)
        try:
            pin = self.store.acquire(owner, ns, want, self.now)
        except NotFoundError:
            assert not present
            return None
        assert present
        self.pinned[pin.id] = (pin, [b.offset for b in pin.blocks])
        return pin.id

    @rule(pin_id=consumes(pins))
    def release(self, pin_id: int | None) -> None:
        if pin_id is None or pin_id not in self.pinned:
            return
        pin, _ = self.pinned.pop(pin_id)
        try:
            self.store.release(pin.owner, pin.id)
        except (NotFoundError, LeaseExpiredError):
            pass

    @rule(which=st.integers(0, 1), chain=st.integers(0, 3), at=st.integers(0, 5))
    def evict(self, which: int, chain: int, at: int) -> None:
        self.store.evict(self.ns[which], [self.chains[which][chain][at]])

    @rule(owner=st.sampled_from(OWNERS))
    def renew(self, owner: str) -> None:
        self.store.touch_owner(owner, self.now)

    @rule(advance=st.floats(0, 4))
    def time_passes(self, advance: float) -> None:
        self.now += advance
        gone = set(self.store.expire(self.now))
        for pin_id, (pin, _) in list(self.pinned.items()):
            if pin.owner in gone:
                del self.pinned[pin_id]

    @precondition(lambda self: bool(self.store.owners))
    @rule(owner=st.sampled_from(OWNERS))
    def owner_vanishes(self, owner: str) -> None:
        self.store.drop_owner(owner)
        for pin_id, (pin, _) in list(self.pinned.items()):
            if pin.owner == owner:
                del self.pinned[pin_id]

    @invariant()
    def invariants_hold(self) -> None:
        self.store.check_invariants()

    @invariant()
    def pinned_blocks_stay_put(self) -> None:
        for pin, offsets in self.pinned.values():
            for block, offset in zip(pin.blocks, offsets):
                assert block.ns.blocks.get(block.key) is block, "a pinned block was evicted"
                assert block.offset == offset, "a pinned block moved"

    @invariant()
    def lookup_is_the_longest_cached_prefix(self) -> None:
        for ns, chains in zip(self.ns, self.chains):
            for keys in chains:
                n = 0
                while n < len(keys) and keys[n] in ns.blocks:
                    n += 1
                cached = [k in ns.blocks for k in keys]
                assert not any(cached[n:]) or all(cached[:n]), "prefix closure"
                # every cached key's whole prefix is cached
                for i, c in enumerate(cached):
                    if c:
                        assert all(cached[:i]), "a cached key without its prefix"


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
