"""What one client can do to, or learn of, the others through the daemon's shared
surfaces (its counters, its stats, its metrics).  Real daemons and raw sockets."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_proc import DaemonProcess, error_records, free_port
from kvtest import make_identity
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client
from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret
from kvstore.config import load_config
from kvstore.metrics import UNAUTHENTICATED
from kvstore.server import Server


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()


class Raw:
    """A bare DEALER over the daemon's tcp endpoint, with PLAIN credentials when given."""

    def __init__(self, endpoint: str, tenant: str = "", token: str = "") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if token:
            self.sock.plain_username, self.sock.plain_password = tenant.encode(), token.encode()
        self.sock.connect(endpoint)

    def ask(self, msg: p.Message) -> p.Message:
        self.sock.send(p.encoder.encode(msg))
        assert self.sock.poll(10_000), "the daemon did not answer"
        return p.reply_decoder.decode(self.sock.recv_multipart()[0])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def token_daemon(daemon_factory: Any, tmp_path: Path) -> tuple[DaemonProcess, Path, int]:
    """A daemon with a token secret, a tcp endpoint and metrics (behind a bearer token,
    as credentials require)."""
    secret = tmp_path / "secret"
    cli("keygen", "--secret", str(secret))
    metrics_token = tmp_path / "metrics.token"
    metrics_token.write_text(METRICS_TOKEN + "\n")
    config = tmp_path / "auth.toml"
    config.write_text(f'[server]\nmetrics_token_file = "{metrics_token}"\n'
                      f'[auth]\nsecret_file = "{secret}"\noperators = ["ops"]\n'
                      '[auth.shared_tenants]\npublic = ["acme"]\n'
                      '[auth.shared_writers]\npublic = ["acme"]\n')
    port = free_port()
    d = daemon_factory(tcp=True, extra=["--config", str(config), "--slab-size", "1MiB",
                                        "--metrics-port", str(port)])
    return d, secret, port


def token(secret: Path, tenant: str) -> str:
    """What ``kvstore token --secret-file SECRET --tenant TENANT`` prints, without a
    Python start each (these tests ask for a dozen)."""
    return issue_token(read_secret(secret), tenant, 86400.0)


METRICS_TOKEN = "metrics-scraper-token-0123456789"


def scrape_text(port: int) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    return urllib.request.urlopen(request, timeout=10).read().decode()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(scrape_text(port))
            for s in family.samples}


def put_blocks(ns: Any, n: int) -> None:
    """``n`` blocks of random bytes, a chain of ``n`` blocks' tokens."""
    keys = ns.keys(range(n * ns.identity.block_tokens))
    assert len(keys) == n
    ns.put(keys, [os.urandom(ns.block_bytes) for _ in range(n)])


def test_an_oversized_report_is_refused_and_stats_keep_answering(
        token_daemon: tuple[DaemonProcess, Path, int]) -> None:
    d, secret, port = token_daemon
    assert d.tcp_endpoint is not None
    raw = Raw(d.tcp_endpoint, "acme", token(secret, "acme"))
    try:
        assert isinstance(raw.ask(p.Hello(1, p.PROTOCOL_VERSION, "acme", token(secret, "acme"))),
                          p.HelloReply)
        for rid in (2, 3):  # two of them once summed past what msgpack can encode
            reply = raw.ask(p.Report(rid, (1 << 64) - 1))
            assert isinstance(reply, p.ErrorReply) and reply.code == "malformed", reply
            assert reply.rid == rid
        assert isinstance(raw.ask(p.Report(4, p.MAX_REPORTED_TOKENS)), p.OkReply)
        stats = raw.ask(p.Stats(5))
        assert isinstance(stats, p.StatsReply)
        assert "scheduling" not in stats.stats  # the daemon's figures: operators' only
        # a request sent right behind another is answered without a later wake-up
        raw.sock.send(p.encoder.encode(p.Stats(6)))
        raw.sock.send(p.encoder.encode(p.Ping(7)))
        for rid in (6, 7):
            assert raw.sock.poll(5000), f"request {rid} was not answered"
            assert p.reply_decoder.decode(raw.sock.recv_multipart()[0]).rid == rid
    finally:
        raw.close()
    assert scrape(port)[("kvstore_recomputed_tokens_total", ())] == p.MAX_REPORTED_TOKENS
    with Client(d.endpoint, token=token(secret, "globex")) as other:
        seen = other.stats()  # not an operator: none of the whole daemon's figures
        # (replies left unread, a change of eviction policy under way: every tenant's)
        wide = {"scheduling", "tiers", "replies", "eviction_switch", "before_hello"}
        assert not wide & set(seen), sorted(seen)
    with Client(d.endpoint, token=token(secret, "ops")) as ops:  # auth.operators
        assert ops.stats()["scheduling"]["recomputed_tokens"] == p.MAX_REPORTED_TOKENS
        assert wide <= set(ops.stats())
    assert not error_records(d.log())


