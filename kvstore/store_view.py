"""The store seen from outside: figures per tier, and the invariant checker.

Figures cost O(tiers): each tier reads counters the store keeps as blocks change, so
the stats verb and a metrics scrape never walk the blocks.  The checker walks every
block (O(blocks)) and recounts what those counters say: for tests and
``--debug-invariants``.  Each tier answers for its own slots and orders
(``Tier.stats``, ``Tier.check``); what spans tiers is checked here: pins, tenants'
charges, prefix closure, child links.
"""

from __future__ import annotations

from kvstore.blocks import DRAM, SSD, Block, writers
from kvstore.core import StoreCore


def tier_stats(store: StoreCore) -> dict[str, dict[str, int]]:
    """Each tier's figures, by its name (its ``Tier.stats``)."""
    return {tier.name: tier.stats() for tier in store.tiers}


def check_invariants(store: StoreCore) -> None:
    """Every tier's own invariants (``Tier.check``), and what spans tiers: pins, tenants'
    charges, prefix closure, child links; no lookup's hits left untold to the orders
    (``Index.settle``: the server settles each once its reply is sent)."""
    if store.key_counts is not None:  # (events on: every map's keys counted)
        store.key_counts.check()
    index = getattr(store, "index", None)  # (the store's; a bare core has none)
    assert index is None or index._unsettled is None, "a lookup's hits were never settled"
    room = getattr(store, "room", None)  # (the store's: demotions whose writes are to begin)
    for b in room.demotions_planned if room is not None else ():
        assert b.demoting and b.offset is not None, f"{b}: a demotion planned, not demoting"
    pin_counts: dict[Block, int] = {}
    for state in store.owners.values():
        for r in state.reservations.values():
            if r.parent is not None and r.parent_pinned:
                pin_counts[r.parent] = pin_counts.get(r.parent, 0) + 1
            for b in r.held.values():
                pin_counts[b] = pin_counts.get(b, 0) + 1
        for pin in state.pins.values():
            for b in pin.blocks:
                pin_counts[b] = pin_counts.get(b, 0) + 1
    for t in store.transfers.values():
        for b, demote in zip(t.blocks, t.demote):
            if t.tier == SSD and not demote:
                pin_counts[b] = pin_counts.get(b, 0) + 1
    if store.gpu is not None:
        for b in store.gpu.copying:  # read into the GPU tier: pinned meanwhile
            pin_counts[b] = pin_counts.get(b, 0) + 1
    used: dict[tuple[int, str], int] = {}  # (tier, tenant): bytes of DRAM slots held
    for state in store.owners.values():
        for r in state.reservations.values():
            at = (id(r.ns.dram), r.ns.tenant)
            used[at] = used.get(at, 0) + len(r.offsets) * r.ns.cls.slot_bytes
    for t in store.transfers.values():
        if t.tier == DRAM:
            for b in t.blocks:
                at = (id(b.ns.dram), b.ns.tenant)
                used[at] = used.get(at, 0) + b.ns.cls.slot_bytes
    grouped = {(tenant, ns_id) for tenant, group in store.tenant_namespaces.items()
               for ns_id in group}
    listed = {(ns.identity.tenant, ns_id) for ns_id, ns in store.namespaces.items()}
    assert grouped == listed, "namespaces by tenant: the store's, each in its tenant's"
    _check_first_blocks(store)
    _check_pending(store)
    pinned: dict[tuple[int, str], int] = {}
    for ns in store.namespaces.values():
        at = (id(ns.dram), ns.tenant)
        held = sum(1 for b in ns.blocks.values() if b.offset is not None)
        used[at] = used.get(at, 0) + held * ns.cls.slot_bytes
        held_pins = sum(1 for b in ns.blocks.values() if b.refs)
        pinned[at] = pinned.get(at, 0) + held_pins * ns.cls.slot_bytes
    for dram in store.drams.values():
        for tenant, nbytes in dram.pinned.items():
            assert pinned.pop((id(dram), tenant), 0) == nbytes, (
                f"tenant {tenant!r}: {nbytes} bytes counted as pinned, not so")
    uncounted = {at: nbytes for at, nbytes in pinned.items() if nbytes}
    assert not uncounted, f"pins not counted per tenant: {uncounted}"
    for dram in store.drams.values():
        for tenant, nbytes in dram.used.items():
            holds = used.pop((id(dram), tenant), 0)
            assert holds == nbytes, (
                f"tenant {tenant!r} is charged {nbytes} bytes of dram, holds {holds}")
    held_uncharged = {at: nbytes for at, nbytes in used.items() if nbytes}
    assert not held_uncharged, f"dram slots held but not charged: {held_uncharged}"
    for ns in store.namespaces.values():
        links = 0  # child links, each of which must name a block whose parent it is
        for key, b in ns.blocks.items():
            assert b.key == key and b.ns is ns, f"{b} indexed under the wrong key"
            for name in b.extra or ():
                assert name in store.added_tiers, f"{b} has a copy in no tier: {name}"
            if b.parent is not None:
                assert ns.blocks.get(b.parent.key) is b.parent, (
                    f"{b} is cached but its parent is not (prefix closure broken)")
                assert any(k is b for k in b.parent.child_list()), (
                    f"{b} is missing from its parent's children")
            for kid in b.child_list():
                links += 1
                assert kid.parent is b and ns.blocks.get(kid.key) is kid, (
                    f"{b} lists {kid} as a child, not so")
            if not b.present:
                assert b.kids is not None or b.ssd_holds or b.promoting, (
                    f"hollow {b} kept for nothing")
            held = pin_counts.get(b, 0)
            assert b.refs == held, f"{b} has refs={b.refs} but {held} pins hold it"
        with_parent = sum(1 for b in ns.blocks.values() if b.parent is not None)
        assert links == with_parent, f"{links} child links for {with_parent} children"
    every = [b for ns in store.namespaces.values() for b in ns.blocks.values()]
    for tier in store.tiers:  # each tier's slots, orders and marks
        tier.check(every)


