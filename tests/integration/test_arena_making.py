"""A tenant's own arena is made on a thread: other clients are served meanwhile."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from daemon_proc import DaemonProcess

from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret, write_secret
from kvstore.client import Client
from kvstore.errors import ConfigError, LimitExceededError
from kvstore.tiers.dram import check_memory


def tenant_daemon(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path,
                  capacity: str, extra: str = "") -> tuple[DaemonProcess, bytes]:
    """A daemon that takes tokens (so each tenant has an arena of its own)."""
    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    config = tmp_path / "tenants.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n{extra}')
    d = daemon_factory(dram_capacity=capacity, extra=["--config", str(config)], tcp=True)
    return d, read_secret(secret_file)


def test_another_tenants_first_hello_does_not_stall_a_client_being_served(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Before, a new tenant's arena (1 GiB: allocated, mapped, its pages faulted in) was
    made on the loop, and every other client waited for it: a ping as long as the new
    tenant's whole hello (557-613 ms of 669-751).  The new tenant's client runs in a
    process of its own (its mapping of the arena holds its own interpreter)."""
    d, secret = tenant_daemon(daemon_factory, tmp_path, "1GiB")
    hello = ("import sys, time; from kvstore.client import Client; t = time.perf_counter(); "
             "Client(sys.argv[1], token=sys.argv[2]).close(); "
             "print(time.perf_counter() - t)")
    with Client(d.endpoint, token=issue_token(secret, "acme", 600.0)) as acme:
        acme.ping()
        other = subprocess.Popen([sys.executable, "-c", hello, d.endpoint,
                                  issue_token(secret, "globex", 600.0)],
                                 stdout=subprocess.PIPE, text=True)
        pings = []
        while other.poll() is None:
            started = time.perf_counter()
            acme.ping()
            pings.append(time.perf_counter() - started)
        out, _ = other.communicate()
        assert other.returncode == 0
        took = float(out)
        assert pings, (took, pings)
        if took > 0.2:  # an arena whose making takes time (its memory taken whole)
            assert len(pings) >= 3, (took, pings)
            assert max(pings) < took / 4, (max(pings), took, len(pings))
        else:  # sparse, as per-tenant arenas are now (``kvstore.arena_budget``): its
            # memory comes as slabs are written, and the hello has little to wait for
            assert max(pings) < 0.2, (max(pings), took, len(pings))


def test_arenas_past_the_limit_are_refused_by_type_and_the_others_still_served(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    d, secret = tenant_daemon(daemon_factory, tmp_path, "64MiB", "[dram]\nmax_arenas = 2\n")
    with Client(d.endpoint, token=issue_token(secret, "a", 600.0)) as a, \
            Client(d.endpoint, token=issue_token(secret, "b", 600.0)) as b:
        with pytest.raises(LimitExceededError, match="max_arenas"):
            Client(d.endpoint, token=issue_token(secret, "c", 600.0), timeout=10.0)
        a.ping()
        b.ping()
        with Client(d.endpoint, token=issue_token(secret, "a", 600.0)) as again:
            again.ping()  # (a tenant's second session: its arena is there)


def test_a_hello_sent_with_its_next_request_is_answered_first(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """A peer may send its next request before the hello's reply (the router does); with
    the hello waiting for its tenant's arena, that request was served first, and met no
    session.  Now it waits behind the hello."""
    d, secret = tenant_daemon(daemon_factory, tmp_path, "256MiB")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    token = issue_token(secret, "router", 600.0)
    sock.plain_username, sock.plain_password = b"router", token.encode()  # (tcp: PLAIN)
    assert d.tcp_endpoint is not None
    sock.connect(d.tcp_endpoint)
    try:
        sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "router", token)))
        for rid in (2, 3, 4):
            sock.send(p.encoder.encode(p.Ping(rid)))
        replies = []
        for _ in range(4):
            assert sock.poll(10_000), replies
            replies.append(p.reply_decoder.decode(sock.recv_multipart()[0]))
        assert isinstance(replies[0], p.HelloReply), replies
        assert all(isinstance(r, p.OkReply) for r in replies[1:]), replies
        assert [r.rid for r in replies] == [1, 2, 3, 4]
    finally:
        sock.close(linger=0)
        ctx.term()


def test_an_arena_that_cannot_be_made_refuses_the_hello_by_type(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Its making fails on the thread (here its directory is gone): the hello is refused
    with the reason, not made again on the loop, and the daemon serves on."""
    shm = tmp_path / "shm"
    shm.mkdir()
    config = tmp_path / "file-arenas.toml"
    config.write_text(f'[dram]\nper_tenant_arenas = true\narena_kind = "file"\n'
                      f'directory = "{shm}"\n')
    d = daemon_factory(extra=["--config", str(config)])
    shm.rmdir()
    for _ in range(2):
        with pytest.raises(ConfigError, match="dram.directory"):
            Client(d.endpoint, tenant="a", timeout=20.0)
    shm.mkdir()
    with Client(d.endpoint, tenant="a") as a:
        a.ping()
    assert d.alive()


def test_an_arena_larger_than_the_memory_available_is_refused(tmp_path: Path) -> None:
    """Its allocation went on until the kernel killed processes for memory."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:    1048576 kB\n")
    check_memory(1 << 30, str(meminfo))
    with pytest.raises(ConfigError, match="more than the 1073741824 bytes of memory"):
        check_memory((1 << 30) + 1, str(meminfo))
    check_memory(1 << 50, str(tmp_path / "none"))  # (unreadable: not checked)
