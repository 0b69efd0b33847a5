"""The daemon's side of cache-aware routing: the ``snapshot`` and ``probe`` verbs.

``snapshot`` lists every cached block per tier as of the event stream's last sequence
number (pending changes are published first), so a router starts from it and applies
the batches after it.  ``probe`` answers a router's question for one key chain: the
longest cached prefix per tier, and what the router needs to estimate the cost of
serving the request here (the wait ahead of a new transfer, the load bandwidth per
tier).  Neither touches a block: a router's question is not a use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvstore import protocol as p
from kvstore.auth import Auth
from kvstore.blocks import DRAM, Block, Namespace
from kvstore.config import Config, parse_size
from kvstore.events import EventPublisher, snapshot
from kvstore.sessions import Session
from kvstore.store import BlockStore
from kvstore.tiering import SsdMover
from kvstore.transfers import TransferGate
from kvstore.verbs import Handler, Outcome, tier_runs

_MEASURED_BYTES = 1 << 20  # promotions read before the measured bandwidth counts


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


class RoutingVerbs:
    """The handlers of ``Snapshot`` and ``Probe``."""

    def __init__(self, daemon: RoutingDaemon) -> None:
        self.d = daemon
        e = daemon.config.events
        self.configured = {  # load bandwidth per tier until measured, bytes a second
            "dram": float(parse_size(e.dram_bandwidth, "events.dram_bandwidth")),
            "ssd": float(parse_size(e.ssd_bandwidth, "events.ssd_bandwidth")),
            "remote": float(parse_size(e.remote_bandwidth, "events.remote_bandwidth"))}

    def table(self) -> dict[type[Any], Handler]:
        return {p.Snapshot: self._snapshot, p.Probe: self._probe}

    def _visible(self, session: Session) -> Callable[[Namespace], bool]:
        auth, tenant = self.d.auth, session.tenant
        return lambda ns: auth.may_open(tenant, ns.tenant)

    def _snapshot(self, session: Session, req: p.Snapshot, payload: list[Any]) -> Outcome:
        events = self.d.events
        seq = -1
        if events is not None:
            events.flush()  # what changed this turn goes out first: the snapshot follows it
            seq = events.last_seq
        return p.SnapshotReply(req.rid, seq, snapshot(self.d.store, self._visible(session))), []

    def _probe(self, session: Session, req: p.Probe, payload: list[Any]) -> Outcome:
        d = self.d
        chain: list[Block] = []
        ns = self._namespace_of(session, req.keys)
        if ns is not None:
            blocks = ns.blocks
            for key in req.keys:
                block = blocks.get(key)
                # ``Block.present``, inline: this loop is the probe's cost
                if block is None or (block.offset is None and block.ssd_offset is None
                                     and block.extra is None):
                    break
                chain.append(block)
        block_bytes = ns.block_bytes if ns is not None else 0
        block_tokens = ns.identity.block_tokens if ns is not None else 0
        in_dram = all(b.offset is not None for b in chain)
        tiers = [DRAM] * len(chain) if in_dram else [b.tier for b in chain]
        return p.ProbeReply(req.rid, tier_runs(tiers), block_bytes, block_tokens,
                            self.queue_seconds(), self.bandwidth()), []

    def _namespace_of(self, session: Session, keys: list[bytes]) -> Namespace | None:
        """The visible namespace that caches the chain's first key (keys are hashed with
        their namespace, so at most one does).  Only the namespaces of the tenants the
        session may see are searched: another tenant's count costs a probe nothing."""
        if not keys:
            return None
        first = keys[0]
        groups = self.d.store.tenant_namespaces
        for tenant in self._visible_tenants(session):
            for ns in groups.get(tenant, {}).values():
                if first in ns.blocks:
                    return ns
        return None

    def _visible_tenants(self, session: Session) -> list[str]:
        """The session's tenant, and those that share their namespaces with it
        (``auth.shared_tenants``): whose namespaces ``_visible`` lets it see."""
        tenant = session.tenant
        return [tenant, *(owner for owner, grantees in self.d.auth.shared.items()
                          if owner != tenant and tenant in grantees)]

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
