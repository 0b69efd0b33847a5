"""Prometheus metrics for the daemon, in a private registry.

Four groups: pool state per tier, reuse, scheduling and service, plus invariant
violations.  Pool state and the counters the store already keeps are read at scrape
time from a stats callable (the dict of ``Server.stats()``), so nothing is counted
twice; what only the daemon sees (request latency, transfers, queue waits, admission
outcomes) is observed through the ``observe_*`` methods.

The stats dict, as the collector reads it (every key optional)::

    {"tiers": {"dram": {"capacity": int, "free": int, "reserved": int,
                        "committed": int, "peak_committed": int, "tail_waste": int,
                        "reserved_slots": int, "committed_slots": int, "blocks": int,
                        "pinned_blocks": int, "empty_slabs": int, "lookups": int,
                        "budget_slabs": int, "allocated": int,
                        "lookup_keys": int, "hits": int, "commits": int,
                        "duplicates": int, "aborts": int, "capacity_rejects": int,
                        "lease_expiries": int, "checksum_failures": int,
                        "evictions": int, "evictions_by_cause": {cause: int}}, ...},
     "evictions_by_policy": {"dram": {policy: int}},
     "sessions": int, "namespaces": int, "invariant_violations": int}
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvstore.metrics_http import (  # noqa: F401 (the port's bounds, here as before)
    CUT_WAIT,
    METRICS_MAX_CONNECTIONS,
    METRICS_READ_TIMEOUT,
    serve_metrics,
)

log = logging.getLogger("kvstore.metrics")

StatsSource = Callable[[], Mapping[str, Any]]
"""Returns the daemon's stats dict (the shape in the module docstring)."""

OTHER_TENANT = "_other"
"""The label of every tenant past ``max_tenants``."""
UNAUTHENTICATED = "_unauthenticated"
"""The label of requests made without a session (a refused hello, one before hello)."""

REQUEST_SECONDS_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    0.1, 0.25, 0.5, 1.0, 2.5)
TRANSFER_SECONDS_BUCKETS = (
    100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0)
TRANSFER_BYTES_BUCKETS = tuple(float(4096 * 4**i) for i in range(11))  # 4 KiB .. 4 GiB
REQUEST_SECONDS_BOUNDS = (*REQUEST_SECONDS_BUCKETS, float("inf"))
_REQUEST_SECONDS_LE = tuple(floatToGoString(b)  # type: ignore[no-untyped-call]
                            for b in REQUEST_SECONDS_BOUNDS)  # the buckets' ``le`` labels