def _check_first_blocks(store: StoreCore) -> None:
    """The map of first blocks holds each namespace's entries with no parent, under
    their keys, and nothing else; a key of several heads is grouped by their tenants,
    no group empty.  Each entry found where it should be, and as many heads in the map
    as entries, make the two the same (O(blocks), with a look in the map a first block:
    it runs on every request under ``--debug-invariants``)."""
    roots = store.roots
    firsts = 0
    for ns in store.namespaces.values():
        for b in ns.blocks.values():
            if b.parent is None:
                firsts += 1
                had = roots.get(b.key)
                assert had is ns or (isinstance(had, dict) and ns in had.get(ns.tenant, ())), (
                    f"the first blocks' map: {b} of {ns} not under its key")
    heads = 0
    for had in roots.values():
        if isinstance(had, dict):
            assert all(group and all(ns.tenant == tenant for ns in group)
                       for tenant, group in had.items()), "the first blocks' map: groups"
            several = sum(map(len, had.values()))
            assert several > 1, "the first blocks' map: one head in a group"
            heads += several
        else:
            heads += 1
    assert heads == firsts, f"the first blocks' map: {heads} heads for {firsts} first blocks"


def _check_pending(store: StoreCore) -> None:
    """Each namespace's pending keys (``Namespace.pending``) list its open reservations
    that gave the key a slot, each once a slot; an awaited key had no slot of its own.
    The links between awaiting reservations and those they await go both ways, to open
    reservations of the namespace and of other owners (older: made at the reserve)."""
    lists: dict[int, dict[bytes, list[int]]] = {}
    open_ids = {r.id for state in store.owners.values() for r in state.reservations.values()}
    for state in store.owners.values():
        for r in state.reservations.values():
            assert r.ns.users > 0 and not r.ns.forgotten, f"{r}: its namespace is gone"
            assert len(r.offsets) + len(r.held) + len(r.awaited) == len(r.keys), (
                f"{r}: {len(r.offsets)} slots for {len(r.keys)} keys")
            assert not r.awaited.intersection(r.held), f"{r}: a key held and awaited"
            for other in r.awaits:
                assert other.id in open_ids and r in other.awaited_by, (
                    f"{r} awaits {other}, ended or not linked back")
                assert other.owner != r.owner and other.ns is r.ns, (
                    f"{r} awaits {other}: not a writer of another session there")
            for other in r.awaited_by:
                assert other.id in open_ids and r in other.awaits, (
                    f"{r} awaited by {other}, ended or not linked back")
            mine = lists.setdefault(id(r.ns), {})
            for key in r.slotted_keys():
                mine.setdefault(key, []).append(r.id)
    for ns in store.namespaces.values():
        found = lists.pop(id(ns), {})
        listed = {key: sorted(r.id for r in writers(held)) for key, held in ns.pending.items()}
        assert listed == {key: sorted(ids) for key, ids in found.items()}, (
            f"{ns}: {len(ns.pending)} keys listed pending, open reservations hold "
            f"slots for {len(found)}")
    assert not lists, "reservations in namespaces the store does not list"
