"""The server's parts: the verb table, the sessions' per-tenant counts, the live settings."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, get_args

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client
from kvstore import protocol as p
from kvstore.config import LIVE_SETTINGS, Config, ServerConfig
from kvstore.errors import LeaseExpiredError, LimitExceededError
from kvstore.keys import chain_keys
from kvstore.server import Server
from kvstore.sessions import Sessions
from kvstore.store import BlockStore, Limits

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB


def test_every_request_type_has_exactly_one_handler() -> None:
    verbs = Server(Config()).verbs
    requests = get_args(p.Request)
    assert set(verbs.table) == set(requests) and len(verbs.table) == len(requests)
    handlers = list(verbs.table.values())
    assert len(set(handlers)) == len(handlers), "a handler serves two request types"
    for request_type, name in verbs.names.items():
        assert name == request_type.__struct_config__.tag


def _sessions(now: list[float], **caps: int) -> tuple[BlockStore, Sessions]:
    slot = IDENT.block_bytes
    store = BlockStore(64 * slot, 16 * slot, limits=Limits(lease_seconds=5.0))
    sessions = Sessions(store, ServerConfig(**caps), clock=lambda: now[0],
                        max_bytes_in_flight=1 << 30, max_tenant_bytes_in_flight=0)
    return store, sessions


def test_bytes_in_flight_admit_below_the_limit_and_what_holds_nothing() -> None:
    """A request is admitted while what is under way is below the limit (one larger than
    the limit alone too), refused at it, except one that holds nothing (a drop that
    waits for sends); what goes back makes room again."""
    now = [0.0]
    _, sessions = _sessions(now)
    sessions.max_bytes_in_flight = 8
    s = sessions.hello(b"\0a", "acme", "")
    sessions.hold_bytes(s, 12)  # larger than the limit: alone, admitted
    with pytest.raises(LimitExceededError):
        sessions.hold_bytes(s, 1)
    sessions.hold_bytes(s, 0)  # holds nothing: never refused
    sessions.release_bytes(s, 12)
    sessions.hold_bytes(s, 7)
    sessions.hold_bytes(s, 5)  # 7 under way, below 8: admitted (at most limit + one)
    assert s.bytes_in_flight == 12


def test_tenant_caps_span_sessions_and_come_back_when_a_session_expires() -> None:
    now = [0.0]
    store, sessions = _sessions(now, max_reservations_per_tenant=2, max_pins_per_tenant=2)
    a = sessions.hello(b"\0a", "acme", "")
    b = sessions.hello(b"\0b", "acme", "")
    g = sessions.hello(b"\0g", "globex", "")
    assert sessions.hello(b"\0a2", "acme", a.id) is a  # an attached connection
    ns = store.open_namespace(IDENT)
    chains = [chain_keys(ns.id, list(range(i * 16, (i + 1) * 16)), 16) for i in range(4)]

    def reserve(session: Any, chain: int) -> int:
        sessions.check_cap(session, "reservations")
        rid = store.reserve(session.id, ns, chains[chain], None, now[0]).id
        sessions.counted(session)
        return rid

    first = reserve(a, 0)
    reserve(b, 1)
    with pytest.raises(LimitExceededError, match="tenant 'acme' holds 2 reservations"):
        sessions.check_cap(a, "reservations")
    sessions.check_cap(g, "reservations")            # another tenant's count is its own
    store.commit(a.id, first, now[0])
    sessions.counted(a)
    sessions.check_cap(b, "reservations")            # the commit gave one back
    sessions.check_invariants()

    for session in (a, b):
        sessions.check_cap(session, "pins")
        store.acquire(session.id, ns, chains[0], now[0])
        sessions.counted(session)
    with pytest.raises(LimitExceededError, match="tenant 'acme' holds 2 pins"):
        sessions.check_cap(a, "pins")
    sessions.check_invariants()

    now[0] = 10.0                                    # b's lease runs out; a renewed its own
    store.touch_owner(a.id, now[0])
    store.touch_owner(g.id, now[0])
    sessions.forget(set(store.expire(now[0])))
    sessions.check_cap(a, "pins")                    # b's pin and reservation came back
    sessions.check_cap(a, "reservations")
    assert sessions.tenants["acme"].pins == 1 and sessions.tenants["acme"].reservations == 0
    sessions.check_invariants()
    with pytest.raises(LeaseExpiredError):
        sessions.get(b"\0b")
    assert sessions.get(b"\0a2") is a and len(sessions) == 2


def test_a_tenant_pin_cap_spans_sessions_and_a_gone_session_gives_back(
        daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "caps.toml"
    config.write_text("[server]\nmax_pins_per_tenant = 2\n")
    d = daemon_factory(lease=1.5, extra=["--config", str(config)])
    with Client(d.endpoint, tenant="acme") as a2:
        ns2 = a2.namespace(IDENT)
        keys = ns2.keys(range(64))
        ns2.put(keys, [bytes(IDENT.block_bytes)] * 4)
        a1 = Client(d.endpoint, tenant="acme")
        try:
            kept = a1.namespace(IDENT).acquire(keys[:1])  # one pin each, in two sessions
            held = ns2.acquire(keys[:2])
            with pytest.raises(LimitExceededError, match="tenant 'acme' holds 2 pins"):
                ns2.acquire(keys[:3])
        finally:
            a1.close()                               # gone without releasing its pin
        deadline = time.monotonic() + 10
        while True:
            a2.ping()                                # a2 keeps its own lease
            try:
                ns2.acquire(keys[:3]).release()      # a1's pin came back with its lease
                break
            except LimitExceededError:
                assert time.monotonic() < deadline, "the expired session kept its count"
                time.sleep(0.2)
        held.release()
        assert a2.stats()["sessions"] == 1 and not kept.released


# A value for each live setting, different from the running one; keep in step with the
# table (the first assertion below says when it is not).
RELOADED = {
    ("server", "lease_seconds"): 12.5,
    ("server", "max_keys_per_request"): 1000,
    ("server", "max_reservations_per_session"): 77,
    ("server", "max_pins_per_session"): 88,
    ("server", "log_level"): "info",
    ("server", "log_format"): "json",
    ("server", "debug_invariants"): True,
    ("server", "max_requests_per_second"): 5000.0,
    ("server", "max_reservations_per_tenant"): 500,
    ("server", "max_pins_per_tenant"): 600,
    ("server", "max_namespaces_per_session"): 99,
    ("server", "max_namespaces_per_tenant"): 700,
    ("server", "max_sessions_per_tenant"): 800,
    ("server", "max_requests_per_second_per_tenant"): 9000.0,
    ("server", "stop_seconds"): 30.0,
    ("server", "max_bytes_in_flight"): 3 << 20,
    ("server", "max_bytes_in_flight_per_tenant"): 5 << 20,
    ("server", "max_bytes_in_flight_total"): 7 << 20,
    ("auth", "grantee_pin_share"): 0.5,
    ("auth", "grantee_pin_total"): 0.75,
    ("ssd", "admit_after"): 3,
    ("dram", "eviction_policy"): "arc",
}


def _toml(values: dict[tuple[str, str], Any]) -> str:
    sections: dict[str, list[str]] = {}
    for (section, field), value in values.items():
        sections.setdefault(section, []).append(f"{field} = {json.dumps(value)}")
    return "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())


def test_a_reload_applies_every_live_setting(tmp_path: Path) -> None:
    assert set(RELOADED) == set(LIVE_SETTINGS), "RELOADED must name every live setting"
    d = DaemonProcess(tmp_path / "daemon", debug_invariants=False)
    fixed = {("server", "endpoint"): d.endpoint, ("dram", "capacity"): "32MiB",
             ("ssd", "path"): str(tmp_path / "ssd"), ("ssd", "capacity"): "16MiB",
             ("server", "log_level"): "warning"}
    config = tmp_path / "kvstore.toml"
    config.write_text(_toml(fixed))
    # only the file: flags would override it on reload, too
    d.args = [sys.executable, "-m", "kvstore", "serve", "--config", str(config)]
    try:
        d.start()
        with Client(d.endpoint, tenant="acme") as client:
            running = client.stats()["settings"]
            assert set(running) == {f"{s}.{f}" for s, f in LIVE_SETTINGS}
            expected = {f"{s}.{f}": v for (s, f), v in RELOADED.items()}
            assert all(running[k] != v for k, v in expected.items()), running
            config.write_text(_toml({**fixed, **RELOADED}))
            assert d.proc is not None
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while (now := client.stats()["settings"]) != expected:
                assert time.monotonic() < deadline, f"not applied: {now}"
                time.sleep(0.05)
        deadline = time.monotonic() + 5
        while "reloaded the configuration" not in d.log():  # and nothing needs a restart
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
    finally:
        d.stop()