QUEUE_WAIT_SECONDS_BUCKETS = (
    100e-6, 1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# (stats key, metric name, help) of the per-tier pool gauges.
_POOL_GAUGES = (
    ("capacity", "kvstore_pool_capacity_bytes", "Bytes the tier can hold."),
    ("free", "kvstore_pool_free_bytes", "Bytes in free slots."),
    ("reserved", "kvstore_pool_reserved_bytes", "Bytes in slots reserved but not committed."),
    ("committed", "kvstore_pool_committed_bytes", "Bytes in slots holding committed blocks."),
    ("tail_waste", "kvstore_pool_tail_waste_bytes",
     "Bytes at the ends of slabs too small for another slot."),
    ("reserved_slots", "kvstore_pool_reserved_slots", "Slots reserved but not committed."),
    ("committed_slots", "kvstore_pool_committed_slots", "Slots holding committed blocks."),
    ("blocks", "kvstore_pool_blocks", "Blocks cached."),
    ("pinned_blocks", "kvstore_pool_pinned_blocks",
     "Unique blocks referenced by at least one pin, reservation parent or held key."),
    ("healthy", "kvstore_tier_healthy",
     "1 while the tier is in use; 0 once it was turned off for good (the SSD tier's "
     "directory removed or replaced under the daemon: off until a restart)."),
    ("empty_slabs", "kvstore_pool_empty_slabs", "Slabs not assigned to any slot size."),
    ("budget_slabs", "kvstore_pool_budget_slabs",
     "Slabs the per-tenant arenas may hold together (dram.capacity over the slab size)."),
    ("allocated", "kvstore_pool_allocated_bytes",
     "Memory the per-tenant arenas' files hold now (slabs written, less those given back)."),
)

# (stats key, metric name without _total, help) of the per-tier counters the store keeps.
_TIER_COUNTERS = (
    ("lookups", "kvstore_lookups", "Lookup requests."),
    ("lookup_keys", "kvstore_lookup_blocks", "Blocks asked for by lookups."),
    ("hits", "kvstore_hit_blocks", "Blocks found by lookups (the leading cached prefix)."),
    ("commits", "kvstore_committed_blocks", "Blocks committed."),
    ("duplicates", "kvstore_duplicate_blocks",
     "Committed blocks another writer had cached first (their slots were freed)."),
    ("aborts", "kvstore_aborts", "Reservations aborted."),
    ("capacity_rejects", "kvstore_allocation_failures",
     "Reservations refused because the tier was full of pinned blocks."),
    ("lease_expiries", "kvstore_lease_expiries",
     "Reservations and pins rolled back because their lease ran out."),
    ("checksum_failures", "kvstore_checksum_failures",
     "Blocks whose bytes failed their checksum on read (served as misses)."),
    ("promotions", "kvstore_promotions", "Blocks read up into this tier from the one below."),
    ("demotions", "kvstore_demotions", "Blocks written back into this tier as DRAM evicted them."),
    ("writes", "kvstore_tier_writes", "Blocks written into this tier."),
    ("reads", "kvstore_tier_reads", "Blocks read from this tier."),
    ("errors", "kvstore_tier_errors", "Failed transfers with this tier."),
    ("slab_moves", "kvstore_slab_moves",
     "Slabs handed from one block size's class to another's (emptied into its others)."),
    ("slab_moved_blocks", "kvstore_slab_moved_blocks",
     "Blocks copied into their class's other slabs so that a slab could be handed over."),
    ("slab_turns", "kvstore_slab_turns",
     "Loop turns a request needing several slabs let other requests have between them."),
    ("dropped_on_eviction", "kvstore_dropped_on_eviction",
     "Blocks that left DRAM without a copy below (the tier below declined or was off)."),
    ("evicted_unwritten", "kvstore_evicted_unwritten",
     "SSD copies evicted before the remote store had them (its write-back mode)."),
    ("write_backs", "kvstore_write_backs",
     "Blocks written back into this tier as the tiers above let them go."),
    ("budget_taken", "kvstore_budget_slabs_taken",
     "Slabs a per-tenant arena gave up to one below its share of dram.capacity."),
    ("budget_no_memory", "kvstore_budget_slabs_without_memory",
     "Slabs of per-tenant arenas whose memory could not be allocated (system short)."),
    ("budget_held_back", "kvstore_budget_refusals",
     "Requests of tenants holding no slab refused: more tenants wrote than there are slabs."),
)

# (stats["scheduling"] key, metric name without _total, help)
_SCHEDULING_COUNTERS = (
    ("defers", "kvstore_defers", "Requests deferred to wait for room."),
    ("defer_timeouts", "kvstore_defer_rejects",
     "Deferred requests rejected at their deadline."),
    ("rejects", "kvstore_capacity_rejects",
     "Requests refused for want of room, whatever the cause (see kvstore_admission_rejects)."),
    ("recomputed_tokens", "kvstore_recomputed_tokens",
     "Tokens engines reported recomputing (cache misses that cost compute)."),
)


class _Monotonic:
    """Turns counters that restart from zero (a tier rebuilt on reload) into ones that
    only go up, so a rate over the restart stays right."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, ...], float] = {}
        self._base: dict[tuple[str, ...], float] = {}

    def __call__(self, key: tuple[str, ...], raw: float) -> float:
        last = self._last.get(key)
        if last is not None and raw < last:
            self._base[key] = self._base.get(key, 0.0) + last
        self._last[key] = raw
        return self._base.get(key, 0.0) + raw


class _StatsCollector(Collector):
    """Pool state and store counters, read from the stats callable at each scrape."""

    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats
        # Scrapes may run concurrently on the HTTP server's threads.
        self._lock = threading.Lock()
        self._monotonic = _Monotonic()
        self._peak: dict[str, float] = {}
        self._errors = 0

    def describe(self) -> Iterable[Metric]:
        return self._families({})

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats()
            with self._lock:
                return self._families(stats)
        except Exception:
            log.exception("reading the daemon's stats for a scrape failed")
            with self._lock:
                self._errors += 1
                return [self._error_family()]

    def _error_family(self) -> Metric:
        family = CounterMetricFamily(
            "kvstore_stats_errors", "Scrapes that could not read the daemon's stats.")
        family.add_metric([], float(self._errors))
        return family

    def _families(self, stats: Mapping[str, Any]) -> list[Metric]:
        pool = {key: GaugeMetricFamily(name, text, labels=["tier"])
                for key, name, text in _POOL_GAUGES}
        peak = GaugeMetricFamily(
            "kvstore_pool_peak_committed_bytes",
            "Most bytes committed at once since start (as seen at scrapes, unless the "
            "tier tracks it itself).", labels=["tier"])
        counters = {key: CounterMetricFamily(name, text, labels=["tier"])
                    for key, name, text in _TIER_COUNTERS}
        evictions = CounterMetricFamily(
            "kvstore_evictions", "Blocks evicted, by tier, eviction policy and cause.",
            labels=["tier", "policy", "cause"])
        hit_ratio = GaugeMetricFamily(
            "kvstore_lookup_hit_ratio",
            "Blocks found over blocks asked for, by lookups since start.", labels=["tier"])
        sessions = GaugeMetricFamily("kvstore_sessions", "Client sessions open.")
        namespaces = GaugeMetricFamily("kvstore_namespaces", "Namespaces open.")
        violations = CounterMetricFamily(
            "kvstore_invariant_violations",
            "Invariant checks that failed (each is logged; see --debug-invariants).")

        scheduling = {key: CounterMetricFamily(name, text)
                      for key, name, text in _SCHEDULING_COUNTERS}
        for key, counter in scheduling.items():
            if key in stats.get("scheduling", {}):
                counter.add_metric([], self._monotonic(
                    ("scheduling", key), float(stats["scheduling"][key])))
        tiers: Mapping[str, Mapping[str, Any]] = dict(stats.get("tiers", {}))
        if "remote" in stats:  # the store's marks of it, and the remote tier's own figures
            tiers = {**tiers, "remote": {**tiers.get("remote", {}), **stats["remote"]}}
        policies: Mapping[str, str] = stats.get("eviction_policies", {})
        # a tier's evictions under each policy in charge since start (a SIGHUP changes it)
        by_policies: Mapping[str, Mapping[str, int]] = stats.get("evictions_by_policy", {})
        for tier, t in tiers.items():
            for key, gauge in pool.items():
                if key in t:
                    gauge.add_metric([tier], float(t[key]))
            if "committed" in t or "peak_committed" in t:
                seen = float(t.get("peak_committed", t.get("committed", 0)))
                self._peak[tier] = max(self._peak.get(tier, 0.0), seen)
                peak.add_metric([tier], self._peak[tier])
            for key, counter in counters.items():
                if key in t:
                    counter.add_metric([tier], self._monotonic((key, tier), float(t[key])))
            by_cause: Mapping[str, Any] = t.get("evictions_by_cause") or (
                {"capacity": t["evictions"]} if "evictions" in t else {})
            by_policy = by_policies.get(tier)
            if by_policy and list(by_cause) == ["capacity"]:  # each policy's own share
                for policy, count in by_policy.items():
                    evictions.add_metric([tier, policy, "capacity"], self._monotonic(
                        ("evictions", tier, "capacity", policy), float(count)))
                by_cause = {}
            for cause, count in by_cause.items():
                evictions.add_metric(
                    [tier, policies.get(tier, "none"), cause],
                    self._monotonic(("evictions", tier, cause), float(count)))
            if t.get("lookup_keys"):
                hit_ratio.add_metric([tier], float(t.get("hits", 0)) / float(t["lookup_keys"]))
        if "sessions" in stats:
            sessions.add_metric([], float(stats["sessions"]))
        if "namespaces" in stats:
            namespaces.add_metric([], float(stats["namespaces"]))
        if "invariant_violations" in stats:
            violations.add_metric(
                [], self._monotonic(("invariant_violations",),
                                    float(stats["invariant_violations"])))
        return [*pool.values(), peak, *counters.values(), evictions, hit_ratio, sessions,
                namespaces, violations, *scheduling.values(), self._error_family(),
                *self._event_families(stats), _grantee_pins_family(stats),
                *self._replies_families(stats), _arena_slabs_family(stats)]

    def _replies_families(self, stats: Mapping[str, Any]) -> list[Metric]:
        """Replies to connections that do not read them: dropped past the queue's bound
        (``server.max_unread_replies``), and the bytes of big ones not yet sent."""
        replies = stats.get("replies")
        if not replies:
            return []
        dropped = CounterMetricFamily(
            "kvstore_replies_dropped_unread",
            "Replies dropped because their connection left max_unread_replies unread.")
        dropped.add_metric([], self._monotonic(("replies_dropped_unread",),
                                               float(replies["dropped_unread"])))
        unread = GaugeMetricFamily(
            "kvstore_replies_unread_bytes",
            "Bytes of big replies (16 KiB or more) not yet handed to their connections.")
        unread.add_metric([], float(replies["unread_bytes"]))
        return [dropped, unread]

    def _event_families(self, stats: Mapping[str, Any]) -> list[Metric]:
        """The KV event stream's batches sent, and those some subscriber missed (it was
        behind)."""
        events = stats.get("events")
        if not events:
            return []
        out: list[Metric] = []
        for key, name, text in (
                ("batches", "kvstore_events_batches", "KV event batches published."),
                ("dropped", "kvstore_events_dropped",
                 "KV event batches no subscriber got (a lossy send failed: not "
                 "expected; subscribers see a sequence jump and replay it)."),
                ("lossy_batches", "kvstore_events_lossy_batches",
                 "KV event batches a full subscriber's queue refused, sent to every "
                 "subscriber with room (the full ones see a sequence jump and replay "
                 "it)."),
                ("replays", "kvstore_events_replays", "Replay requests answered.")):
            family = CounterMetricFamily(name, text)
            family.add_metric([], self._monotonic(("events", key),
                                                  float(events.get(key, 0))))
            out.append(family)
        return out


class _Count:
    """One counter series: its value, and when it was made (its ``_created``)."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value: float = 0
        self.created = time.time()


