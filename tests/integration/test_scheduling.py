"""Scheduling in the real daemon: defer then serve or reject, the pressure chain."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client
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


def test_without_evict_in_the_chain_cached_blocks_stay(daemon_factory: Any,
                                                       tmp_path: Any) -> None:
    config = tmp_path / "chain.toml"
    config.write_text('[dram]\npressure = ["defer", "reject"]\ndefer_seconds = 0.1\n')
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes),
                       extra=["--slab-size", str(8 * BIG.block_bytes), "--config", str(config)])
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        keys = ns.keys(range(16 * 8))
        ns.put(keys, [bytes(BIG.block_bytes)] * 8)     # full, nothing pinned
        with pytest.raises(CapacityError):
            ns.put(ns.keys(range(10**6, 10**6 + 16)), [bytes(BIG.block_bytes)])
        assert ns.lookup(keys).blocks == 8             # nothing was evicted
        assert c.stats()["tiers"]["dram"]["evictions"] == 0
