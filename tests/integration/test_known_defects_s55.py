"""Defects known from earlier reviews: each against a real daemon (and a real Redis where
the remote tier is in it)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client
from kvstore import protocol as p
from kvstore.errors import LimitExceededError, NamespaceInUseError
from kvstore.under_way import SESSION_MOST


class Peer:
    """A bare DEALER of tenant acme with one namespace open."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        assert isinstance(self.ask(p.Hello(1, p.PROTOCOL_VERSION, "acme", "", "")),
                          p.HelloReply)
        opened = self.ask(p.OpenNamespace(2, make_identity(tenant="acme")))
        assert isinstance(opened, p.NamespaceReply), opened
        self.ns = opened.ns

    def send(self, msg: p.Message) -> None:
        self.sock.send(p.encoder.encode(msg))

    def ask(self, msg: p.Message) -> p.Message:
        self.send(msg)
        assert self.sock.poll(15_000), "the daemon did not answer"
        return p.reply_decoder.decode(self.sock.recv_multipart()[0])

    def replies(self, count: int, wait_ms: int) -> list[p.Message]:
        """Up to ``count`` replies, each within ``wait_ms`` of the one before."""
        got: list[p.Message] = []
        while len(got) < count and self.sock.poll(wait_ms):
            got.append(p.reply_decoder.decode(self.sock.recv_multipart()[0]))
        return got

    def prefetches(self, first: int, count: int, timeout_ms: int = 0) -> None:
        """``count`` waiting prefetches of a key of nowhere each (the remote store asked)."""
        for rid in range(first, first + count):
            self.send(p.Prefetch(rid, self.ns, [os.urandom(16)], wait=True,
                                 timeout_ms=timeout_ms))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def under_way(peer: Peer) -> dict[str, int]:
    stats = peer.ask(p.Stats(3))
    assert isinstance(stats, p.StatsReply), stats
    assert stats.stats["invariant_violations"] == 0
    counts: dict[str, int] = stats.stats["under_way"]
    return counts


def wait_for_none_under_way(peer: Peer) -> None:
    deadline = time.monotonic() + 30
    while (counts := under_way(peer)) != {"requests": 0, "keys": 0}:
        assert time.monotonic() < deadline, counts
        time.sleep(0.05)


def refused_of(replies: list[p.Message]) -> list[int]:
    return sorted(r.rid for r in replies if isinstance(r, p.ErrorReply)
                  and r.code == "limit_exceeded" and "under way" in r.message)


