"""Metrics scraped over real HTTP equal what was fed, and follow Prometheus naming."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.metrics import OTHER_TENANT, Metrics, stats_on_loop

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def tier_stats(**changes: int) -> dict[str, Any]:
    t = {"capacity": 1 << 30, "free": 700 << 20, "reserved": 24 << 20,
         "committed": 300 << 20, "reserved_slots": 3, "committed_slots": 37, "blocks": 37,
         "pinned_blocks": 5, "tail_waste": 4096, "empty_slabs": 2, "hits": 30,
         "lookups": 10, "lookup_keys": 40, "evictions": 7, "commits": 44,
         "duplicates": 2, "aborts": 1, "lease_expiries": 3, "capacity_rejects": 4}
    t.update(changes)
    return t


class FakeDaemon:
    def __init__(self) -> None:
        self.stats: dict[str, Any] = {
            "tiers": {"dram": tier_stats(),
                      "ssd": {"checksum_failures": 2, "evicted_unwritten": 3,
                              "evictions_by_cause": {"capacity": 5, "expired": 1}}},
            "remote": {"writes": 9, "write_backs": 6, "errors": 1},
            "sessions": 3, "namespaces": 2, "invariant_violations": 0,
            "replies": {"dropped_unread": 7, "unread_bytes": 1 << 20},
            "eviction_policies": {"dram": "s3fifo", "ssd": "lru"}}
        self.calls = 0

    def __call__(self) -> Mapping[str, Any]:
        self.calls += 1
        return self.stats


def _serve(metrics: Metrics) -> tuple[int, Callable[[], None]]:
    for _ in range(20):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        probe.close()
        try:
            close = metrics.start_http_server(port)
        except OSError as exc:  # someone took the port between probe and bind
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        assert close is not None
        return port, close
    raise RuntimeError("no free port")


class Scraper:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.text = ""

    def __call__(self) -> Samples:
        with urllib.request.urlopen(self.url, timeout=10) as response:
            assert response.status == 200
            self.text = response.read().decode()
        samples: Samples = {}
        for family in text_string_to_metric_families(self.text):
            for s in family.samples:
                samples[(s.name, frozenset(s.labels.items()))] = s.value
        return samples

    def families(self) -> list[Any]:
        return list(text_string_to_metric_families(self.text))


@pytest.fixture
def daemon() -> FakeDaemon:
    return FakeDaemon()


@pytest.fixture
def metrics(daemon: FakeDaemon) -> Metrics:
    return Metrics(daemon, max_tenants=4)


@pytest.fixture
def scrape(metrics: Metrics) -> Iterator[Scraper]:
    port, close = _serve(metrics)
    yield Scraper(port)
    close()


def v(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_pool_state_equals_the_stats(daemon: FakeDaemon, scrape: Scraper) -> None:
    s = scrape()
    t = daemon.stats["tiers"]["dram"]
    for key, name in (("capacity", "capacity_bytes"), ("free", "free_bytes"),
                      ("reserved", "reserved_bytes"), ("committed", "committed_bytes"),
                      ("tail_waste", "tail_waste_bytes"), ("blocks", "blocks"),
                      ("pinned_blocks", "pinned_blocks"), ("empty_slabs", "empty_slabs"),
                      ("reserved_slots", "reserved_slots"),
                      ("committed_slots", "committed_slots")):
        assert v(s, f"kvstore_pool_{name}", tier="dram") == t[key], name
    assert v(s, "kvstore_pool_peak_committed_bytes", tier="dram") == 300 << 20
    assert v(s, "kvstore_allocation_failures_total", tier="dram") == 4
    assert v(s, "kvstore_sessions") == 3 and v(s, "kvstore_namespaces") == 2
    assert v(s, "kvstore_invariant_violations_total") == 0
    assert ("kvstore_pool_free_bytes", frozenset({("tier", "ssd")})) not in s
    assert v(s, "kvstore_replies_dropped_unread_total") == 7
    assert v(s, "kvstore_replies_unread_bytes") == 1 << 20

    daemon.stats["tiers"]["dram"] = tier_stats(committed=100 << 20)
    daemon.stats["invariant_violations"] = 2
    s = scrape()
    assert v(s, "kvstore_pool_committed_bytes", tier="dram") == 100 << 20
    assert v(s, "kvstore_pool_peak_committed_bytes", tier="dram") == 300 << 20
    assert v(s, "kvstore_invariant_violations_total") == 2
    daemon.stats["tiers"]["dram"] = tier_stats(committed=1, peak_committed=900 << 20)
    assert v(scrape(), "kvstore_pool_peak_committed_bytes", tier="dram") == 900 << 20


def test_reuse_counters_equal_the_stats(daemon: FakeDaemon, scrape: Scraper) -> None:
    s = scrape()
    assert v(s, "kvstore_lookups_total", tier="dram") == 10
    assert v(s, "kvstore_lookup_blocks_total", tier="dram") == 40
    assert v(s, "kvstore_hit_blocks_total", tier="dram") == 30
    assert v(s, "kvstore_lookup_hit_ratio", tier="dram") == 0.75
    assert v(s, "kvstore_committed_blocks_total", tier="dram") == 44
    assert v(s, "kvstore_duplicate_blocks_total", tier="dram") == 2
    assert v(s, "kvstore_aborts_total", tier="dram") == 1
    assert v(s, "kvstore_lease_expiries_total", tier="dram") == 3
    assert v(s, "kvstore_evictions_total", tier="dram", policy="s3fifo", cause="capacity") == 7
    assert v(s, "kvstore_evictions_total", tier="ssd", policy="lru", cause="capacity") == 5
    assert v(s, "kvstore_evictions_total", tier="ssd", policy="lru", cause="expired") == 1
    assert v(s, "kvstore_checksum_failures_total", tier="ssd") == 2
    assert v(s, "kvstore_evicted_unwritten_total", tier="ssd") == 3
    assert v(s, "kvstore_write_backs_total", tier="remote") == 6
    assert v(s, "kvstore_tier_writes_total", tier="remote") == 9


def test_observations_are_exported(metrics: Metrics, scrape: Scraper) -> None:
    for seconds in (0.0001, 0.0002, 0.003):
        metrics.observe_request("lookup", seconds, None, "acme")
    metrics.observe_request("reserve", 0.001, "capacity", "acme")
    metrics.observe_request("reserve", 0.001, None, "globex")
    metrics.observe_lookup_tokens("dram", "acme", 480, 32)
    metrics.observe_transfer("demote", "ssd", 1 << 20, 0.004)
    metrics.observe_transfer("demote", "ssd", 3 << 20, 0.006)
    metrics.set_queue_depth("writeback", 9)
    metrics.observe_queue_wait("reload", "acme", 0.25)
    metrics.observe_defer("dram", "acme")
    metrics.observe_reject("dram", "globex", "pinned")
    s = scrape()
    assert v(s, "kvstore_requests_total", verb="lookup", tenant="acme") == 3
    assert v(s, "kvstore_requests_total", verb="reserve", tenant="acme") == 1
    assert v(s, "kvstore_requests_total", verb="reserve", tenant="globex") == 1
    assert v(s, "kvstore_request_errors_total", verb="reserve", code="capacity",
             tenant="acme") == 1
    assert v(s, "kvstore_request_duration_seconds_count", verb="lookup") == 3
    assert v(s, "kvstore_request_duration_seconds_sum", verb="lookup") == pytest.approx(0.0033)
    assert v(s, "kvstore_request_duration_seconds_bucket", verb="lookup", le="0.00025") == 2
    assert v(s, "kvstore_request_duration_seconds_count", verb="reserve") == 2
    assert v(s, "kvstore_lookup_hit_tokens_total", tier="dram", tenant="acme") == 480
    assert v(s, "kvstore_lookup_missed_tokens_total", tier="dram", tenant="acme") == 32
    assert v(s, "kvstore_transfer_duration_seconds_count", direction="demote", tier="ssd") == 2
    assert v(s, "kvstore_transfer_duration_seconds_sum", direction="demote",
             tier="ssd") == pytest.approx(0.01)
    assert v(s, "kvstore_transfer_size_bytes_sum", direction="demote", tier="ssd") == 4 << 20
    assert v(s, "kvstore_queue_depth", **{"class": "writeback"}) == 9
    assert v(s, "kvstore_queue_wait_seconds_count", **{"class": "reload"}) == 1
    assert v(s, "kvstore_queue_waited_seconds_total", tenant="acme",
             **{"class": "reload"}) == 0.25
    assert v(s, "kvstore_admission_defers_total", tier="dram", tenant="acme") == 1
    assert v(s, "kvstore_admission_rejects_total", tier="dram", tenant="globex",
             cause="pinned") == 1


def test_request_series_read_as_prometheus_client_writes_them(
        metrics: Metrics, scrape: Scraper) -> None:
    """Bucket edges (a value on a bound falls in that bucket), cumulative buckets up to
    +Inf, and each series' ``_created``."""
    for seconds in (50e-6, 50.000001e-6, 2.5, 7.0):
        metrics.observe_request("ping", seconds, None, "acme")
    metrics.observe_lookup_tokens("dram", "acme", 16, 0)
    s = scrape()
    assert v(s, "kvstore_request_duration_seconds_bucket", verb="ping", le="5e-05") == 1
    assert v(s, "kvstore_request_duration_seconds_bucket", verb="ping", le="0.0001") == 2
    assert v(s, "kvstore_request_duration_seconds_bucket", verb="ping", le="2.5") == 3
    assert v(s, "kvstore_request_duration_seconds_bucket", verb="ping", le="+Inf") == 4
    assert v(s, "kvstore_request_duration_seconds_count", verb="ping") == 4
    for name, labels in (("kvstore_requests_created", {"verb": "ping", "tenant": "acme"}),
                         ("kvstore_request_duration_seconds_created", {"verb": "ping"}),
                         ("kvstore_lookup_hit_tokens_created",
                          {"tier": "dram", "tenant": "acme"})):
        assert v(s, name, **labels) > 0, name
    assert ("kvstore_request_errors_total",
            frozenset({("verb", "ping"), ("code", "internal"), ("tenant", "acme")})) not in s


