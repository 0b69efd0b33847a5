"""Operations against the real daemon: metrics over HTTP, systemd notifications."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import free_port
from kvtest import make_identity
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_equal_what_the_workload_implies(daemon_factory: Any) -> None:
    ident = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB blocks
    port = free_port()
    d = daemon_factory(dram_capacity=str(8 * ident.block_bytes),
                       extra=["--slab-size", str(8 * ident.block_bytes),
                              "--metrics-port", str(port)])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        keys = ns.keys(range(16 * 8))
        ns.put(keys, [os.urandom(ns.block_bytes) for _ in keys])        # 8 committed
        assert ns.lookup(keys).blocks == 8                                # 8 hit blocks
        assert ns.lookup(ns.keys(range(5000, 5000 + 16 * 3))).blocks == 0  # 3 missed
        ns.put(ns.keys(range(9000, 9000 + 16 * 2)), [bytes(ns.block_bytes)] * 2)  # 2 evicted
        try:
            ns.get(ns.keys(range(7000, 7016)))
        except KeyError:
            pass
        before = scrape(port)
        assert value(before, "kvstore_pool_committed_bytes", tier="dram") == \
            8 * ns.block_bytes
        assert value(before, "kvstore_pool_reserved_bytes", tier="dram") == 0
        assert value(before, "kvstore_evictions_total", tier="dram", policy="auto",
                     cause="capacity") == 2
        assert value(before, "kvstore_lookup_hit_tokens_total", tier="dram", tenant="acme") \
            == 8 * 16
        assert value(before, "kvstore_invariant_violations_total") == 0
        assert value(before, "kvstore_requests_total", verb="put", tenant="acme") == 2
        assert value(before, "kvstore_request_errors_total", verb="get", tenant="acme",
                     code="not_found") == 1
        client.report(recomputed_tokens=48)
        ns.lookup(keys[:4])
        after = scrape(port)
        assert value(after, "kvstore_recomputed_tokens_total") == 48
        for (name, labels), v in before.items():
            if name.endswith("_total"):
                assert after[(name, labels)] >= v, name   # counters only go up


def test_systemd_notifications(daemon_factory: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(15)
    d = daemon_factory(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    try:
        got: list[str] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and sum("WATCHDOG=1" in g for g in got) < 2:
            got.append(sock.recv(4096).decode())
        assert any("READY=1" in g for g in got), got
        assert sum("WATCHDOG=1" in g for g in got) >= 2, got
        with Client(d.endpoint, tenant="acme") as client:
            client.ping()   # READY came after the socket serves
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        while True:
            message = sock.recv(4096).decode()
            if "STOPPING=1" in message:
                break
        assert d.proc.wait(10) == 0
    finally:
        sock.close()


@pytest.mark.parametrize("spoil", ["latin-1", "directory", "fifo", "nested"])
def test_a_reload_of_an_unreadable_config_is_refused_and_still_says_ready(
        daemon_factory: Any, tmp_path: Path, spoil: str) -> None:
    """SIGHUP with a config file that is not UTF-8, a directory, a FIFO, or values nested
    thousands deep (a RecursionError's traceback, the reload left half done): the reload is
    refused with a logged reason, systemd hears READY=1 after RELOADING=1 (it failed the
    unit's reload without it), and the daemon keeps serving (a FIFO with no writer held
    its event loop for ever)."""
    config = tmp_path / "kvstore.toml"
    config.write_text("[server]\nmax_reservations_per_session = 2\n")
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(15)
    d = daemon_factory(extra=["--config", str(config)], env={"NOTIFY_SOCKET": path})
    try:
        while "READY=1" not in sock.recv(4096).decode():
            pass
        config.unlink()
        if spoil == "latin-1":
            config.write_bytes("# caf\xe9\n[server]\n".encode("latin-1"))
        elif spoil == "directory":
            config.mkdir()
        elif spoil == "nested":
            config.write_text("a = " + "[" * 50000 + "]" * 50000 + "\n")
        else:
            os.mkfifo(config)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        got = [sock.recv(4096).decode()]
        assert "RELOADING=1" in got[0], got
        sock.settimeout(5)
        got.append(sock.recv(4096).decode())
        assert "READY=1" in got[1], got
        with Client(d.endpoint, tenant="acme", timeout=5) as client:
            client.ping()
        log = d.log()
        assert "reload refused" in log and str(config) in log, log
        assert "Traceback" not in log, log
    finally:
        sock.close()


def test_transfer_metrics_count_ssd_traffic(daemon_factory: Any) -> None:
    ident = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB
    port = free_port()
    d = daemon_factory(dram_capacity=str(8 * ident.block_bytes), ssd_capacity="32MiB",
                       extra=["--slab-size", str(8 * ident.block_bytes),
                              "--metrics-port", str(port)])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        chains = [ns.keys(range(10**6 * i, 10**6 * i + 16 * 4)) for i in range(8)]
        for keys in chains:
            ns.put(keys, [os.urandom(ns.block_bytes) for _ in keys])
        # 32 blocks through 8 DRAM slots: the first chain has long left DRAM for the SSD
        assert set(ns.lookup(chains[0]).tiers) == {"ssd"}
        ns.get(chains[0])                                         # promoted back

        def moved(stats: dict[str, Any]) -> tuple[int, int]:
            return stats["tiers"]["dram"]["promotions"], stats["tiers"]["ssd"]["writes"]

        for _ in range(100):  # a scrape with no demotion or promotion around it
            stats = client.stats()
            samples = scrape(port)
            if moved(client.stats()) == moved(stats):
                break
            time.sleep(0.05)
        assert value(samples, "kvstore_promotions_total", tier="dram") == \
            stats["tiers"]["dram"]["promotions"] > 0
        assert value(samples, "kvstore_tier_writes_total", tier="ssd") == \
            stats["tiers"]["ssd"]["writes"] > 0
        moved = value(samples, "kvstore_transfer_size_bytes_sum", direction="promote",
                      tier="ssd")
        assert moved == stats["tiers"]["dram"]["promotions"] * ns.block_bytes
