"""The block store: namespaces, the key index, reservations, pins, leases and tiers.

Pure bookkeeping over slot offsets: no sockets, files or event loop.  The daemon owns
the bytes (the DRAM arena, the SSD files) and asks the store where they go.  Every
public method checks before it mutates, so a failed call leaves nothing behind.

``BlockStore`` is the facade over a few parts that share its state:

- ``index`` (``kvstore.index``): blocks chained in namespaces, longest-prefix lookup,
  removal leaf first;
- ``leases`` (``kvstore.owners``): owners, their reservations and pins, and leases;
- ``room`` (``kvstore.room``): which cold blocks leave DRAM for a request, by the
  pressure chain's steps in order;
- ``ssd_copies`` (``kvstore.ssd_copies``) and ``gpu`` (``kvstore.gpu_copies``): the
  copies in the SSD and GPU tiers;
- slot accounting per tier and slab class (``kvstore.accounting``), and the figures and
  invariant checker (``kvstore.store_view``).

A key has one ``Block`` entry, which holds up to one copy per tier.  In each tier a slot
is free, reserved (held by a reservation, a promotion or a write to SSD that has not
finished) or committed (holds a copy).  ``refs`` counts the pins on the DRAM copy; a
pinned copy is never evicted, moved or reused.

Decide, then do: a call that needs bytes moved first returns a ``Plan`` (data) instead
of its result.  When the DRAM tier is full and an SSD tier exists, a cold block that is
only in DRAM is demoted (written back) rather than lost: ``reserve`` returns a plan
naming the victims, the daemon writes them to SSD (``ssd_copies.reserve`` …
``finish_write``) and reserves again.  ``acquire`` of blocks only on SSD returns a plan
holding their promotion (DRAM slots reserved for the reads, from
``ssd_copies.begin_promotion``); the daemon reads the copies, reports with
``ssd_copies.finish_promotion`` and acquires again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from kvstore.blocks import (
    DRAM,
    LINKED_TIERS,
    SEEN_FULL,
    SEEN_ONE,
    SSD,
    Block,
    CommitResult,
    Counters,
    Limits,
    Namespace,
    Owner,
    OwnerState,
    Pin,
    Reservation,
    Skip,
    TierSlots,
    Transfer,
    pend,
    reserved_out,
    unpend,
)
from kvstore.core import StoreCore
from kvstore.dram_copies import DramCopies
from kvstore.first_blocks import also_heads
from kvstore.errors import (
    LimitExceededError,
    MalformedError,
    NotFoundError,
    UnknownNamespaceError,
)
from kvstore.identity import Identity
from kvstore.index import Index
from kvstore.owners import Leases
from kvstore.plans import Plan
from kvstore.remote_copies import RemoteCopies
from kvstore.room import RoomMaker
from kvstore.scheduler.dueling import Duel
from kvstore.scheduler.eviction import WarmPins, make_policy
from kvstore.scheduler.policy import EvictionPolicy
from kvstore.scheduler.switch import Switch
from kvstore.shared_keys import FULL, SHIFT
from kvstore.slab_moves import reachable_slots
from kvstore.ssd_copies import SsdCopies
from kvstore.store_view import check_invariants, tier_stats
from kvstore.token_ids import TokenRun, let_go, run_of, split_sparse

__all__ = ["DRAM", "SSD", "Block", "BlockStore", "CommitResult", "Counters", "Limits",
           "Namespace", "Owner", "OwnerState", "Pin", "Plan", "Reservation", "Skip",
           "TierSlots", "Transfer"]


class BlockStore(StoreCore):
    """The store's verbs over its parts (see the module docstring)."""

    def _compose(self) -> None:
        # the parts, each over the core's state; the facade's verbs hand on to them
        self.index = Index(self)
        self.leases = Leases(self)
        self.room = RoomMaker(self)
        self.ssd_copies = SsdCopies(self, self.room)
        self.tiers.append(DramCopies(self))
        if self.ssd is not None:
            self.tiers.append(self.ssd_copies)
        if self.remote_tier:
            self.tiers.append(RemoteCopies(self))
        if self.gpu is not None:
            self.tiers.append(self.gpu)
        self.lookup = self.index.lookup
        self.evict = self.index.evict
        self.drop_namespace = self.index.drop_namespace
        self.touch_owner = self.leases.touch
        self.drop_owner = self.leases.drop
        self.abort = self.leases.abort
        self.release = self.leases.release
        self.expire = self.leases.expire

    # -- namespaces and owners ----------------------------------------------------------
    def open_namespace(self, identity: Identity) -> Namespace:
        """The namespace of ``identity``, made if new, with one more user (a session of
        the daemon; ``close_namespace`` when done with it)."""
        ns = self.namespaces.get(identity.namespace_id)
        if ns is None:
            dram = self.dram_for(identity.tenant)
            cls = dram.class_for(identity.block_bytes)
            ssd_cls = self.ssd.class_for(identity.block_bytes) if self.ssd else None
            ns = Namespace(identity, dram, cls, ssd_cls)
            self.namespaces[identity.namespace_id] = ns
            self.tenant_namespaces.setdefault(identity.tenant, {})[ns.id] = ns
            self.order.add(ns, len(self.namespaces))
        ns.users += 1
        return ns

    def available_slots(self, ns: Namespace) -> int:
        """DRAM slots a reservation in ``ns`` could have now (``reachable_slots``)."""
        return reachable_slots(ns.dram, ns.cls)

    def keep_warm(self, ns: Namespace, keys: Sequence[bytes], until: float) -> int:
        """Soft-pin the DRAM copies of ``keys`` until ``until``: eviction takes them last."""
        policy = ns.dram.policy(ns.cls)
        count = 0
        for key in keys:
            block = ns.blocks.get(key)
            if block is not None and block.offset is not None and not block.demoting \
                    and isinstance(policy, WarmPins):
                policy.pin_soft(block, until)
                count += 1
        return count

    # -- reserve / commit / abort -----------------------------------------------------------
    def reserve(
        self,
        owner: Owner,
        ns: Namespace,
        keys: Sequence[bytes],
        parent: bytes | None,
        now: float,
        skip_held: bool | int = False,
        writer: str | None = None,
    ) -> Reservation | Plan:
        """DRAM slots for every key; or the plan of the writes that must come first, or an
        error, and nothing taken.  With ``skip_held`` (``Skip``: True is both), keys held
        in DRAM take no slot (``Leases.pin_held``), nor keys another session's open
        reservation that ``writer``'s tenant trusts holds one for (``Leases.awaited``)."""
        if ns.forgotten:  # (a fetch for a session that ended, its namespace unused)
            raise UnknownNamespaceError("the namespace is no longer open; open it again")
        skip = Skip.of(skip_held)
        state = self.leases.touch(owner, now)
        if len(state.reservations) >= self.limits.max_reservations_per_owner:
            raise LimitExceededError(
                f"session holds {len(state.reservations)} open reservations "
                f"(limit {self.limits.max_reservations_per_owner}); commit or abort some"
            )
        parent_block = None if parent is None else cached_parent(ns, parent)
        # a user while room is made: evicting its last blocks must not forget it
        ns.users += 1
        # pinned before room is made, so that making it evicts none of them
        held = self.leases.pin_held(ns, keys) if skip & Skip.HELD else {}
        awaited = (self.leases.awaited(ns, keys, held, owner, writer)
                   if skip & Skip.PENDING else set())
        try:
            # (0: no room to make, nor a quota to ask)
            need = len(keys) - len(held) - len(awaited)
            offsets = self.room.allocate(ns, need, protect=parent_block) if need else []
        except BaseException:
            self.leases.unpin_held(held)
            self.close_namespace(ns)
            raise
        if isinstance(offsets, Plan):
            self.leases.unpin_held(held)
            self.close_namespace(ns)
            return offsets
        pinned = parent_block is not None and self.hold(parent_block)  # keep it till commit
        r = Reservation(next(self.ids), owner, ns, list(keys), parent_block, offsets, pinned,
                        held, awaited, grantee=None if writer == ns.tenant else writer,
                        overdue=state.overdue_until > now)
        state.reservations[r.id] = r
        if keys:  # (a reservation of no keys holds no entry: ``reserved_out``)
            state.reserved_in[ns.tenant] = state.reserved_in.get(ns.tenant, 0) + len(keys)
        pend(r)
        self.reserved_slots += len(offsets)
        self.reserved_bytes += len(offsets) * ns.cls.slot_bytes
        self.counters.reservations += 1
        self.counters.awaited_keys += len(awaited)
        return r

    def finish_remote_write(self, blocks: list[Block], ok: list[bool],
                            damaged: Sequence[bool] = ()) -> None:
        """The write-back of demoting blocks to the remote store ended: the written ones
        leave DRAM (unless pinned meanwhile), and so do the ``damaged`` (bytes changed
        since their commit: never sent, and kept they would be picked again at each
        eviction); the others return to its eviction order."""
        for i, (b, good) in enumerate(zip(blocks, ok)):
            if b not in self.remote_demoting:
                continue
            self.remote_demoting.discard(b)
            if good:
                b.remote = True
                self.changed(b)
                self.counters.remote_writebacks += 1
            if b.offset is None:
                b.demoting = False
            elif (good or (damaged and damaged[i])) and b.refs == 0:
                self.drop_dram_copy(b)
                if not good and not b.present and b.ns.blocks.get(b.key) is b:
                    self.drop_subtree(b.ns, [b], self.dropped_ssd)  # no copy left
            else:
                self.back_on_order(b)

    def commit(self, owner: Owner, rid: int, now: float,
               checksums: Sequence[int] = (),
               tokens: bytes | Sequence[bytes] = ()) -> CommitResult:
        """Publish a reservation's blocks (with the writer's checksums and the blocks'
        token ids laid out as ``kvstore.token_ids`` says, if given: one buffer for all,
        or each block's bytes)."""
        state, r = self.leases.take_reservation(owner, rid, now)
        runs = commit_runs(self, r, checksums, tokens)
        del state.reservations[rid]
        reserved_out(state, r)
        waiting = unpend(r)  # (awaiting its keys: pinned for below, once stored)
        self.reserved_slots -= len(r.offsets)
        self.reserved_bytes -= len(r.offsets) * r.ns.cls.slot_bytes
        ns = r.ns
        ns.users -= 1  # (its keys' entries keep it)
        policy = ns.dram.policy(ns.cls)
        parent = r.parent
        duplicates: list[int] = []
        fresh: list[Block] = []
        bare: list[Block] = []  # blocks already in DRAM with no token ids
        revived: list[Block] = []  # blocks only on SSD given a DRAM copy, with token ids
        shards, mask = ns.blocks.shards, ns.blocks.mask  # ``ns.blocks``' get and set, inline
        counted = self.key_counts  # (events on: the keys of every map, counted)
        slots = r.slots()
        stored = len(slots)  # the leading keys stored (or cached): all but after a gap
        for i, (key, offset) in enumerate(zip(r.keys, slots)):
            h = hash(key)
            shard = shards[h & mask]
            block = shard.get(key)
            if offset < 0 and i in r.awaited:  # another reservation's slot: its bytes
                if block is None or not block.present:  # not committed (aborted, its
                    stored = i  # lease ran out, or still open), or gone since: nothing
                    break  # below it is stored, no block without its parent
                if block.offset is not None and block.tokens is None:
                    bare.append(block)
            elif offset < 0:  # held in DRAM since the reserve (pinned): a duplicate
                assert block is r.held[i] and block.offset is not None, f"{block} went"
                if block.tokens is None:
                    bare.append(block)
            elif block is None:
                block = Block(key, ns, parent)
                if parent is not None:
                    if parent.kids is None:  # a chain's common case, inline
                        parent.kids = block
                    else:
                        parent.add_child(block)
                elif self.roots.setdefault(key, ns) is not ns:
                    also_heads(self.roots, key, ns)  # a key of its client's making
                shard[key] = block
                if counted is not None:  # ``KeyCounts.add``, inline
                    counts, at = counted.counts, h >> SHIFT & counted.mask
                    n = counts[at]
                    if n != FULL:
                        counts[at] = n + 1
                if checksums:
                    block.checksum = checksums[i]
                block.offset = offset
                fresh.append(block)
            elif block.offset is not None or block.promoting:
                duplicates.append(offset)
                if block.tokens is None:
                    bare.append(block)
            elif (block.checksum != (given := checksums[i] if checksums else 0)
                  and (block.ssd_holds or block.extra is not None)):
                duplicates.append(offset)   # other bytes over a copy kept: ``rewritten``
            else:
                block.offset = offset       # only on SSD: this is its DRAM copy
                if block.checksum != given:
                    self.rewritten(block, given)
                fresh.append(block)
                if block.tokens is not None:
                    revived.append(block)
            if block.marks < SEEN_FULL:  # (``seen``, without a call)
                block.marks += SEEN_ONE
            parent = block
        dropped = len(slots) - stored
        if dropped:  # the slots after the gap go back, their bytes unread
            duplicates += [offset for offset in slots[stored:] if offset >= 0]
        ns.blocks.grown()
        if runs:
            _keep_token_ids(ns, r.keys[:stored], runs, isinstance(tokens, bytes), fresh,
                            bare, revived)
        ns.dram.pool.place(ns.cls, fresh)
        policy.insert_many(reversed(fresh))  # deepest first: parents end up warmer
        if self.dropping and ns in self.dropping:  # the removals asked so far keep them
            self.dropping[ns].kept(fresh)
        if self.changes is not None:
            if duplicates or r.held or r.awaited:  # gaps between them: one by one
                self.changes.touch_all(fresh)
            else:  # one chain: one mark
                self.changes.touch_run(fresh)
        if self.ssd is not None:
            dirty = self.dirty.setdefault(ns.cls, {})
            dirty.update((block, None) for block in fresh if block.ssd_offset is None)
        if duplicates:
            ns.dram.give(ns, duplicates)
        self.committed_slots += len(fresh)
        self.committed_bytes += len(fresh) * ns.cls.slot_bytes
        self.counters.peak_committed = max(self.counters.peak_committed, self.committed_slots)
        self.leases.hold_awaited(waiting)
        self.leases.unpin_held(r.held)
        if r.parent is not None:
            self.unhold(r.parent, r.parent_pinned)
        found = stored - len(fresh)  # the keys stored already: held, awaited or not
        self.counters.committed_blocks += len(fresh)
        self.counters.duplicate_blocks += found
        self.counters.awaited_dropped += dropped
        return CommitResult(len(fresh), found, fresh, dropped)

    def rewritten(self, block: Block, checksum: int) -> None:
        """A block only on SSD or remote committed again with other bytes (KV caches are
        not bit-exact from run to run): the new DRAM copy's checksum becomes the block's,
        so its writer's reads verify, and its SSD copy, of other bytes, goes (to be
        written again).  A remote copy keeps the checksum in its value's header: read
        back, it is taken.

        Not while its SSD copy is held (a reservation below it, or the remote store's
        write-back reading it), nor over a copy in a tier beyond the four (``extra``,
        which may be in use): that copy cannot go, and kept it would stand under the
        new checksum, so the block would leave DRAM unwritten and its next read fail
        (and take what hangs below it along) or serve the old bytes as the new.
        ``commit`` makes such a commit a duplicate instead, as over a DRAM copy: the
        first bytes stay."""
        assert block.ssd_holds == 0 and block.extra is None, f"{block}: a copy is kept"
        block.checksum = checksum
        if block.ssd_offset is not None:
            self.dropped_ssd.append(self.drop_ssd_copy(block))

    # -- acquire / release ------------------------------------------------------------------
    def acquire(self, owner: Owner, ns: Namespace, keys: Sequence[bytes], now: float, *,
                promote: bool = True) -> Pin | Plan:
        """Pin every key's DRAM copy; or NotFoundError, or, for blocks only on SSD, the plan
        of their promotion (with ``promote``; without, an empty plan, nothing reserved),
        and nothing pinned."""
        state = self.leases.touch(owner, now)
        if len(state.pins) >= self.limits.max_pins_per_owner:
            raise LimitExceededError(
                f"session holds {len(state.pins)} pins (limit "
                f"{self.limits.max_pins_per_owner}); release some"
            )
        blocks: list[Block] = []
        for i, key in enumerate(keys):
            block = ns.blocks.get(key)
            if block is None or not block.present:
                raise NotFoundError(f"key {i} of {len(keys)} ({key.hex()}) is not cached")
            blocks.append(block)
        below = [b for b in blocks if b.offset is None]
        if below:
            return self.ssd_copies.promotion(below) if promote else Plan()
        self.index.access(blocks)
        for block in blocks:
            self.pin_block(block)
        if self.gpu is not None:
            self.gpu.touch(blocks)
        pin = Pin(next(self.ids), owner, blocks)
        state.pins[pin.id] = pin
        self.counters.acquires += 1
        return pin

    def gpu_begin(self, blocks: Iterable[Block]) -> list[tuple[Block, int]]:
        """GPU slots to copy blocks' DRAM copies into; the DRAM copies stay pinned (and
        so in place) until :meth:`gpu_end`."""
        if self.gpu is None:
            return []
        plan = self.gpu.plan(b for b in blocks if b.ns.blocks.get(b.key) is b)
        for b, _ in plan:
            self.pin_block(b)
        return plan

    def gpu_end(self, plan: list[tuple[Block, int]], ok: bool) -> None:
        """The copies of a :meth:`gpu_begin` plan ended (all well, or not)."""
        assert self.gpu is not None
        for b, _ in plan:
            self.gpu.finish(b, ok)
            self.unpin_block(b)

    # -- the eviction order -------------------------------------------------------------------
    def set_eviction_policy(self, name: str, at_once: bool = False) -> None:
        """Order every DRAM class by the policy ``name`` from now on (and new tiers too),
        keeping every cached block, pinned ones pinned and warm ones warm.  A class
        whose order keeps warm pins (the daemon's: its tiers have a clock) passes its
        blocks to the new order in steps (``kvstore.scheduler.switch``: ``switch_step``,
        which the daemon's loop calls between requests, and the order's own calls), the
        old one's coldest first; otherwise, or ``at_once``, in this one call (O(blocks):
        at a million blocks 0.8-6 s)."""
        make_policy(name)  # an unknown name fails here, before any change
        self.dram_args = (*self.dram_args[:3], name)
        for dram in self.drams.values():
            dram.policy_name = name
            links = dram.name if dram.name in LINKED_TIERS else None
            for slot_bytes, old in list(dram.policies.items()):
                if not at_once and isinstance(old, WarmPins):
                    if old.inner.name != name:  # (or on its way there already)
                        self._start_switch(old, dram, slot_bytes, links)
                    continue
                if isinstance(old, WarmPins) and isinstance(old.inner, Switch):
                    self._finish_switch(old.inner)
                dram.policies[slot_bytes] = _switched_at_once(self, dram, slot_bytes, old)

    def _start_switch(self, warm: WarmPins[Block], dram: TierSlots, slot_bytes: int,
                      links: str | None) -> None:
        """``warm``'s order handed over to a new one of ``dram``'s policy in steps (a
        switch under way: the new one drains it, and is let be)."""
        running = warm.inner
        if isinstance(running, Switch):
            if dram.policy_name == "auto" and any(isinstance(o, Duel) for o in running.parts()):
                # two duels keep their states in the same slot of a block: the one
                # leaving is let go first (a SIGHUP back to ``auto`` while it goes)
                self._finish_switch(running)
                running = warm.inner
            else:
                self.switches.remove(running)
        new = dram.new_policy(slot_bytes)
        inner = new.inner if isinstance(new, WarmPins) else new

        def done(order: EvictionPolicy[Block]) -> None:
            if warm.inner is switch:
                warm.inner = order
                warm.name = order.name

        switch = Switch(running, inner, warm.pinned_inside(), warm.is_pinned_inside,
                        links, done)
        warm.inner = switch
        warm.name = switch.name
        self.switches.append(switch)

    def _finish_switch(self, switch: Switch[Block]) -> None:
        while not switch.finished:
            switch.step(1 << 16)
        self.switches.remove(switch)

    def switch_step(self, most: int) -> bool:
        """Pass on up to ``most`` blocks of each change of policy under way (see
        ``set_eviction_policy``); whether any is still under way."""
        for switch in self.switches:
            switch.step(most)
        self.switches = [s for s in self.switches if not s.finished]
        return bool(self.switches)

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Figures per tier: bytes and slots free, reserved, committed; counters."""
        return tier_stats(self)

    def check_invariants(self) -> None:
        """Conservation per tier and class, one state per slot, closure, pins off orders."""
        check_invariants(self)

    def stats(self) -> dict[str, int]:
        """The DRAM tier's figures (see ``tier_stats`` for every tier)."""
        return self.tier_stats()[DRAM]

    def __repr__(self) -> str:
        return (f"BlockStore(namespaces={len(self.namespaces)}, "
                f"dram committed={self.committed_slots} reserved={self.reserved_slots}, "
                f"ssd committed={self.ssd_committed_slots} reserved={self.ssd_reserved_slots}, "
                f"owners={len(self.owners)}, transfers={len(self.transfers)})")