def test_with_credentials_a_tenant_sees_only_its_own_tenants_figures(
        token_daemon: tuple[DaemonProcess, Path, int]) -> None:
    d, secret, port = token_daemon
    victim_id = make_identity(tenant="globex-secret-customer")
    with Client(d.endpoint, token=token(secret, "globex-secret-customer")) as victim, \
            Client(d.endpoint, token=token(secret, "acme")) as spy:
        ns = victim.namespace(victim_id)
        put_blocks(ns, 8)
        mine = spy.namespace(make_identity(tenant="acme"))
        put_blocks(mine, 3)
        public = spy.namespace(make_identity(tenant="public", model="system-prompt"))
        put_blocks(public, 2)
        seen = spy.stats()
        assert seen["tenant_dram_bytes"] == {"acme": 3 * mine.block_bytes,
                                             "public": 2 * public.block_bytes}
        assert "globex-secret-customer" not in repr(seen)
        # the counts too are of the tenants it may open: its own session's namespaces
        assert (seen["sessions"], seen["namespaces"]) == (1, 2)
        assert victim.stats()["namespaces"] == 1
        assert victim.stats()["tenant_dram_bytes"] == {
            "globex-secret-customer": 8 * ns.block_bytes}
        # nor the whole daemon's counters, which the victim's puts moved
        assert not set(seen) & {"tiers", "scheduling", "ssd_io", "remote", "events"}
        assert set(seen["transfers"]) == {"waits"}
    # the operator's surfaces still show every tenant
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--json", "--endpoint",
                          d.endpoint], capture_output=True, text=True, check=True, timeout=60,
                         env=dict(os.environ, KVSTORE_TOKEN=token(secret, "acme"))).stdout
    assert "globex-secret-customer" not in out and "acme" in out
    assert "globex-secret-customer" in scrape_text(port)


def test_without_credentials_stats_show_every_tenant(daemon: DaemonProcess) -> None:
    with Client(d_endpoint := daemon.endpoint, tenant="globex") as b, \
            Client(d_endpoint, tenant="acme") as a:
        ns = b.namespace(make_identity(tenant="globex"))
        put_blocks(ns, 4)
        assert a.stats()["tenant_dram_bytes"] == {"globex": 4 * ns.block_bytes}


def test_refused_hellos_never_take_a_tenant_label(
        token_daemon: tuple[DaemonProcess, Path, int]) -> None:
    d, secret, port = token_daemon
    assert d.tcp_endpoint is not None
    acme = token(secret, "acme")
    refused = 0
    for c in range(33):  # past the metrics' 256 tenant labels
        raw = Raw(d.tcp_endpoint, "acme", acme)
        try:
            for i in range(8):
                reply = raw.ask(p.Hello(1, p.PROTOCOL_VERSION, f"junk-{c}-{i}-" + "A" * 300,
                                        acme))
                refused += isinstance(reply, p.ErrorReply) and reply.code == "forbidden"
        finally:
            raw.close()
    assert refused == 264
    with Client(d.endpoint, token=token(secret, "newco")) as real:
        ns = real.namespace(make_identity(tenant="newco"))
        for i in range(5):
            ns.lookup([os.urandom(16)])
    samples = scrape(port)
    requests = {labels: v for (name, labels), v in samples.items()
                if name == "kvstore_requests_total"}
    assert requests[(("tenant", "newco"), ("verb", "lookup"))] == 5
    assert requests[(("tenant", UNAUTHENTICATED), ("verb", "hello"))] == 264
    assert not [labels for labels in requests if "junk" in repr(labels)]
    assert not [labels for labels in requests if ("tenant", "_other") in labels]


