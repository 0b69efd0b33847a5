"""Each tenant's share of the remote store: what this daemon keeps there for a tenant,
bounded (``remote.max_bytes_per_tenant``).

The remote store is shared by every tenant (and by the daemons of many hosts).  Without
a bound, one tenant's flood of writes filled it: under Redis's ``noeviction`` every other
tenant's writes were refused, under ``allkeys-lru`` its flood evicted the others' blocks.
Every value this daemon writes to the store goes through ``RemoteTier.send``; before
each backend call the tenant's share is planned here, on the loop, in O(1) per block:
past the bound, that tenant's own oldest values are deleted first (never another
tenant's), and what still does not fit (a send larger than the whole bound) is not sent,
counted per tenant as refused for the share.

The ledger: per tenant, the values this daemon wrote to the store and knows to be there,
oldest first, with their bytes; plus those being sent or deleted right now.  A read of
one of them makes it the newest; a read of a value another daemon wrote (or an earlier
run) counts nothing: before, every value read was added, so the ledger grew with every
other daemon's values read here, and a write past the bound deleted values another
daemon wrote (and keeps in its own ledger).  It loses an entry when a read or lookup
finds the value gone (the store evicted or expired it) or corrupt (then deleted too),
and all of them when the store lost what it held (``remote_watch``).  It outlives the
blocks cached here: a block DRAM and SSD let go keeps its remote copy, and its bytes in
the ledger.  Its size is bounded: a tenant's entries are those of at most its bound's
bytes (and of the sends under way), and a tenant that holds, sends and counted nothing
has no entry.

After a restart the daemon no longer knows what it wrote: the ledger starts empty, and a
value written by an earlier run counts once this daemon writes it again.  Until then
such values are not bounded by this daemon; an operator who restarts often under
``noeviction`` should give the store an eviction policy (``allkeys-lru``), which lets
those age out.  The bound is of this daemon's writes: daemons of several hosts sharing
one store each keep a tenant within its bound, and delete only values they wrote.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvstore.blocks import REMOTE_MARK, Namespace
from kvstore.core import StoreCore
from kvstore.plugins import StorageBackend

log = logging.getLogger("kvstore.remote")

Entry = tuple[bytes, bytes]  # (namespace id, key)


@dataclasses.dataclass(slots=True)
class _Tenant:
    """One tenant's ledger."""

    held: dict[Entry, int] = dataclasses.field(default_factory=dict)  # oldest first
    held_bytes: int = 0
    deleting: int = 0  # bytes of values being deleted for room (still in the store)
    sending: int = 0  # bytes of new values being sent
    deleted: int = 0  # values deleted for the share, since start
    refused: int = 0  # values not sent for the share, since start

    @property
    def used(self) -> int:
        return self.held_bytes + self.deleting + self.sending

    @property
    def kept(self) -> int:
        """What the bound is of: values there and being sent, not those being deleted
        (each send deletes its victims before its values go; counted until then, sends
        under way at once refused their values for one another's victims)."""
        return self.held_bytes + self.sending

    @property
    def idle(self) -> bool:
        """Holds, sends and deletes nothing, and counted nothing: no ledger needed."""
        return not (self.held or self.sending or self.deleting or self.deleted
                    or self.refused)


@dataclasses.dataclass(slots=True)
class SharePlan:
    """What one send may do within its tenant's share: which keys go (``send``, indexes
    into the send's keys), which of the tenant's oldest values are deleted first."""

    tenant: str
    size: int  # of one block of the send's namespace
    send: list[int]
    new: list[Entry]  # keys of ``send`` not in the ledger: ``size`` bytes each reserved
    again: list[tuple[Entry, int]]  # keys of ``send`` held already (sent again)
    victims: list[tuple[Entry, int]]
    round: int
    entries: list[Entry] = dataclasses.field(default_factory=list)  # of ``send``

    def victims_by_namespace(self) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = {}
        for (ns_id, key), _ in self.victims:
            out.setdefault(ns_id, []).append(key)
        return out


