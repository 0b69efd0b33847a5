"""Making room in a DRAM tier: which cold blocks give up their slots, by the pressure
chain's steps in their configured order, and what happens to each (dropped, written
to SSD first, or to the remote store first).

Decisions over the store's bookkeeping only; the writes they need come back as a
``Plan`` for the daemon to carry out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from kvstore.block_map import BlockMap
from kvstore.blocks import REMOTE_MARK, SEEN_SHIFT, Block, Namespace, TierSlots
from kvstore.core import StoreCore
from kvstore.errors import CapacityError
from kvstore.first_blocks import no_longer_heads
from kvstore.plans import Plan
from kvstore.pool import SlabClass
from kvstore.scheduler.policy import GO_ON
from kvstore.shared_keys import FULL, SHIFT
from kvstore.slab_moves import SlabMoves, ssd_refused
from kvstore.tier_changes import TierChanges
from kvstore.token_ids import TokenRun, split_sparse

# The kinds of victim each pressure step takes (see RoomMaker._victim_test): evict drops
# blocks (a copy is below, or no tier below takes them), demote moves them down (a copy is
# below, or they are written there first).
_STEP_KINDS = {"evict": frozenset({"clean", "lossy"}), "demote": frozenset({"clean", "dirty"})}


class RoomMaker:
    """Frees DRAM slots for a request: eviction, demotion, tenant shares and quotas."""

    def __init__(self, store: StoreCore) -> None:
        self.store = store
        self.slabs = SlabMoves(store, self._make_room, self._put_back)  # between sizes
        # Victims marked to be written to SSD whose write has yet to reserve its slots
        # there (``SsdCopies.reserve``; it starts in a task, after requests read
        # meanwhile): room coming all the same (``room_coming``)
        self.demotions_planned: set[Block] = set()
        # Owners the daemon's own moves pin and reserve DRAM slots under (the remote
        # tier's: its sends, its reads): what they hold is room coming too
        self.movers: set[object] = set()

    def allocate(self, ns: Namespace, count: int,
                 protect: Block | None = None) -> list[int] | Plan:
        """DRAM slots, evicting as needed; all or nothing: the slots, or the plan of the
        writes that must come first (nothing taken), or CapacityError."""
        pool, cls = ns.dram.pool, ns.cls
        if self.store.tenant_quota and not self.store.per_tenant:
            plan = self._make_quota_room(ns, count, protect)  # among the tenant's own
            if plan is not None:
                return plan
        if pool.available(cls) < count and len(pool.classes) > 1:  # from another size:
            # a tenant over its share only a slab of its own blocks
            over = self._over_share(ns.dram, (ns.tenant, count * cls.slot_bytes))
            plan = self.slabs.make_way(ns.dram, cls, count, protect,
                                       ns.tenant if ns.tenant in over else None)
            if plan is not None:
                return plan
        if pool.available(cls) < count and pool.budget is not None:  # another arena's
            plan = self.slabs.from_other_arenas(ns.dram, cls, count, protect)
            if plan is not None:
                return plan
        if pool.budget is not None:  # (a sparse arena out of memory: refused, typed)
            self.slabs.check_memory(ns.dram, cls, count)
        if pool.available(cls) < count:
            plan = self._make_room(ns.dram, cls, count - pool.available(cls), protect,
                                   requester=(ns.tenant, count * cls.slot_bytes))
            if plan is not None:
                return plan
        if pool.budget is not None:  # a sparse arena: its new slabs' memory there first
            plan = self.slabs.wait_for_memory(ns.dram, cls, count)
            if plan is not None:
                return plan
        offsets = ns.dram.take(ns, count)
        assert offsets is not None, "allocation failed after making room"
        ns.dram.note_use(cls, count)  # (once a request, when it gets its slots)
        return offsets

    def _make_quota_room(self, ns: Namespace, count: int,
                         protect: Block | None) -> Plan | None:
        """Evict (or plan demotions of) the tenant's own coldest blocks, of any size, until
        ``count`` more slots fit its quota; refused, with nothing evicted, when even every
        unpinned block of it would not do."""
        dram, slot, tenant = ns.dram, ns.cls.slot_bytes, ns.tenant
        held = dram.used.get(tenant, 0)
        excess = held + count * slot - self.store.tenant_quota
        if excess <= 0:
            return None

        never = count * slot > self.store.tenant_quota  # (no room coming makes it fit)

        def refuse(short: int) -> Plan:  # (``short``: bytes still to free)
            if not never and self.room_coming(None, tenant, short):
                return Plan(room_coming=True)
            self.store.counters.capacity_rejects += 1
            raise CapacityError(
                f"tenant {tenant!r} holds {held} bytes of the dram tier and asks for "
                f"{count * slot} more; its quota is {self.store.tenant_quota} bytes, and not enough "
                f"of its blocks can be evicted (release pins, or ask for less)", cause="quota")

        unpinned = held - dram.pinned.get(tenant, 0)
        if never or unpinned < excess:
            return refuse(excess - unpinned)
        policies = [dram.policy(ns.cls)] + [
            policy for size, policy in dram.policies.items() if size != slot]
        freed = 0
        leaving = _Leaving(self.store, self.demotions_planned)
        try:
            for _, kinds in self._room_steps():
                allowed = self._victim_test(protect, kinds, tenant, leaving.facts)
                for policy in policies:
                    while freed < excess and (victim := policy.pop_victim(allowed)) is not None:
                        freed += victim.ns.cls.slot_bytes
                        leaving.evict(victim)
        except BaseException:
            self._put_back(leaving.to_demote + leaving.to_remote, failed=True)
            raise
        finally:
            leaving.finish()
        if freed < excess and not leaving.to_remote:  # (leaves written: parents next round)
            self._put_back(leaving.to_demote + leaving.to_remote)
            return refuse(excess - freed)
        return leaving.plan()

    def _room_steps(self) -> list[tuple[str, frozenset[str]]]:
        """The passes the scheduler's pressure chain makes now (``room_passes``), each
        named and with the kinds of victim it may take."""
        return [("+".join(group), frozenset().union(*(_STEP_KINDS[s] for s in group)))
                for group in self.store.chain.room_passes(self.store.early)]

    def _victim_test(self, protect: Block | None, kinds: frozenset[str],
                     tenant: str | None = None,
                     facts: _Facts | None = None) -> Callable[[Block], bool]:
        """Which blocks a pass may take now (of ``tenant`` only, if given): those whose
        kind of leaving is in ``kinds``: "clean" (a copy lives below: it just goes),
        "dirty" (written to a lower tier first), "lossy" (a cold leaf no lower tier
        takes: it leaves the cache); a block that is none of these cannot leave now.
        Called for every candidate a policy passes: the kinds are told apart inline, on
        the store's facts read once per request (``facts``)."""
        f = facts or _Facts(self.store)
        admit_to_ssd, admit_after, remote_dirty = f.admit_to_ssd, f.admit_after, f.remote_dirty
        refuses = f.ssd_refuses
        clean, dirty, lossy = "clean" in kinds, "dirty" in kinds, "lossy" in kinds
        # "lossy" when nothing below takes it; else "dirty" (to the remote store first),
        # but for a tenant whose write-backs skip it (``_Leaving.evict`` drops those)
        bare = dirty if remote_dirty else lossy
        skip = f.remote_skip

        def allowed(b: Block) -> bool:
            if b.refs or b is protect or (tenant is not None and b.ns.tenant != tenant):
                return False
            if b.ssd_offset is not None or (b.rare is not None and b.extra is not None):
                return clean
            if (admit_to_ssd and b.marks >> SEEN_SHIFT >= admit_after
                    and not (refuses and b.ns.ssd_cls in refuses)):
                return dirty
            if b.kids is not None:
                return False  # without a copy on SSD, only leaves leave DRAM
            if b.marks & REMOTE_MARK:  # (``remote``, without a call)
                return clean
            return lossy if skip and b.ns.tenant in skip else bare

        return allowed

    def _put_back(self, blocks: list[Block], failed: bool = False) -> None:
        """Victims marked for a write that will not happen: back on their orders.
        ``failed``: an exception cut the request's victims short, so an order may not
        have finished taking them (a duel notes a batch's victims after it): each is
        forgotten by its order first, as any victim is, so that it goes back in."""
        for b in blocks:
            self.store.remote_demoting.discard(b)
            self.demotions_planned.discard(b)
            if failed:
                b.ns.dram.policy(b.ns.cls).remove(b)
            self.store.back_on_order(b)

    def not_demoting(self, blocks: list[Block]) -> None:
        """Demotion victims that will not be written after all: back on their orders."""
        self.demotions_planned.difference_update(blocks)
        for b in blocks:
            if b.demoting:
                self.store.back_on_order(b)

    def _over_share(self, dram: TierSlots,
                    requester: tuple[str, int] | None) -> dict[str, int]:
        """Tenants of a shared tier that hold more than their weighted share of it (the
        requester counted with the bytes it asks for): the bytes each holds beyond it."""
        used = dict(dram.used)
        if requester is not None:
            used[requester[0]] = used.get(requester[0], 0) + requester[1]
        if self.store.per_tenant or len(used) < 2:
            return {}
        weights = {t: self.store.tenant_weights.get(t, 1.0) for t in used}
        total = sum(weights.values())
        capacity = dram.pool.capacity_bytes
        shares = {t: capacity * weights[t] / total for t in used}
        return {t: held - int(shares[t]) for t, held in used.items() if held > shares[t]}

    def _make_room(self, dram: TierSlots, cls: SlabClass, need: int,
                   protect: Block | None,
                   requester: tuple[str, int] | None = None,
                   tenant: str | None = None) -> Plan | None:
        """Free ``need`` slots of ``cls``: evict, or plan demotions (a Plan), taking
        tenants over their share first (``requester``: the tenant asking, and the bytes it
        asks for), or only ``tenant``'s blocks if given."""
        pool = dram.pool
        policy = dram.policy(cls)
        # more than the tier holds of the class, every slab its: no room coming will do
        never = need + pool.available(cls) > pool.num_slabs * cls.slots_per_slab
        if need > len(policy):
            if not never and self.room_coming(cls, None, (need - len(policy)) * cls.slot_bytes):
                return Plan(room_coming=True)  # room is on its way: wait for those writes
            self.store.counters.capacity_rejects += 1
            raise CapacityError(
                f"{need + pool.available(cls)} slots of {cls.slot_bytes} bytes requested, "
                f"{pool.available(cls)} free and {len(policy)} evictable in the dram tier; "
                f"release pins or raise its capacity", cause="pinned")

        over = self._over_share(dram, requester) if tenant is None else {}
        # Each request demotes its own victims: the room its writes free is taken right
        # when they finish, with no await in between for another request to slip into.
        taken = 0
        steps = self._room_steps()
        leaving = _Leaving(self.store, self.demotions_planned)
        try:
            for _, kinds in steps:  # in the configured order; each takes what it may
                allowed = self._victim_test(protect, kinds, tenant, leaving.facts)
                if not over:  # (the common case) the pass's victims in one call
                    taken += len(policy.pop_victims(allowed, need - taken, leaving.evict))
                    continue

                def over_share(b: Block) -> bool:
                    return over.get(b.ns.tenant, 0) > 0 and allowed(b)

                def take_over(victim: Block) -> object:
                    if victim.ns.tenant in over:
                        over[victim.ns.tenant] -= cls.slot_bytes
                    return leaving.evict(victim)

                # the victims of tenants over their share first, in one walk past the
                # others' colder blocks (a walk per victim held the loop 100 ms a put
                # once 2000 of those lay there); then, none of theirs left, any.  (A
                # victim of the second walk is of no tenant over its share, nor is its
                # parent: its leaving makes no block of one a victim.)
                taken += len(policy.pop_victims(over_share, need - taken, take_over))
                if taken < need:
                    taken += len(policy.pop_victims(allowed, need - taken, leaving.evict))
        except BaseException:
            self._put_back(leaving.to_demote + leaving.to_remote, failed=True)
            raise
        finally:
            leaving.finish()
        if taken < need and leaving.to_remote:
            # the remote store's write-back takes leaves only (a block written there leaves
            # the cache here); once written, their parents are leaves, taken next round.
            # Before, a request that needed more slots than DRAM had leaves was refused,
            # nothing written: a DRAM full of one long chain took no put of two blocks
            return leaving.plan()
        if taken < need:
            self._put_back(leaving.to_demote + leaving.to_remote)  # nothing was written yet
            if not never and self.room_coming(cls, None, (need - taken) * cls.slot_bytes):
                return Plan(room_coming=True)
            self.store.counters.capacity_rejects += 1
            tried = " then ".join(name for name, _ in steps) or (
                "no step that frees room before defer")
            raise CapacityError(
                f"{need + pool.available(cls)} slots of {cls.slot_bytes} bytes requested; "
                f"the dram tier is full of pinned blocks or their prefixes, or of blocks "
                f"the pressure steps ({tried}) may not take", cause="pinned")
        return leaving.plan()

    def drops(self) -> _Leaving:
        """A batch of DRAM copies to drop, of blocks off their eviction orders (a
        demotion's, once written): ``drop`` each, then ``finish`` once."""
        return _Leaving(self.store, self.demotions_planned)

    def room_coming(self, cls: SlabClass | None, tenant: str | None = None,
                    short: int = 1) -> bool:
        """Whether the daemon's own work under way will free or unpin at least ``short``
        bytes of DRAM slots of ``cls`` (of any class if None; of ``tenant``'s, if given):
        a demoted block leaves DRAM (counted from when it is planned: a request read in
        the same drain as one that planned the demotion of every evictable block was
        refused, "0 evictable", nothing being written yet); a block written through to
        SSD, copied into the GPU tier (a put into a DRAM whose blocks were all being
        copied was refused) or sent by the remote tier (a ``movers``' pin) becomes
        evictable, unless an engine pins it too; and a read into slots reserved for it
        (a promotion from SSD, a ``movers``' read from the remote store) brings blocks
        evictable once in.  Enough of it, not any: with sends or copies under way after
        every commit, a request short of far more waited for them, 30 s, where it is
        refused at once."""
        def mine(ns: Namespace) -> bool:
            return ((cls is None or ns.cls is cls)
                    and (tenant is None or ns.tenant == tenant))

        store = self.store
        moving = (b for t in store.transfers.values() for b in t.blocks)  # (to SSD, from it)
        copying = store.gpu.copying if store.gpu is not None else ()
        held = [state for owner in self.movers if (state := store.owners.get(owner))]
        pinned = (b for state in held for pin in state.pins.values() for b in pin.blocks)
        seen: set[Block] = set()
        coming = 0
        for b in itertools.chain(self.demotions_planned, moving, store.remote_demoting,
                                 copying, pinned):
            # (a block pinned by more than the one move, an engine's too, frees nothing)
            if b.refs <= 1 and b not in seen and mine(b.ns):
                seen.add(b)
                coming += b.ns.cls.slot_bytes
                if coming >= short:
                    return True
        for state in held:
            for r in state.reservations.values():
                if mine(r.ns):
                    coming += r.ns.cls.slot_bytes * sum(o >= 0 for o in r.offsets)
        return coming >= short