class _Latency:
    """One histogram series: the observations in each bucket (not cumulative), their sum."""

    __slots__ = ("buckets", "sum", "created")

    def __init__(self) -> None:
        self.buckets = [0] * len(REQUEST_SECONDS_BOUNDS)
        self.sum = 0.0
        self.created = time.time()


class _Requests(Collector):
    """Requests, their errors and latency, and lookups' tokens: counted in plain numbers
    on the loop and read into families at each scrape.  A prometheus_client child takes
    a lock per increment and a histogram walks its buckets in Python: 1.8 us a request,
    against 0.3-0.7 here.  The scrape's thread only reads (a dict copied in one C call, each
    number whole), so a scrape may see one request's count before its latency, never a
    count that goes down."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, ...], _Count] = {}       # (verb, tenant)
        self.errors: dict[tuple[str, ...], _Count] = {}         # (verb, code, tenant)
        self.latency: dict[str, _Latency] = {}                  # verb
        self.hit_tokens: dict[tuple[str, ...], _Count] = {}     # (tier, tenant)
        self.missed_tokens: dict[tuple[str, ...], _Count] = {}  # (tier, tenant)

    @staticmethod
    def count(series: dict[tuple[str, ...], _Count], labels: tuple[str, ...]) -> _Count:
        found = series.get(labels)
        if found is None:
            found = series[labels] = _Count()
        return found

    def latency_of(self, verb: str) -> _Latency:
        found = self.latency.get(verb)
        if found is None:
            found = self.latency[verb] = _Latency()
        return found

    def describe(self) -> Iterable[Metric]:
        return self._families({}, {}, {}, {}, {})

    def collect(self) -> Iterable[Metric]:
        return self._families(self.requests.copy(), self.errors.copy(), self.latency.copy(),
                              self.hit_tokens.copy(), self.missed_tokens.copy())

    def _families(self, requests: Mapping[tuple[str, ...], _Count],
                  errors: Mapping[tuple[str, ...], _Count],
                  latency: Mapping[str, _Latency],
                  hit_tokens: Mapping[tuple[str, ...], _Count],
                  missed_tokens: Mapping[tuple[str, ...], _Count]) -> list[Metric]:
        # prometheus_client's own Counter and Histogram leave out ``_created`` when
        # PROMETHEUS_DISABLE_CREATED_SERIES or disable_created_metrics() says so; the
        # families built here honour the same switch, which the library keeps only in this
        # private module global (read at each scrape, as its own metrics do).
        with_created = prometheus_client.metrics._use_created
        counters = [
            (requests, CounterMetricFamily(
                "kvstore_requests", "Requests handled, by verb and tenant.",
                labels=["verb", "tenant"])),
            (errors, CounterMetricFamily(
                "kvstore_request_errors", "Requests answered with an error, by verb, error "
                "code and tenant.", labels=["verb", "code", "tenant"])),
            (hit_tokens, CounterMetricFamily(
                "kvstore_lookup_hit_tokens", "Tokens in blocks found by lookups.",
                labels=["tier", "tenant"])),
            (missed_tokens, CounterMetricFamily(
                "kvstore_lookup_missed_tokens", "Tokens in full blocks asked for but not "
                "cached (the engine recomputes them).", labels=["tier", "tenant"]))]
        for series, family in counters:
            for labels, count in series.items():
                family.add_metric(labels, count.value,
                                  created=count.created if with_created else None)
        seconds = HistogramMetricFamily(
            "kvstore_request_duration_seconds", "Time from receiving a request to sending "
            "its reply, by verb.", labels=["verb"])
        for verb, one in latency.items():
            buckets, total = list(one.buckets), one.sum
            cumulative = 0.0
            points = []
            for le, n in zip(_REQUEST_SECONDS_LE, buckets):
                cumulative += n
                points.append((le, cumulative))
            seconds.add_metric([verb], points, total)
            if with_created:
                seconds.samples.append(Sample(f"{seconds.name}_created", {"verb": verb},
                                              one.created))
        return [counters[0][1], counters[1][1], seconds, counters[2][1], counters[3][1]]


def stats_on_loop(
    loop: asyncio.AbstractEventLoop, stats: StatsSource, timeout: float = 2.0
) -> StatsSource:
    """Wrap ``stats`` so that scrapes from other threads run it on ``loop``.

    The store's dicts change on the loop's thread; walking them from the HTTP server's
    thread could see them mid-change.  A loop stuck for longer than ``timeout`` makes
    the scrape fail (counted in ``kvstore_stats_errors_total``) instead of hanging.
    """

    def on_loop() -> Mapping[str, Any]:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return stats()
        done: concurrent.futures.Future[Mapping[str, Any]] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(stats())
            except Exception as exc:  # noqa: BLE001 - re-raised in the scraping thread
                done.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return done.result(timeout)

    return on_loop


class Metrics:
    """The daemon's metrics in a private registry; ``observe_*`` on the hot paths.

    ``observe_request`` and ``observe_lookup_tokens`` count in plain numbers with no lock
    (``_Requests``): call them from the event loop's thread only.
    """

    def __init__(self, stats: StatsSource | None = None, *, max_tenants: int = 256,
                 known_tenants: Iterable[str] = ()) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be positive, got {max_tenants}")
        self.registry = CollectorRegistry()
        self.max_tenants = max_tenants
        self._tenants: set[str] = set()
        # tenants the configuration names (weights, grants, peers, operators, readers):
        # labelled whoever came first.  Without credentials any client names any tenant,
        # and the first ``max_tenants`` names took every label for the daemon's life:
        # a script's 256 hellos left the configured tenants counted as OTHER_TENANT.
        self._known = frozenset(known_tenants)
        if stats is not None:
            self.registry.register(_StatsCollector(stats))
        r = self.registry
        # service and reuse: every request counts here, in plain numbers (``_Requests``)
        self._figures = _Requests()
        r.register(self._figures)
        self._transfer_seconds = Histogram(
            "kvstore_transfer_duration_seconds", "Time of block transfers, by direction "
            "(offload, reload, promote, demote) and tier.", ["direction", "tier"],
            buckets=TRANSFER_SECONDS_BUCKETS, registry=r)
        self._transfer_bytes = Histogram(
            "kvstore_transfer_size_bytes", "Bytes per block transfer, by direction and tier.",
            ["direction", "tier"], buckets=TRANSFER_BYTES_BUCKETS, registry=r)
        # scheduling
        self._queue_depth = Gauge(
            "kvstore_queue_depth", "Transfers waiting, by class.", ["class"], registry=r)
        self._queue_wait = Histogram(
            "kvstore_queue_wait_seconds", "Time transfers waited in their queue, by class.",
            ["class"], buckets=QUEUE_WAIT_SECONDS_BUCKETS, registry=r)
        self._tenant_wait = Counter(
            "kvstore_queue_waited_seconds", "Seconds transfers waited, by class and tenant.",
            ["class", "tenant"], registry=r)
        self._defers = Counter(
            "kvstore_admission_defers", "Requests admission deferred, by tier and tenant.",
            ["tier", "tenant"], registry=r)
        self._rejects = Counter(
            "kvstore_admission_rejects", "Requests admission rejected, by tier, tenant and "
            "cause.", ["tier", "tenant", "cause"], registry=r)
        # (verb, tenant) -> its count and its verb's latency; the tenant as the client
        # named it (those past ``max_tenants`` share the series of OTHER_TENANT)
        self._request_children: dict[tuple[str, str], tuple[_Count, _Latency]] = {}
        self._error_children: dict[tuple[str, str, str], _Count] = {}
        self._token_children: dict[tuple[str, str], tuple[_Count, _Count]] = {}
        self._transfer_children: dict[tuple[str, str], tuple[Histogram, Histogram]] = {}

    def __repr__(self) -> str:
        return (f"Metrics(tenants={len(self._tenants)}/{self.max_tenants}, "
                f"request_series={len(self._request_children)})")

    def _tenant(self, tenant: str) -> str:
        # Tenants are named by clients; capping them keeps a misbehaving client from
        # growing the exposition (and this process) without bound.
        if tenant in self._tenants or tenant == UNAUTHENTICATED or tenant in self._known:
            return tenant
        if len(self._tenants) < self.max_tenants:
            self._tenants.add(tenant)
            return tenant
        return OTHER_TENANT

    # -- service -------------------------------------------------------------------------
    def observe_request(
        self, verb: str, seconds: float, error_code: str | None, tenant: str
    ) -> None:
        """Count one handled request, its latency, and its error code if it failed."""
        children = self._request_children.get((verb, tenant))
        if children is None:
            label = self._tenant(tenant)
            children = (self._figures.count(self._figures.requests, (verb, label)),
                        self._figures.latency_of(verb))
            if label == tenant:
                self._request_children[(verb, tenant)] = children
        children[0].value += 1
        latency = children[1]
        latency.buckets[bisect.bisect_left(REQUEST_SECONDS_BOUNDS, seconds)] += 1
        latency.sum += seconds
        if error_code is not None:
            error = self._error_children.get((verb, error_code, tenant))
            if error is None:
                label = self._tenant(tenant)
                error = self._figures.count(self._figures.errors, (verb, error_code, label))
                if label == tenant:
                    self._error_children[(verb, error_code, tenant)] = error
            error.value += 1

    # -- reuse ---------------------------------------------------------------------------
    def observe_lookup_tokens(
        self, tier: str, tenant: str, hit_tokens: int, missed_tokens: int
    ) -> None:
        """Tokens a lookup found cached and tokens it asked for in vain."""
        children = self._token_children.get((tier, tenant))  # every lookup comes here
        if children is None:
            label = self._tenant(tenant)
            figures = self._figures
            children = (figures.count(figures.hit_tokens, (tier, label)),
                        figures.count(figures.missed_tokens, (tier, label)))
            if label == tenant:
                self._token_children[(tier, tenant)] = children
        children[0].value += hit_tokens
        children[1].value += missed_tokens

    def observe_transfer(self, direction: str, tier: str, nbytes: int, seconds: float) -> None:
        """One transfer of ``nbytes`` taking ``seconds``.

        ``direction`` is offload or reload (engine and store) or promote or demote
        (between tiers); ``tier`` is the store tier read or written, for promote and
        demote the lower of the two.
        """
        children = self._transfer_children.get((direction, tier))
        if children is None:
            children = (self._transfer_seconds.labels(direction, tier),
                        self._transfer_bytes.labels(direction, tier))
            self._transfer_children[(direction, tier)] = children
        children[0].observe(seconds)
        children[1].observe(nbytes)

    # -- scheduling ----------------------------------------------------------------------
    def set_queue_depth(self, cls: str, depth: int) -> None:
        """How many transfers of class ``cls`` (reload, prefetch, writeback) wait now."""
        self._queue_depth.labels(cls).set(depth)

    def observe_queue_wait(self, cls: str, tenant: str, seconds: float) -> None:
        """A transfer of class ``cls`` left its queue after waiting ``seconds``."""
        self._queue_wait.labels(cls).observe(seconds)
        self._tenant_wait.labels(cls, self._tenant(tenant)).inc(seconds)

    def observe_defer(self, tier: str, tenant: str) -> None:
        """Admission deferred a request of ``tenant`` for room in ``tier``."""
        self._defers.labels(tier, self._tenant(tenant)).inc()

    def observe_reject(self, tier: str, tenant: str, cause: str) -> None:
        """Admission rejected a request of ``tenant`` in ``tier``, for ``cause``."""
        self._rejects.labels(tier, self._tenant(tenant), cause).inc()

    # -- export --------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what a scrape returns)."""
        return prometheus_client.generate_latest(self.registry)

    def start_http_server(
        self, port: int, addr: str = "127.0.0.1", token: bytes = b"", *,
        max_connections: int = METRICS_MAX_CONNECTIONS,
        read_timeout: float = METRICS_READ_TIMEOUT,
    ) -> Callable[[], None] | None:
        """Serve ``/metrics`` on ``addr:port`` from a background thread; with ``token``,
        only to scrapes that carry ``Authorization: Bearer <token>`` (others get 401).

        Each connection has a thread of its own, before any token check: so at most
        ``max_connections`` at once, and each waits at most ``read_timeout`` seconds for
        its request line and headers (else a peer that sends half a request, many times
        over, holds as many threads for ever).  A connection past them cuts the one
        waiting longest for its request among those of the peer address with the most
        waiting, if any (else it is closed at once): a peer holding half-sent requests,
        or opening them again as they are cut, loses its own connections, not a scrape
        from another address that is about to send its request.

        Port 0 means disabled and returns None; otherwise returns a function that stops
        the server and closes its socket.
        """
        if port == 0:
            return None
        return serve_metrics(self.registry, port, addr, token, max_connections, read_timeout)


