"""Scheduling in the real daemon: defer then serve or reject, the pressure chain."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore.errors import CapacityError

BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB blocks


def full_of_pins(daemon_factory: Any, **kw: Any) -> tuple[Any, Client, Any]:
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes),
                       extra=["--slab-size", str(8 * BIG.block_bytes), *kw.pop("extra", [])],
                       **kw)
    holder = Client(d.endpoint, tenant="acme")
    ns = holder.namespace(BIG)
    keys = ns.keys(range(16 * 8))
    ns.put(keys, [bytes(BIG.block_bytes)] * 8)
    return d, holder, ns.acquire(keys)


def test_a_deferred_reservation_is_served_when_room_frees(daemon_factory: Any) -> None:
    d, holder, held = full_of_pins(daemon_factory)
    try:
        with Client(d.endpoint, tenant="acme") as other:
            ns = other.namespace(BIG)
            result: list[Any] = []

            def reserve() -> None:
                try:
                    with ns.reserve(ns.keys(range(10**6, 10**6 + 16))) as r:
                        result.append(r.commit())
                except Exception as exc:   # pragma: no cover - reported below
                    result.append(exc)

            worker = threading.Thread(target=reserve)
            worker.start()
            time.sleep(0.1)                # deferred: the tier is full of pins
            assert not result
            held.release()                 # room frees; the deferred request goes on
            worker.join(10)
            assert result == [1]
            sched = other.stats()["scheduling"]
            assert sched["defers"] >= 1 and sched["defer_timeouts"] == 0
    finally:
        holder.close()


def test_a_deferred_reservation_is_rejected_at_its_deadline(daemon_factory: Any) -> None:
    d, holder, held = full_of_pins(daemon_factory)
    try:
        with Client(d.endpoint, tenant="acme") as other:
            ns = other.namespace(BIG)
            started = time.monotonic()
            with pytest.raises(CapacityError, match="deferred, then rejected"):
                ns.reserve(ns.keys(range(10**6, 10**6 + 16)))
            waited = time.monotonic() - started
            assert 0.2 <= waited < 3
            sched = other.stats()["scheduling"]
            assert sched["defer_timeouts"] == 1
            assert other.stats()["tiers"]["dram"]["reserved_slots"] == 0
    finally:
        held.release()
        holder.close()


def _eight_block_daemon(daemon_factory: Any, tmp_path: Any, chain: str,
                       defer_seconds: float) -> Any:
    """A daemon whose DRAM holds eight BIG blocks, under the pressure chain ``chain``."""
    config = tmp_path / "chain.toml"
    config.write_text(f"[dram]\npressure = {chain}\ndefer_seconds = {defer_seconds}\n")
    return daemon_factory(dram_capacity=str(8 * BIG.block_bytes),
                          extra=["--slab-size", str(8 * BIG.block_bytes),
                                 "--config", str(config)])


def _fill(ns: Any) -> list[bytes]:
    """Eight blocks in one chain: the tier is full, nothing pinned."""
    keys: list[bytes] = ns.keys(range(16 * 8))
    ns.put(keys, [bytes(BIG.block_bytes)] * 8)
    return keys


def test_without_evict_in_the_chain_cached_blocks_stay(daemon_factory: Any,
                                                       tmp_path: Any) -> None:
    d = _eight_block_daemon(daemon_factory, tmp_path, '["defer", "reject"]', 0.1)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        keys = _fill(ns)
        with pytest.raises(CapacityError):
            ns.put(ns.keys(range(10**6, 10**6 + 16)), [bytes(BIG.block_bytes)])
        assert ns.lookup(keys).blocks == 8             # nothing was evicted
        assert c.stats()["tiers"]["dram"]["evictions"] == 0


def test_soft_pins_go_last_and_hard_pins_never(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes),
                       extra=["--slab-size", str(8 * BIG.block_bytes)])
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        prompt = ns.keys(range(16 * 2))                  # a system prompt kept warm
        ns.put(prompt, [bytes(BIG.block_bytes)] * 2)
        assert ns.keep_warm(prompt, 60) == 2
        for i in range(10):                              # colder traffic passes through
            keys = ns.keys(range(10**6 * (i + 1), 10**6 * (i + 1) + 16 * 2))
            ns.put(keys, [bytes(BIG.block_bytes)] * 2)
        assert ns.lookup(prompt).blocks == 2             # still there
        with ns.acquire(prompt):
            for i in range(8):                           # only warm + pinned are left to take
                keys = ns.keys(range(10**8 * (i + 1), 10**8 * (i + 1) + 16 * 3))
                ns.put(keys, [bytes(BIG.block_bytes)] * 3)
            assert ns.lookup(prompt).blocks == 2         # the hard pin holds


def test_batch_admission_is_all_or_none_and_says_what_fits(daemon_factory: Any) -> None:
    from kvstore.client import PlanItem

    d, holder, held = full_of_pins(daemon_factory)      # 8 slots, all pinned
    try:
        held.release()
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(BIG)
            bt = BIG.block_tokens

            def item(i: int, reserved: int, new: int) -> PlanItem:
                need = -(-(reserved + new) // bt) - -(-reserved // bt)
                return PlanItem(reserved, new, ns.keys(range(10**6 * (i + 1),
                                                             10**6 * (i + 1) + need * bt)))

            too_big = [item(1, 0, 5 * bt), item(2, 3, 2 * bt), item(3, 0, 2 * bt)]
            result = ns.reserve_batch(too_big)            # 5 + 2 + 2 = 9 > 8
            assert not result.admitted and result.blocks == [5, 2, 2]
            assert result.fitting == [0, 1]
            assert c.stats()["tiers"]["dram"]["reserved_slots"] == 0
            fits = ns.reserve_batch([item(4, 0, 3 * bt), item(5, bt, bt + 1)])
            assert fits.admitted and fits.blocks == [3, 2]
            assert [len(r.buffers) for r in fits.reservations] == [3, 2]
            assert sum(r.commit() for r in fits.reservations) == 5
    finally:
        holder.close()


def ssd_daemon(daemon_factory: Any) -> Any:
    """A daemon whose DRAM holds 8 BIG blocks, with an SSD tier under it."""
    return daemon_factory(dram_capacity=str(8 * BIG.block_bytes), ssd_capacity="64MiB",
                          extra=["--slab-size", str(8 * BIG.block_bytes)])


def push_down(ns: Any, chain: list[bytes], rounds: range) -> None:
    """Put other 4-block chains (one per round) until ``chain`` is on SSD only."""
    for i in rounds:
        keys = ns.keys(range(10**6 * (i + 1), 10**6 * (i + 1) + 16 * 4))
        ns.put(keys, [bytes(BIG.block_bytes)] * 4)
    # a demotion's write to SSD finishes in the background: its DRAM copy stays till then
    deadline = time.monotonic() + 10
    while set(ns.lookup(chain).tiers) != {"ssd"}:
        assert time.monotonic() < deadline, ns.lookup(chain)
        time.sleep(0.01)


def test_prefetch_promotes_ahead_of_use(daemon_factory: Any) -> None:
    d = ssd_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        first = ns.keys(range(16 * 4))
        ns.put(first, [b"\1" * BIG.block_bytes] * 4)
        push_down(ns, first, rounds=range(4))
        result = ns.prefetch(first, wait=True, timeout=10)
        assert result.ready == 4 and result.cached == 4
        assert ns.lookup(first).tiers == ["dram"] * 4
        missing = ns.keys(range(5 * 10**7, 5 * 10**7 + 16 * 2))
        partial = ns.prefetch(first + missing, wait=True)
        assert partial.cached == 4 and partial.ready == 4     # a usable prefix
        c.report(recomputed_tokens=32)
        assert c.stats()["scheduling"]["recomputed_tokens"] == 32


def test_a_posted_prefetch_promotes_without_a_round_trip(daemon_factory: Any) -> None:
    d = ssd_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        first = ns.keys(range(16 * 4))
        ns.put(first, [b"\1" * BIG.block_bytes] * 4)
        push_down(ns, first, rounds=range(4))
        ns.post_prefetch(first)                          # returns before any reply
        assert c._unread                                  # its reply is read later
        deadline = time.monotonic() + 10
        while ns.lookup(first).tiers != ["dram"] * 4:
            assert time.monotonic() < deadline, ns.lookup(first)
            time.sleep(0.01)
        assert not c._unread                              # settled by a later reply
        assert ns.get(first) == [b"\1" * BIG.block_bytes] * 4
        push_down(ns, first, rounds=range(4, 8))         # down to SSD again

    async def posted_by_the_async_client() -> list[str]:
        async with AsyncClient(d.endpoint, tenant="acme") as ac:
            ans = await ac.namespace(BIG)
            await ans.post_prefetch(first)
            deadline = time.monotonic() + 10
            while (tiers := (await ans.lookup(first)).tiers) != ["dram"] * 4:
                assert time.monotonic() < deadline, tiers
                await asyncio.sleep(0.01)
            return tiers

    assert asyncio.run(posted_by_the_async_client()) == ["dram"] * 4


def test_a_scan_does_not_flush_the_hot_set_under_the_scan_resistant_policies(
        daemon_factory: Any) -> None:
    small = make_identity(num_layers=2, num_kv_heads=2, head_dim=64)   # 16 KiB blocks
    hits = {}
    for policy in ("lru", "s3fifo", "arc", "slru"):
        d = daemon_factory(dram_capacity=str(64 * small.block_bytes),
                           extra=["--slab-size", str(64 * small.block_bytes),
                                  "--eviction-policy", policy])
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(small)
            hot = [ns.keys(range(16 * i, 16 * (i + 1))) for i in range(24)]
            for keys in hot:
                ns.put(keys, [bytes(small.block_bytes)])
            found = 0
            for round_ in range(6):
                for keys in hot:                                  # the hot set, reused
                    if ns.lookup(keys).blocks:
                        found += 1
                    else:
                        ns.put(keys, [bytes(small.block_bytes)])
                for j in range(60):                               # a scan of one-time blocks
                    scan = ns.keys(range(10**7 * (round_ + 1) + 16 * j,
                                         10**7 * (round_ + 1) + 16 * (j + 1)))
                    ns.put(scan, [bytes(small.block_bytes)])
            hits[policy] = found
        d.stop()
    for policy in ("s3fifo", "arc", "slru"):
        assert hits[policy] > 1.5 * hits["lru"], hits


SMALL = make_identity(num_layers=2, num_kv_heads=2, head_dim=64)   # 16 KiB blocks


def _spaces(ca: Client, cb: Client) -> tuple[Any, Any]:
    return (ca.namespace(make_identity(num_layers=2, num_kv_heads=2, head_dim=64, tenant="a")),
            cb.namespace(make_identity(num_layers=2, num_kv_heads=2, head_dim=64, tenant="b")))


def _put_roots(ns: Any, first: int, count: int) -> list[list[bytes]]:
    chains = [ns.keys(range(16 * i, 16 * (i + 1))) for i in range(first, first + count)]
    for keys in chains:
        ns.put(keys, [bytes(SMALL.block_bytes)])
    return chains


def test_two_tenants_under_pressure_each_keep_their_share(daemon_factory: Any,
                                                          tmp_path: Any) -> None:
    """64 slots, tenant b weighted 3: b's 40 cold blocks outlast a flood from tenant a,
    which recycles its own 24 (a's share is 16; b, within its 48, is never touched)."""
    config = tmp_path / "weights.toml"
    config.write_text('[server]\ntenant_weights = { b = 3.0 }\n')
    d = daemon_factory(dram_capacity=str(64 * SMALL.block_bytes),
                       extra=["--slab-size", str(64 * SMALL.block_bytes),
                              "--config", str(config)])
    with Client(d.endpoint, tenant="a") as ca, Client(d.endpoint, tenant="b") as cb:
        a, b = _spaces(ca, cb)
        b_chains = _put_roots(b, 0, 40)
        a_chains = _put_roots(a, 1000, 200)
        assert sum(b.lookup(k).blocks for k in b_chains) == 40
        assert sum(a.lookup(k).blocks for k in a_chains[-24:]) == 24
        stats = ca.stats()
        assert stats["tenant_dram_bytes"] == {"a": 24 * SMALL.block_bytes,
                                              "b": 40 * SMALL.block_bytes}
        _put_roots(b, 5000, 20)            # b grows past its share of 48: a gives way
        stats = ca.stats()
        assert stats["tenant_dram_bytes"]["b"] == 48 * SMALL.block_bytes
        assert stats["invariant_violations"] == 0


def test_a_tenant_quota_caps_its_dram_and_spares_the_others(daemon_factory: Any) -> None:
    quota = 16 * SMALL.block_bytes
    d = daemon_factory(dram_capacity=str(64 * SMALL.block_bytes),
                       extra=["--slab-size", str(64 * SMALL.block_bytes)],
                       env={"KVSTORE_DRAM_TENANT_QUOTA": str(quota)})
    with Client(d.endpoint, tenant="a") as ca, Client(d.endpoint, tenant="b") as cb:
        a, b = _spaces(ca, cb)
        b_chains = _put_roots(b, 0, 10)
        a_chains = _put_roots(a, 1000, 50)
        stats = ca.stats()
        assert stats["tenant_dram_bytes"]["a"] == quota
        assert sum(a.lookup(k).blocks for k in a_chains[-16:]) == 16   # its newest stay
        assert sum(b.lookup(k).blocks for k in b_chains) == 10
        assert stats["tiers"]["dram"]["free"] >= 38 * SMALL.block_bytes
        held = a.acquire([k for c in a_chains[-16:] for k in c])     # all of a's, pinned
        with pytest.raises(CapacityError, match="quota"):
            _put_roots(a, 9000, 1)
        held.release()
        _put_roots(a, 9000, 1)
        assert ca.stats()["invariant_violations"] == 0


@pytest.mark.parametrize("chain,waits", [('["evict", "defer", "reject"]', False),
                                         ('["defer", "evict", "reject"]', True)])
def test_the_daemon_runs_the_pressure_chain_in_its_order(daemon_factory: Any, tmp_path: Any,
                                                         chain: str, waits: bool) -> None:
    """Evict before defer: a full tier makes room at once.  Defer before evict: the
    request first waits for room (none comes), and evicts only at its deadline."""
    d = _eight_block_daemon(daemon_factory, tmp_path, chain, 0.4)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        keys = _fill(ns)
        started = time.monotonic()
        ns.put(ns.keys(range(10**6, 10**6 + 16)), [bytes(BIG.block_bytes)])
        waited = time.monotonic() - started
        stats = c.stats()
        assert stats["tiers"]["dram"]["evictions"] == 1
        assert stats["scheduling"]["defers"] == (1 if waits else 0)
        assert (waited >= 0.35) is waits, waited
        assert ns.lookup(keys).blocks == 7             # the chain lost its leaf only


def _deferred_reserve(endpoint: str, first: int, blocks: int,
                      out: dict[str, Any], name: str) -> threading.Thread:
    """A reserve of ``blocks`` BIG blocks in a thread of its own: what it got, when."""
    def run() -> None:
        with Client(endpoint, tenant="acme", timeout=30) as c:
            ns = c.namespace(BIG)
            started = time.monotonic()
            try:
                ns.reserve(ns.keys(range(first, first + 16 * blocks))).abort()
                out[name] = ("granted", time.monotonic() - started)
            except CapacityError as exc:
                out[name] = (str(exc), time.monotonic() - started)

    worker = threading.Thread(target=run)
    worker.start()
    return worker


def test_a_deferred_request_too_large_for_the_room_holds_up_none_behind_it(
        daemon_factory: Any) -> None:
    # Only the oldest waiter was woken when room freed; one that still did not fit
    # waited again without passing the wake on, and every later request waited its
    # whole deadline with the room for it free.
    d, holder, held = full_of_pins(daemon_factory, env={"KVSTORE_DRAM_DEFER_SECONDS": "4"})
    try:
        out: dict[str, Any] = {}
        big = _deferred_reserve(d.endpoint, 10**6, 16, out, "big")  # more than the tier
        time.sleep(0.3)
        small = _deferred_reserve(d.endpoint, 2 * 10**6, 2, out, "small")
        time.sleep(0.3)
        assert out == {}  # both deferred
        held.release()  # room for 8 blocks frees: the small request fits
        small.join(10)
        assert out["small"][0] == "granted" and out["small"][1] < 1.5, out
        big.join(10)
        assert "deferred, then rejected" in out["big"][0]
        with Client(d.endpoint, tenant="acme") as c:
            assert c.stats()["tiers"]["dram"]["reserved_slots"] == 0
    finally:
        holder.close()


def test_a_stop_refuses_deferred_requests_rather_than_wait_out_their_deadline(
        daemon_factory: Any) -> None:
    # SIGTERM stops reading requests, so nothing can free room: a deferred request
    # waited its whole deadline (the stop with it) before it was refused.
    d, holder, held = full_of_pins(daemon_factory, env={"KVSTORE_DRAM_DEFER_SECONDS": "20"})
    try:
        out: dict[str, Any] = {}
        waiting = _deferred_reserve(d.endpoint, 10**6, 1, out, "deferred")
        time.sleep(0.5)
        started = time.monotonic()
        assert d.stop() == 0
        stopped = time.monotonic() - started
        waiting.join(30)
        assert stopped < 8, f"the stop took {stopped:.1f}s"
        assert out["deferred"][0] != "granted" and out["deferred"][1] < 10, out
    finally:
        holder.close()
