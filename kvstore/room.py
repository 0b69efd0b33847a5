"""Making room in a DRAM tier: which cold blocks give up their slots, by the pressure
chain's steps in their configured order, and what happens to each (dropped, written
to SSD first, or to the remote store first).

Decisions over the store's bookkeeping only; the writes they need come back as a
``Plan`` for the daemon to carry out.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.blocks import REMOTE_MARK, SSD, Block, Namespace, TierSlots
from kvstore.core import StoreCore
from kvstore.errors import CapacityError
from kvstore.plans import Plan
from kvstore.pool import SlabClass

# The kinds of victim each pressure step takes (see RoomMaker._victim_kind): evict drops
# blocks (a copy is below, or no tier below takes them), demote moves them down (a copy is
# below, or they are written there first).
_STEP_KINDS = {"evict": frozenset({"clean", "lossy"}), "demote": frozenset({"clean", "dirty"})}


class RoomMaker:
    """Frees DRAM slots for a request: eviction, demotion, tenant shares and quotas."""

    def __init__(self, store: StoreCore) -> None:
        self.store = store

    def allocate(self, ns: Namespace, count: int,
                 protect: Block | None = None) -> list[int] | Plan:
        """DRAM slots, evicting as needed; all or nothing: the slots, or the plan of the
        writes that must come first (nothing taken), or CapacityError."""
        pool, cls = ns.dram.pool, ns.cls
        if self.store.tenant_quota and not self.store.per_tenant:
            plan = self._make_quota_room(ns, count, protect)  # among the tenant's own
            if plan is not None:
                return plan
        if pool.available(cls) < count:
            plan = self._make_room(ns.dram, cls, count - pool.available(cls), protect,
                                   requester=(ns.tenant, count * cls.slot_bytes))
            if plan is not None:
                return plan
        offsets = ns.dram.take(ns, count)
        assert offsets is not None, "allocation failed after making room"
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

        def refuse() -> Plan:
            if self.room_coming(None, tenant):
                return Plan(room_coming=True)
            self.store.counters.capacity_rejects += 1
            raise CapacityError(
                f"tenant {tenant!r} holds {held} bytes of the dram tier and asks for "
                f"{count * slot} more; its quota is {self.store.tenant_quota} bytes, and not enough "
                f"of its blocks can be evicted (release pins, or ask for less)", cause="quota")

        if count * slot > self.store.tenant_quota or held - dram.pinned.get(tenant, 0) < excess:
            return refuse()
        policies = [dram.policy(ns.cls)] + [
            policy for size, policy in dram.policies.items() if size != slot]
        to_demote: list[Block] = []
        to_remote: list[Block] = []
        freed = 0
        for _, kinds in self._room_steps():
            allowed = self._victim_test(protect, kinds, tenant)
            for policy in policies:
                while freed < excess and (victim := policy.pop_victim(allowed)) is not None:
                    freed += victim.ns.cls.slot_bytes
                    self._evict(victim, to_demote, to_remote)
        if freed < excess:
            self._put_back(to_demote + to_remote)
            return refuse()
        if to_demote or to_remote:
            return Plan(demote=to_demote, to_remote=to_remote)
        return None

    def _room_steps(self) -> list[tuple[str, frozenset[str]]]:
        """The passes the scheduler's pressure chain makes now (``room_passes``), each
        named and with the kinds of victim it may take."""
        return [("+".join(group), frozenset().union(*(_STEP_KINDS[s] for s in group)))
                for group in self.store.chain.room_passes(self.store.early)]

    def _victim_kind(self, b: Block) -> str | None:
        """How a DRAM copy would leave: "clean" (a copy lives below: it just goes),
        "dirty" (written to a lower tier first), "lossy" (a cold leaf no lower tier
        takes: it leaves the cache), or None (it cannot leave now)."""
        if b.ssd_offset is not None or b.extra is not None:
            return "clean"
        if self.store.admitted(b):
            return "dirty"
        if b.kids is not None:
            return None  # without a copy on SSD, only leaves leave DRAM
        if b.marks & REMOTE_MARK:  # (``remote``: read for each candidate, without a call)
            return "clean"
        return "dirty" if self._remote_dirty(b) else "lossy"

    def _victim_test(self, protect: Block | None, kinds: frozenset[str],
                     tenant: str | None = None) -> Callable[[Block], bool]:
        """Which blocks a pass may take now (of ``tenant`` only, if given): those whose
        kind of leaving is in ``kinds``."""

        def allowed(b: Block) -> bool:
            if b.refs or b is protect or (tenant is not None and b.ns.tenant != tenant):
                return False
            return self._victim_kind(b) in kinds

        return allowed

    def _evict(self, victim: Block, to_demote: list[Block], to_remote: list[Block]) -> None:
        """A victim off its eviction order leaves DRAM now, or is marked to be written back
        first (to SSD, or to the remote store in its write-back mode)."""
        if victim.ssd_offset is not None or victim.extra is not None:
            self.store.drop_dram_copy(victim)     # clean: a copy below stays
        elif self.store.admitted(victim):
            victim.demoting = True                # dirty: write it back first
            to_demote.append(victim)
        elif self._remote_dirty(victim):
            victim.demoting = True                # to the remote store first
            self.store.remote_demoting.add(victim)
            to_remote.append(victim)
        else:
            self.store.drop_dram_copy(victim)          # a cold leaf the SSD tier declines
            self.store.counters.dropped_on_eviction += 1
        self.store.counters.evictions += 1

    def _put_back(self, blocks: list[Block]) -> None:
        """Victims marked for a write that will not happen: back on their orders."""
        for b in blocks:
            self.store.remote_demoting.discard(b)
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
                   requester: tuple[str, int] | None = None) -> Plan | None:
        """Free ``need`` slots of ``cls``: evict, or plan demotions (a Plan), taking
        tenants over their share first (``requester``: the tenant asking, and the bytes it
        asks for)."""
        pool = dram.pool
        policy = dram.policy(cls)
        if need > len(policy):
            if self.room_coming(cls):
                return Plan(room_coming=True)  # room is on its way: wait for those writes
            self.store.counters.capacity_rejects += 1
            raise CapacityError(
                f"{need + pool.available(cls)} slots of {cls.slot_bytes} bytes requested, "
                f"{pool.available(cls)} free and {len(policy)} evictable in the dram tier; "
                f"release pins or raise its capacity", cause="pinned")

        over = self._over_share(dram, requester)
        # Each request demotes its own victims: the room its writes free is taken right
        # when they finish, with no await in between for another request to slip into.
        to_demote: list[Block] = []
        to_remote: list[Block] = []
        taken = 0
        steps = self._room_steps()
        for _, kinds in steps:  # in the configured order; each takes what it may
            allowed = self._victim_test(protect, kinds)

            def over_share(b: Block) -> bool:
                return over.get(b.ns.tenant, 0) > 0 and allowed(b)

            while taken < need:
                victim = policy.pop_victim(over_share) if over else None
                if victim is None:
                    victim = policy.pop_victim(allowed)
                if victim is None:
                    break
                taken += 1
                if victim.ns.tenant in over:
                    over[victim.ns.tenant] -= cls.slot_bytes
                self._evict(victim, to_demote, to_remote)
        if taken < need:
            self._put_back(to_demote + to_remote)  # nothing was written yet
            if self.room_coming(cls):
                return Plan(room_coming=True)
            self.store.counters.capacity_rejects += 1
            tried = " then ".join(name for name, _ in steps) or (
                "no step that frees room before defer")
            raise CapacityError(
                f"{need + pool.available(cls)} slots of {cls.slot_bytes} bytes requested; "
                f"the dram tier is full of pinned blocks or their prefixes, or of blocks "
                f"the pressure steps ({tried}) may not take", cause="pinned")
        if to_demote or to_remote:
            return Plan(demote=to_demote, to_remote=to_remote)
        return None

    def room_coming(self, cls: SlabClass | None, tenant: str | None = None) -> bool:
        """Whether writes under way will free or unpin DRAM slots of ``cls`` (of any
        class if None; of ``tenant``'s, if given): a demoted block leaves DRAM, a
        written-through one becomes evictable."""
        def mine(b: Block) -> bool:
            return ((cls is None or b.ns.cls is cls)
                    and (tenant is None or b.ns.tenant == tenant))

        return any(mine(b) for t in self.store.transfers.values() if t.tier == SSD
                   for b in t.blocks) or any(mine(b) for b in self.store.remote_demoting)

    def _remote_dirty(self, block: Block) -> bool:
        return (self.store.allow_demote and not block.marks & REMOTE_MARK
                and self.store.remote_writing_back())