def test_disabling_created_series_hides_every_created(
        metrics: Metrics, scrape: Scraper) -> None:
    """prometheus_client's switch (PROMETHEUS_DISABLE_CREATED_SERIES sets it too) holds for
    the request families counted in plain numbers as for the library's own metrics."""
    prometheus_client.disable_created_metrics()
    try:
        metrics.observe_request("reserve", 0.001, None, "acme")
        metrics.observe_request("reserve", 0.001, "capacity", "acme")
        metrics.observe_lookup_tokens("dram", "acme", 16, 16)
        metrics.observe_defer("dram", "acme")
        s = scrape()
    finally:
        prometheus_client.enable_created_metrics()
    assert v(s, "kvstore_requests_total", verb="reserve", tenant="acme") == 2
    assert v(s, "kvstore_admission_defers_total", tier="dram", tenant="acme") == 1
    assert [name for name, _ in s if name.endswith("_created")] == []
    assert v(scrape(), "kvstore_requests_created", verb="reserve", tenant="acme") > 0


def _counters(s: Samples) -> Samples:
    return {k: val for k, val in s.items() if k[0].endswith("_total")}


def test_counters_only_go_up(daemon: FakeDaemon, metrics: Metrics, scrape: Scraper) -> None:
    metrics.observe_request("ping", 0.0001, None, "acme")
    before = _counters(scrape())
    daemon.stats["tiers"]["dram"] = tier_stats(lookups=15, evictions=9)
    metrics.observe_request("ping", 0.0001, "internal", "acme")
    middle = _counters(scrape())
    # The tier was rebuilt (a reload): its own counters restart from zero.
    daemon.stats["tiers"]["dram"] = tier_stats(lookups=2, evictions=0, hits=0)
    after = _counters(scrape())
    for prev, cur in ((before, middle), (middle, after)):
        for key, value in prev.items():
            assert cur[key] >= value, key
    assert v(middle, "kvstore_lookups_total", tier="dram") == 15
    assert v(after, "kvstore_lookups_total", tier="dram") == 17
    assert v(after, "kvstore_evictions_total", tier="dram", policy="s3fifo", cause="capacity") == 9


