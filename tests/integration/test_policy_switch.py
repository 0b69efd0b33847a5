"""The DRAM eviction policy changes at runtime by SIGHUP, against the real daemon: every
cached block stays, pinned blocks stay pinned, and eviction goes on by the new order."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import CapacityError

ORDERS = {"lru": "LRUPolicy(", "auto": "AutoPolicy(", "s3fifo": "S3FIFOPolicy(",
          "density": "HitDensityPolicy("}
SMALL = make_identity(num_layers=2, num_kv_heads=2, head_dim=64)  # 16 KiB blocks


def _chain(ns: Any, i: int) -> list[bytes]:
    return ns.keys(range(16 * i, 16 * (i + 1)))  # type: ignore[no-any-return]


def _wait_for_policy(client: Client, name: str) -> None:
    deadline = time.monotonic() + 10
    while client.stats()["eviction_policies"]["dram"] != name:
        assert time.monotonic() < deadline, "the reload did not take effect"
        time.sleep(0.05)


@pytest.mark.parametrize(("before", "after"), [("lru", "auto"), ("auto", "s3fifo"),
                                               ("auto", "density"), ("density", "lru")])
def test_sighup_switches_the_eviction_policy_and_keeps_every_block(
        daemon_factory: Any, tmp_path: Path, before: str, after: str) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[dram]\neviction_policy = "{before}"\n')
    d = daemon_factory(dram_capacity=str(64 * SMALL.block_bytes),
                       extra=["--config", str(config),
                              "--slab-size", str(64 * SMALL.block_bytes)])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(SMALL)
        assert client.stats()["eviction_policies"]["dram"] == before
        assert ORDERS[before] in client.stats()["eviction_orders"][0]
        chains = [_chain(ns, i) for i in range(40)]
        for keys in chains:
            ns.put(keys, [bytes(SMALL.block_bytes)])
        held = ns.acquire(chains[0])  # pinned across the switch
        ns.keep_warm(chains[1], 60.0)  # kept warm across it

        config.write_text(f'[dram]\neviction_policy = "{after}"\n')
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        _wait_for_policy(client, after)

        assert [ns.lookup(keys).blocks for keys in chains] == [1] * 40
        stats = client.stats()
        (order,) = stats["eviction_orders"]  # one slab class, now ordered by the new policy
        assert ORDERS[after] in order and "pinned=1" in order and "warm=1" in order, order
        assert stats["tiers"]["dram"]["evictions"] == 0
        assert stats["invariant_violations"] == 0

        # The new order evicts: 64 slots, 40 used; 60 more chains push 36 out, never
        # the pinned block nor the warm one (others are evictable).
        for i in range(100, 160):
            ns.put(_chain(ns, i), [bytes(SMALL.block_bytes)])
        assert client.stats()["tiers"]["dram"]["evictions"] == 36
        assert ns.lookup(chains[0]).blocks == 1
        assert ns.lookup(chains[1]).blocks == 1
        held.release()
        assert client.stats()["invariant_violations"] == 0


def test_an_unknown_policy_on_reload_keeps_the_running_one(
        daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction_policy = "lru"\n')
    d = daemon_factory(dram_capacity=str(64 * SMALL.block_bytes),
                       extra=["--config", str(config),
                              "--slab-size", str(64 * SMALL.block_bytes)])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(SMALL)
        keys = _chain(ns, 0)
        ns.put(keys, [bytes(SMALL.block_bytes)])
        config.write_text('[dram]\neviction_policy = "mru"\n')
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload refused" not in d.log():
            assert time.monotonic() < deadline, "the bad reload was not reported"
            time.sleep(0.05)
        assert "eviction_policy" in d.log()
        assert client.stats()["eviction_policies"]["dram"] == "lru"
        assert ns.lookup(keys).blocks == 1
        with pytest.raises(CapacityError):  # the daemon still answers as before
            ns.put(ns.keys(range(10**6, 10**6 + 16 * 65)),
                   [bytes(SMALL.block_bytes)] * 65)


def test_a_switch_of_thousands_of_blocks_goes_in_loop_turns(
        daemon_factory: Any, tmp_path: Path) -> None:
    """4096 blocks pass to the new order 256 a loop turn, the daemon answering between
    them (its invariants checked after every request): every block stays, the pinned
    one pinned, the warm ones warm, and the new order evicts."""
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction_policy = "auto"\n')
    d = daemon_factory(dram_capacity=str(4160 * SMALL.block_bytes),
                       extra=["--config", str(config), "--log-level", "info",
                              "--slab-size", str(64 * SMALL.block_bytes)])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(SMALL)
        chains = [ns.keys(range(1024 * i, 1024 * (i + 1))) for i in range(64)]  # 64 blocks
        for keys in chains:
            ns.put(keys, [bytes(SMALL.block_bytes)] * 64)
        held = ns.acquire(chains[0][:1])
        ns.keep_warm(chains[1], 60.0)
        config.write_text('[dram]\neviction_policy = "slru"\n')
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        answered = 0
        while True:  # the daemon answers while the blocks pass (a lookup, then a look)
            assert ns.lookup(chains[answered % 64]).blocks == 64
            answered += 1
            if "eviction policy slru in charge" in d.log():
                break
            assert time.monotonic() < deadline, "the switch did not end"
        line = next(x for x in d.log().splitlines() if "eviction policy slru in charge" in x)
        turns = int(line.split("after ")[1].split(" loop turns")[0])
        assert turns >= 4096 // 256 // 2, line  # (lookups between turns pass some on too)
        assert answered >= 1
        switch = client.stats()["eviction_switch"]
        assert switch == {"under_way": False, "passed": 0, "done": 1, "last_turns": turns}
        assert [ns.lookup(keys).blocks for keys in chains] == [64] * 64
        stats = client.stats()
        (order,) = stats["eviction_orders"]
        assert "SLRUPolicy(" in order and "pinned=1" in order and "warm=64" in order, order
        assert stats["tiers"]["dram"]["evictions"] == 0
        assert stats["invariant_violations"] == 0
        for i in range(64, 70):  # 64 slots free, then 320 evicted by the new order
            ns.put(ns.keys(range(1024 * i, 1024 * (i + 1))), [bytes(SMALL.block_bytes)] * 64)
        assert client.stats()["tiers"]["dram"]["evictions"] == 6 * 64 - 64
        assert ns.lookup(chains[0][:1]).blocks == 1 and ns.lookup(chains[1]).blocks == 64
        held.release()
        assert client.stats()["invariant_violations"] == 0
