"""What an operator sees of a daemon under bad or heavy traffic, against a real daemon
process: ``kvstore stats`` for each tenant under credentials, the metrics of requests
that cannot be decoded, and the engine's log while the daemon keeps refusing it."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_proc import DaemonProcess, free_port
from kvtest import make_identity

from kvstore import Client
from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret
from kvstore.errors import LimitExceededError
from kvstore.integrations import daemon_link
from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings


def cli(*args: str, token: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KVSTORE_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.fixture
def token_daemon(daemon_factory: Callable[..., DaemonProcess],
                 tmp_path: Path) -> tuple[DaemonProcess, bytes]:
    """A daemon that takes tokens, acme its operator; and its secret."""
    secret_file = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "kvstore", "keygen", "--secret", str(secret_file)],
                   check=True, capture_output=True, timeout=60)
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\noperators = ["acme"]\n')
    d = daemon_factory(extra=["--config", str(config)])
    return d, read_secret(secret_file)


def test_stats_shows_a_tenant_that_is_no_operator_its_own_figures(
        token_daemon: tuple[DaemonProcess, bytes]) -> None:
    """``kvstore stats`` of a tenant that is not an operator was a KeyError traceback:
    the daemon leaves the whole daemon's figures (``tiers`` among them) out of its
    stats, and the view read them unconditionally."""
    d, secret = token_daemon
    for tenant in ("acme", "globex"):
        with Client(d.endpoint, token=issue_token(secret, tenant, 600)) as client:
            ns = client.namespace(make_identity(tenant=tenant))
            ns.put(ns.keys(range(32)), [b"\1" * ns.block_bytes] * 2)
    operator = cli("stats", "--endpoint", d.endpoint, token=issue_token(secret, "acme", 600))
    assert operator.returncode == 0, operator.stderr
    assert "dram" in operator.stdout and "invariant violations=0" in operator.stdout
    shown = cli("stats", "--endpoint", d.endpoint, token=issue_token(secret, "globex", 600))
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr and shown.stderr == ""
    assert "globex" in shown.stdout and "acme" not in shown.stdout  # its own only
    assert "sessions=1" in shown.stdout
    assert "auth.operators" in shown.stdout  # says why the daemon's figures are not there


def test_an_engine_logs_a_refusal_repeated_at_every_step_once_in_a_while(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A daemon refusing every request (here its rate limit) wrote a warning in the
    engine's log for each failed step: 2,000 lookups, 2,000 lines.  Now the first of each
    kind at once, then one every 10 s saying how many more were held back."""
    config = tmp_path / "limits.toml"
    config.write_text("[server]\nmax_requests_per_second = 5\n")
    d = daemon_factory(extra=["--config", str(config)])
    now = [0.0]
    link = DaemonLink(DaemonSettings(endpoint=d.endpoint, tenant="acme", timeout=5.0),
                      clock=lambda: now[0])
    ident = make_identity()

    refused = {"lookup": 0, "save": 0}

    def step(what: str, i: int) -> None:
        ns = link.namespace("a", lambda: ident)
        assert ns is not None
        try:
            if what == "lookup":
                ns.lookup([i.to_bytes(16, "big")])
            else:
                ns.put([i.to_bytes(16, "big")], [b"\1" * ns.block_bytes])
        except LimitExceededError as exc:
            refused[what] += 1
            link.failed(what if what == "lookup" else f"save for request {i}", exc)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == daemon_link.__name__ and r.levelname == "WARNING"]

    try:
        with caplog.at_level("WARNING", logger=daemon_link.__name__):
            for i in range(300):
                step("lookup", i)
            assert refused["lookup"] >= 250  # (5 a second pass)
            assert len(warnings()) == 1 and "requests per second" in warnings()[0]
            while not refused["save"]:  # another kind of step: seen at once
                step("save", 1)
            assert len(warnings()) == 2 and "save for request 1" in warnings()[1]
            now[0] += 10.5
            held = refused["lookup"] - 1
            while len(warnings()) == 2:  # (a lookup may pass: the limit's next second)
                step("lookup", 301)
            assert f"({held} more like this in the last 10 s)" in warnings()[2]
            assert link.failures == refused["lookup"] + refused["save"]
    finally:
        link.close()


def test_requests_a_session_sends_that_cannot_be_decoded_count_as_its_tenants(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    """Headers that do not decode, sent by a connection with a session, were counted as
    ``_unauthenticated`` in the metrics (the label of peers without a session): an
    operator looking for the tenant whose client is broken was sent after a stranger.
    A refused hello's self-named tenant still takes no label."""
    port = free_port()
    d = daemon_factory(extra=["--metrics-port", str(port)])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(d.endpoint)
        sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "broken-client")))
        assert sock.poll(10_000) and isinstance(p.reply_decoder.decode(sock.recv()),
                                                p.HelloReply)
        for _ in range(50):
            sock.send(b"\x93\xa4junk\x01\x02")           # no verb's header
            assert sock.poll(10_000)
            reply = p.reply_decoder.decode(sock.recv())
            assert isinstance(reply, p.ErrorReply) and reply.code == "malformed"
        stranger.connect(d.endpoint)
        stranger.send(p.encoder.encode(p.Hello(1, 999, "self-named")))  # refused
        assert stranger.poll(10_000) and isinstance(
            p.reply_decoder.decode(stranger.recv()), p.ErrorReply)
        stranger.send(b"\x93\xa4junk\x01\x02")        # and junk, without a session
        assert stranger.poll(10_000)
        stranger.recv()
    finally:
        sock.close()
        stranger.close()
        ctx.term()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in body.splitlines() if line.startswith("kvstore_request")}
    assert series['kvstore_requests_total{tenant="broken-client",verb="invalid"}'] == 50
    assert series['kvstore_request_errors_total{code="malformed",tenant="broken-client",'
                  'verb="invalid"}'] == 50
    assert series['kvstore_requests_total{tenant="_unauthenticated",verb="invalid"}'] == 1
    assert 'tenant="self-named"' not in body
