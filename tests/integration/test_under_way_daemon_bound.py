"""Work under way in tasks is bounded over the whole daemon, not only per session and
per tenant.

A real daemon, raw ZeroMQ sockets.  Each session had at most 256 requests under way in
tasks (reserves waiting for room, reads, prefetches) and each tenant's named at most
2**20 keys, but nothing bounded them together: many tenants, or one tenant's many
sessions, held as many tasks and keys as they sent.  Now the daemon holds at most
``server.max_requests_under_way`` naming ``server.max_keys_under_way`` keys; past it a
request is refused with ``limit_exceeded`` at once, nothing started, and the ones under
way finish as before (here: their wait for room ends at its deadline).  Each tenant holds
at most its share of the bound (``test_under_way_tenant_share.py``): six tenants of one
request each fill it here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvtest import make_identity
from test_attacks_s53 import ask_frames
from test_protocol_abuse import error_code
from test_tenant_isolation import Raw

from kvstore import protocol as p

MOST = 6  # server.max_requests_under_way here
TENANTS = ("globex", "initech", "umbrella", "soylent", "cyberdyne", "tyrell")
EACH = 2  # reserves each of those tenants sends: the first of each waits


def hello(d: Any, tenant: str) -> Raw:
    raw = Raw(d.tcp_endpoint)
    assert isinstance(raw.ask(p.Hello(1, p.PROTOCOL_VERSION, tenant, "", "")), p.HelloReply)
    return raw


def replies(raws: list[Raw], count: int, seconds: float) -> list[p.Message]:
    """Up to ``count`` replies over ``raws`` (in whatever order the daemon read them),
    within ``seconds``."""
    got: list[p.Message] = []
    deadline = time.monotonic() + seconds
    while len(got) < count and time.monotonic() < deadline:
        for raw in raws:
            if raw.sock.poll(10):
                got.append(p.reply_decoder.decode(raw.sock.recv_multipart()[0]))
    return got


def pin_dram_full(owner: Raw) -> tuple[p.NamespaceReply, list[bytes], p.AcquireReply]:
    """acme's session fills the daemon's 2 MiB of DRAM with blocks and pins them all
    (reserves then wait for room): its namespace, the keys, the pin."""
    opened = owner.ask(p.OpenNamespace(2, make_identity(tenant="acme")))
    assert isinstance(opened, p.NamespaceReply), opened
    slots = (2 << 20) // opened.slot_bytes
    full = [i.to_bytes(16, "big") for i in range(1, slots + 1)]
    put = ask_frames(owner, p.Put(3, opened.ns, full), *[b"\1" * opened.block_bytes] * slots)
    assert isinstance(put, p.PutReply) and put.created == slots, put
    held = owner.ask(p.Acquire(4, opened.ns, full))
    assert isinstance(held, p.AcquireReply), held
    return opened, full, held


def test_tenants_together_cannot_leave_requests_waiting_without_bound(
        daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(f"[server]\nmax_requests_under_way = {MOST}\n"
                      '[dram]\npressure = ["defer", "reject"]\ndefer_seconds = 2\n')
    d = daemon_factory(tcp=True, dram_capacity="2MiB",
                       extra=["--config", str(config), "--slab-size", "1MiB"])
    owner = hello(d, "acme")
    others = {tenant: hello(d, tenant) for tenant in TENANTS}
    try:
        opened, full, held = pin_dram_full(owner)
        slots = len(full)
        namespaces = {}
        for tenant, raw in others.items():
            ns = raw.ask(p.OpenNamespace(2, make_identity(tenant=tenant)))
            assert isinstance(ns, p.NamespaceReply), ns
            namespaces[tenant] = ns.ns
        for i in range(EACH):  # each tenant's in turn: the first MOST wait, the rest refused
            for tenant, raw in others.items():
                raw.sock.send(p.encoder.encode(
                    p.Reserve(100 + i, namespaces[tenant], [bytes([1 + i]) * 16])))
        refused = replies(list(others.values()), len(TENANTS) * EACH - MOST, 10)
        assert len(refused) == len(TENANTS) * EACH - MOST, refused
        assert not replies(list(others.values()), 1, 0.5)  # the others wait
        late = hello(d, "hooli")  # a tenant of its own, a session of its own: refused too
        try:
            mine = late.ask(p.OpenNamespace(2, make_identity(tenant="hooli")))
            assert isinstance(mine, p.NamespaceReply), mine
            refused_too = late.ask(p.Reserve(3, mine.ns, [b"\3" * 16]))
            assert error_code(refused_too) == "limit_exceeded", refused_too
        finally:
            late.close()
        # the waiting ones end at their deadline, each answered once, holding nothing after
        ended = replies(list(others.values()), MOST, 15)
        assert len(ended) == MOST and all(error_code(r) == "capacity" for r in ended), ended
        assert isinstance(owner.ask(p.Release(5, held.pin)), p.OkReply)
        evicted = owner.ask(p.Evict(6, opened.ns, full))
        assert isinstance(evicted, p.CountReply) and evicted.count == slots, evicted
        stats = owner.ask(p.Stats(7))
        assert isinstance(stats, p.StatsReply)
        assert stats.stats["invariant_violations"] == 0
        raw = others["globex"]
        again = raw.ask(p.Reserve(200, namespaces["globex"], [b"\7" * 16]))
        assert isinstance(again, p.ReserveReply), again  # the count went back
    finally:
        for each in (owner, *others.values()):
            each.close()