def _switched_at_once(store: BlockStore, dram: TierSlots, slot_bytes: int,
                      old: EvictionPolicy[Block]) -> EvictionPolicy[Block]:
    """A fresh order of ``dram``'s policy for the class, holding every block of ``old``
    (passed in the order it lists them), pinned ones pinned, warm ones warm: one call."""
    on_order = list(old.evictable())
    held = [b for ns in store.namespaces.values()
            if ns.dram is dram and ns.cls.slot_bytes == slot_bytes
            for b in ns.blocks.values()
            if b.offset is not None and b.refs > 0 and not b.demoting]
    # the pinned: held and not listed (no set of every listed block)
    listed_held = set(held).intersection(on_order)
    pinned = [b for b in held if b not in listed_held]
    old.release()  # before the new order may link the same blocks
    new = dram.new_policy(slot_bytes)
    new.insert_many(on_order + pinned)  # one call: parents and children meet
    for b in pinned:
        new.pin(b)
    if isinstance(old, WarmPins) and isinstance(new, WarmPins):
        for b in on_order + pinned:
            until = old.warm_until(b)
            if until is not None:
                new.pin_soft(b, until)
    return new


def cached_parent(ns: Namespace, parent: bytes) -> Block:
    """The block a reservation's first key hangs under: cached, or ``NotFoundError``
    saying why not.  A parent an open reservation holds a slot for, not committed yet
    (a save of the chain's previous blocks still under way, in this session or
    another), was refused as if evicted since the lookup, and a client looking the
    chain up again found the same."""
    block = ns.blocks.get(parent)
    if block is not None and block.present:
        return block
    if parent in ns.pending:
        raise NotFoundError(
            "the parent of the first key is not committed yet: an open reservation holds "
            "a slot for it; reserve after that one's commit, or from the parent's own "
            "longest cached prefix with the parent's key among the keys")
    raise NotFoundError(
        "the parent of the first key is not cached (evicted since lookup?); "
        "look up the chain again and reserve from its longest cached prefix")


