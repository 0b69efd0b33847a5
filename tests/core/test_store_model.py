"""Model-based test of the block store: random operation sequences keep every invariant."""

from __future__ import annotations

from typing import Any

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

from kvstore.blocks import Block
from kvstore.blocks import subtree as _subtree  # (the store's own walk)
from kvstore.errors import CapacityError, LeaseExpiredError, NotFoundError
from kvstore.keys import chain_keys
from kvstore.store import BlockStore, Limits, Pin, Plan, Reservation

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

    ssd_slots = 0
    dram_slots = 12

    def __init__(self) -> None:
        super().__init__()
        slot = IDENTS[0].block_bytes
        # room for 12 small blocks; the big class takes whole slabs of 4 small slots
        self.store = BlockStore(self.dram_slots * slot, 4 * slot, limits=Limits(lease_seconds=5.0),
                                ssd_capacity=self.ssd_slots * slot, ssd_slab_bytes=4 * slot)
        self.outcomes = iter(())  # success or failure of each simulated SSD transfer
        self.ns = [self.store.open_namespace(i) for i in IDENTS]
        self.chains = [_chains(n.id, n.identity.block_tokens) for n in self.ns]
        self.now = 0.0
        self.pinned: dict[int, tuple[Pin, list[int]]] = {}  # pin id -> (pin, offsets then)

    @rule(target=reservations, owner=st.sampled_from(OWNERS), which=st.integers(0, 1),
          chain=st.integers(0, 3), extra=st.integers(0, 3), length=st.integers(1, 4),
          skip_held=st.booleans())
    def reserve(self, owner: str, which: int, chain: int, extra: int,
                length: int, skip_held: bool = False) -> Reservation | None:
        ns, keys = self.ns[which], self.chains[which][chain]
        hit = len(self.store.lookup(ns, keys))
        start = min(max(hit - extra, 0), len(keys))  # sometimes re-reserve cached keys
        todo = keys[start:start + length]
        if not todo:
            return None
        before = (self.store.reserved_slots, self.store.committed_slots)
        try:
            return self.moving(lambda: self.store.reserve(
                owner, ns, todo, keys[start - 1] if start else None, self.now, skip_held))
        except (CapacityError, NotFoundError):
            assert self.store.reserved_slots == before[0], "a failed reserve kept slots"
            return None

    def moving(self, call: Any) -> Any:
        """Run a store call, carrying out the moves it plans as the daemon would."""
        for _ in range(6):
            plan = call()
            if not isinstance(plan, Plan):
                return plan
            assert not (plan.to_remote or plan.fetch or plan.defer_until), plan
            if plan.demote:
                try:
                    t, _removed = self.store.ssd_copies.reserve(plan.demote)
                except CapacityError:
                    self.store.ssd_copies.abort_demotion(plan.demote)
                    raise
                self.store.check_invariants()                     # mid-transfer states hold
                ok = next(self.outcomes, True)
                self.store.ssd_copies.finish_write(t, [object()] * len(t.blocks) if ok else None)
            elif plan.promote is not None:
                t = plan.promote
                self.store.check_invariants()
                self.store.ssd_copies.finish_promotion(t, [next(self.outcomes, True) for _ in t.blocks])
            else:  # room_coming, or others' reads (none here: one transfer at a time)
                raise CapacityError("waiting on others' moves")
        raise CapacityError("kept moving")

    @precondition(lambda self: self.store.ssd is not None)
    @rule(batch=st.integers(1, 4), ok=st.booleans(), interleave=st.booleans())
    def write_back(self, batch: int, ok: bool, interleave: bool) -> None:
        plan = self.store.ssd_copies.writeback_plan(high=0.0, low=0.0, batch=batch)
        if not plan:
            return
        try:
            t, _removed = self.store.ssd_copies.reserve(plan)
        except CapacityError:
            return
        self.store.check_invariants()
        if interleave:  # other work while the write is under way
            ns = self.ns[0]
            keys = self.chains[0][1]
            try:
                # an owner of its own: dropping it must not release the rules' pins
                self.moving(lambda: self.store.acquire("reader", ns, keys[:2], self.now))
            except (NotFoundError, CapacityError):
                pass
            self.store.drop_owner("reader")
        self.store.ssd_copies.finish_write(t, [object()] * len(t.blocks) if ok else None)

    @rule(pattern=st.lists(st.booleans(), max_size=8))
    def next_transfers(self, pattern: list[bool]) -> None:
        self.outcomes = iter(pattern)

    @rule(r=consumes(reservations), advance=st.floats(0, 3))
    def commit(self, r: Reservation | None, advance: float) -> None:
        if r is None:
            return
        self.now += advance
        try:
            result = self.store.commit(r.owner, r.id, self.now)
        except (NotFoundError, LeaseExpiredError):
            return  # expired or rolled back with its owner
        stored = len(r.keys) - result.dropped
        assert result.created + result.duplicates == stored
        assert result.duplicates >= len(r.held), "a key held in DRAM was stored again"
        if result.dropped:  # an awaited key not cached: the keys from it on not stored
            gap = r.keys[stored]
            assert stored in r.awaited and gap not in r.ns.blocks or not (
                r.ns.blocks[gap].present), "keys dropped after a key cached"
        ancestor, broken = r.parent, False
        while ancestor is not None:   # a corrupt ancestor takes what hangs below it
            broken |= not (r.ns.blocks.get(ancestor.key) is ancestor and ancestor.present)
            ancestor = ancestor.parent
        for key in r.keys[:stored]:
            assert key in r.ns.blocks or broken, "a committed key is not visible"

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
            pin = self.moving(lambda: self.store.acquire(owner, ns, want, self.now))
        except NotFoundError:
            return None   # absent, or a promotion read failed (a miss)
        except CapacityError:
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
                assert block.offset is not None, "a pinned block lost its DRAM copy"
                assert block.offset == offset, "a pinned block moved"

    @invariant()
    def lookup_is_the_longest_cached_prefix(self) -> None:
        for ns, chains in zip(self.ns, self.chains):
            for keys in chains:
                cached = [k in ns.blocks and ns.blocks[k].present for k in keys]
                n = 0
                while n < len(keys) and cached[n]:
                    n += 1
                assert not any(cached[n:]) or all(cached[:n]), "prefix closure"
                # every cached key's whole prefix is cached, unless a read found an
                # ancestor corrupt while something hanging below the key was in use (then
                # it stays until released): below it on this chain or on another one
                for i, c in enumerate(cached):
                    if c and not all(cached[:i]):
                        assert any(map(_in_use, _subtree(ns.blocks[keys[i]]))), (
                            "a cached key without its prefix")