def _arena_slabs_family(stats: Mapping[str, Any]) -> Metric:
    """The DRAM slabs each arena holds (per-tenant arenas draw on one budget of them)."""
    family = GaugeMetricFamily("kvstore_arena_slabs", "DRAM slabs each arena holds.",
                               labels=["arena"])
    held: dict[str, int] = {}
    for c in stats.get("slab_classes", {}).get("dram", []):
        held[c["arena"]] = held.get(c["arena"], 0) + c["slabs"]
    for arena, slabs in held.items():
        family.add_metric([arena], float(slabs))
    return family


def _grantee_pins_family(stats: Mapping[str, Any]) -> Metric:
    """Bytes of each owner's DRAM each grantee keeps pinned (its labels are the grants
    configured, a bounded set)."""
    family = GaugeMetricFamily(
        "kvstore_grantee_pinned_bytes", "Bytes of an owner tenant's DRAM a tenant it "
        "granted its namespaces to keeps pinned (within auth.grantee_pin_share).",
        labels=["grantee", "owner"])
    held: Mapping[str, Mapping[str, int]] = stats.get("grantee_pinned_bytes") or {}
    for grantee, by_owner in held.items():
        for owner, nbytes in by_owner.items():
            family.add_metric([grantee, owner], float(nbytes))
    return family