def test_a_waiting_prefetch_counts_once_in_its_sessions_work_under_way(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """A prefetch with ``wait`` was counted twice while its reply waited (its task in the
    background, and the request finishing in a task): a session was refused at 128 of
    them, not 256, and a TP=8 engine's workers' prefetches were refused quietly.  The
    count goes back to 0 after each kind of end: done, reply at its timeout (the rest
    going on), the remote store failing, the session gone."""
    d = daemon_factory(extra=["--remote", fresh_redis_server.url],
                       env={"KVSTORE_REMOTE_TIMEOUT_S": "20"})
    peer = Peer(d.endpoint)
    try:
        fresh_redis_server.pause()  # every remote read waits
        try:
            peer.prefetches(100, SESSION_MOST + 8)
            refused = peer.replies(8, 3_000)
            assert refused_of(refused) == list(range(100 + SESSION_MOST,
                                                     100 + SESSION_MOST + 8)), refused
            assert under_way(peer) == {"requests": SESSION_MOST, "keys": SESSION_MOST}
        finally:
            fresh_redis_server.resume()
        done = peer.replies(SESSION_MOST, 20_000)
        assert len(done) == SESSION_MOST and all(
            isinstance(r, p.PrefetchReply) for r in done), done[:3]
        wait_for_none_under_way(peer)

        # replies at their timeout, the reads going on (counted) until Redis answers
        fresh_redis_server.pause()
        try:
            peer.prefetches(1000, 4, timeout_ms=100)
            timed_out = peer.replies(4, 5_000)
            assert [type(r) for r in timed_out] == [p.PrefetchReply] * 4, timed_out
            assert under_way(peer) == {"requests": 4, "keys": 4}
        finally:
            fresh_redis_server.resume()
        wait_for_none_under_way(peer)

        # the session gone while its prefetches wait
        other = Peer(d.endpoint)
        fresh_redis_server.pause()
        try:
            other.prefetches(2000, 4)
            deadline = time.monotonic() + 10
            while under_way(peer)["requests"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            other.send(p.Bye(9))
            other.close()
        finally:
            fresh_redis_server.resume()
        wait_for_none_under_way(peer)
    finally:
        peer.close()


def test_a_waiting_prefetch_the_remote_store_fails_leaves_nothing_under_way(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """The remote read under a waiting prefetch times out: its reply goes (nothing
    brought up), and the session's count of work under way goes back to 0."""
    d = daemon_factory(extra=["--remote", fresh_redis_server.url],
                       env={"KVSTORE_REMOTE_TIMEOUT_S": "1"})
    peer = Peer(d.endpoint)
    try:
        fresh_redis_server.pause()
        try:
            peer.prefetches(100, 4)
            failed = peer.replies(4, 10_000)
        finally:
            fresh_redis_server.resume()
        assert [(type(r), getattr(r, "ready", None)) for r in failed] == [
            (p.PrefetchReply, 0)] * 4, failed
        wait_for_none_under_way(peer)
    finally:
        peer.close()


def test_an_engines_link_tells_a_close_refused_for_a_rate_from_a_save_under_way(
        daemon_factory: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """The daemon refuses a close with LimitExceededError where the session has a
    reservation open in the namespace, and also for its request rates.  The engine's
    link took every such refusal for a save under way: refused for a rate, it asked
    every other namespace of its table in turn, each refused, of a daemon asking for
    fewer requests.  Now a refusal for another limit ends the round, the namespace kept
    in its place as the oldest."""
    from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings

    config = tmp_path / "rate.toml"
    config.write_text("[server]\n")
    d = daemon_factory(extra=["--config", str(config)])
    link = DaemonLink(DaemonSettings(d.endpoint, "acme", None, timeout=10.0))
    closes: list[str] = []
    try:
        for i in range(4):
            ns = link.namespace(f"salt-{i}", lambda i=i: make_identity(salt=f"u{i}"))
            assert ns is not None, link.last_error
            close = ns.close
            monkeypatch.setattr(ns, "close", lambda i=i, close=close: (
                closes.append(f"salt-{i}"), close())[1])
        busy = link.namespace("salt-1", lambda: make_identity(salt="u1"))
        assert busy is not None
        saving = busy.reserve(busy.keys(range(16)))
        with pytest.raises(NamespaceInUseError):
            busy.close()
        closes.clear()
        # below one request a second every request past the hello is refused
        reload(d, config, "[server]\nmax_requests_per_second = 0.5\n", limited=True)
        assert link._close_oldest() is False
        assert closes == ["salt-0"], closes  # (before: all four, each refused)
        assert list(link._namespaces) == ["salt-0", "salt-2", "salt-3", "salt-1"]
        reload(d, config, "[server]\n", limited=False)
        closes.clear()
        assert link._close_oldest() is True
        assert link._close_oldest() is True  # salt-1's save under way: kept, salt-2 went
        assert closes == ["salt-0", "salt-2"], closes
        assert list(link._namespaces) == ["salt-3", "salt-1"]
        saving.abort()
    finally:
        link.close()


def reload(d: Any, config: Path, text: str, *, limited: bool) -> None:
    """Reload the daemon's settings (SIGHUP) and wait until a new session's ping is
    refused for its rate (``limited``) or not."""
    config.write_text(text)
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while True:
        with Client(d.endpoint, tenant="acme", timeout=10) as probe:
            try:
                probe.ping()
                refused = False
            except LimitExceededError:
                refused = True
        if refused == limited:
            return
        assert time.monotonic() < deadline, "the reload did not take effect"
        time.sleep(0.05)


def test_a_remote_store_failing_while_its_marks_are_forgotten_leaves_no_trace(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    """The store loses what it held and then refuses every write (full, noeviction):
    the round that forgets the daemon's marks of it ends all the same (it calls no
    store: the blocks' writes again go in tasks of their own, and fail there), the
    watch goes on checking, and notices the store's next generation."""
    from kvstore.identity import Identity

    ident: Identity = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")
    d = daemon_factory(extra=["--remote", fresh_redis_server.url, "--log-level", "error"],
                       env={"KVSTORE_REMOTE_CHECK_SECONDS": "0.2",
                            "KVSTORE_REMOTE_TIMEOUT_S": "2"})
    with Client(d.endpoint, tenant="acme", timeout=10) as client:
        def remote() -> dict[str, Any]:
            stats = client.stats()
            assert stats["invariant_violations"] == 0
            out: dict[str, Any] = stats["remote"]
            return out

        def wait(predicate: Any, what: str) -> None:
            deadline = time.monotonic() + 20
            while not predicate():
                shown = {k: v for k, v in remote().items() if v}
                assert time.monotonic() < deadline, f"{what}: {shown}"
                time.sleep(0.05)

        ns = client.namespace(ident)
        keys = ns.keys(range(4 * ident.block_tokens))
        ns.put(keys, [bytes([i]) * ident.block_bytes for i in range(len(keys))])
        wait(lambda: remote()["writes"] >= 4 and remote()["generation_checks"] >= 1,
             "the writes through")
        written = remote()["writes"]
        with fresh_redis_server.client() as r:
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", "1")
            r.flushall()
        wait(lambda: remote()["generations_lost"] == 1 and not remote()["forgetting_marks"]
             and remote()["marks_forgotten"] >= 4, "the marks forgotten")
        wait(lambda: remote()["refused_writes"] >= 4, "the writes again refused")
        assert remote()["writes"] == written
        with fresh_redis_server.client() as r:
            r.config_set("maxmemory", "0")
        # the store takes a token again: another generation, noticed, its round ended
        # (the refused writes are not sent again: a full store's refusal, as any)
        wait(lambda: remote()["generations_lost"] == 2 and not remote()["forgetting_marks"],
             "the next check")
        assert ns.get(keys) == [bytes([i]) * ident.block_bytes for i in range(len(keys))]
