"""A second reading of stop 55's change, against a real daemon over tcp.

An evict or a drop whose removed blocks had SSD copies is answered from a task once the
SSD index lets go of them (``Removals._answer``).  That task was counted under way like
a request still to run, and could be refused for a session's or a tenant's bound
(``kvstore.under_way``) after the removal was done: the client was told
``limit_exceeded`` ("nothing is started") while its blocks were gone.  A session with
``SESSION_MOST`` reserves waiting for room, the very one that evicts to make it, met it
at every evict.  Before stop 55 such a removal was answered at once and never refused.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvtest import make_identity
from test_attacks_s53 import ask_frames
from test_deferred_wakeups_s55 import wait_for_ssd_copies
from test_protocol_abuse import error_code
from test_under_way_daemon_bound import hello

from kvstore import protocol as p
from kvstore.under_way import SESSION_MOST

SHAPE = dict(num_layers=1, num_kv_heads=2, head_dim=32, block_tokens=16)  # 4 KiB blocks
DEFER = 20  # seconds the reserves wait for room: far past the test


def test_an_evict_done_is_not_refused_for_the_sessions_requests_waiting(
        daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[dram]\npressure = ["defer", "demote", "reject"]\n'
                      f'defer_seconds = {DEFER}\n')
    dram = 2 << 20
    d = daemon_factory(tcp=True, dram_capacity=str(dram), ssd_capacity="16MiB",
                       extra=["--config", str(config), "--slab-size", "1MiB",
                              "--ssd-write-policy", "write-through"])
    owner = hello(d, "acme")
    try:
        opened = owner.ask(p.OpenNamespace(2, make_identity(tenant="acme", **SHAPE)))
        assert isinstance(opened, p.NamespaceReply), opened
        slots = dram // opened.slot_bytes
        keys = [i.to_bytes(16, "big") for i in range(1, slots + 1)]
        put = ask_frames(owner, p.Put(3, opened.ns, keys),
                         *[b"\1" * opened.block_bytes] * slots)
        assert isinstance(put, p.PutReply) and put.created == slots, put
        wait_for_ssd_copies(owner, slots)
        for i in range(SESSION_MOST):  # DRAM full: each waits for room, under way
            owner.sock.send(p.encoder.encode(
                p.Reserve(100 + i, opened.ns, [(slots + 1 + i).to_bytes(16, "big")])))
        time.sleep(0.5)
        assert not owner.sock.poll(0), "the reserves were to wait for room"
        tail = 8
        owner.sock.send(p.encoder.encode(p.Evict(8, opened.ns, keys[-tail:-tail + 1])))
        evicted = None
        deadline = time.monotonic() + DEFER / 2
        while evicted is None and time.monotonic() < deadline:
            if owner.sock.poll(50):
                reply = p.reply_decoder.decode(owner.sock.recv_multipart()[0])
                if reply.rid == 8:
                    evicted = reply
        # before: limit_exceeded, the blocks gone all the same
        assert isinstance(evicted, p.CountReply) and evicted.count == tail, (
            error_code(evicted) if isinstance(evicted, p.ErrorReply) else evicted)
    finally:
        owner.close()
