"""An attacker's requests against a real daemon: another session's ids, replays, requests
that would pass a tenant's caps.  Each gets a typed error; nothing is left held."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import zmq

from daemon_proc import DaemonProcess
from kvtest import make_identity
from test_protocol_abuse import Raw, error_code, hello

from kvstore import Client
from kvstore import protocol as p
from kvstore.config import load_config
from kvstore.errors import ConfigError


def ask(raw: Raw, msg: p.Message, *payload: bytes) -> p.Message:
    return raw.ask(p.encoder.encode(msg), *payload)


def held(daemon: DaemonProcess) -> tuple[int, int, int]:
    """Reserved slots, pinned blocks and invariant violations, as stats tell them."""
    with Client(daemon.endpoint, tenant="audit") as client:
        stats = client.stats()
    tier = stats["tiers"]["dram"]
    return tier["reserved_slots"], tier["pinned_blocks"], stats["invariant_violations"]


def configured(daemon_factory: Any, tmp_path: Path, toml: str,
               tcp: bool = False) -> DaemonProcess:
    """A daemon started with ``toml`` as its configuration file."""
    config = tmp_path / "kvstore.toml"
    config.write_text(toml)
    return daemon_factory(tcp=tcp, extra=["--config", str(config)])


def test_ids_of_another_session_and_replays_are_refused(daemon: DaemonProcess) -> None:
    owner, thief = Raw(daemon.endpoint), Raw(daemon.endpoint)
    try:
        hello(owner)
        hello(thief)  # the same tenant: ids alone must not reach across sessions
        ident = make_identity()
        ns = ask(owner, p.OpenNamespace(1, ident))
        assert isinstance(ns, p.NamespaceReply)
        assert isinstance(ask(thief, p.OpenNamespace(1, ident)), p.NamespaceReply)
        keys = [os.urandom(16) for _ in range(2)]
        put = ask(owner, p.Put(2, ns.ns, keys), *[b"\1" * ident.block_bytes] * 2)
        assert isinstance(put, p.PutReply)
        pin = ask(owner, p.Acquire(3, ns.ns, keys))
        r = ask(owner, p.Reserve(4, ns.ns, [os.urandom(16)]))
        assert isinstance(pin, p.AcquireReply) and isinstance(r, p.ReserveReply)
        for msg in (p.Commit(5, r.reservation), p.Abort(6, r.reservation),
                    p.Release(7, pin.pin)):
            assert error_code(ask(thief, msg)) == "not_found"
        assert held(daemon)[:2] == (1, 2)  # the owner's, untouched
        assert isinstance(ask(owner, p.Abort(8, r.reservation)), p.OkReply)
        assert error_code(ask(owner, p.Commit(9, r.reservation))) == "not_found"
        assert error_code(ask(owner, p.Abort(10, r.reservation))) == "not_found"
        r = ask(owner, p.Reserve(11, ns.ns, [os.urandom(16)]))
        assert isinstance(r, p.ReserveReply)
        assert isinstance(ask(owner, p.Commit(12, r.reservation)), p.CommitReply)
        assert error_code(ask(owner, p.Commit(13, r.reservation))) == "not_found"
        assert isinstance(ask(owner, p.Release(14, pin.pin)), p.OkReply)
        assert error_code(ask(owner, p.Release(15, pin.pin))) == "not_found"
        assert held(daemon) == (0, 0, 0)
    finally:
        owner.close()
        thief.close()
    assert daemon.alive()


def test_a_batch_of_reservations_stays_under_the_tenants_cap(daemon_factory: Any,
                                                              tmp_path: Path) -> None:
    daemon = configured(daemon_factory, tmp_path, "[server]\nmax_reservations_per_tenant = 4\n")
    first, second = Raw(daemon.endpoint), Raw(daemon.endpoint)
    try:
        hello(first)
        hello(second)
        ident = make_identity()
        ns = ask(first, p.OpenNamespace(1, ident))
        assert isinstance(ns, p.NamespaceReply)
        assert isinstance(ask(second, p.OpenNamespace(1, ident)), p.NamespaceReply)

        def plan(n: int) -> list[p.PlanItem]:
            return [p.PlanItem(0, ident.block_tokens, [os.urandom(16)]) for _ in range(n)]

        reply = ask(first, p.ReserveBatch(2, ns.ns, plan(8)))  # twice the cap in one go
        assert error_code(reply) == "limit_exceeded", reply
        assert held(daemon) == (0, 0, 0)
        one = ask(first, p.Reserve(3, ns.ns, [os.urandom(16)]))
        assert isinstance(one, p.ReserveReply)
        assert error_code(ask(second, p.ReserveBatch(4, ns.ns, plan(4)))) == "limit_exceeded"
        batch = ask(second, p.ReserveBatch(5, ns.ns, plan(3)))  # 1 + 3: the cap, not over
        assert isinstance(batch, p.BatchReply) and batch.admitted
        assert error_code(ask(first, p.Reserve(6, ns.ns, [os.urandom(16)]))) == \
            "limit_exceeded"
        assert held(daemon) == (4, 0, 0)
        for rid in batch.reservations:
            assert isinstance(ask(second, p.Abort(7, rid)), p.OkReply)
        assert isinstance(ask(first, p.Abort(8, one.reservation)), p.OkReply)
        assert held(daemon) == (0, 0, 0)
    finally:
        first.close()
        second.close()
    assert daemon.alive()


def test_a_hello_refused_for_want_of_an_arena_opens_no_session(daemon_factory: Any,
                                                                tmp_path: Path) -> None:
    daemon = configured(daemon_factory, tmp_path,
                        '[dram]\nper_tenant_arenas = true\narena_kind = "memfd"\nmax_arenas = 1\n')
    with Client(daemon.endpoint, tenant="acme") as client:  # the first tenant's arena
        sessions = client.stats()["sessions"]
        for i in range(2):  # past the limit: one more tenant's arena does not fit
            raw = Raw(daemon.endpoint)
            try:
                reply = ask(raw, p.Hello(1, p.PROTOCOL_VERSION, f"intruder{i}"))
                assert error_code(reply) == "limit_exceeded", reply
                # the connection has no session: told so, not served
                assert error_code(ask(raw, p.Ping(2))) == "forbidden"
            finally:
                raw.close()
        stats = client.stats()
        assert stats["sessions"] == sessions
        assert stats["invariant_violations"] == 0
    assert daemon.alive()


def test_a_hello_refused_for_another_reason_makes_no_arena(daemon_factory: Any,
                                                            tmp_path: Path) -> None:
    # the tenant's arena was made before the checks: each refused hello of a new tenant
    # took one of max_arenas for good, and a later tenant found none left
    daemon = configured(daemon_factory, tmp_path,
                        '[dram]\nper_tenant_arenas = true\narena_kind = "memfd"\nmax_arenas = 2\n')
    first, second = Raw(daemon.endpoint), Raw(daemon.endpoint)
    try:
        hello(first, "a")
        again = ask(first, p.Hello(2, p.PROTOCOL_VERSION, "b"))  # a second hello
        assert error_code(again) == "forbidden", again
        stray = ask(second, p.Hello(1, p.PROTOCOL_VERSION, "d", attach="0" * 32))
        assert error_code(stray) == "forbidden", stray  # no such session to attach to
        hello(second, "c")  # the second arena is still free
    finally:
        first.close()
        second.close()


def test_hellos_count_against_the_tenants_request_rate(daemon_factory: Any,
                                                       tmp_path: Path) -> None:
    # connect, hello, go, again: each hello left a session held till its lease, at any rate
    daemon = configured(daemon_factory, tmp_path,
                        "[server]\nmax_requests_per_second_per_tenant = 2\n")
    opened = refused = 0
    raws = [Raw(daemon.endpoint) for _ in range(30)]  # far more than two a second's worth
    try:
        for raw in raws:  # all sent before any reply is read: one burst, however slow
            raw.sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "acme")))
        for raw in raws:
            assert raw.sock.poll(10_000), "the daemon did not answer"
            reply = p.reply_decoder.decode(raw.sock.recv_multipart()[0])
            if isinstance(reply, p.HelloReply):
                opened += 1
            else:
                assert error_code(reply) == "limit_exceeded", reply
                assert error_code(ask(raw, p.Ping(2))) == "forbidden"  # no session
                refused += 1
    finally:
        for raw in raws:
            raw.close()
    assert refused > 0
    with Client(daemon.endpoint, tenant="audit") as client:  # a bucket of its own
        stats = client.stats()
    assert stats["sessions"] == opened + 1
    assert stats["invariant_violations"] == 0


def test_a_tenant_rate_below_one_request_a_second_is_refused() -> None:
    # its bucket, a second's worth, never held a whole hello: the tenant was shut out
    def rate(value: float) -> float:
        server = load_config(env={}, overrides={
            "server": {"max_requests_per_second_per_tenant": value}}).server
        return server.max_requests_per_second_per_tenant

    assert (rate(0), rate(1), rate(2.5)) == (0, 1, 2.5)
    for value in (0.5, -1):
        with pytest.raises(ConfigError, match="0 \\(no limit\\) or at least 1"):
            rate(value)


def test_get_replies_a_peer_never_reads_stay_within_its_bytes_in_flight(
        daemon_factory: Any, tmp_path: Path) -> None:
    # a get's blocks stay pinned until zmq has sent the reply, outside any lease: a peer
    # that asks and never reads held them for as long as it stayed connected, any amount
    # (gets of 16 MiB against 64: what the kernel's socket buffers take unread, a few
    # MiB, is less than one get, so the limit is reached whatever they hold)
    daemon = configured(daemon_factory, tmp_path, '[server]\nmax_bytes_in_flight = "64MiB"\n',
                        tcp=True)
    ident = make_identity(num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB blocks
    raw = Raw(daemon.tcp_endpoint)
    raw.sock.setsockopt(zmq.RCVHWM, 1)
    try:
        hello(raw)
        ns = ask(raw, p.OpenNamespace(1, ident))
        assert isinstance(ns, p.NamespaceReply)
        keys = [os.urandom(16) for _ in range(16)]
        assert isinstance(ask(raw, p.Put(2, ns.ns, keys), *[b"\1" * ident.block_bytes] * 16),
                          p.PutReply)
        asks = 64  # 1 GiB of replies, far more than socket buffers take unread
        for i in range(asks):
            raw.sock.send(p.encoder.encode(p.Get(10 + i, ns.ns, keys)))
        with Client(daemon.endpoint, tenant="audit") as client:
            assert client.stats()["invariant_violations"] == 0  # served while it waits
        codes = []
        for _ in range(asks):
            assert raw.sock.poll(10_000)
            frames = raw.sock.recv_multipart()
            reply = p.reply_decoder.decode(frames[0])
            codes.append(type(reply).__name__ if isinstance(reply, p.GetReply)
                         else error_code(reply))
        assert "GetReply" in codes and "limit_exceeded" in codes, codes
        again = ask(raw, p.Get(99, ns.ns, keys))  # read: the bytes went back
        assert isinstance(again, p.GetReply)
    finally:
        raw.close()
    assert held(daemon) == (0, 0, 0)


@pytest.mark.parametrize("limit", ['"8MiB"', '"64MiB"', "0"])
def test_one_get_at_a_time_is_never_refused_for_bytes_in_flight(
        daemon_factory: Any, tmp_path: Path, limit: str) -> None:
    # a reply already read still counted till it was reaped, so the next get was refused;
    # a limit of 0 refused those gets every time
    daemon = configured(daemon_factory, tmp_path, f"[server]\nmax_bytes_in_flight = {limit}\n")
    ident = make_identity(num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB blocks
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        keys = [os.urandom(16) for _ in range(12)]
        ns.put(keys, [b"\1" * ident.block_bytes] * 12)
        for _ in range(100):
            for n in (8, 1, 12):  # each right after a reply of the limit's size
                assert len(ns.get(keys[:n])) == n
    assert held(daemon) == (0, 0, 0)


def test_a_get_larger_than_the_bytes_in_flight_limit_is_admitted_alone(
        daemon_factory: Any, tmp_path: Path) -> None:
    # a limit below one get's size refused that get every time
    daemon = configured(daemon_factory, tmp_path, '[server]\nmax_bytes_in_flight = "8MiB"\n')
    ident = make_identity(num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB blocks
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        keys = [os.urandom(16) for _ in range(12)]
        ns.put(keys, [b"\1" * ident.block_bytes] * 12)
        assert len(ns.get(keys)) == 12  # 12 MiB, nothing else under way
    assert held(daemon) == (0, 0, 0)


def test_get_replies_a_peer_never_reads_stay_within_its_tenants_bytes_in_flight(
        daemon_factory: Any, tmp_path: Path) -> None:
    # the per-tenant limit: a peer that never reads holds at most that much of its
    # tenant's, and the tenant's other sessions wait, told why, until it reads
    daemon = configured(daemon_factory, tmp_path,
                        '[server]\nmax_bytes_in_flight_per_tenant = "64MiB"\n', tcp=True)
    ident = make_identity(num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB blocks
    raw, other = Raw(daemon.tcp_endpoint), Raw(daemon.endpoint)
    raw.sock.setsockopt(zmq.RCVHWM, 1)
    try:
        hello(raw)
        hello(other)
        ns = ask(raw, p.OpenNamespace(1, ident))
        assert isinstance(ns, p.NamespaceReply)
        assert isinstance(ask(other, p.OpenNamespace(1, ident)), p.NamespaceReply)
        keys = [os.urandom(16) for _ in range(16)]  # gets of 16 MiB: see above
        assert isinstance(ask(raw, p.Put(2, ns.ns, keys), *[b"\1" * ident.block_bytes] * 16),
                          p.PutReply)
        asks = 64  # 1 GiB of replies, far more than socket buffers take unread
        for i in range(asks):
            raw.sock.send(p.encoder.encode(p.Get(10 + i, ns.ns, keys)))
        for rid in range(2, 1000):  # served until the unread replies hold the tenant's
            refused = ask(other, p.Get(rid, ns.ns, keys[:1]))
            if not isinstance(refused, p.GetReply):
                break
        assert error_code(refused) == "limit_exceeded", refused
        assert isinstance(refused, p.ErrorReply) and "tenant 'acme'" in refused.message
        codes = []
        for _ in range(asks):
            assert raw.sock.poll(10_000)
            frames = raw.sock.recv_multipart()
            reply = p.reply_decoder.decode(frames[0])
            codes.append(type(reply).__name__ if isinstance(reply, p.GetReply)
                         else error_code(reply))
        assert "GetReply" in codes and "limit_exceeded" in codes, codes
        assert isinstance(ask(other, p.Get(3, ns.ns, keys)), p.GetReply)  # read: back
    finally:
        raw.close()
        other.close()
    assert held(daemon) == (0, 0, 0)