@pytest.fixture
def in_process(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    """A Server on a loop in a thread of this process, to reach inside it."""
    endpoint = f"ipc://{tmp_path / 'kv.sock'}"
    config = load_config(env={}, overrides={
        "server": {"endpoint": endpoint},
        "dram": {"capacity": "8MiB", "slab_size": "1MiB", "directory": str(tmp_path),
                 "populate": False},
        "ssd": {"capacity": "0"}})
    server = Server(config)
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(
        server.serve(lambda s: ready.set())), daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield server, endpoint
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(30)
        loop.close()


def test_a_reply_that_cannot_be_encoded_becomes_an_internal_error(
        in_process: tuple[Server, str]) -> None:
    server, endpoint = in_process
    raw = Raw(endpoint)
    try:
        assert isinstance(raw.ask(p.Hello(1, p.PROTOCOL_VERSION, "acme")), p.HelloReply)
        server.scheduling["defers"] = 1 << 64  # a bug: a figure msgpack cannot carry
        raw.sock.send(p.encoder.encode(p.Stats(2)))
        raw.sock.send(p.encoder.encode(p.Ping(3)))  # queued right behind it
        assert raw.sock.poll(5000)
        reply = p.reply_decoder.decode(raw.sock.recv_multipart()[0])
        assert isinstance(reply, p.ErrorReply) and reply.code == "internal", reply
        assert reply.rid == 2
        assert raw.sock.poll(5000), "the request behind the failed reply was not answered"
        assert isinstance(p.reply_decoder.decode(raw.sock.recv_multipart()[0]), p.OkReply)
        server.scheduling["defers"] = 0
        assert isinstance(raw.ask(p.Stats(4)), p.StatsReply)
    finally:
        raw.close()


def test_a_reply_from_a_task_that_cannot_be_encoded_becomes_an_internal_error(
        in_process: tuple[Server, str]) -> None:
    # replies a request's task finishes (not the drain) go out through the same send:
    # one that cannot be encoded raised inside that task, and its client heard nothing
    server, endpoint = in_process
    raw = Raw(endpoint)
    try:
        assert isinstance(raw.ask(p.Hello(1, p.PROTOCOL_VERSION, "acme")), p.HelloReply)
        [peer] = list(server.sessions.by_connection)
        assert server._loop is not None
        server._loop.call_soon_threadsafe(  # as a task's reply is sent
            server.transport.send, peer, p.StatsReply(7, {"defers": 1 << 64}), [])
        assert raw.sock.poll(5000), "no reply came"
        reply = p.reply_decoder.decode(raw.sock.recv_multipart()[0])
        assert isinstance(reply, p.ErrorReply) and reply.code == "internal", reply
        assert reply.rid == 7
        assert isinstance(raw.ask(p.Ping(8)), p.OkReply)
    finally:
        raw.close()


def test_a_reserve_batch_of_too_many_plan_items_is_refused_before_any_work(
        token_daemon: tuple[DaemonProcess, Path, int]) -> None:
    """A plan's length is checked first: 200k empty items took the loop half a second."""
    d, secret, _ = token_daemon
    assert d.tcp_endpoint is not None
    with Client(d.endpoint, token=token(secret, "acme")) as c:
        ns = c.namespace(make_identity(tenant="acme"))
        limit = c.hello.max_keys if c.hello is not None else 0
        raw = Raw(d.tcp_endpoint, "acme", token(secret, "acme"))
        try:
            assert isinstance(raw.ask(p.Hello(1, p.PROTOCOL_VERSION, "acme",
                                              token(secret, "acme"))), p.HelloReply)
            opened = raw.ask(p.OpenNamespace(2, ns.identity))
            assert isinstance(opened, p.NamespaceReply)
            plan = [p.PlanItem(0, 0, [])] * (limit + 1)
            reply = raw.ask(p.ReserveBatch(3, opened.ns, plan))
            assert isinstance(reply, p.ErrorReply) and reply.code == "too_large", reply
            assert f"{limit + 1} plan items" in reply.message
            ok = raw.ask(p.ReserveBatch(4, opened.ns, plan[:limit]))
            assert isinstance(ok, p.BatchReply) and ok.admitted
        finally:
            raw.close()
    with Client(d.endpoint, token=token(secret, "ops")) as ops:
        assert ops.stats()["tiers"]["dram"]["reserved_slots"] == 0
