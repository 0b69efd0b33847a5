"""Requests deferred behind a full DRAM are woken when an evict or a drop answered later
frees it.

A real daemon over tcp, raw ZeroMQ sockets.  One tenant's blocks fill DRAM; three other
tenants' reserves defer (pressure ``["defer", "reject"]``: nothing of another's is
evicted for them); then that tenant evicts (or drops) its blocks.  The server wakes the
waiters after a freeing request answered at once; an evict whose first slice did not
reach its end (more than ``DROP_SLICE`` entries, or past its millisecond: 256 blocks,
13 of 20 runs here) and a drop of more than ``DROP_AT_ONCE`` blocks go on in slices,
are answered from a task, and woke no one: the reserves waited out their deadline, the
room free, and were refused.  (When the owner released a pin just before, the wake-ups
that release passed from waiter to waiter were sometimes still going as the first slice
freed room, and served them: the failure came in some runs only.)  Here nothing else
wakes them, and the owner's chain is longer than a slice, so the removal always goes
on in slices.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity
from test_attacks_s53 import ask_frames
from test_protocol_abuse import error_code
from test_under_way_daemon_bound import hello, replies

from kvstore import protocol as p
from kvstore.removals import DROP_SLICE

TENANTS = ("globex", "initech", "umbrella")
EACH = 3  # reserves each of those tenants leaves waiting
# seconds: far past a removal's time.  At its deadline a deferred request runs once
# more and finds the room free, so a reply before it is what says it was woken
DEFER = 20
SHAPE = dict(num_layers=1, num_kv_heads=2, head_dim=32, block_tokens=16)  # 4 KiB blocks
DRAM = 32 << 20  # 8192 of them: two slices' worth
CHAIN = 4096  # keys a request may name (``server.max_keys_per_request``)


def wait_for_ssd_copies(owner: Any, blocks: int) -> None:
    """Until the SSD tier holds ``blocks`` copies (``owner``: a raw session)."""
    deadline = time.monotonic() + 30
    while True:
        stats = owner.ask(p.Stats(4))
        assert isinstance(stats, p.StatsReply)
        if stats.stats["tiers"]["ssd"]["blocks"] >= blocks:
            return
        assert time.monotonic() < deadline, stats.stats["tiers"]["ssd"]
        time.sleep(0.05)


def defer_reserves(others: dict[str, Any]) -> None:
    """Each tenant of ``others`` (raw sessions) opens a namespace and sends ``EACH``
    reserves of a block, which wait: DRAM is full."""
    namespaces = {}
    for tenant, raw in others.items():
        ns = raw.ask(p.OpenNamespace(2, make_identity(tenant=tenant, **SHAPE)))
        assert isinstance(ns, p.NamespaceReply), ns
        namespaces[tenant] = ns.ns
    for i in range(EACH):
        for tenant, raw in others.items():
            raw.sock.send(p.encoder.encode(
                p.Reserve(100 + i, namespaces[tenant], [bytes([1 + i]) * 16])))
    assert not replies(list(others.values()), 1, 0.3)  # DRAM full: they wait


@pytest.mark.parametrize("removal", ["evict", "drop"])
def test_reserves_deferred_behind_a_full_dram_wake_when_a_removal_in_slices_frees_it(
        daemon_factory: Any, tmp_path: Path, removal: str) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[dram]\npressure = ["defer", "reject"]\ndefer_seconds = {DEFER}\n')
    d = daemon_factory(tcp=True, dram_capacity=str(DRAM),
                       extra=["--config", str(config), "--slab-size", "1MiB"])
    owner = hello(d, "acme")
    others = {tenant: hello(d, tenant) for tenant in TENANTS}
    try:
        opened = owner.ask(p.OpenNamespace(2, make_identity(tenant="acme", **SHAPE)))
        assert isinstance(opened, p.NamespaceReply), opened
        slots = DRAM // opened.slot_bytes
        assert slots > DROP_SLICE and slots % CHAIN == 0, slots  # more than one slice
        keys = [i.to_bytes(16, "big") for i in range(1, slots + 1)]
        for at in range(0, slots, CHAIN):  # one chain, a request's worth at a time
            chain = keys[at:at + CHAIN]
            put = ask_frames(owner, p.Put(3, opened.ns, chain, keys[at - 1] if at else None),
                             *[b"\1" * opened.block_bytes] * len(chain))
            assert isinstance(put, p.PutReply) and put.created == len(chain), put
        defer_reserves(others)
        if removal == "evict":
            removed = owner.ask(p.Evict(8, opened.ns, keys[:1]))  # the whole chain
        else:
            removed = owner.ask(p.DropNamespace(8, opened.ns))
        assert isinstance(removed, p.CountReply) and removed.count == slots, removed
        # each answered once, with its reservation, woken by the room the removal freed
        # (before: none answered until its deadline)
        got = replies(list(others.values()), len(TENANTS) * EACH, DEFER / 2)
        assert len(got) == len(TENANTS) * EACH, got
        assert all(isinstance(r, p.ReserveReply) for r in got), [
            error_code(r) if isinstance(r, p.ErrorReply) else r for r in got]
        stats = owner.ask(p.Stats(9))
        assert isinstance(stats, p.StatsReply)
        assert stats.stats["invariant_violations"] == 0
        assert stats.stats["scheduling"]["defer_timeouts"] == 0, stats.stats["scheduling"]
    finally:
        for each in (owner, *others.values()):
            each.close()


def test_reserves_deferred_wake_when_an_evict_answered_once_the_ssd_index_lets_go(
        daemon_factory: Any, tmp_path: Path) -> None:
    # An evict of blocks with SSD copies is answered once their index records are out
    # (a crash after the reply brought them back): from a task, so the server wakes
    # none after it; the evict itself wakes those waiting for the room it freed.
    config = tmp_path / "kvstore.toml"
    # (``demote`` writes to SSD at all; after the wait, never reached here)
    config.write_text(f'[dram]\npressure = ["defer", "demote", "reject"]\n'
                      f'defer_seconds = {DEFER}\n')
    dram = 2 << 20
    d = daemon_factory(tcp=True, dram_capacity=str(dram), ssd_capacity="16MiB",
                       extra=["--config", str(config), "--slab-size", "1MiB",
                              "--ssd-write-policy", "write-through"])
    owner = hello(d, "acme")
    others = {tenant: hello(d, tenant) for tenant in TENANTS}
    try:
        opened = owner.ask(p.OpenNamespace(2, make_identity(tenant="acme", **SHAPE)))
        assert isinstance(opened, p.NamespaceReply), opened
        slots = dram // opened.slot_bytes
        keys = [i.to_bytes(16, "big") for i in range(1, slots + 1)]
        put = ask_frames(owner, p.Put(3, opened.ns, keys),
                         *[b"\1" * opened.block_bytes] * slots)
        assert isinstance(put, p.PutReply) and put.created == slots, put
        wait_for_ssd_copies(owner, slots)
        defer_reserves(others)
        tail = 2 * len(TENANTS) * EACH  # a few blocks: one slice, answered once withdrawn
        removed = owner.ask(p.Evict(8, opened.ns, keys[-tail:-tail + 1]))
        assert isinstance(removed, p.CountReply) and removed.count == tail, removed
        got = replies(list(others.values()), len(TENANTS) * EACH, DEFER / 2)
        assert len(got) == len(TENANTS) * EACH, got
        assert all(isinstance(r, p.ReserveReply) for r in got), [
            error_code(r) if isinstance(r, p.ErrorReply) else r for r in got]
    finally:
        for each in (owner, *others.values()):
            each.close()