def _in_use(b: Block) -> bool:
    """What the store keeps when an ancestor's last copy goes (``drop_leaf``'s test)."""
    return bool(b.refs or b.demoting or b.promoting or b.ssd_holds)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class StoreWithSsdMachine(StoreMachine):
    """The same sequences over a DRAM tier with an SSD tier below it."""

    ssd_slots = 8
    dram_slots = 8


TestStoreWithSsdMachine = StoreWithSsdMachine.TestCase
TestStoreWithSsdMachine.settings = settings(max_examples=200, stateful_step_count=80,
                                            deadline=None)


def test_the_ssd_admission_filter_spares_blocks_seen_once() -> None:
    ident = IDENTS[0]
    slot = ident.block_bytes
    store = BlockStore(4 * slot, 4 * slot, ssd_capacity=8 * slot, ssd_slab_bytes=4 * slot,
                       ssd_admit_after=2)
    # demote before evict: with evict first, dropping the cold leaves the SSD declines
    # would make room before any write (the order test below checks that)
    store.pressure = ("demote", "evict", "defer", "reject")
    ns = store.open_namespace(ident)
    once, twice = _chains(ns.id, ident.block_tokens)[:2]
    r = store.reserve("a", ns, once[:2], None, 0.0)
    store.commit("a", r.id, 0.0)                      # seen once
    store.lookup(ns, once[:1])                        # the root seen twice, its child once
    r = store.reserve("a", ns, twice[4:6], None, 0.0)
    store.commit("a", r.id, 0.0)
    plan = store.reserve("a", ns, twice[:3], None, 0.0)  # needs room: 4 slots, 4 taken
    assert isinstance(plan, Plan), "the twice-seen root should be demoted, not dropped"
    assert [b.key for b in plan.demote] == [once[0]], "only the block seen twice goes"
    assert once[1] not in ns.blocks                  # the leaf seen once was dropped
    assert store.counters.dropped_on_eviction >= 1
