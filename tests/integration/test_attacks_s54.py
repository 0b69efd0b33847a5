"""A hostile tenant against a daemon with credentials (a token secret, a tcp endpoint):
what it leaves the daemon holding for it stays bounded.  Real daemon processes, raw
ZeroMQ sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtest import make_identity
from test_attacks_s53 import ask_frames, connect
from test_protocol_abuse import error_code
from test_tenant_isolation import Raw, cli

from kvstore import protocol as p
from kvstore.auth import read_secret
from kvstore.under_way import SESSION_MOST


def replies(raw: Raw, count: int, wait_ms: int) -> list[p.Message]:
    """Up to ``count`` replies, each within ``wait_ms`` of the one before."""
    got: list[p.Message] = []
    while len(got) < count and raw.sock.poll(wait_ms):
        got.append(p.reply_decoder.decode(raw.sock.recv_multipart()[0]))
    return got


def test_a_session_cannot_leave_requests_waiting_without_bound(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A request that finishes in a task (waiting for room, a read from SSD or the remote
    store, a prefetch going on after its reply) held its keys and a task, and a peer may
    send the next without waiting: reserves deferred behind a tier full of the tenant's
    own pins piled up, as many as it sent, till their deadline.  A session now has at
    most SESSION_MOST under way; past it each request is refused at once, and those
    under way finish as before."""
    secret = tmp_path / "secret"
    cli("keygen", "--secret", str(secret))
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret}"\noperators = ["ops"]\n'
                      '[dram]\npressure = ["defer", "reject"]\ndefer_seconds = 60\n')
    d = daemon_factory(tcp=True, dram_capacity="2MiB",
                       extra=["--config", str(config), "--slab-size", "1MiB"])
    key = read_secret(secret)
    raw, _ = connect(d, key, "acme")
    other, _ = connect(d, key, "acme")  # another session of the tenant's
    ops, _ = connect(d, key, "ops")
    try:
        opened = raw.ask(p.OpenNamespace(2, make_identity(tenant="acme")))
        assert isinstance(opened, p.NamespaceReply), opened
        slots = (2 << 20) // opened.slot_bytes
        full = [i.to_bytes(16, "big") for i in range(1, slots + 1)]
        put = ask_frames(raw, p.Put(3, opened.ns, full),
                         *[b"\1" * opened.block_bytes] * slots)
        assert isinstance(put, p.PutReply) and put.created == slots, put
        held = raw.ask(p.Acquire(4, opened.ns, full))  # the tier full of pins: reserves wait
        assert isinstance(held, p.AcquireReply), held
        over = 8
        for rid in range(100, 100 + SESSION_MOST + over):
            reserve = p.Reserve(rid, opened.ns, [rid.to_bytes(16, "little")])
            raw.sock.send(p.encoder.encode(reserve))
        refused = replies(raw, over, 5_000)
        assert len(refused) == over, refused
        assert all(error_code(r) == "limit_exceeded" and "under way" in r.message
                   and r.rid >= 100 + SESSION_MOST for r in refused), refused
        # room comes (an evict is a request this session may not start now: another's
        # makes it): the waiting ones are served, each once, and hold nothing after
        assert isinstance(raw.ask(p.Release(5, held.pin)), p.OkReply)
        assert isinstance(other.ask(p.OpenNamespace(2, make_identity(tenant="acme"))),
                          p.NamespaceReply)
        evicted = other.ask(p.Evict(3, opened.ns, full))
        assert isinstance(evicted, p.CountReply) and evicted.count == slots, evicted
        served = replies(raw, SESSION_MOST, 10_000)
        reserved = [r for r in served if isinstance(r, p.ReserveReply)]
        assert len(reserved) == SESSION_MOST, served
        for i, r in enumerate(reserved):
            assert isinstance(raw.ask(p.Abort(1000 + i, r.reservation)), p.OkReply)
        again = raw.ask(p.Reserve(2000, opened.ns, [b"\2" * 16]))
        assert isinstance(again, p.ReserveReply), again  # the count went back
        stats = ops.ask(p.Stats(7))
        assert isinstance(stats, p.StatsReply)
        assert stats.stats["tiers"]["dram"]["reserved_slots"] == 1
        assert stats.stats["invariant_violations"] == 0
    finally:
        for each in (raw, other, ops):
            each.close()
