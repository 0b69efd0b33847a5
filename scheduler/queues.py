"""Transfer queues: which block copy runs next, and how many run at once.

Three classes, served by strict priority: reload (an engine waits on it) before
prefetch before write-back.  Strict priority alone can starve the lower classes, so each
lower class has an aging bound: once its oldest queued transfer has waited longer than
the bound, that transfer goes first.  Inside a class, tenants share by weighted fair
queuing on bytes (self-clocked virtual finish times), so a burst from one tenant
queues behind its own earlier work rather than in front of everyone else's.  At most
``max_in_flight`` transfers run at once (optionally fewer per class), and a quota hook
may hold a tenant's next transfer back.

The structure is synchronous and pure: the caller passes the time, calls ``next`` when
it can start a transfer, and ``done`` when one finishes.  The daemon's async layer
drives it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, TypeVar

from kvstore.errors import ConfigError, MalformedError, NotFoundError

K = TypeVar("K")


class TransferKind(IntEnum):
    """Transfer classes; a lower value is served first."""

    RELOAD = 0
    PREFETCH = 1
    WRITEBACK = 2


# Seconds a class's oldest transfer may wait before it jumps the higher classes.
DEFAULT_AGING: Mapping[TransferKind, float] = {
    TransferKind.PREFETCH: 0.5,
    TransferKind.WRITEBACK: 2.0,
}


@dataclass(eq=False, slots=True)
class Transfer(Generic[K]):
    """One queued or running transfer; compared by identity."""

    key: K
    kind: TransferKind
    tenant: str
    nbytes: int
    enqueued_at: float
    finish_tag: float  # virtual finish time inside its class
    seq: int


@dataclass(slots=True)
class TenantUsage:
    """A tenant's running transfers, as the quota hook sees them."""

    in_flight: int = 0
    in_flight_bytes: int = 0


QuotaHook = Callable[[Transfer[K], TenantUsage], bool]
"""Whether the tenant may start this transfer now, given what it already runs."""


@dataclass(slots=True)
class _ClassQueue(Generic[K]):
    virtual_time: float = 0.0
    tenants: dict[str, deque[Transfer[K]]] = field(default_factory=dict)  # FIFO each
    last_finish: dict[str, float] = field(default_factory=dict)
    queued: int = 0
    in_flight: int = 0


