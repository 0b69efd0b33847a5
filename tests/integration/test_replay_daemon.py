"""The replay through a real daemon gives its simulator's hits: the simulator calls a
policy as the store does (reserve room for a put's blocks, then commit them deepest
first), so what the daemon does differently shows up in the replay's ``-sim`` column."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvstore.blocks import key_hash
from kvstore.scheduler.eviction import make_policy


def _load_replay() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "replay.py"
    spec = importlib.util.spec_from_file_location("kvstore_benchmark_replay_daemon", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


replay = _load_replay()


@pytest.mark.parametrize("policy", ["lru", "slru", "arc", "s3fifo", "density", "auto"])
def test_the_daemon_hits_what_its_simulator_hits(policy: str) -> None:
    trace = replay.cacheable(replay.synthetic("conversations", 250))
    capacity = replay.daemon_capacity(0.05, replay.unique_blocks(trace))
    chains = replay.KeyChains()
    daemon = replay.replay_daemon(trace, policy, capacity, chains)
    # the simulator names blocks by the daemon's keys, hashed as the store hashes them
    # (auto's miniatures sample by that hash: the same sample, the same elections)
    sim = replay.replay(chains.keyed(trace), replay.PolicyCache(
        make_policy(policy, name_hash=key_hash), capacity))
    assert daemon.evictions > 0  # the cache was full: the order decided
    assert sim.hit_blocks > 0
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