class TenantShares:
    """The ledger of every tenant's values in the remote store, and the bound on each:
    ``bound`` bytes per tenant (0: none, and no ledger is kept)."""

    def __init__(self, store: StoreCore, bound: int, concurrency: int = 1) -> None:
        self.store = store
        self.bound = bound
        self.concurrency = concurrency  # (the tier's sends under way at once, at most)
        self._tenants: dict[str, _Tenant] = {}
        self._round = 0  # one more each time the store lost what it held
        self._too_large: set[int] = set()  # block sizes past the bound, warned of

    def _of(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant()
        return t

    def most(self, ns: Namespace) -> int:
        """Values of ``ns`` one backend call sends, at most: a write-through batch (a
        loop turn's commits, or a backlog) in one call larger than the bound was refused
        past it, though it could go a bound at a time, each part taking its tenant's
        oldest values' place; and so are the tier's sends under way at once."""
        if not self.bound:
            return 1 << 62
        return max(1, self.bound // ns.block_bytes // self.concurrency)

    def plan(self, ns: Namespace, keys: Sequence[bytes]) -> SharePlan:
        """Plan a send of ``keys`` of ``ns``: room made by taking the tenant's oldest
        values off the ledger (their remote marks here taken back at once: a block must
        not leave the local tiers as if the store kept it), the rest refused."""
        size = ns.block_bytes
        plan = SharePlan(ns.tenant, size, [], [], [], [], self._round)
        if not self.bound:
            plan.send = list(range(len(keys)))
            return plan
        if size > self.bound and size not in self._too_large:
            self._too_large.add(size)  # (a few sizes: once each)
            log.warning("remote.max_bytes_per_tenant is %d bytes, less than one block of "
                        "%d bytes (namespace %s): no block of that size goes to the remote "
                        "store, each refused for its tenant's share; raise the bound to a "
                        "few blocks at least", self.bound, size, ns.id.hex()[:12])
        t = self._of(ns.tenant)
        held = t.held
        fresh: list[int] = []
        for i, key in enumerate(keys):
            entry = (ns.id, key)
            nbytes = held.pop(entry, None)
            if nbytes is None:
                fresh.append(i)
            else:  # (sent again: its bytes stay counted, now as being sent)
                t.held_bytes -= nbytes
                t.sending += nbytes
                plan.again.append((entry, nbytes))
                plan.send.append(i)
        freeing = 0
        while held and t.kept - freeing + len(fresh) * size > self.bound:
            entry = next(iter(held))
            nbytes = held.pop(entry)
            freeing += nbytes
            plan.victims.append((entry, nbytes))
            self._unmark(entry)
        t.held_bytes -= freeing
        t.deleting += freeing
        room = max(0, self.bound - (t.kept - freeing))
        fits = min(len(fresh), room // size)
        t.refused += len(fresh) - fits
        t.deleted += len(plan.victims)
        t.sending += fits * size
        plan.new = [(ns.id, keys[i]) for i in fresh[:fits]]
        plan.send = sorted(plan.send + fresh[:fits])
        plan.entries = [(ns.id, keys[i]) for i in plan.send]
        return plan

    def _unmark(self, entry: Entry) -> None:
        ns = self.store.namespaces.get(entry[0])
        b = ns.blocks.get(entry[1]) if ns is not None else None
        if b is not None and b.marks & REMOTE_MARK:
            b.marks &= ~REMOTE_MARK
            self.store.changed(b)

    def deleted(self, plan: SharePlan, ok: bool) -> None:
        """The plan's victims were deleted (``ok``), or may still be there (counted
        again, newest now)."""
        if plan.round != self._round or not plan.victims:
            return
        t = self._of(plan.tenant)
        for entry, nbytes in plan.victims:
            t.deleting -= nbytes
            if not ok:  # (counted once: a read or a send may have held it again since)
                self._hold(t, entry, nbytes)
        if not ok:
            t.deleted -= len(plan.victims)
        plan.victims = []

    def done(self, plan: SharePlan, written: Sequence[bool] | None) -> None:
        """The plan's send ended: ``written`` per key of ``plan.send`` (empty: none was
        sent; None: the put failed or timed out, any of them may be written, so all are
        counted: left out, the tenant went past its bound by the values the store wrote
        while the call failed)."""
        if not self.bound:
            return
        t = self._of(plan.tenant)
        t.sending -= len(plan.new) * plan.size + sum(n for _, n in plan.again)
        if plan.round != self._round:  # the store lost what it held meanwhile: the
            self._prune(plan.tenant, t)  # ledger starts again
            return
        self.deleted(plan, False)  # (victims of a send that failed before it deleted)
        for entry, nbytes in plan.again:  # the value it replaces is there if it failed
            self._hold(t, entry, nbytes)
        if written is None:
            for entry in plan.new:
                self._hold(t, entry, plan.size)
        else:
            new = set(plan.new)
            for entry, good in zip(plan.entries, written):
                if good and entry in new:
                    self._hold(t, entry, plan.size)
        self._prune(plan.tenant, t)

    def _hold(self, t: _Tenant, entry: Entry, nbytes: int) -> None:
        if entry in t.held:  # (sent twice at once: counted once, newest now)
            t.held_bytes -= t.held.pop(entry)
        t.held[entry] = nbytes
        t.held_bytes += nbytes

    def seen(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """Values of ``keys`` were read from the store: those this daemon wrote are the
        newest now; the others (an earlier run's, another daemon's) count nothing."""
        t = self._tenants.get(ns.tenant)
        if t is None:
            return
        held = t.held
        for key in keys:
            entry = (ns.id, key)
            nbytes = held.pop(entry, None)
            if nbytes is not None:
                held[entry] = nbytes

    def gone(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """The store lacks the values of ``keys`` (missed, or found corrupt)."""
        t = self._tenants.get(ns.tenant)
        if t is None:
            return
        for key in keys:
            nbytes = t.held.pop((ns.id, key), None)
            if nbytes is not None:
                t.held_bytes -= nbytes
        self._prune(ns.tenant, t)

    def _prune(self, tenant: str, t: _Tenant) -> None:
        """A tenant that holds, sends and deletes nothing, and counted nothing, leaves."""
        if t.idle:
            self._tenants.pop(tenant, None)

    def forget(self) -> None:
        """The store lost what it held: every ledger starts again (sends under way
        still count until they end, and then hold nothing)."""
        self._round += 1
        for tenant, t in list(self._tenants.items()):
            t.held.clear()
            t.held_bytes = t.deleting = 0
            self._prune(tenant, t)

    def check(self) -> None:
        """Each ledger's bytes are those of its entries (AssertionError if not)."""
        for tenant, t in self._tenants.items():
            assert t.held_bytes == sum(t.held.values()), (tenant, t.held_bytes, len(t.held))
            assert not t.idle, tenant
            assert t.sending >= 0 and t.deleting >= 0, (tenant, t)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tenant: bytes it has in the store (as this daemon knows), values deleted
        and values refused for its share."""
        return {tenant: {"bytes": t.used, "share_deleted": t.deleted,
                         "share_refused": t.refused}
                for tenant, t in self._tenants.items()}

    def __repr__(self) -> str:
        return (f"TenantShares(bound={self.bound}, "
                f"{sum(t.used for t in self._tenants.values())} bytes, "
                f"{sum(len(t.held) for t in self._tenants.values())} values, "
                f"{len(self._tenants)} tenants)")


async def put_in_share(shares: TenantShares, backend: StorageBackend, ns: Namespace,
                       keys: Sequence[bytes], views: Sequence[memoryview],
                       sums: Sequence[int | None], what: str,
                       call: Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]],
                       ) -> list[bool | None]:
    """Put values of ``ns`` within its tenant's share, each backend call through
    ``call`` (the tier's, judged): the tenant's oldest values deleted first where they
    must make room; per key whether it was written, None where refused for the share."""
    out: list[bool | None] = []
    most = shares.most(ns)
    for start in range(0, len(keys), most):
        part = slice(start, start + most)
        out += await _put_part(shares, backend, ns, keys[part], views[part], sums[part],
                               what, call)
    return out


async def _put_part(shares: TenantShares, backend: StorageBackend, ns: Namespace,
                    keys: Sequence[bytes], views: Sequence[memoryview],
                    sums: Sequence[int | None], what: str,
                    call: Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]],
                    ) -> list[bool | None]:
    """One backend call of ``put_in_share`` (and the deletes before it)."""
    plan = shares.plan(ns, keys)
    written: list[bool] | None = []  # (none sent: a delete for room failed)
    try:
        for ns_id, victims in plan.victims_by_namespace().items():
            await call("delete", functools.partial(backend.delete, ns_id, victims))
        shares.deleted(plan, True)
        picked = plan.send
        written = None  # (until it answers: failed, any of them may be written)
        written = await call(what, lambda: backend.put_checksummed(
            ns.id, [keys[i] for i in picked], [views[i] for i in picked],
            [sums[i] for i in picked])) if picked else []
    finally:
        shares.done(plan, written)
    out: list[bool | None] = [None] * len(keys)
    for i, good in zip(plan.send, written or ()):
        out[i] = good
    return out
