"""The remote tier: a store shared by the daemons of many hosts, through a plugin.

Blocks go to the remote store as they commit (write-through, in the background, a few
transfers at a time) and come back on demand: lookup asks the remote store for the part
of a chain not found locally, and acquire/get of such blocks reads them into DRAM slots
first.  Keys carry the namespace id, so daemons of different models or tenants never
collide.  If the remote store is slow or down, every call is bounded by its timeout, the
tier is marked unhealthy for a while (lookups skip it), errors are counted, and the
local tiers keep serving.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import xxhash

from kvstore.auth import read_secret
from kvstore.blocks import REMOTE_MARK
from kvstore.config import Config
from kvstore.errors import KVStoreError, NotFoundError
from kvstore.plugins import GuardedBackend, load_backend, parse_remote_url
from kvstore.plugins.turns import UrgentFirst, calling
from kvstore.remote_health import TierHealth
from kvstore.remote_held import HeldWrites
from kvstore.remote_refusals import Refusals
from kvstore.remote_shares import TenantShares, put_in_share
from kvstore.remote_stop import flush_on_stop
from kvstore.remote_watch import GenerationWatch
from kvstore.scheduler.queues import TransferKind
from kvstore.store import Block, BlockStore, Namespace, Pin, Reservation
from kvstore.transfers import Background, TransferGate, TurnBatch, current

log = logging.getLogger("kvstore.remote")

REMOTE = "remote"
REMOTE_OWNER = ("daemon", "remote")  # holds DRAM copies while they move to or from it
TAG_SECRET_MOST = 64  # a block of HMAC-SHA256: longer keys are hashed first
# bytes of one backend call, at most: each call is bounded by ``timeout_s``, so one of a
# request's whole batch (4096 blocks of a large model's, gigabytes) never fit in it; it
# failed every time, and marked the tier unhealthy for every tenant
PUT_BYTES_MOST = 64 << 20  # of one send
READ_BYTES_MOST = 64 << 20  # of one read
# keys of one read or lookup call, at most: each call holds one of the tier's
# ``concurrency`` places, and its timeout runs while the daemon's loop serves everything
# else.  One tenant's flood of 4096-key reads (prefetches of random keys, each read of
# 4096 misses in one call) held every place, made another tenant's read wait behind
# them, and on a busy loop one timed out: the tier was skipped for every tenant.  In
# pieces, the others' calls go between them, a piece of a miss ends the read, and each
# piece is short on any loop.
CALL_KEYS_MOST = 256


class RemoteTier:
    """Carries out the daemon's traffic with one remote backend."""

    def __init__(self, config: Config, store: BlockStore,
                 slot: Callable[[Namespace, int], memoryview],
                 gate: TransferGate) -> None:
        r = config.remote
        if r.url:
            name, options = parse_remote_url(r.url)
        else:
            name, options = r.backend, {}
        options = {**options, **r.options, "timeout_s": r.timeout_s}
        self.name = name
        self.backend: GuardedBackend = load_backend(name, options)
        if r.tag_secret_file:
            self.backend.key_tags(read_secret(r.tag_secret_file, "remote.tag_secret_file",
                                              most=TAG_SECRET_MOST))
        self.store = store
        self.slot = slot
        self.cooldown = r.unhealthy_seconds
        # reads and lookups before writes, tenants in turn, and one place kept from any
        # one tenant (writes count as one): another's read waits for no whole call
        self._gate = UrgentFirst(r.concurrency, tenant_most=r.concurrency - 1)
        self.transfers = gate
        self.write_back = r.write_policy == "write-back"
        # until when write-backs leave the remote store out, all or a tenant's: it
        # refused values (a full store, or the tenant's share), as it would again
        self.refusals = Refusals(self.cooldown)
        if self.write_back:  # DRAM-only blocks come here before they are evicted
            store.remote_write_back = lambda: self.taking_write_backs
            store.remote_skipping = self.refusals.skipping
        self._background = Background()
        self.health = TierHealth(self.cooldown, r.timeout_s, self.backend.health,
                                 lambda probe: self._background.spawn(probe, own_context=True))
        self._through: TurnBatch[Block] = TurnBatch(self._background, self._write_through)
        self.counters = {"writes": 0, "write_bytes": 0, "reads": 0, "read_bytes": 0,
                         "misses": 0, "errors": 0, "lookups": 0, "hit_blocks": 0,
                         "write_backs": 0, "changed_since_commit": 0,
                         # values the store answered but did not keep (full); write-
                         # throughs its outage or a refusal held back, to send again
                         # (``remote_held``), and those past ``DEFERRED_MOST``, never sent
                         "refused_writes": 0, "deferred_writes": 0, "unsent_writes": 0,
                         # the store's generation asked; found another (the store lost
                         # what it held); and the marks of blocks it held taken back
                         "generation_checks": 0, "generations_lost": 0,
                         "marks_forgotten": 0,
                         # values found corrupt by a read, deleted from the store
                         "corrupt_deleted": 0}
        self.held = HeldWrites(self.counters)  # write-throughs to send again
        self.shares = TenantShares(store, config.remote_tenant_bytes, r.concurrency)
        # where write-through blocks DRAM let go before they were sent (held back, or
        # batched) go: the pipeline sends their SSD copies (without an SSD tier, nowhere)
        self.from_ssd: Callable[[list[Block]], None] | None = None
        self.freed: Callable[[list[Block]], None] = lambda sent: None  # (``Moves``)
        store.touch_owner(REMOTE_OWNER, float("inf"))
        # one more each time the store is found to have lost what it held: a send or
        # read begun before marks nothing (it may have gone to what was lost)
        self.epoch = 0
        self.watch = GenerationWatch(self, r.check_seconds)

    # -- health ---------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def taking_write_backs(self) -> bool:
        """Whether blocks leaving the local tiers go to the remote store first: it is
        healthy and has not refused values lately.  A store that refuses them (Redis at
        its maxmemory under noeviction) answers, so it stays healthy; but blocks kept in
        DRAM for a write-back it refuses were picked again by every request that needed
        room, refused again, and DRAM took no new block.  Meanwhile they leave as they
        would without a remote store."""
        return self.healthy and self.refusals.taking()

    def _refused(self, count: int, tenant: str | None = None) -> None:
        """The store refused ``count`` values (full), or ``tenant``'s share did (counted
        as its own): either way, kept they would be refused again at each eviction."""
        self.counters["refused_writes"] += 0 if tenant else count
        if self.refusals.refuse(tenant) and self.write_back:
            log.warning("the remote store refused %d values (%s); %s write-backs skip it "
                        "for %gs", count, f"tenant {tenant!r}'s share" if tenant else "full?",
                        "the tenant's" if tenant else "every tenant's", self.cooldown)

    def failed(self, what: str, exc: Exception, began: float | None = None) -> None:
        """A call for no tenant (the generation check, begun at ``began``) failed."""
        self.counters["errors"] += 1
        self.health.failed(what, exc, began)

    # -- lookup ----------------------------------------------------------------------------
    async def leading(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` the remote store holds as a leading run (0 if unhealthy)."""
        tenant = asking(ns)
        if not keys or not self.health.serves(tenant):
            return 0
        self.counters["lookups"] += 1
        n = 0
        try:
            for start in range(0, len(keys), CALL_KEYS_MOST):
                part = list(keys[start:start + CALL_KEYS_MOST])
                async with self._gate.hold(urgent=True, tenant=tenant):
                    if not self.health.serves(tenant):  # marked while this waited its turn
                        return 0
                    with calling(True, tenant):  # (its turn at the connections too)
                        found = await self.health.call(
                            tenant, "lookup", lambda: self.backend.exists(ns.id, part))
                n += found
                if found < len(part):
                    self.shares.gone(ns, part[found:found + 1])  # (evicted, expired)
                    break
        except KVStoreError:  # (judged: ``remote_health``)
            self.counters["errors"] += 1
            return 0
        self.counters["hit_blocks"] += n
        return n

    # -- reads -----------------------------------------------------------------------------
    async def to_fetch(self, ns: Namespace,
                       keys: Sequence[bytes]) -> tuple[list[bytes], bytes | None] | None:
        """The keys of a chain to read in (those not cached locally: each one's parent is
        the key before it) and the parent of the first; None if every key is cached.
        NotFoundError where asking first finds the remote store lacks any of them."""
        first = next((i for i, k in enumerate(keys)
                      if (b := ns.blocks.get(k)) is None or not b.present), None)
        if first is None:
            return None
        missing = [k for k in keys[first:]
                   if (b := ns.blocks.get(k)) is None or not b.present]
        # Ask first where reading would cost evictions (a miss must not evict for nothing);
        # with room free, the reads themselves tell a miss, one round trip sooner
        room = ns.dram.pool.available(ns.cls) >= len(missing) and not (
            self.store.tenant_quota and not self.store.per_tenant)
        if not room and await self.leading(ns, missing) < len(missing):
            self.counters["misses"] += 1
            raise NotFoundError(f"{len(missing)} blocks are cached neither here nor remotely")
        return missing, keys[first - 1] if first else None

    async def read_into(self, ns: Namespace, missing: list[bytes], r: Reservation) -> None:
        """Read the values of ``missing`` into a reservation of ours and commit them (or
        abort it: NotFoundError if any was missing or corrupt)."""
        views = [self.slot(ns, off) for off in r.offsets]
        epoch = self.epoch
        sums: list[int] = []
        most = max(1, min(CALL_KEYS_MOST, READ_BYTES_MOST // ns.block_bytes))
        tenant = asking(ns)
        try:
            for start in range(0, len(views), most):
                part = views[start:start + most]
                async with self._gate.hold(urgent=True, tenant=tenant), self.transfers.slot(
                        len(part) * ns.block_bytes, default_kind=TransferKind.RELOAD,
                        default_tenant=ns.tenant):
                    # (a tier marked unhealthy while this waited: a miss, not a timeout
                    # more) each payload's xxh3, verified on arrival: the DRAM copy's
                    # checksum too, which clients check
                    corrupt = self.backend.counters.corrupt_values
                    with calling(True, tenant):
                        got = await self.health.call(
                            tenant, "read", lambda: self.backend.get_into_checksums(
                                ns.id, missing[start:start + most], part)
                        ) if self.health.serves(tenant) else []
                found = [digest for digest in got if digest is not None]
                sums += found
                if len(found) < len(part):  # a miss: the rest would be read for nothing
                    misread(self, ns, [k for k, d in zip(missing[start:], got) if d is None],
                            self.backend.counters.corrupt_values > corrupt)
                    break
        except KVStoreError as exc:  # (judged: ``remote_health``)
            self.counters["errors"] += 1
            failure: KVStoreError | None = exc
        except BaseException:  # cancelled while queued or reading: give the slots back
            self.store.abort(REMOTE_OWNER, r.id)
            raise
        else:
            failure = None
        finally:
            for view in views:
                view.release()
        if len(sums) < len(missing):
            self.store.abort(REMOTE_OWNER, r.id)
            self.counters["misses"] += 1
            raise NotFoundError(
                "a block read from the remote store was missing or corrupt" if failure is None
                else f"the remote store failed the read (a miss for now): {failure}")
        result = self.store.commit(REMOTE_OWNER, r.id, time.monotonic(), sums)
        for block in result.blocks if self.epoch == epoch else ():
            block.remote = True
            self.store.changed(block)
        if self.epoch == epoch:
            self.shares.seen(ns, missing)
        self.counters["reads"] += len(missing)
        self.counters["read_bytes"] += len(missing) * ns.block_bytes

    # -- writes ----------------------------------------------------------------------------
    def committed(self, blocks: Iterable[Block]) -> None:
        """New blocks were committed: under write-through, copy them to the remote store
        in the background; under write-back they go there when DRAM evicts them."""
        if not self.write_back:
            self._through.add(b for b in blocks if not b.marks & REMOTE_MARK)
            self.send_held()

    def send_held(self) -> None:
        """Healthy, nothing refused for a cooldown: write-throughs held back go (of the
        tenants not skipping the tier); at each commit and each watch's check."""
        if not self.write_back and len(self.held) and self.taking_write_backs:
            self._through.add(self.held.take(
                lambda tenant: self.health.serves(tenant) and self.refusals.serves(tenant)))

    def write_again(self, blocks: list[Block]) -> None:
        """Blocks cached here whose copy the remote store lost: under write-through,
        sent again (write-back sends them as they leave DRAM)."""
        if not self.write_back:
            self._through.add(blocks)

    async def _write_through(self, batch: list[Block]) -> None:
        by_ns: dict[Namespace, list[Block]] = {}
        for b in batch:
            if b.ns.blocks.get(b.key) is b and b.present and not b.marks & REMOTE_MARK:
                by_ns.setdefault(b.ns, []).append(b)
        for ns, blocks in by_ns.items():
            # a backlog (an outage's deferred writes) in sends of a bounded size, each
            # within one timeout: sent whole, one send of 16384 blocks timed out again
            # and again, the tier marked down each time
            most = max(1, PUT_BYTES_MOST // ns.block_bytes)
            for start in range(0, len(blocks), most):
                await self.send_blocks(ns, blocks[start:start + most])

    async def send_blocks(self, ns: Namespace, blocks: list[Block]) -> None:
        """Send cached blocks of ``ns`` (those DRAM holds; held back if the tier skips
        their tenant), marking those written."""
        if not self.health.serves(ns.tenant):
            self.held.hold(blocks)
            return
        # a write-through block DRAM let go (to SSD) since it was committed or held back:
        # skipped, it never had a remote copy
        below = [b for b in blocks if b.offset is None]
        if below and not self.write_back and self.from_ssd is not None:
            self.from_ssd(below)
        blocks = [b for b in blocks if b.offset is not None]
        if not blocks:
            return
        try:
            pin = self.store.acquire(REMOTE_OWNER, ns, [b.key for b in blocks],
                                     time.monotonic(), promote=False)
        except KVStoreError:
            return  # gone meanwhile
        if not isinstance(pin, Pin):  # only on SSD by now: not worth a read
            return
        views = [self.slot(ns, off) for off in pin.offsets]
        try:
            ok = await self.send(ns, [b.key for b in blocks], views, "write",
                                  write_back=self.write_back, blocks=blocks)
            if not self.write_back or ok is None:  # (went down: held back, again later)
                self.held.after_send(blocks, ok, self.health.serves(ns.tenant))
            for b, good in zip(blocks, ok or ()):
                if good and not b.marks & REMOTE_MARK:
                    b.remote = True
                    self.store.changed(b)
        finally:
            for view in views:
                view.release()
            self.store.release(REMOTE_OWNER, pin.id)
            self.freed(blocks)

    async def send(self, ns: Namespace, keys: list[bytes], views: Sequence[memoryview],
                    what: str, *, write_back: bool, blocks: Sequence[Block] = (),
                    checked: Sequence[int] = ()) -> list[bool | None] | None:
        """Put values here, through the transfer queues and within the concurrency bound;
        per key whether it was written (False: refused, by the store or the tenant's
        share; None: not sent, its bytes changed since their commit, damaged), or None
        if the remote store failed (counted, and the tier marked unhealthy) or was
        marked unhealthy while this waited its turn (not sent: an outage costs each
        send queued behind it no ``timeout_s`` of its own).
        ``blocks``: those the views are DRAM copies of; or ``checked``: the
        views' xxh3, checked already (an SSD read's, into a buffer of the daemon's own),
        which they go with, hashed no more."""
        # in pieces of a bounded size, each a backend call within one timeout, each
        # checked as it goes (a whole batch's check held the loop 64 ms a GiB)
        result: list[bool | None] = []
        most = max(1, PUT_BYTES_MOST // ns.block_bytes)
        epoch = self.epoch
        for start in range(0, len(keys), most):
            part = slice(start, start + most)
            written = await self._send_piece(ns, keys[part], views[part], what,
                                             blocks=blocks[part], checked=checked[part])
            if written is None:
                return None  # (the pieces before it were written, and counted)
            result += written
            n = sum(1 for w in written if w)
            self.counters["writes"] += n
            self.counters["write_bytes"] += n * ns.block_bytes
            if write_back:
                self.counters["write_backs"] += n
        if self.epoch != epoch:  # lost since an earlier piece went: it went with the rest
            return [None if w is None else False for w in result]
        return result

    async def _send_piece(self, ns: Namespace, keys: list[bytes],
                          views: Sequence[memoryview], what: str, *,
                          blocks: Sequence[Block],
                          checked: Sequence[int]) -> list[bool | None] | None:
        """One backend call of ``send``."""
        # A value goes with a digest, which every daemon reading it hands its readers:
        # bytes changed since a commit that gave a checksum (through a mapping kept after
        # it) must not come back verified.  Those found changed are not sent, and are
        # damaged (a write-back drops them: kept, each eviction would pick them again);
        # the others go with the commit's checksum, not one made as the backend encodes
        # them, so bytes changed after this check read back as damaged too.
        sums: list[int | None] = ([b.checksum or None for b in blocks]
                                  or [s or None for s in checked] or [None] * len(keys))
        same = [not b.checksum or xxhash.xxh3_64_intdigest(v) == b.checksum
                for b, v in zip(blocks, views)]
        if not all(same):
            self.counters["changed_since_commit"] += same.count(False)
            keys = list(itertools.compress(keys, same))
            views = list(itertools.compress(views, same))
            sums = list(itertools.compress(sums, same))
        epoch = self.epoch
        try:
            # the remote bound first: a send waiting on a slow remote store holds none of
            # the transfer slots the local tiers share
            async with self._gate.hold(urgent=False), self.transfers.slot(
                    len(views) * ns.block_bytes, default_tenant=ns.tenant):
                # (the tier down for everyone: a tenant's own skip holds back its reads and
                # write-throughs, not write-backs, which DRAM needs for room)
                if not self.healthy:
                    return None
                with calling(False, ns.tenant):  # (within the tenant's share)
                    written = await put_in_share(
                        self.shares, self.backend, ns, keys, views, sums, what,
                        lambda op, make: self.health.call(ns.tenant, op, make))
        except KVStoreError:  # (judged: ``remote_health``)
            self.counters["errors"] += 1
            return None
        if self.epoch != epoch:  # the store lost what it held meanwhile: maybe these too
            written = [False] * len(written)
        elif False in written:
            self._refused(written.count(False))
        if None in written:  # refused for the tenant's share: not sent, and not damaged
            self._refused(written.count(None), ns.tenant)
            written = [w is True for w in written]
        result = written
        if not all(same):
            sent = iter(written)
            result = [next(sent) if good else None for good in same]
        return result

    async def demote(self, blocks: list[Block]) -> None:
        """Write back blocks DRAM is about to evict (the store marked them demoting), then
        let the store drop the written ones; those that failed stay in DRAM."""
        ok = [False] * len(blocks)
        damaged = [False] * len(blocks)
        epoch = self.epoch  # (a namespace sent before a loss noticed at a later one's)
        try:
            for ns, indexes in by_namespace(blocks).items():
                group = [blocks[i] for i in indexes]
                views = [self.slot(ns, b.offset) for b in group if b.offset is not None]
                try:
                    if (len(views) != len(group) or not self.healthy
                            or not self.refusals.serves(ns.tenant)):
                        continue
                    written = await self.send(ns, [b.key for b in group], views,
                                              "write-back", write_back=True, blocks=group)
                finally:
                    for view in views:
                        view.release()
                for i, good in zip(indexes, written or ()):
                    ok[i], damaged[i] = bool(good), good is None
        finally:
            if self.epoch != epoch:
                ok = [False] * len(blocks)
            self.store.finish_remote_write(blocks, ok, damaged)

    async def flush(self) -> int:
        """On the way out, what the remote store should have and lacks goes, one try
        whatever the tier's health (``remote_stop``); how many blocks went."""
        return await flush_on_stop(self)

    async def drain(self) -> None:
        await self._background.drain()

    async def close(self) -> None:
        await self.watch.stop()
        await self.backend.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["backend"] = self.name
        out["healthy"] = self.healthy
        # tenants whose own calls timed out, skipping the tier for now (how many: their
        # names are not every reader's to see)
        out["tenants_skipping"] = self.health.skipping()
        out["last_failure"] = self.health.failure()  # (why it is down: the log says more)
        out.update(self.health.counters)
        out["forgetting_marks"] = self.watch.forgetting
        out["corrupt_values"] = self.backend.counters.corrupt_values
        out["corrupt_changed"] = self.backend.counters.corrupt_changed  # (kept, not ours)
        out["corrupt_deletes_refused"] = self.backend.counters.deletes_refused
        out["timeouts"] = self.backend.counters.timeouts
        out["tenant_share_bytes"] = self.shares.bound  # (0: no bound)
        return out


def misread(tier: RemoteTier, ns: Namespace, gone: list[bytes], corrupt: bool) -> None:
    """A read found the values of ``gone`` missing, or some ``corrupt``: off the
    ledger, and deleted if corrupt (left, the store's EXISTS kept reporting them to
    every lookup, and every acquire read them again, a miss each time)."""
    tier.shares.gone(ns, gone)
    if corrupt and gone:
        tier._background.spawn(_delete_corrupt(tier, ns, gone))


async def _delete_corrupt(tier: RemoteTier, ns: Namespace, keys: list[bytes]) -> None:
    try:  # (those read corrupt, each only if still the value read: another daemon may
        # have written a good one since; a store refusing the delete counts it)
        tier.counters["corrupt_deleted"] += await tier.health.call(
            ns.tenant, "delete", lambda: tier.backend.delete_corrupt(ns.id, keys))
    except KVStoreError:  # (judged: ``remote_health``; a later read finds it again)
        tier.counters["errors"] += 1


def asking(ns: Namespace) -> str:
    """The tenant a read or lookup is for: the request's being served (a grantee reading
    an owner's namespace waits its own turn), else the namespace's."""
    served = current()
    return served[1] if served is not None else ns.tenant


def by_namespace(blocks: Sequence[Block]) -> dict[Namespace, list[int]]:
    """The blocks' indexes, grouped by namespace (a backend call serves one)."""
    groups: dict[Namespace, list[int]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault(b.ns, []).append(i)
    return groups