def test_names_follow_prometheus_conventions(metrics: Metrics, scrape: Scraper) -> None:
    metrics.observe_request("lookup", 0.001, "malformed", "acme")
    metrics.observe_transfer("reload", "dram", 4096, 0.001)
    metrics.observe_lookup_tokens("dram", "acme", 16, 0)
    metrics.set_queue_depth("reload", 0)
    metrics.observe_queue_wait("reload", "acme", 0.001)
    metrics.observe_defer("dram", "acme")
    metrics.observe_reject("dram", "acme", "full")
    scrape()
    families = scrape.families()
    assert len(families) > 30
    for family in families:
        assert family.name.startswith("kvstore_"), family.name
        if family.type == "counter":
            for s in family.samples:
                assert s.name.endswith(("_total", "_created")), s.name
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_bytes")), family.name
        if family.type == "gauge" and not family.name.endswith("_created"):
            assert not family.name.endswith("_total"), family.name
        assert "tenant" not in family.name


def test_tenants_past_the_cap_share_one_label(metrics: Metrics, scrape: Scraper) -> None:
    for i in range(10):
        metrics.observe_request("ping", 0.0001, None, f"tenant{i}")
    metrics.observe_request("ping", 0.0001, None, "tenant0")
    s = scrape()
    assert v(s, "kvstore_requests_total", verb="ping", tenant="tenant0") == 2
    assert v(s, "kvstore_requests_total", verb="ping", tenant=OTHER_TENANT) == 6
    tenants = {dict(k[1]).get("tenant") for k in s if k[0] == "kvstore_requests_total"}
    assert len(tenants) == 5
    assert "request_series=4" in repr(metrics)