class TransferQueues(Generic[K]):
    """Priority classes with aging, WFQ across tenants, bounded concurrency."""

    def __init__(
        self,
        max_in_flight: int,
        *,
        class_limits: Mapping[TransferKind, int] | None = None,
        aging: Mapping[TransferKind, float] | None = None,
        weights: Mapping[str, float] | None = None,
        quota: QuotaHook[K] | None = None,
    ) -> None:
        if max_in_flight <= 0:
            raise ConfigError(f"max_in_flight must be positive, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._class_limits = dict(class_limits or {})
        if any(limit <= 0 for limit in self._class_limits.values()):
            raise ConfigError(f"class limits must be positive, got {self._class_limits}")
        self._aging = dict(DEFAULT_AGING if aging is None else aging)
        if any(bound < 0 for bound in self._aging.values()):
            raise ConfigError(f"aging bounds must be >= 0 seconds, got {self._aging}")
        self._weights: dict[str, float] = {}
        for tenant, weight in (weights or {}).items():
            self.set_weight(tenant, weight)
        self._quota = quota
        self._classes: dict[TransferKind, _ClassQueue[K]] = {
            kind: _ClassQueue() for kind in TransferKind
        }
        self._running: set[Transfer[K]] = set()
        self._usage: dict[str, TenantUsage] = {}
        self._seq = 0

    def set_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share inside each class (default 1); applies to later submits."""
        if not weight > 0:
            raise ConfigError(f"tenant {tenant!r}: weight must be positive, got {weight}")
        self._weights[tenant] = weight

    def submit(
        self, key: K, *, kind: TransferKind, tenant: str, nbytes: int, now: float
    ) -> Transfer[K]:
        """Queue a transfer of ``nbytes`` for ``tenant``; returns its handle."""
        if nbytes < 0:
            raise MalformedError(f"nbytes must be >= 0, got {nbytes}")
        queue = self._classes[kind]
        start = max(queue.virtual_time, queue.last_finish.get(tenant, 0.0))
        finish = start + nbytes / self._weights.get(tenant, 1.0)
        queue.last_finish[tenant] = finish
        self._seq += 1
        transfer = Transfer(key, kind, tenant, nbytes, now, finish, self._seq)
        queue.tenants.setdefault(tenant, deque()).append(transfer)
        queue.queued += 1
        return transfer

    def next(self, now: float) -> Transfer[K] | None:
        """Start the transfer that goes next, or None (nothing eligible, or at the limit)."""
        if len(self._running) >= self.max_in_flight:
            return None
        open_kinds = [
            kind
            for kind in TransferKind
            if self._classes[kind].queued
            and self._classes[kind].in_flight < self._class_limits.get(kind, self.max_in_flight)
        ]
        chosen = self._most_overdue(open_kinds, now)
        if chosen is None:
            for kind in open_kinds:
                chosen = self._fairest(kind)
                if chosen is not None:
                    break
        if chosen is None:
            return None
        self._start(chosen)
        return chosen

    def _eligible_heads(self, kind: TransferKind) -> Iterator[Transfer[K]]:
        for tenant_queue in self._classes[kind].tenants.values():
            head = tenant_queue[0]
            if self._quota is None or self._quota(head, self.usage(head.tenant)):
                yield head

    def _most_overdue(self, kinds: list[TransferKind], now: float) -> Transfer[K] | None:
        best: Transfer[K] | None = None
        best_overdue = 0.0
        for kind in kinds:
            bound = self._aging.get(kind)
            if bound is None:
                continue
            oldest = min(self._eligible_heads(kind), key=_age_order, default=None)
            if oldest is None:
                continue
            overdue = now - oldest.enqueued_at - bound
            if overdue > best_overdue:
                best, best_overdue = oldest, overdue
        return best

    def _fairest(self, kind: TransferKind) -> Transfer[K] | None:
        return min(self._eligible_heads(kind), key=_fair_order, default=None)

    def _start(self, transfer: Transfer[K]) -> None:
        queue = self._classes[transfer.kind]
        tenant_queue = queue.tenants[transfer.tenant]
        assert tenant_queue[0] is transfer, "only a tenant's oldest transfer starts"
        tenant_queue.popleft()
        queue.queued -= 1
        queue.in_flight += 1
        queue.virtual_time = max(queue.virtual_time, transfer.finish_tag)
        if not tenant_queue:
            del queue.tenants[transfer.tenant]
        self._forget_idle(queue)
        self._running.add(transfer)
        usage = self._usage_of(transfer.tenant)
        usage.in_flight += 1
        usage.in_flight_bytes += transfer.nbytes

    def _forget_idle(self, queue: _ClassQueue[K]) -> None:
        # A finish time at or below the virtual time gives no head start, so an idle
        # tenant's entry can go; this keeps the map to tenants with recent work.
        stale = [
            tenant
            for tenant, finish in queue.last_finish.items()
            if finish <= queue.virtual_time and tenant not in queue.tenants
        ]
        for tenant in stale:
            del queue.last_finish[tenant]

    def _usage_of(self, tenant: str) -> TenantUsage:
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = TenantUsage()
        return usage

    def done(self, transfer: Transfer[K]) -> None:
        """A started transfer finished (or failed): its slot is free again."""
        if transfer not in self._running:
            raise NotFoundError(f"transfer {transfer.seq} is not running")
        self._running.discard(transfer)
        self._classes[transfer.kind].in_flight -= 1
        usage = self._usage[transfer.tenant]
        usage.in_flight -= 1
        usage.in_flight_bytes -= transfer.nbytes
        if usage.in_flight == 0:
            del self._usage[transfer.tenant]

    def cancel(self, transfer: Transfer[K]) -> bool:
        """Drop a transfer that has not started; False if it is not queued."""
        queue = self._classes[transfer.kind]
        tenant_queue = queue.tenants.get(transfer.tenant)
        if tenant_queue is None or transfer not in tenant_queue:
            return False
        tenant_queue.remove(transfer)
        queue.queued -= 1
        if not tenant_queue:
            del queue.tenants[transfer.tenant]
        return True

    def usage(self, tenant: str) -> TenantUsage:
        """A copy of the tenant's running counts."""
        usage = self._usage.get(tenant, TenantUsage())
        return TenantUsage(usage.in_flight, usage.in_flight_bytes)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def queued(self, kind: TransferKind | None = None) -> int:
        """Transfers waiting, in one class or in all."""
        if kind is not None:
            return self._classes[kind].queued
        return sum(queue.queued for queue in self._classes.values())

    def __len__(self) -> int:
        return self.queued()

    def check(self) -> None:
        """Assert the counters agree with the queues (for tests and debug mode)."""
        running = 0
        for kind, queue in self._classes.items():
            waiting = sum(len(q) for q in queue.tenants.values())
            assert waiting == queue.queued, f"{kind.name}: {waiting} queued, counted {queue.queued}"
            assert all(queue.tenants.values()), f"{kind.name}: an empty tenant queue is kept"
            for tenant_queue in queue.tenants.values():
                tags = [t.finish_tag for t in tenant_queue]
                assert tags == sorted(tags), f"{kind.name}: finish tags out of order"
            live = sum(1 for t in self._running if t.kind is kind)
            assert live == queue.in_flight, (
                f"{kind.name}: {live} running, counted {queue.in_flight}"
            )
            running += live
        assert running <= self.max_in_flight, f"{running} running over {self.max_in_flight}"
        by_tenant = sum(u.in_flight for u in self._usage.values())
        assert by_tenant == running, f"tenant usage counts {by_tenant}, running {running}"

    def __repr__(self) -> str:
        queued = ", ".join(f"{k.name.lower()}={self._classes[k].queued}" for k in TransferKind)
        return f"TransferQueues(in_flight={self.in_flight}/{self.max_in_flight}, {queued})"


def _age_order(transfer: Transfer[K]) -> tuple[float, int]:
    return (transfer.enqueued_at, transfer.seq)


def _fair_order(transfer: Transfer[K]) -> tuple[float, int]:
    return (transfer.finish_tag, transfer.seq)