def commit_runs(store: BlockStore, r: Reservation, checksums: Sequence[int],
                tokens: bytes | Sequence[bytes]) -> list[TokenRun | None]:
    """A commit of ``r``'s checksums and token ids, checked (``MalformedError``): the
    token ids' runs to keep (``run_of``), [] for none.  Checked before a commit waits
    for older writers too (``CommitWaits``): a malformed one waited out the bound first,
    then failed."""
    if checksums and len(checksums) != len(r.keys):
        raise MalformedError(f"{len(checksums)} checksums for {len(r.keys)} blocks")
    # token ids are kept only for events (none: a writer sending them costs nothing),
    # and only while no larger than the blocks (they live outside every tier's
    # capacity: an identity of huge blocks_tokens and tiny blocks made them most of
    # the daemon's memory; no model's KV is smaller than its ids)
    return (run_of(tokens, r.keys, r.ns.identity.block_tokens)
            if tokens and store.changes is not None
            and _ids_bytes(tokens) <= len(r.keys) * r.ns.block_bytes else [])


def _ids_bytes(tokens: bytes | Sequence[bytes]) -> int:
    return len(tokens) if isinstance(tokens, bytes) else sum(map(len, tokens))


def _keep_token_ids(ns: Namespace, keys: list[bytes], runs: list[TokenRun | None],
                    one_buffer: bool, fresh: list[Block], bare: list[Block],
                    revived: list[Block]) -> None:
    """A commit's token ids (events on), kept by the blocks of ``keys`` (those it
    stored): ``runs`` as ``run_of`` laid them out of ``one_buffer``, or of each block's
    bytes; ``fresh`` the new copies, ``bare`` blocks in DRAM already without ids,
    ``revived`` blocks only on SSD given a DRAM copy, with ids."""
    if one_buffer:  # each new copy names it, and so does a block already in DRAM that
        # came without ids (a block with ids keeps those)
        for block in revived:  # named by this commit's run from now on
            old_run, block.tokens = block.tokens, None
            assert old_run is not None, "a revived block had token ids"
            let_go(old_run, ns.blocks)
        run = runs[0]
        assert run is not None, "one buffer: one run"
        if bare:
            live = 0
            for block in itertools.chain(fresh, bare):
                if block.tokens is not run:  # (a key twice in a commit: counted once)
                    block.tokens = run
                    live += 1
            run.live = live
        else:  # the common case: the fresh blocks are distinct (a key's second
            for block in fresh:  # time in a commit finds it in DRAM: a duplicate)
                block.tokens = run
            run.live = len(fresh)
        split_sparse(run, ns.blocks)  # mostly blocks held already: not the buffer
    else:  # each block's bytes apart (an older client's): kept where none were
        for key, one in zip(keys, runs):
            block = ns.blocks[key]
            if one is not None and block.tokens is None:
                block.tokens = one