def test_a_failing_stats_source_fails_only_its_part(scrape: Scraper, daemon: FakeDaemon,
                                                    metrics: Metrics) -> None:
    metrics.observe_request("ping", 0.0001, None, "acme")
    daemon.stats = {"tiers": {"dram": {"free": "not a number"}}}
    s = scrape()
    assert v(s, "kvstore_stats_errors_total") == 1
    assert v(s, "kvstore_requests_total", verb="ping", tenant="acme") == 1
    assert ("kvstore_sessions", frozenset()) not in s


def test_registering_does_not_read_the_stats(daemon: FakeDaemon) -> None:
    Metrics(daemon)
    assert daemon.calls == 0


def test_port_zero_is_disabled_and_close_frees_the_port(metrics: Metrics) -> None:
    assert metrics.start_http_server(0) is None
    port, close = _serve(metrics)
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert b"kvstore_pool_free_bytes" in response.read()
    close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_stats_on_loop_reads_on_the_loop_thread() -> None:
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever)
    runner.start()
    seen: list[int] = []

    def stats() -> Mapping[str, Any]:
        seen.append(threading.get_ident())
        return {"sessions": 1}

    try:
        source = stats_on_loop(loop, stats)
        assert source() == {"sessions": 1}
        assert seen == [runner.ident]

        async def from_the_loop() -> Mapping[str, Any]:
            return source()  # must not wait on itself

        assert asyncio.run_coroutine_threadsafe(from_the_loop(), loop).result(5) == {
            "sessions": 1}
        assert seen[-1] == runner.ident
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join()
        loop.close()


def test_stats_on_a_stuck_loop_time_out() -> None:
    loop = asyncio.new_event_loop()  # never run: as stuck as a loop gets
    try:
        source = stats_on_loop(loop, dict, timeout=0.05)
        metrics = Metrics(source)
        text = metrics.exposition().decode()
        assert "kvstore_stats_errors_total 1.0" in text
    finally:
        loop.close()


def test_scrapes_at_once_share_one_page_and_one_after_another_do_not() -> None:
    # each scrape read the stats on the daemon's loop and built its page: 8 threads
    # scraping without pause slowed another client's ping p50 from 0.09 to 10 ms
    daemon = FakeDaemon()
    entered = threading.Event()
    release = threading.Event()

    def slow() -> Mapping[str, Any]:
        entered.set()
        release.wait(10)
        return daemon()

    port, close = _serve(Metrics(slow))
    try:
        scrape = Scraper(port)
        pages: list[Samples] = []
        first = threading.Thread(target=lambda: pages.append(scrape()))
        first.start()
        assert entered.wait(10)  # the first is making its page: the others come now
        others = [threading.Thread(target=lambda: pages.append(Scraper(port)()))
                  for _ in range(7)]
        for thread in others:
            thread.start()
        time.sleep(0.3)
        release.set()
        for thread in (first, *others):
            thread.join(30)
        assert len(pages) == 8 and all(page == pages[0] for page in pages)
        assert daemon.calls < 8  # (1 where all came while the first was under way)
        calls = daemon.calls
        daemon.stats["sessions"] = 5
        assert v(scrape(), "kvstore_sessions") == 5  # one after another: fresh
        assert daemon.calls == calls + 1
    finally:
        release.set()
        close()


def test_a_configured_tenant_keeps_its_label_past_the_cap(daemon: FakeDaemon) -> None:
    # without credentials any client names any tenant: the first names took every
    # label, and a tenant the configuration names was counted as OTHER_TENANT
    metrics = Metrics(daemon, max_tenants=2, known_tenants={"acme"})
    for i in range(5):
        metrics.observe_request("ping", 0.0001, None, f"junk{i}")
    metrics.observe_request("ping", 0.0001, None, "acme")
    metrics.observe_lookup_tokens("dram", "acme", 16, 0)
    port, close = _serve(metrics)
    try:
        s = Scraper(port)()
    finally:
        close()
    assert v(s, "kvstore_requests_total", verb="ping", tenant="acme") == 1
    assert v(s, "kvstore_requests_total", verb="ping", tenant=OTHER_TENANT) == 3
    assert v(s, "kvstore_requests_total", verb="ping", tenant="junk1") == 1
