"""A real daemon under ``auto``: a commit of thousands of blocks takes its share of the
duel's sampled references at once and leaves the rest for the loop's next turns
(``kvstore.scheduler.duel_samples``), which take them all, a slice a turn, while
requests go on being served; eviction by the duel goes on after them, every invariant
checked after every request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.scheduler.duel_samples import A_TURN

TINY = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512 B blocks, 4 KiB slots


def _samples(client: Client) -> dict[str, int]:
    return client.stats()["eviction_samples"]  # type: ignore[no-any-return]


def test_a_big_commits_samples_are_taken_in_later_turns(daemon_factory: Any,
                                                        tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction_policy = "auto"\n')
    d = daemon_factory(dram_capacity="16MiB", extra=["--config", str(config),
                                                     "--slab-size", "1MiB"])
    with Client(d.endpoint, tenant="acme", timeout=30) as client:
        ns = client.namespace(TINY)
        assert _samples(client) == {"waiting": 0, "taken_later": 0}
        first = ns.keys(range(16 * 3000))
        ns.put(first, [bytes(TINY.block_bytes)] * len(first))  # one commit of 3000
        deadline = time.monotonic() + 10
        while (samples := _samples(client))["waiting"]:
            assert time.monotonic() < deadline, samples
            time.sleep(0.01)
        # one key in eight sampled (a cache of 4096 blocks), 375 or so: A_TURN at once
        assert 100 < samples["taken_later"] < 3000 // 8 * 2 - A_TURN, samples
        assert ns.lookup(first).blocks == len(first)
        # chains that overflow the arena: the duel picks victims, its backlogs drain
        for i in range(1, 6):
            keys = ns.keys(range(100_000 * i, 100_000 * i + 16 * 1500))
            ns.put(keys, [bytes(TINY.block_bytes)] * len(keys))
            assert ns.lookup(keys).blocks == len(keys)
        deadline = time.monotonic() + 10
        while (samples := _samples(client))["waiting"]:
            assert time.monotonic() < deadline, samples
            time.sleep(0.01)
        stats = client.stats()
        assert stats["tiers"]["dram"]["evictions"] >= 4000, stats["tiers"]["dram"]
        assert "AutoPolicy(" in stats["eviction_orders"][0]
        assert stats["invariant_violations"] == 0
