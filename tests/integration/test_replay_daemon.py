"""The replay through a real daemon gives its simulator's hits: the simulator calls a
policy as the store does (reserve room for a put's blocks, then commit them deepest
first), so what the daemon does differently shows up in the replay's ``-sim`` column."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest


def _load_replay() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "replay.py"
    spec = importlib.util.spec_from_file_location("kvstore_benchmark_replay_daemon", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


replay = _load_replay()


def _renamed(trace: list[Any], seed: int) -> list[Any]:
    """``trace`` with every block id renamed to a random one (the same for the same id)."""
    rng = random.Random(seed)
    names: dict[int, int] = {}
    return [msgspec.structs.replace(r, hash_ids=[names.setdefault(h, rng.getrandbits(60))
                                                 for h in r.hash_ids]) for r in trace]


@pytest.mark.parametrize("policy", ["lru", "slru", "arc", "s3fifo", "density", "auto"])
def test_the_daemon_hits_what_its_simulator_hits(policy: str) -> None:
    trace = replay.cacheable(replay.synthetic("conversations", 250))
    capacity = replay.daemon_capacity(0.05, replay.unique_blocks(trace))
    sim = replay.replay(trace, replay.PolicyCache(replay.POLICIES[policy](), capacity))
    daemon = replay.replay_daemon(trace, policy, capacity, replay.KeyChains())
    assert daemon.evictions > 0  # the cache was full: the order decided
    assert sim.hit_blocks > 0
    if policy == "auto":
        # Its miniatures sample keys by hash, the store's blocks and the simulator's
        # ids hash apart: the same elections are not promised.  The daemon's hits are
        # within what the simulator hits over samplings (the same trace, its ids
        # renamed at random: another sample of keys each).
        hits = [sim.hit_blocks] + [
            replay.replay(_renamed(trace, seed),
                          replay.PolicyCache(replay.POLICIES[policy](), capacity)).hit_blocks
            for seed in range(1, 8)]
        slack = 0.01 * sim.blocks
        assert min(hits) - slack <= daemon.hit_blocks <= max(hits) + slack, (daemon, hits)
    else:
        assert daemon.hit_blocks == sim.hit_blocks
    assert daemon.tier_hits == {"dram": daemon.hit_blocks}


def test_with_an_ssd_tier_beneath_the_replay_counts_hits_by_tier() -> None:
    trace = replay.cacheable(replay.synthetic("conversations", 250))
    unique = replay.unique_blocks(trace)
    capacity = replay.daemon_capacity(0.05, unique)
    sim = replay.replay(trace, replay.PolicyCache(replay.POLICIES["auto"](), capacity))
    ssd_blocks = unique // replay.SLAB_SLOTS * replay.SLAB_SLOTS  # room for every block
    daemon = replay.replay_daemon(trace, "auto", capacity, replay.KeyChains(),
                                  ssd_blocks=ssd_blocks)
    assert daemon.tier_hits is not None and daemon.tier_hits.get("ssd", 0) > 0
    assert sum(daemon.tier_hits.values()) == daemon.hit_blocks
    assert daemon.hit_blocks > sim.hit_blocks  # what DRAM dropped, SSD still had
    assert daemon.tiers is not None and daemon.tiers["ssd"]["writes"] > 0
