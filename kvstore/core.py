"""The store's shared state and the few moves every part makes on it.

``StoreCore`` holds the tiers' slots, the namespaces, the owners and the counters, and
the primitive changes of one block's copies that keep the invariants: pin and unpin a
DRAM copy, hold a block in place, drop a DRAM or SSD copy, forget an entry once nothing
holds it, drop a subtree leaf first (at once, or in steps of bounded work:
``SubtreeDrop``).  The parts (``index``, ``owners``, ``room``,
``ssd_copies``) and the facade (``store``) build on it; it imports none of them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from kvstore.arena_budget import budget_over_arenas, join_budget
from kvstore.blocks import (
    DRAM,
    SSD,
    Block,
    Counters,
    Limits,
    Namespace,
    Owner,
    OwnerState,
    Pin,
    Reservation,
    TierSlots,
    Transfer,
    reserved_out,
    subtree,
    unpend,
)
from kvstore.first_blocks import Heads, no_longer_heads
from kvstore.gpu_copies import GpuCopies
from kvstore.ids import UnguessableIds
from kvstore.namespace_order import NamespaceOrder
from kvstore.pool import SlabClass
from kvstore.errors import ConfigError
from kvstore.scheduler.admission import SEEN_MOST, PolicyChain, Step
from kvstore.scheduler.switch import Switch
from kvstore.scheduler.duel_samples import Backlogs
from kvstore.shared_keys import KeyCounts, counted_keys, unmap
from kvstore.tier import Tier
from kvstore.tier_changes import TierChanges
from kvstore.token_ids import let_go


# Entries a call of ``sweep_hollow`` goes through when the rest can wait for a later one
# (about a millisecond's work).
SWEEP_SLICE = 1024


class Dropping:
    """The removals of one namespace that span loop turns (evicts in slices,
    ``index.NamespaceDrop``), as the store keeps them up to date between their slices.

    Each removal takes a mark when it is asked for (``StoreCore.keep_commits``), and
    keeps what is committed after that, however long it then waits (for get replies
    still being sent, behind another removal of the namespace) before its walk starts.
    ``spare`` maps each block committed while any is open to the count of removals
    asked by then (its stamp): a block is kept by exactly the removals asked before its
    commit (``Keeping.keeps``), and a commit costs O(1) a block however many wait.
    ``walks``: the leaf lists of the namespace drops walking now (entries that lost
    their last child, to be looked at again), one each, since what one keeps another
    may drop.

    Removals asked one before the last ends keep the record open for as long as they
    overlap; a stamp below every open removal's mark keeps nothing (it reads as no stamp
    does), so it goes as soon as the removal holding that lowest mark closes: the
    blocks committed are also listed in ``buckets``, one list per stamp in stamp order,
    and a close drops the buckets below the lowest open mark (O(the open removals) to
    find it, then O(1) a stamp freed, each freed once: what committing it cost).  A
    commit storm during one long removal makes one bucket as big as the storm, freed
    at once when that removal closes: popped one by one while it is under half the
    stamps, else by keeping the rest in a new map (O(the rest)) and freeing the old
    one whole in C, as ending the record does (1M stamps: ~30 ms on the loop)."""

    __slots__ = ("spare", "buckets", "marks", "asked", "open", "walks")

    def __init__(self) -> None:
        self.spare: dict[Block, int] = {}
        # (stamp, blocks committed with it), oldest first; a block committed again has
        # a newer stamp, and only the bucket of its stamp in ``spare`` frees it
        self.buckets: deque[tuple[int, list[Block]]] = deque()
        self.marks: set[int] = set()  # the open removals' marks
        self.asked = 0  # removals asked for since this record began
        self.open = 0  # of them, those not over
        self.walks: list[list[Block]] = []

    def kept(self, fresh: Sequence[Block]) -> None:
        """Blocks just committed: kept by every removal asked so far."""
        stamp = self.asked
        self.spare.update(dict.fromkeys(fresh, stamp))
        buckets = self.buckets
        if buckets and buckets[-1][0] == stamp:
            buckets[-1][1].extend(fresh)
        else:
            buckets.append((stamp, list(fresh)))

    def closed(self, mark: int) -> None:
        """The removal of ``mark`` is over: the stamps no open removal keeps by go; the
        last one over empties the record (a closed ``Keeping`` held on to, by a
        finalizer or a finished drop, then holds no block)."""
        marks = self.marks
        marks.discard(mark)
        self.open -= 1
        if not marks:
            self.spare.clear()
            self.buckets.clear()
            self.walks.clear()
            return
        low = min(marks)
        buckets, spare = self.buckets, self.spare
        dead: list[tuple[int, list[Block]]] = []
        while buckets and buckets[0][0] < low:
            dead.append(buckets.popleft())
        if 2 * sum(len(blocks) for _, blocks in dead) >= len(spare):
            # mostly dead: keep the rest in a new map, the old one freed in C (1M
            # stamps: ~30 ms, where popping them one by one takes ~300)
            get = spare.get
            self.spare = {b: stamp for stamp, blocks in buckets for b in blocks
                          if get(b) == stamp}
            return
        for stamp, blocks in dead:
            for b in blocks:
                if spare.get(b) == stamp:  # (not committed again since, nor gone)
                    del spare[b]


class Keeping:
    """One removal's claim on the commits into its namespace made after it was asked
    for (``StoreCore.keep_commits``); ``close`` ends it (twice is harmless)."""

    __slots__ = ("store", "ns", "state", "mark", "closed")

    def __init__(self, store: StoreCore, ns: Namespace, state: Dropping) -> None:
        self.store = store
        self.ns = ns
        self.state = state
        state.asked += 1
        state.open += 1
        self.mark = state.asked  # commits from now on are stamped with this or more
        state.marks.add(self.mark)
        self.closed = False

    def keeps(self, block: Block) -> bool:
        """Whether the block was committed after this removal was asked for."""
        return self.state.spare.get(block, -1) >= self.mark

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        state = self.state
        state.closed(self.mark)
        if not state.open and self.store.dropping.get(self.ns) is state:
            del self.store.dropping[self.ns]


_NONE_KEPT: dict[Block, int] = {}


class SubtreeDrop:
    """Drop the blocks the ``keys`` name when the walk reaches them, and what hangs
    below them, leaves first, except what is pinned, moving or held (and so their
    prefixes): what ``drop_subtree`` does for each key in turn, in steps of bounded work
    (an evict whose key heads a huge subtree, the sweep below hollow entries).

    ``drop_subtree`` lists a whole subtree before it drops a block of it: O(the
    subtree) in one go, which a key heading 400k blocks makes tens of milliseconds on
    the daemon's loop.  This walk keeps no list of the subtree: it stands at one block,
    goes down to a child it has not refused yet, drops a block once no child is left (a
    leaf), and climbs back to its parent.  So no block is dropped before its children,
    and a lookup between steps sees chains shortened from their ends, never a hole.

    The store changes between steps, and the walk takes it as it finds it: a block gone
    meanwhile (evicted, dropped by someone else) is stepped over, its parent looked at
    again; a block it refused (pinned, moving, held, or with a child it refused) is
    never entered again, so each block is visited a bounded number of times; and with
    a ``keeping`` (``StoreCore.keep_commits``, taken when the daemon's evict in slices
    was asked for) or after ``keep_commits``, blocks committed into the namespace since
    are kept, with their prefixes, as a namespace drop keeps them.
    """

    def __init__(self, store: StoreCore, ns: Namespace, keys: Sequence[bytes],
                 keeping: Keeping | None = None) -> None:
        self.store = store
        self.ns = ns
        self.keys = keys
        self.count = 0  # entries removed so far (climbs through hollow parents included)
        self.visits = 0  # entries the last step went through
        self.removed_ssd: list[tuple[bytes, bytes]] = []  # SSD copies dropped, to hand on
        self._next = 0  # the next key to take a root from
        self._root: Block | None = None  # the subtree under way
        self._at: Block | None = None  # where the walk stands in it
        self._kept: set[Block] = set()  # refused: never entered again
        self._keeping = keeping

    @property
    def done(self) -> bool:
        return self._root is None and self._next == len(self.keys)

    def keep_commits(self) -> Keeping:
        """From now on (unless it was given a ``keeping`` already), blocks committed into
        the namespace are kept: for a drop that spans loop turns.  Other removals of
        the namespace may keep theirs meanwhile, each from when it was asked for."""
        if self._keeping is None:
            self._keeping = self.store.keep_commits(self.ns)
        return self._keeping

    def step(self, budget: int, seconds: float = float("inf")) -> bool:
        """Go through up to ``budget`` entries, stopping early once ``seconds`` have
        passed (looked at every 32 entries); True once every key's subtree has been
        (and the drop is closed)."""
        blocks, kept, removed = self.ns.blocks, self._kept, self.removed_ssd
        # kept: committed since the mark (a block committed while no removal of the
        # namespace was open is not in ``spare``: -1)
        keeping = self._keeping
        spare, mark = ((keeping.state.spare, keeping.mark) if keeping is not None
                       else (_NONE_KEPT, 0))
        drop_leaf, forget = self.store.drop_leaf, self.store.forget_if_gone
        before = len(blocks)
        until = time.perf_counter() + seconds
        visits = 0
        root, b = self._root, self._at
        while visits < budget:
            if b is None:  # the next key's subtree
                if self._next == len(self.keys):
                    root = None
                    break
                key = self.keys[self._next]
                self._next += 1
                root = b = blocks.get(key)
                continue
            visits += 1
            if not visits & 31 and time.perf_counter() > until:
                visits -= 1  # (not gone through: the next step starts here)
                break
            if blocks.get(b.key) is not b:  # gone meanwhile: its parent may be a leaf now
                b = None if b is root else b.parent
                continue
            # (into what is kept as committed meanwhile too: a block given a copy again
            # is, and what hung below it before the drop goes as a namespace drop's does)
            kid = _open_child(b.kids, kept)
            if kid is not None:
                b = kid
                continue
            if b.kids is None and spare.get(b, -1) < mark and drop_leaf(b, removed):
                forget(b)  # (a hollow entry, with no copy to drop, goes here)
            else:
                kept.add(b)  # pinned, moving or held, or a child of it is: kept
            b = None if b is root else b.parent
        self._root, self._at = (root, b) if b is not None else (None, None)
        self.visits = visits
        self.count += before - len(blocks)
        if self.done:
            self.close()
            return True
        return False

    def close(self) -> None:
        """The drop is over (or given up): commits are no longer kept for it."""
        if self._keeping is not None:
            self._keeping.close()

    def take_removed(self) -> list[tuple[bytes, bytes]]:
        """The SSD copies dropped since the last call (the daemon's mover frees them)."""
        removed, self.removed_ssd = self.removed_ssd, []
        return removed


def _open_child(kids: Block | dict[Block, None] | None, kept: set[Block]) -> Block | None:
    """A child not refused yet, if any."""
    if kids is None:
        return None
    if isinstance(kids, Block):
        return kids if kids not in kept else None
    for kid in kids:
        if kid not in kept:
            return kid
    return None


class StoreCore:
    """Namespaces and blocks in a DRAM tier and an optional SSD tier below it."""

    tier = DRAM

    def __init__(
        self,
        capacity_bytes: int,
        slab_bytes: int,
        *,
        limits: Limits = Limits(),
        eviction_policy: str = "lru",
        alignment: int = 4096,
        per_tenant: bool = False,
        clock: Callable[[], float] = time.monotonic,
        ssd_capacity: int = 0,
        ssd_slab_bytes: int = 256 << 20,
        ssd_admit_after: int = 1,
        tenant_quota: int = 0,
        tenant_weights: Mapping[str, float] | None = None,
        gpu_capacity: int = 0,
        gpu_slab_bytes: int = 64 << 20,
        remote_tier: bool = False,
        samples_later: bool = False,
    ) -> None:
        self.dram_args = (capacity_bytes, slab_bytes, alignment, eviction_policy)
        self.tenant_quota = tenant_quota  # most bytes of a shared DRAM tier one tenant holds
        self.tenant_weights = dict(tenant_weights or {})  # shares under pressure (default 1)
        self.clock = clock
        self.per_tenant = per_tenant
        self.drams: dict[str, TierSlots] = {}  # one DRAM tier (arena) per tenant, or one for all
        self.dram_budget = budget_over_arenas(per_tenant, *self.dram_args[:2], self.tenant_weights)
        # changes of a DRAM class's eviction policy under way (``set_eviction_policy``)
        self.switches: list[Switch[Block]] = []
        # ``auto``'s sampled references past a request's share, for the loop's next turns
        # (``kvstore.scheduler.duel_samples``; None: each taken at once)
        self.backlogs = Backlogs() if samples_later else None
        self.ssd = (TierSlots(SSD, ssd_capacity, ssd_slab_bytes, 4096, "lru",
                              tenant_weights=self.tenant_weights)  # (shares: one tier)
                    if ssd_capacity else None)
        if not 1 <= ssd_admit_after <= SEEN_MOST:  # (a block's count stops there)
            raise ConfigError(f"ssd_admit_after: must be in [1, {SEEN_MOST}], got "
                              f"{ssd_admit_after}")
        self.ssd_admit_after = ssd_admit_after
        self.gpu = GpuCopies(gpu_capacity, gpu_slab_bytes) if gpu_capacity else None
        self.remote_tier = remote_tier  # a remote store lies below (the daemon has one)
        self.ssd_writable = True  # off for a while after the SSD tier failed a write
        # Remote write-back: whether the remote store takes blocks now (None: write-through
        # or no remote tier), and the tenants it skips a while (their shares refused values)
        self.remote_write_back: Callable[[], bool] | None = None
        self.remote_skipping: Callable[[], frozenset[str]] = frozenset
        self.remote_demoting: set[Block] = set()
        # The configured steps under pressure, in order (evict, demote, defer, reject).
        # ``early``: the request may still defer, so only the steps before "defer" run
        # now (the daemon sets it around a deferrable request's first attempts).
        self.chain = PolicyChain()  # ``pressure`` sets it
        self.early = False
        self.hollow: set[Block] = set()  # lost their last copy; kept for what is in use below
        self.roots: dict[bytes, Heads] = {}  # chains' first keys -> namespaces (a probe's)
        # The sweep below them, left to go on in later calls (``sweep_hollow``): the
        # daemon's way to be called again, the round's entries left, the one under way.
        self.sweep_later: Callable[[], None] | None = None
        self._sweeps: list[Block] = []
        self._sweeping: tuple[Block, SubtreeDrop] | None = None
        self.dropping: dict[Namespace, Dropping] = {}  # namespaces removed from in slices
        self.dirty: dict[SlabClass, dict[Block, None]] = {}  # per DRAM class: DRAM-only, oldest first
        self.dropped_ssd: list[tuple[bytes, bytes]] = []  # SSD copies dropped by sweeps
        self.limits = limits
        self.namespaces: dict[bytes, Namespace] = {}
        self.order = NamespaceOrder()  # for walks across loop turns (a paged snapshot's)
        # the same namespaces by tenant: what a probe searches, what a tenant's cap counts
        self.tenant_namespaces: dict[str, dict[bytes, Namespace]] = {}
        self.on_forget: Callable[[Namespace], None] | None = None  # (its SSD record goes)
        self.owners: dict[Owner, OwnerState] = {}
        self.transfers: dict[int, Transfer] = {}
        self.counters = Counters()
        self.ids = UnguessableIds()  # (a counter's told others' requests)
        self.reserved_slots = 0      # DRAM slots held by reservations and promotions
        self.committed_slots = 0     # DRAM copies
        self.ssd_reserved_slots = 0
        self.ssd_committed_slots = 0
        # The same in bytes, and the pinned DRAM copies: kept as they change (O(tiers))
        self.reserved_bytes = 0
        self.committed_bytes = 0
        self.pinned_blocks = 0
        self.ssd_committed_bytes = 0
        self.tiers: list[Tier] = []  # every tier's copies, fastest first (the parts add theirs)
        self.added_tiers: dict[str, Tier] = {}
        self.changes: TierChanges | None = None  # blocks whose copies changed (events on)
        self.key_counts: KeyCounts | None = None  # every map's keys (events on: ``shared_keys``)
        # (ns, from, to): copies a block's bytes between DRAM slots (the daemon's arena)
        self.move_bytes: Callable[[Namespace, int, int], None] | None = None
        self._compose()

    def _compose(self) -> None:
        """Build what sits over the core (the store's parts); nothing here."""

    def use_gpu(self, copies: GpuCopies) -> None:
        """The GPU tier's copies, once the daemon has its device pool."""
        assert self.gpu is None, "the gpu tier is there already"
        self.gpu = copies
        self.tiers.append(copies)
        copies.changes = self.changes

    def record_changes(self, changes: TierChanges) -> None:
        """Mark every block whose copies change from now on (the event stream is on)."""
        self.changes = changes
        self.key_counts = counted_keys(self.namespaces, changes, self.dram_args[0], self.ssd)
        if self.gpu is not None:
            self.gpu.changes = changes

    def changed(self, block: Block) -> None:
        """The block's copies changed (a mark for the event stream, when it is on)."""
        if self.changes is not None:
            self.changes.touch(block)

    def add_tier(self, tier: Tier) -> None:
        """A tier beyond the store's own (see ``kvstore.tier``): listed after them, its
        copies kept in ``Block.extra`` under its name."""
        if any(t.name == tier.name for t in self.tiers):
            raise ValueError(f"a tier named {tier.name!r} is already there")
        self.added_tiers[tier.name] = tier
        self.tiers.append(tier)

    def arena_of(self, tenant: str) -> str:
        """The name of the DRAM arena a tenant's blocks live in ("" when shared by all)."""
        return tenant if self.per_tenant else ""

    def dram_for(self, tenant: str) -> TierSlots:
        name = self.arena_of(tenant)
        tier = self.drams.get(name)
        if tier is None:
            tier = self.drams[name] = TierSlots(DRAM, *self.dram_args, clock=self.clock,
                                                backlogs=self.backlogs)
            join_budget(self.dram_budget, tier.pool, name)  # (per-tenant arenas: one budget)
        return tier

    @property
    def pressure(self) -> tuple[Step, ...]:
        """The configured steps under pressure, in order (the scheduler's chain)."""
        return self.chain.steps

    @pressure.setter
    def pressure(self, steps: tuple[Step, ...]) -> None:
        self.chain = PolicyChain(tuple(steps))

    @property
    def allow_demote(self) -> bool:
        return "demote" in self.pressure

    @staticmethod
    def back_on_order(b: Block) -> None:
        """A demoting block stays in DRAM after all: on its eviction order again (pinned
        there if a reader pinned it meanwhile)."""
        b.demoting = False
        policy = b.ns.dram.policy(b.ns.cls)
        policy.insert(b)
        if b.refs:
            policy.pin(b)

    def admitted(self, block: Block) -> bool:
        return (self.ssd is not None and self.ssd_writable and self.allow_demote
                and block.seen >= self.ssd_admit_after)

    def rollback(self, state: OwnerState, r: Reservation) -> None:
        del state.reservations[r.id]
        reserved_out(state, r)
        unpend(r)
        self.reserved_slots -= len(r.offsets)
        self.reserved_bytes -= len(r.offsets) * r.ns.cls.slot_bytes
        r.ns.dram.give(r.ns, r.offsets)
        for block in reversed(r.held.values()):  # (``Leases.unpin_held``)
            self.unpin_block(block)
        if r.parent is not None:
            self.unhold(r.parent, r.parent_pinned)
        self.close_namespace(r.ns)  # the reservation's use of it

    def unpin(self, state: OwnerState, pin: Pin) -> None:
        del state.pins[pin.id]
        for block in reversed(pin.blocks):  # deepest first: parents end up warmer
            self.unpin_block(block, sweep=False)
        if self.hollow:  # once for the whole pin, not once a block (a sweep a block
            self.sweep_hollow()  # walked what stayed below a hollow entry each time)

    def pin_block(self, block: Block) -> None:
        assert block.offset is not None, f"pinning {block} without a DRAM copy"
        block.refs += 1
        if block.refs == 1:
            self.pinned_blocks += 1
            pinned = block.ns.dram.pinned
            pinned[block.ns.tenant] = pinned.get(block.ns.tenant, 0) + block.ns.cls.slot_bytes
            if not block.demoting:  # a demoting block is off the order
                block.ns.dram.policy(block.ns.cls).pin(block)

    def unpin_block(self, block: Block, sweep: bool = True) -> None:
        assert block.refs > 0, f"{block} released more often than pinned"
        block.refs -= 1
        if block.refs == 0:
            self.pinned_blocks -= 1
            pinned = block.ns.dram.pinned
            left = pinned[block.ns.tenant] - block.ns.cls.slot_bytes
            if left:
                pinned[block.ns.tenant] = left
            else:
                del pinned[block.ns.tenant]
        if block.refs == 0 and not block.demoting:
            block.ns.dram.policy(block.ns.cls).unpin(block)
            if sweep and self.hollow:
                self.sweep_hollow()

    def hold(self, block: Block) -> bool:
        """Keep a block where it is (a reservation's parent); True if its DRAM copy was
        pinned, False if its SSD copy is held."""
        if block.offset is not None:
            self.pin_block(block)
            return True
        block.ssd_holds += 1
        return False

    def unhold(self, block: Block, pinned: bool) -> None:
        if pinned:
            self.unpin_block(block)
        else:
            block.ssd_holds -= 1
            self.forget_if_gone(block)
            if self.hollow:
                self.sweep_hollow()

    # -- removing copies --------------------------------------------------------------------
    def drop_dram_copy(self, block: Block) -> None:
        """Free the DRAM slot (the block must be off the eviction order or is taken off)."""
        assert block.offset is not None and block.refs == 0
        ns = block.ns
        ns.dram.policy(ns.cls).remove(block)
        if block.gpu_offset is not None and self.gpu is not None:
            self.gpu.drop(block)  # a GPU copy lives no longer than the DRAM copy
        ns.dram.give(ns, [block.offset])
        block.offset = None
        block.demoting = False
        self.committed_slots -= 1
        self.committed_bytes -= ns.cls.slot_bytes
        if self.changes is not None:
            self.changes.touch(block)
        if self.dirty:
            self.dirty.get(ns.cls, {}).pop(block, None)
        self.forget_if_gone(block)

    def remote_writing_back(self) -> bool:
        return self.remote_write_back is not None and self.remote_write_back()

    def forget_if_gone(self, block: Block | None) -> None:
        """Remove entries that hold no copy, nothing depends on and nothing holds (and
        their namespace, once it has none and nothing uses it)."""
        first = block
        while (block is not None and not block.present and block.kids is None
               and block.ssd_holds == 0 and not block.promoting
               and block.ns.blocks.get(block.key) is block):
            unmap(block, self.key_counts)  # (``del block.ns.blocks[block.key]``, counted)
            if block.parent is None:
                no_longer_heads(self.roots, block.key, block.ns)
            if self.dropping:
                # its mark goes with it (removals queued one behind another keep their
                # namespace's record open for long: it holds live entries only)
                dropping = self.dropping.get(block.ns)
                if dropping is not None:
                    dropping.spare.pop(block, None)
            if block.tokens is not None:  # (it keeps its ids for an event still to come)
                let_go(block.tokens, block.ns.blocks)
            if self.changes is not None and block.marks & 4:  # (``announced``: remote)
                self.changes.touch(block)  # a remote mark goes with the entry
            parent = block.parent
            if parent is not None:
                parent.remove_child(block)
            block = parent
        if block is not first and first is not None:
            if self.dropping and block is not None and block.kids is None:
                # a namespace being dropped in slices looks again at what is a leaf now
                dropping = self.dropping.get(block.ns)
                if dropping is not None:
                    for leaves in dropping.walks:
                        leaves.append(block)
            if not first.ns.users:
                self.forget_if_unused(first.ns)  # (an entry went: the namespace may be empty)

    def keep_commits(self, ns: Namespace) -> Keeping:
        """A removal of ``ns`` is asked for that will span loop turns: what is committed
        into it from now on is kept by it (``Keeping.keeps``) until its ``close``."""
        state = self.dropping.get(ns)
        if state is None:
            state = self.dropping[ns] = Dropping()
        return Keeping(self, ns, state)

    def close_namespace(self, ns: Namespace) -> bool:
        """One user fewer; True if that left the namespace forgotten (``forget_if_unused``)."""
        ns.users -= 1
        return self.forget_if_unused(ns)

    def forget_if_unused(self, ns: Namespace) -> bool:
        """Forget a namespace with no entry that no session has open and no reservation
        is in (True if it was): its identity leaves the store, and the SSD tier's record
        of it (``on_forget``); opening it again makes it anew.  So what a tenant opens
        and leaves empty costs nothing once its sessions end."""
        if ns.users or ns.blocks or self.namespaces.get(ns.id) is not ns:
            return False
        del self.namespaces[ns.id]
        group = self.tenant_namespaces[ns.tenant]
        del group[ns.id]
        if not group:
            del self.tenant_namespaces[ns.tenant]
        self.order.forgot(ns, len(self.namespaces))  # (marks it forgotten)
        if self.on_forget is not None:
            self.on_forget(ns)
        return True

    def drop_subtree(self, ns: Namespace, roots: list[Block], removed_ssd: list[tuple[bytes, bytes]]) -> None:
        """Drop the roots and what hangs below them, leaves first, except what is pinned,
        moving or held (and so their prefixes); O(the subtree), along the child links."""
        order = [b for root in roots for b in subtree(root)]
        for b in reversed(order):  # leaves before their parents
            self.drop_leaf(b, removed_ssd)

    def drop_leaf(self, b: Block, removed_ssd: list[tuple[bytes, bytes]]) -> bool:
        """Drop every copy of a block nothing depends on, unless it is pinned, moving or
        held; True if it was dropped (its entry goes with its last copy)."""
        if b.kids is not None or b.refs or b.demoting or b.promoting or b.ssd_holds:
            return False
        if b.offset is not None:
            self.drop_dram_copy_unchecked(b)
        if b.ssd_offset is not None:
            removed_ssd.append(self.drop_ssd_copy(b))
        if b.extra is not None:
            for name in list(b.extra):
                self.added_tiers[name].drop(b)
            self.forget_if_gone(b)
        return True

    def sweep_hollow(self) -> bool:
        """Drop what hangs below hollow entries once it is no longer in use; True once
        every hollow entry has been looked at.

        Without ``sweep_later`` (the pure store), in one go.  With it (the daemon), each
        call goes through at most ``SWEEP_SLICE`` entries, asks ``sweep_later`` for
        another call, and the next call (the daemon's, a loop turn later, or any
        release's meanwhile) goes on where this one stopped: a big subtree below a
        hollow entry never holds the loop for long.  Each call leaves the store whole
        (``SubtreeDrop``: leaves first, what is in use kept)."""
        budget = SWEEP_SLICE if self.sweep_later is not None else 1 << 62
        if self._sweeping is None and not self._sweeps:
            self._sweeps = list(self.hollow)  # a round: the hollow entries as it begins
        while budget > 0:
            if self._sweeping is None:
                if not self._sweeps:
                    return True
                b = self._sweeps.pop()
                if b.ns.blocks.get(b.key) is not b or b.present:
                    self.hollow.discard(b)
                    continue
                self._sweeping = (b, SubtreeDrop(self, b.ns, [b.key]))
            b, walk = self._sweeping
            if b.ns.blocks.get(b.key) is not b or b.present:
                # given a copy again (committed) since the last call: what hangs below
                # it is reachable again, and what is committed below it new (the walk
                # would have taken both, and the entry itself last)
                self._sweeping = None
                self.hollow.discard(b)
                continue
            done = walk.step(budget)
            budget -= walk.visits
            self.dropped_ssd += walk.take_removed()
            if done:
                self._sweeping = None
                self.forget_if_gone(b)
                if b.ns.blocks.get(b.key) is not b or b.present:
                    self.hollow.discard(b)
        if self._sweeping is None and not self._sweeps:
            return True
        if self.sweep_later is not None:
            self.sweep_later()
        return False

    def drop_dram_copy_unchecked(self, block: Block) -> None:
        # the SSD copy, if any, goes right after: keep the entry alive until then
        block.ssd_holds += 1
        self.drop_dram_copy(block)
        block.ssd_holds -= 1
        self.forget_if_gone(block)

    def drop_ssd_copy(self, block: Block) -> tuple[bytes, bytes]:
        ns = block.ns
        cls = ns.ssd_cls
        assert block.ssd_offset is not None and self.ssd is not None and cls is not None
        self.ssd.policy(cls).remove(block)
        self.ssd.pool.free(cls, [block.ssd_offset])
        block.ssd_offset = None
        self.ssd_committed_slots -= 1
        self.ssd_committed_bytes -= cls.slot_bytes
        if self.changes is not None:
            self.changes.touch(block)
        self.forget_if_gone(block)
        return ns.id, block.key
