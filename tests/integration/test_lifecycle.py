"""Lifecycle against the real daemon: SIGHUP reload, SIGTERM drain under load, the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import LimitExceededError

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB


def test_sighup_changes_a_limit_live_and_names_what_needs_a_restart(
        daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text("[server]\nmax_reservations_per_session = 2\n")
    d = daemon_factory(extra=["--config", str(config)])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        held = [ns.reserve(ns.keys(range(i * 16, (i + 1) * 16))) for i in range(2)]
        with pytest.raises(LimitExceededError):
            ns.reserve(ns.keys(range(100, 116)))
        config.write_text("[server]\nmax_reservations_per_session = 5\n"
                          "[dram]\nslab_size = \"32MiB\"\n")
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while True:
            try:
                third = ns.reserve(ns.keys(range(100, 116)))
                break
            except LimitExceededError:
                assert time.monotonic() < deadline, "the reload did not take effect"
                time.sleep(0.05)
        for r in [*held, third]:
            r.abort()
    deadline = time.monotonic() + 5
    while "dram.slab_size" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "need a restart" in d.log() and "dram.slab_size" in d.log()


WRITER = r"""
import sys, hashlib
sys.path[:0] = [sys.argv[3]]
from kvtest import make_identity
from kvstore import Client
ident = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)
acked = open(sys.argv[2], "a")
try:
    with Client(sys.argv[1], tenant="acme", timeout=5) as c:
        ns = c.namespace(ident)
        for i in range(100_000):
            keys = ns.keys(range(i * 64, (i + 1) * 64))
            blocks = [hashlib.blake2b(k).digest() * (ident.block_bytes // 64) for k in keys]
            ns.put(keys, blocks)
            acked.write(f"{i}\n"); acked.flush()
except Exception as exc:
    print("stopped:", type(exc).__name__, exc, flush=True)
"""


def test_sigterm_under_load_loses_no_committed_block(daemon_factory: Any,
                                                     tmp_path: Path) -> None:
    d = daemon_factory(ssd_capacity="256MiB", dram_capacity="16MiB",
                       extra=["--slab-size", "4MiB", "--ssd-write-policy", "write-through"])
    acked = tmp_path / "acked.txt"
    tests_dir = str(Path(__file__).parent.parent)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, d.endpoint,
                                 str(acked) + str(w), tests_dir],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for w in range(2)]
    deadline = time.monotonic() + 30
    while sum(len(Path(str(acked) + str(w)).read_text().split()) if
              Path(str(acked) + str(w)).exists() else 0 for w in range(2)) < 20:
        assert time.monotonic() < deadline, "the writers did not get going"
        time.sleep(0.05)
    assert d.stop(signal.SIGTERM) == 0                        # drains and exits cleanly
    for w in writers:
        w.wait(30)
        assert w.stdout is not None
        w.stdout.close()
    d.start()
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        count = 0
        for w in range(2):
            for line in Path(str(acked) + str(w)).read_text().split():
                i = int(line)
                keys = ns.keys(range(i * 64, (i + 1) * 64))
                import hashlib
                want = [hashlib.blake2b(k).digest() * (IDENT.block_bytes // 64) for k in keys]
                assert ns.get(keys) == want, f"acknowledged put {i} was lost"
                count += 1
        assert count >= 20
        t = client.stats()["tiers"]["dram"]
        assert t["reserved_slots"] == 0


def kvstore_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_cli_ping_stats_and_drop_namespace(daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        keys = ns.keys(range(16 * 3))
        ns.put(keys, [bytes(IDENT.block_bytes)] * 3)
    assert "pong" in kvstore_cli("ping", "--endpoint", d.endpoint).stdout
    out = kvstore_cli("stats", "--json", "--endpoint", d.endpoint)
    stats = json.loads(out.stdout)
    assert stats["tiers"]["dram"]["blocks"] == 3
    view = kvstore_cli("stats", "--endpoint", d.endpoint).stdout
    assert "dram" in view and "blocks=3" in view
    identity = msgspec.json.encode(IDENT).decode()
    dropped = kvstore_cli("drop-namespace", "--identity", identity, "--endpoint", d.endpoint)
    assert dropped.returncode == 0 and "dropped 3 blocks" in dropped.stdout, dropped.stderr
    assert json.loads(kvstore_cli("stats", "--json", "--endpoint", d.endpoint).stdout)[
        "tiers"]["dram"]["blocks"] == 0


@pytest.mark.parametrize("text,field", [
    ("[dram]\ncapacity = \"lots\"\n", "dram.capacity"),
    ("[dram]\neviction_policy = \"random\"\n", "dram.eviction_policy"),
    ("[server]\nlease_seconds = -1\n", "server.lease_seconds"),
    ("[server]\nmetrics_port = 70000\n", "server.metrics_port"),
    ("[server]\nendpoint = \"http://x\"\n", "server.endpoint"),
    ("[server]\nlog_format = \"xml\"\n", "server.log_format"),
    ("[ssd]\nwrite_policy = \"sometimes\"\n", "ssd.write_policy"),
    ("[ssd]\nsync = \"maybe\"\n", "ssd.sync"),
    ("[remote]\ntimeout_s = 0\n", "remote.timeout_s"),
    ("[server]\nmax_keys_per_request = \"many\"\n", "server.max_keys_per_request"),
    ("[dram]\nno_such_field = 1\n", "dram"),
    ("[remote]\nwrite_policy = \"later\"\n", "remote.write_policy"),
    ("[gpu]\ndevice = \"gpu0\"\n", "gpu.device"),
    ("[gpu]\ndevice = \"cpu\"\n[dram]\nper_tenant_arenas = true\n", "gpu.device"),
    ("[auth]\npeer_tenants = { \"0\" = \"acme\" }\n[dram]\nper_tenant_arenas = false\n",
     "dram.shared_arena_with_credentials"),
    ("[dram]\nper_tenant_arenas = \"sometimes\"\n", "dram.per_tenant_arenas"),
    ("[gpu]\ndevice = \"0\"\ncapacity = \"1KiB\"\n", "gpu.capacity"),
    ("[dram]\ntenant_quota = \"2GiB\"\n", "dram.tenant_quota"),
    ("[server]\ntenant_weights = { a = 0 }\n", "server.tenant_weights"),
    ("[server]\nmax_transfers_in_flight = 0\n", "server.max_transfers_in_flight"),
    ("[server\n", "not valid TOML"),
    pytest.param("a = " + "[" * 50000 + "]" * 50000 + "\n", "nests its values too deeply",
                 id="nested-50000-deep"),
])
def test_every_config_error_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = kvstore_cli("config", "check", str(path))
    assert result.returncode == 2
    assert field in result.stderr, result.stderr


def test_json_logs_carry_request_ids(daemon_factory: Any) -> None:
    d = daemon_factory(extra=["--log-format", "json", "--log-level", "debug"])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        with pytest.raises(KeyError):
            ns.get(ns.keys(range(16)))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        records = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
        failed = [r for r in records if r.get("verb") == "get"]
        if failed:
            break
        time.sleep(0.05)
    assert failed and failed[0]["rid"] > 0 and failed[0]["tenant"] == "acme"
    assert {"time", "level", "logger", "message"} <= set(failed[0])


def test_limits_answer_at_once_and_spare_other_clients(daemon_factory: Any,
                                                       tmp_path: Path) -> None:
    config = tmp_path / "limits.toml"
    config.write_text("[server]\nmax_requests_per_second = 50\nmax_pins_per_tenant = 2\n")
    d = daemon_factory(extra=["--config", str(config)])
    with Client(d.endpoint, tenant="acme") as a, Client(d.endpoint, tenant="acme") as a2, \
            Client(d.endpoint, tenant="globex") as g:
        ns = a.namespace(IDENT)
        keys = ns.keys(range(64))
        ns.put(keys, [bytes(IDENT.block_bytes)] * 4)
        limited = 0
        started = time.monotonic()
        for _ in range(200):                         # far over 50 per second
            try:
                a.ping()
            except LimitExceededError:
                limited += 1
        assert limited > 100 and time.monotonic() - started < 5, "refused at once, no stall"
        g.ping()                                     # another session is not slowed
        time.sleep(1.1)
        ns2 = a2.namespace(IDENT)
        held = [ns2.acquire(keys[:1]), ns2.acquire(keys[:2])]
        with pytest.raises(LimitExceededError, match="tenant 'acme'"):
            ns2.acquire(keys[:3])                    # the tenant's third pin
        ns_g = g.namespace(make_identity(num_layers=4, num_kv_heads=4, head_dim=64,
                                         tenant="globex"))
        ns_g.put(ns_g.keys(range(16)), [bytes(IDENT.block_bytes)])
        with ns_g.acquire(ns_g.keys(range(16))):     # another tenant's pins are its own
            pass
        for _ in range(100):                         # a2's requests run over the limit ...
            try:
                a2.ping()
            except LimitExceededError:
                pass
        for h in held:
            h.release()                              # ... but releases are never refused
        time.sleep(1.1)
        assert a2.stats()["tiers"]["dram"]["pinned_blocks"] == 0


def test_a_tenant_rate_cap_spans_its_sessions(daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "tenant-rate.toml"
    config.write_text("[server]\nmax_requests_per_second_per_tenant = 40\n")
    d = daemon_factory(extra=["--config", str(config)])
    with Client(d.endpoint, tenant="acme") as a1, Client(d.endpoint, tenant="acme") as a2, \
            Client(d.endpoint, tenant="globex") as g:
        limited = 0
        for _ in range(60):                          # 120 requests from two sessions
            for client in (a1, a2):
                try:
                    client.ping()
                except LimitExceededError as exc:
                    assert "tenant 'acme'" in str(exc)
                    limited += 1
        assert limited >= 60
        for _ in range(20):
            g.ping()                                 # another tenant has its own bucket


def test_a_killed_daemons_arena_is_swept_by_the_next_start(daemon_factory: Any,
                                                           tmp_path: Path) -> None:
    """SIGKILL leaves the shared-memory arena behind; the next daemon on that directory
    removes it, and leaves alone the arena of a daemon that still runs."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"KVSTORE_DRAM_DIRECTORY": str(shm)}
    running = daemon_factory(env=env)
    killed = daemon_factory(env=env)
    arenas = {p.name for p in shm.iterdir()}
    assert len(arenas) == 2
    assert killed.proc is not None
    killed_pid = killed.proc.pid
    killed.stop(signal.SIGKILL)
    leftover = [a for a in arenas if f"-{killed_pid}-" in a]
    assert leftover and (shm / leftover[0]).exists()
    unrelated = shm / "kvstore-notes.txt"      # not an arena name: never touched
    unrelated.write_text("keep")
    daemon_factory(env=env)
    names = {p.name for p in shm.iterdir()}
    assert leftover[0] not in names
    assert (arenas - set(leftover)) <= names    # the running daemon's arena stays
    assert unrelated.exists() and len(names) == 3
    with Client(running.endpoint, tenant="acme") as client:
        ns = client.namespace(IDENT)
        keys = ns.keys(range(64))
        ns.put(keys, [bytes(IDENT.block_bytes)] * len(keys))
        assert ns.lookup(keys).blocks == len(keys)