class _Facts:
    """What decides how a victim leaves that is the same for every victim of a request
    (read once per request, not per candidate: none of it changes while the request
    makes room, which awaits nothing)."""

    __slots__ = ("admit_to_ssd", "admit_after", "remote_dirty", "remote_skip", "ssd_refuses")

    def __init__(self, store: StoreCore) -> None:
        # ``StoreCore.admitted`` but for the block's own count
        self.admit_to_ssd = store.ssd is not None and store.ssd_writable and store.allow_demote
        # the SSD classes that can get no slot there (``slab_moves.ssd_refused``)
        self.ssd_refuses = ssd_refused(store) if self.admit_to_ssd else frozenset()
        self.admit_after = store.ssd_admit_after
        # a leaf no lower tier holds goes to the remote store first (its write-back mode)
        self.remote_dirty = store.allow_demote and store.remote_writing_back()
        # ...but not a tenant's whose share the store refused lately (``remote_refusals``)
        self.remote_skip = store.remote_skipping() if self.remote_dirty else frozenset()


class _Leaving:
    """The DRAM copies one request evicts, each dropped as ``StoreCore.drop_dram_copy``
    drops it, but with what can wait done once for them all (``finish``): the slots go
    back to their pool in one call per run of one namespace, in the order they were
    taken, so that the pool ends as block by block; the tenants' bytes, the store's
    counts and the forgetting of namespaces left empty in one step.  What a later
    victim's choice can see happens per victim, at once: the copy's offset, its tier
    changes and dirty entry, and the entry forgotten when no copy is left (its parent
    may become a leaf, and a victim, next).

    A victim comes off its eviction order (``pop_victim`` takes it), so the order's
    ``remove``, which ``drop_dram_copy`` calls, is not called again.
    """

    __slots__ = ("store", "facts", "to_demote", "to_remote", "runs", "evicted",
                 "lost", "emptied", "thinned", "_touch", "_counts", "_run", "_planned")

    def __init__(self, store: StoreCore, planned: set[Block]) -> None:
        self.store = store
        self._planned = planned  # (``RoomMaker.demotions_planned``)
        self.facts = _Facts(store)
        self.to_demote: list[Block] = []  # victims to write to SSD before they leave
        self.to_remote: list[Block] = []  # ... to the remote store (its write-back mode)
        self.runs: list[tuple[Namespace, list[int]]] = []  # the slots, in the order taken
        self.evicted = 0  # the victims (counted into the store's counters by ``finish``)
        self.lost = 0  # ... of them, those that left the cache
        self.emptied: dict[Namespace, None] = {}  # lost entries while no session had them
        # Token runs (``kvstore.token_ids``) that lost blocks, and their namespaces' maps:
        # split by ``finish`` if sparse then, not at each block's leaving (a chain's
        # victims leave together: the split at its fourth block from the end was undone
        # by the next three, 0.7 us a victim with events to a subscriber)
        self.thinned: dict[TokenRun, BlockMap[Block]] = {}
        changes: TierChanges | None = store.changes
        self._touch = changes.touch if changes is not None else None
        self._counts = store.key_counts  # (events on: the keys of every map, counted)
        self._run: tuple[Namespace, list[int]] | None = None

    def evict(self, victim: Block) -> object:
        """A victim off its eviction order leaves DRAM now, or is marked to be written
        back first (to SSD, or to the remote store in its write-back mode).  ``GO_ON``
        (``pop_victims``) unless it left the cache: its parent may become a leaf, and a
        victim, however cold."""
        f = self.facts
        rare = victim.rare
        self.evicted += 1
        if victim.ssd_offset is not None or (rare is not None and rare.extra is not None):
            self.drop(victim)                     # clean: a copy below stays
            return GO_ON
        if (f.admit_to_ssd and victim.marks >> SEEN_SHIFT >= f.admit_after
                and not (f.ssd_refuses and victim.ns.ssd_cls in f.ssd_refuses)):
            victim.demoting = True                # dirty: write it back first
            self._planned.add(victim)
            self.to_demote.append(victim)
            return GO_ON
        if (f.remote_dirty and not victim.marks & REMOTE_MARK
                and victim.ns.tenant not in f.remote_skip):
            victim.demoting = True                # to the remote store first
            self.store.remote_demoting.add(victim)
            self.to_remote.append(victim)
            return GO_ON
        self.drop(victim)                         # a cold leaf the SSD tier declines
        self.lost += 1
        return GO_ON if victim.parent is None else None

    def plan(self) -> Plan | None:
        """The writes the victims need first, if any."""
        if self.to_demote or self.to_remote:
            return Plan(demote=self.to_demote, to_remote=self.to_remote)
        return None

    def drop(self, b: Block) -> None:
        """Drop the DRAM copy of a victim off its eviction order."""
        offset = b.offset
        assert offset is not None and not b.refs, f"{b}: no DRAM copy to drop"
        ns, rare = b.ns, b.rare
        if rare is not None:
            if rare.gpu_offset is not None and self.store.gpu is not None:
                self.store.gpu.drop(b)  # a GPU copy lives no longer than the DRAM copy
            b.demoting = False
            rare = b.rare  # (gone once every field of it is back to its default)
        run = self._run
        if run is None or run[0] is not ns:
            run = self._run = (ns, [])
            self.runs.append(run)
        run[1].append(offset)
        b.offset = None
        if self._touch is not None:
            self._touch(b)
        dirty = self.store.dirty
        if dirty:
            dirty.get(ns.cls, {}).pop(b, None)
        if b.ssd_offset is not None or (rare is not None and rare.extra is not None):
            return
        # No copy left: ``StoreCore.forget_if_gone``, inline for the common entry (a
        # leaf, nothing rare about it, no namespace being dropped in slices, no remote
        # mark to announce), the namespace's own forgetting left to ``finish``.  Its
        # parent loses a child at once: it may be the next victim.  (Through the call,
        # whose checks go by properties and the map's methods, a reserve evicting 4096
        # blocks took 6.5 ms of CPU rather than 4.9 under ``auto``, 5.2 rather than 3.5
        # under ``lru``: ``benchmarks/evict_hold.py --setups dram``.)
        store = self.store
        if (rare is not None or b.kids is not None or store.dropping
                or (self._touch is not None and b.marks & REMOTE_MARK)):
            store.forget_if_gone(b)  # (it forgets the namespace itself, if need be)
            return
        key, blocks = b.key, ns.blocks
        shard = blocks.shards[hash(key) & blocks.mask]
        if shard.get(key) is not b:
            return
        del shard[key]
        counted = self._counts
        if counted is not None:  # ``KeyCounts.discard``, inline
            counts, slot = counted.counts, hash(key) >> SHIFT & counted.mask
            n = counts[slot]
            if 0 < n < FULL:
                counts[slot] = n - 1
        ids = b.tokens
        if ids is not None:  # (it keeps its ids for an event still to come)
            ids.live -= 1
            self.thinned[ids] = blocks
        if not ns.users:
            self.emptied[ns] = None
        parent = b.parent
        if parent is None:
            no_longer_heads(store.roots, key, ns)
            return
        if parent.kids is b:
            parent.kids = None
        else:
            parent.remove_child(b)
        if parent.kids is None and not parent.present:
            store.forget_if_gone(parent)  # a hollow parent goes too

    def finish(self) -> None:
        """Give the slots back and count them out (once, after the last victim)."""
        held: dict[tuple[TierSlots, str], int] = {}  # bytes given back per tenant
        count = 0  # the copies dropped
        for ns, offsets in self.runs:
            dram = ns.dram
            dram.pool.free(ns.cls, offsets)
            key = (dram, ns.tenant)
            held[key] = held.get(key, 0) + len(offsets) * ns.cls.slot_bytes
            count += len(offsets)
        for (dram, tenant), given in held.items():
            left = dram.used[tenant] - given
            assert left >= 0, f"tenant {tenant!r} gave back more than it held"
            if left:
                dram.used[tenant] = left
            else:
                del dram.used[tenant]
        store = self.store
        store.committed_slots -= count
        store.committed_bytes -= sum(held.values())
        store.counters.evictions += self.evicted
        store.counters.dropped_on_eviction += self.lost
        for run, blocks in self.thinned.items():
            if run.live:  # (a run none of whose blocks is left goes with its blocks)
                split_sparse(run, blocks)
        for ns in self.emptied:  # namespaces that lost entries while no session had them
            if not ns.users:
                store.forget_if_unused(ns)
        self.runs, self._run, self.thinned = [], None, {}
        self.evicted = self.lost = 0
        self.emptied = {}
