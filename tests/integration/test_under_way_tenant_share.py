"""One tenant's many sessions cannot take the daemon's whole bound on work under way.

A real daemon, raw ZeroMQ sockets.  ``server.max_requests_under_way`` bounds the
requests under way in tasks over every session and tenant, and each session holds at most
256 of them: but one tenant opening many sessions, each below its own bound, filled the
daemon's, and every other tenant's such request (a reserve waiting for room, a read, a
prefetch) was refused ``limit_exceeded`` until that tenant's finished.  Now a tenant holds
at most its share (alone: half; ``kvstore/under_way.py``): past it, its own requests are
refused with an error naming the tenant and its share, and another tenant's still wait
for room, and are served once there is some.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtest import make_identity
from test_protocol_abuse import error_code
from test_tenant_isolation import Raw
from test_under_way_daemon_bound import hello, pin_dram_full, replies

from kvstore import protocol as p

MOST = 8  # server.max_requests_under_way here
SESSIONS = 4  # the heavy tenant's sessions
EACH = 2  # reserves each of them sends: 8, the daemon's whole bound


def test_one_tenants_sessions_leave_room_for_another_tenant(
        daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(f"[server]\nmax_requests_under_way = {MOST}\n"
                      '[dram]\npressure = ["defer", "reject"]\ndefer_seconds = 20\n')
    d = daemon_factory(tcp=True, dram_capacity="2MiB",
                       extra=["--config", str(config), "--slab-size", "1MiB"])
    owner = hello(d, "acme")
    heavy = [hello(d, "initech") for _ in range(SESSIONS)]
    light = hello(d, "globex")
    try:
        opened, full, held = pin_dram_full(owner)
        slots = len(full)
        spaces = []
        for raw in (*heavy, light):
            ns = raw.ask(p.OpenNamespace(2, make_identity(tenant="initech" if raw in heavy
                                                          else "globex")))
            assert isinstance(ns, p.NamespaceReply), ns
            spaces.append(ns.ns)
        for n, raw in enumerate(heavy):
            for i in range(EACH):
                raw.sock.send(p.encoder.encode(
                    p.Reserve(100 + i, spaces[n], [bytes([1 + n, 1 + i]) * 8])))
        refused = replies(heavy, SESSIONS * EACH - MOST // 2, 10)  # half of them: its share
        assert len(refused) == SESSIONS * EACH - MOST // 2, refused
        for reply in refused:
            assert error_code(reply) == "limit_exceeded", reply
            assert isinstance(reply, p.ErrorReply) and "tenant 'initech'" in reply.message
            assert "share" in reply.message, reply
        assert not replies(heavy, 1, 0.5)  # its others wait for room
        light.sock.send(p.encoder.encode(p.Reserve(7, spaces[-1], [b"\7" * 16])))
        assert not replies([light], 1, 0.5)  # another tenant's waits too: not refused
        assert isinstance(owner.ask(p.Release(5, held.pin)), p.OkReply)
        evicted = owner.ask(p.Evict(6, opened.ns, full))
        assert isinstance(evicted, p.CountReply) and evicted.count == slots, evicted
        served = replies([light], 1, 10)
        assert len(served) == 1 and isinstance(served[0], p.ReserveReply), served
        ended = replies(heavy, MOST // 2, 10)  # the heavy tenant's waiting ones, served
        assert len(ended) == MOST // 2, ended
        assert all(isinstance(r, p.ReserveReply) for r in ended), ended
        stats = owner.ask(p.Stats(8))
        assert isinstance(stats, p.StatsReply)
        assert stats.stats["invariant_violations"] == 0
        assert stats.stats["under_way"] == {"requests": 0, "keys": 0}, stats.stats
    finally:
        for each in (owner, *heavy, light):
            each.close()
