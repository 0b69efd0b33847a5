"""The daemon's side of cache-aware routing: the ``snapshot`` and ``probe`` verbs.

``snapshot`` lists every cached block per tier, so that a router starts from it and
applies the event batches after its sequence number.  It never holds the loop for the
whole store: it is answered in pages (``SnapshotWalk``: a client asks for the next
with the cursor of the last), or, for a client that asks for it whole, built a page a
loop turn, each page encoded as it is read (``WholeEntries``), and sent at the end.
Such a snapshot is "fuzzy": the store changes between its pages.  It is still exact
once the events after its sequence number are applied, because

- it is stamped with the sequence number of the batch published when it began (the
  changes of that loop turn are published first), and every page publishes what
  changed before it reads: so every copy it reads is one the stream has announced, and
  any later change of it is announced in a batch after that number;
- events are set operations on (block hash, tier), applied in order, the last one for
  a pair deciding it (BlockStored sets, BlockRemoved clears, AllBlocksCleared clears
  all): a pair the stream changed after the stamp ends as its last event says,
  whatever the snapshot read of it; a pair it did not change held its value from the
  stamp to now, so a page reads it right whenever it read it;
- and the snapshot reads every block that stayed in the store from its start to its end:
  such a block's parent stayed too (a parent outlives its children), so the walk down
  from its root, found in its namespace's key map, reaches it (a node's children are
  taken when it is visited; one added later is a change, announced).

So: snapshot, then every event after ``seq`` in order, equals the daemon's state.

``probe`` answers a router's question for one key chain: the longest cached prefix per
tier, and what the router needs to estimate the cost of serving the request here (the
wait ahead of a new transfer, the load bandwidth per tier).  Neither touches a block: a
router's question is not a use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from kvstore import protocol as p
from kvstore.auth import Auth
from kvstore.blocks import DRAM, Block, Namespace
from kvstore.config import Config, parse_size
from kvstore.errors import LimitExceededError, NotFoundError, TooLargeError
from kvstore.events import EventPublisher
from kvstore.first_blocks import visible_head
from kvstore.ids import UnguessableIds
from kvstore.namespace_order import NamespaceOrder
from kvstore.pending import Later
from kvstore.sessions import Session
from kvstore.slice_turns import SliceTurns
from kvstore.snapshot_walks import Walks
from kvstore.store import BlockStore
from kvstore.tier_changes import TIER_BITS, holdings
from kvstore.tiering import SsdMover
from kvstore.transfers import TransferGate
from kvstore.transport import EncodedHeader
from kvstore.verbs import Answer, Handler, Outcome

_MEASURED_BYTES = 1 << 20  # promotions read before the measured bandwidth counts
SNAPSHOT_PAGE = p.SNAPSHOT_PAGE  # entries a page goes through, when the client says not
PAGE_SECONDS = 0.002  # ...or as many as it goes through in this long (its encoding aside)
# A whole snapshot's page a loop turn goes through for this long: a turn of its own, no
# round trip between, so half a paged one's costs it nothing (400k blocks: the loop's
# longest hold 2.9 -> 1.9 ms, CPU 1.73 -> 1.62 s, medians of 3 runs), where a page
# asked for in half the time would cost its client a round trip more (+5%).
WHOLE_SECONDS = 0.001
SNAPSHOTS_OPEN = 4  # paged snapshots a session may have under way (one more ends the oldest)
# ...and a tenant over all its sessions (one more ends the tenant's oldest): each holds a
# copy of a shard of a namespace's key map, up to 4096 entries (``kvstore.snapshot_walks``)
SNAPSHOTS_A_TENANT = 64
SNAPSHOTS_AT_ONCE = 1024  # ...and the daemon (one more ends the busiest tenant's oldest)
# Snapshots in one reply (limit 0) under way, each holding its reply (about 45 bytes a
# block) from its request until ZeroMQ has sent it: at most this many a tenant, and the
# daemon at most WHOLE_AT_ONCE.  Counted a session only, 100 sessions of one tenant
# asking two each of a 60k-block store held 507 MiB, and a tenant may hold 4096
# sessions; older clients ask for it whole, routers in pages (which this leaves alone).
WHOLE_OPEN = 2
WHOLE_AT_ONCE = 8

Entry = tuple[bytes, bytes | None, str]


class SnapshotWalk:
    """One snapshot under way: the visible namespaces as it began, each walked from its
    roots down (parents first), the roots found a shard of its key map at a time.

    Each ``page`` goes through at most ``budget`` entries (a root search's or the walk's),
    so no page costs more than a few milliseconds however big the store; between pages
    the store changes, and the walk takes it as it finds it: an entry gone is skipped
    (its children went before it), a child added after its parent was visited is not
    reached (its commit is announced after the snapshot's number).  See the module's
    docstring for why that is exact with the events after ``seq``.
    """

    def __init__(self, order: NamespaceOrder, seq: int,
                 visible: Callable[[Namespace], bool] | None = None) -> None:
        self.seq = seq
        # the namespaces made up to its start, in that order, each told visible as the
        # walk reaches it (told at the start, one page at 20k open namespaces held the
        # loop 60-80 ms), and kept as the serial of the last reached: a copy of them all
        # a walk, 2000 walks never finished held 307 MiB at 20k namespaces
        self._order = order
        self._after = 0
        self._until = order.last
        self._visible = visible
        self._shards: list[dict[bytes, Block]] = []
        self._shard = 0
        self._batch: list[Block] = []  # the shard under way, copied
        self._at = 0
        self._stack: list[Block] = []  # of the walk down from a root

    def page(self, budget: int, out: list[Entry], seconds: float = float("inf")) -> bool:
        """Append the next entries to ``out``, going through at most ``budget`` and
        stopping early once ``seconds`` have passed; True once the walk is over."""
        stack = self._stack
        until = time.perf_counter() + seconds
        visits = 0
        while visits < budget:
            if not visits & 63 and visits and time.perf_counter() > until:
                break
            if stack:
                b = stack.pop()
                visits += 1
                bits = holdings(b)  # 0: gone from its namespace (and so its children)
                if not bits and b.ns.blocks.get(b.key) is not b:
                    continue
                parent = b.parent.key if b.parent is not None else None
                for tier, bit in TIER_BITS:
                    if bits & bit:
                        out.append((b.key, parent, tier))
                if b.kids is not None:
                    stack.extend(b.child_list())
            elif self._at < len(self._batch):
                b = self._batch[self._at]
                self._at += 1
                visits += 1
                if b.parent is None:
                    stack.append(b)
            elif self._shard < len(self._shards):
                self._batch = list(self._shards[self._shard].values())
                self._shard += 1
                self._at = 0
                visits += 1
            elif self._after < self._until:
                self._after, ns = self._order.after(self._after)
                visible = (ns is not None and not ns.forgotten and self._after <= self._until
                           and (self._visible is None or self._visible(ns)))
                self._shards = list(ns.blocks.shards) if ns is not None and visible else []
                self._shard = 0
                visits += 1
            else:
                return True
        return False


class WholeEntries:
    """A whole snapshot's reply, encoded a page of entries at a time into one buffer
    (``add``), sent as it is at the end (``header``).  Encoding 400k entries in one go
    held the loop for about 35 ms, and copying its 17 MB into a fresh reply 10 more; a
    page's take a fraction of a millisecond, and the reply reads the same."""

    def __init__(self, rid: int, seq: int) -> None:
        self.rid = rid
        self.seq = seq
        # the reply with no entries ends in an empty array and the cursor (0): the array
        # goes in its place with an array32 header (0xdd and a 4-byte count, set at the
        # end), valid MessagePack for any count, so its size is known before the count
        empty = _ENCODER.encode(p.SnapshotReply(rid, seq, [], 0))
        assert empty.endswith(b"\x90\x00"), "an empty array, then the cursor"
        self._buf = bytearray(empty[:-2] + b"\xdd\0\0\0\0")
        self._count_at = len(self._buf) - 4
        self.count = 0

    def add(self, page: list[Entry]) -> None:
        """Append a page's entries (encoded as an array, whose own header is cut)."""
        if not page:
            return
        start = len(self._buf)
        _ENCODER.encode_into(page, self._buf, -1)
        n = len(page)
        del self._buf[start:start + (1 if n < 16 else 3 if n < 1 << 16 else 5)]
        self.count += n

    def reply(self, on_sent: Callable[[], None] | None = None, tenant: str | None = None
              ) -> tuple[p.Message, EncodedHeader]:
        """The reply: its header frame is the buffer (the reply stands beside it);
        ``on_sent`` once ZeroMQ no longer holds it; ``tenant`` asked for it."""
        at = self._count_at
        self._buf[at:at + 4] = self.count.to_bytes(4, "big")
        self._buf += b"\x00"  # the cursor: no more pages
        return p.SnapshotReply(self.rid, self.seq, []), EncodedHeader(self._buf, on_sent, tenant)


_ENCODER = msgspec.msgpack.Encoder()


class RoutingDaemon(Protocol):
    """What the routing verbs use of the daemon."""

    @property
    def config(self) -> Config: ...
    @property
    def store(self) -> BlockStore: ...
    @property
    def auth(self) -> Auth: ...
    @property
    def ssd(self) -> SsdMover | None: ...
    @property
    def transfers(self) -> TransferGate: ...
    @property
    def events(self) -> EventPublisher | None: ...
    @property
    def max_keys(self) -> int: ...


class RoutingVerbs:
    """The handlers of ``Snapshot`` and ``Probe``."""

    def __init__(self, daemon: RoutingDaemon, turns: SliceTurns | None = None) -> None:
        self.d = daemon
        self.turns = turns or SliceTurns()  # whole snapshots' pages: a turn each, by turns
        e = daemon.config.events
        self.configured = {  # load bandwidth per tier until measured, bytes a second
            "dram": float(parse_size(e.dram_bandwidth, "events.dram_bandwidth")),
            "ssd": float(parse_size(e.ssd_bandwidth, "events.ssd_bandwidth")),
            "remote": float(parse_size(e.remote_bandwidth, "events.remote_bandwidth"))}
        # paged snapshots under way, by session (gone with it) and tenant, and cursor
        self.walks: Walks[Session, SnapshotWalk] = Walks(SNAPSHOTS_OPEN, SNAPSHOTS_A_TENANT,
                                                         SNAPSHOTS_AT_ONCE)
        self.whole: dict[str, int] = {}  # snapshots in one reply under way, by tenant
        self.cursors = UnguessableIds()  # (a counter's told others' snapshots)

    def table(self) -> dict[type[Any], Handler]:
        return {p.Snapshot: self._snapshot, p.Probe: self._probe}

    def _visible(self, session: Session) -> Callable[[Namespace], bool]:
        auth, tenant = self.d.auth, session.tenant
        return lambda ns: auth.may_open(tenant, ns.tenant)

    def _snapshot(self, session: Session, req: p.Snapshot, payload: list[Any]) -> Answer:
        if req.cursor:
            walk = self.walks.take(session, req.cursor)
            if walk is None:
                raise NotFoundError(f"no snapshot under way with cursor {req.cursor} (it "
                                    f"ended, or {SNAPSHOTS_OPEN} newer ones of the session, "
                                    f"or {SNAPSHOTS_A_TENANT} of its tenant, began, or the "
                                    f"daemon kept {SNAPSHOTS_AT_ONCE}): begin again with "
                                    f"cursor 0")
            cursor = req.cursor
        else:
            walk = SnapshotWalk(self.d.store.order, self._seq_for(session),
                                self._visible(session))
            if not req.limit:
                return self._whole_later(session, req.rid, walk)
            cursor = next(self.cursors)
        blocks: list[Entry] = []
        if req.cursor:
            self._published()  # what changed since the last page, announced before it
        if walk.page(req.limit or SNAPSHOT_PAGE, blocks, PAGE_SECONDS):
            cursor = 0
        else:
            self.walks.keep(session, cursor, walk)  # (ending the oldest past the bounds)
        return p.SnapshotReply(req.rid, walk.seq, blocks, cursor), []

    def _seq_for(self, session: Session) -> int:
        """What changed published; the sequence number the session's snapshot begins
        after.  With credentials, -1 for a tenant that may not read the stream (neither
        in ``events.readers`` nor an operator): it could apply no batch after it, and the
        number moves with every tenant's stores and evictions (polled, it told a tenant
        when another's requests stored blocks, as a probe's queue once did)."""
        seq = self._published()
        config, tenant = self.d.config, session.tenant
        if (config.credentials and tenant not in config.events.readers
                and tenant not in config.auth.operators):
            return -1
        return seq

    def _published(self) -> int:
        """Publish what changed this loop turn; the sequence number of the last batch."""
        events = self.d.events
        if events is None:
            return -1
        events.flush()
        return events.last_seq

    def _whole_later(self, session: Session, rid: int, walk: SnapshotWalk) -> Answer:
        """The whole snapshot in one reply, as older clients ask it: at most
        ``WHOLE_OPEN`` a tenant and ``WHOLE_AT_ONCE`` in all under way, each counted
        until its reply is sent (``EncodedHeader.on_sent``), for it holds that reply."""
        tenant, whole = session.tenant, self.whole
        if whole.get(tenant, 0) >= WHOLE_OPEN:
            raise LimitExceededError(f"{WHOLE_OPEN} snapshots in one reply are under way "
                                     f"for tenant {tenant!r}: wait for them, or ask in "
                                     f"pages (limit > 0)")
        if sum(whole.values()) >= WHOLE_AT_ONCE:
            raise LimitExceededError(f"{WHOLE_AT_ONCE} snapshots in one reply are under "
                                     f"way in the daemon: ask in pages (limit > 0), or "
                                     f"again later")
        whole[tenant] = whole.get(tenant, 0) + 1
        done = False

        def sent() -> None:
            nonlocal done
            if done:
                return
            done = True
            left = whole.get(tenant, 1) - 1
            if left:
                whole[tenant] = left
            else:
                whole.pop(tenant, None)

        async def build() -> tuple[p.Message, list[Any]]:
            try:
                return await self._whole(rid, walk, sent, tenant)
            except BaseException:
                sent()
                raise
        # (a coroutine closed before it ran, its request given up, runs no ``except``)
        return Later(build(), give_up=sent)

    async def _whole(self, rid: int, walk: SnapshotWalk, sent: Callable[[], None],
                     tenant: str) -> tuple[p.Message, list[Any]]:
        """Built a page a loop turn, each page encoded as it is read (``WholeEntries``),
        so no turn encodes more than a page.  Each page, the first too, reads the store
        only after what changed before it is published: a change seen but not yet
        announced could come and go before the next batch, and no event would ever
        correct the snapshot."""
        entries = WholeEntries(rid, walk.seq)
        page: list[Entry] = []
        while True:
            await self.turns.turn()  # (many under way: a page of one of them a turn)
            self._published()
            done = walk.page(SNAPSHOT_PAGE, page, WHOLE_SECONDS)
            entries.add(page)
            page.clear()
            if done:
                return entries.reply(sent, tenant)

    def _probe(self, session: Session, req: p.Probe, payload: list[Any]) -> Outcome:
        d = self.d
        if len(req.keys) > d.max_keys:  # as every verb that names keys
            raise TooLargeError(f"{len(req.keys)} keys in one request; the limit is "
                                f"{d.max_keys}")
        chain: list[Block] = []
        ns = self._namespace_of(session, req.keys)
        if ns is not None:
            blocks = ns.blocks
            ssd = d.store.ssd  # (its copies no hit while they are dropped: ``ssd_lost``)
            ssd_gone = ssd is not None and not ssd.readable
            for key in req.keys:
                block = blocks.get(key)
                # ``Block.present``, inline: this loop is the probe's cost
                if block is None or (block.offset is None and block.extra is None
                                     and (block.ssd_offset is None or ssd_gone)):
                    break
                chain.append(block)
        block_bytes = ns.block_bytes if ns is not None else 0
        block_tokens = ns.identity.block_tokens if ns is not None else 0
        in_dram = all(b.offset is not None for b in chain)
        tiers = [DRAM] * len(chain) if in_dram else [b.tier for b in chain]
        if d.config.credentials and session.tenant not in d.config.auth.operators:
            # the measured figures move with every tenant's reads: with credentials a
            # tenant sees none of the whole daemon's (as in its stats), so the
            # configured bandwidths and no queue, unless it is an operator
            return p.ProbeReply(req.rid, p.tier_runs(tiers), block_bytes, block_tokens,
                                0.0, dict(self.configured)), []
        return p.ProbeReply(req.rid, p.tier_runs(tiers), block_bytes, block_tokens,
                            self.queue_seconds(), self.bandwidth()), []

    def _namespace_of(self, session: Session, keys: list[bytes]) -> Namespace | None:
        """The visible namespace whose chain begins with the first key (keys the client
        library makes are hashed with their namespace; a client's own may head chains in
        several, ``kvstore.first_blocks``), from the store's map of first
        blocks: one lookup however many namespaces there are (asking each one held the
        loop 12 ms a probe at 100k of them).  A chain is probed from its first block, as
        a router asks; another tenant's namespace answers nothing, and the session's own
        tenant's comes before one shared with it (``visible_head``)."""
        if not keys:
            return None
        return visible_head(self.d.store.roots, keys[0], self._visible_tenants(session))

    def _visible_tenants(self, session: Session) -> list[str]:
        """The session's tenant, and those that share their namespaces with it
        (``auth.shared_tenants``, ``auth.shared_writers``): whose namespaces ``_visible``
        lets it see."""
        tenant, auth = session.tenant, self.d.auth
        owners = {*auth.shared, *auth.writers} - {tenant}
        return [tenant, *(owner for owner in sorted(owners) if auth.may_open(tenant, owner))]

    def bandwidth(self) -> dict[str, float]:
        """Load bandwidth per tier: measured where the daemon has read enough, else the
        configured figure."""
        out = dict(self.configured)
        ssd = self.d.ssd
        if ssd is not None and ssd.read_bytes >= _MEASURED_BYTES and ssd.read_seconds > 0:
            out["ssd"] = ssd.read_bytes / ssd.read_seconds
        return out

    def queue_seconds(self) -> float:
        """Transfers queued or under way, times the mean time of a promotion."""
        ssd = self.d.ssd
        if ssd is None or not ssd.reads:
            return 0.0
        queues = self.d.transfers.queues
        return (queues.queued() + queues.in_flight) * ssd.read_seconds / ssd.reads
