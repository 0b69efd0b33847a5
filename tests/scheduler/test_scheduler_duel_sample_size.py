"""``auto``'s miniatures are sized by the cache: one key in eight up to 64k items, then
a thinner sample, so that a miniature holds at most ``MINIATURE_MOST`` keys."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvtest import make_identity

from kvstore.keys import chain_keys
from kvstore.scheduler.density import HitDensityPolicy
from kvstore.scheduler.dueling import MINIATURE_MOST, sample_shift_for
from kvstore.scheduler.eviction import AutoPolicy, LRUPolicy
from kvstore.store import BlockStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import replay_sim  # noqa: E402  (benchmarks/ is no package)


def test_the_sample_thins_only_past_eight_miniatures_worth() -> None:
    assert sample_shift_for(1000) == 3
    assert sample_shift_for(8 * MINIATURE_MOST) == 3
    assert sample_shift_for(8 * (MINIATURE_MOST + 1)) == 4
    assert sample_shift_for(1 << 20) == 7
    assert sample_shift_for(10_000_000) == 11  # 4882 keys a miniature
    assert sample_shift_for(1 << 62) == 16  # as thin as a duel takes
    assert sample_shift_for(1 << 20, least=9) == 9  # never denser than asked
    for capacity in (1, 5000, 70_000, 1 << 20, 3_000_000, 10_000_000):
        assert capacity >> sample_shift_for(capacity) <= MINIATURE_MOST


def _sampled_share(duel: AutoPolicy[int], items: int) -> float:
    duel.parent_of = lambda item: None  # type: ignore[assignment]
    duel.insert_many(range(items))
    return len(duel._nodes) / items


def test_a_big_cache_samples_fewer_keys_and_its_density_learns_from_as_many() -> None:
    big = AutoPolicy[int]()
    big.expect(1 << 20)
    assert big.sample_shift == 7
    density = big._minis[3].order
    # it learns from as many sampled references a refresh as at one key in eight
    assert isinstance(density, HitDensityPolicy) and density.refresh == 4096 >> 3
    small = AutoPolicy[int]()
    small.expect(50_000)  # as the replay's caches: as before
    assert small.sample_shift == 3 and small._minis[3].order.refresh == 4096 >> 3
    assert 0.1 < _sampled_share(small, 20_000) < 0.15  # about one in eight
    assert _sampled_share(big, 20_000) < 0.02  # about one in 128


def test_the_sample_is_set_before_the_first_item() -> None:
    duel = AutoPolicy[int]()
    duel.parent_of = lambda item: None  # type: ignore[assignment]
    duel.insert(1)
    duel.expect(1000)  # the same sample: nothing to change
    with pytest.raises(RuntimeError, match="before its first item"):
        duel.expect(1 << 20)
    assert duel.sample_shift == 3


def test_the_store_and_its_simulator_size_the_sample_alike() -> None:
    ident = make_identity()
    slot = ident.block_bytes
    store = BlockStore((1 << 20) * slot, 64 * slot, eviction_policy="auto")
    ns = store.open_namespace(ident)
    order = ns.dram.policy(ns.cls).inner  # type: ignore[attr-defined]
    assert isinstance(order, AutoPolicy) and order.sample_shift == 7
    keys = chain_keys(ns.id, list(range(4 * ident.block_tokens)), ident.block_tokens)
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
    store.set_eviction_policy("lru")
    store.set_eviction_policy("auto")  # a switch sizes its new order too
    while store.switch_step(64):  # (in steps, as the daemon's)
        store.check_invariants()
    order = ns.dram.policy(ns.cls).inner  # type: ignore[attr-defined]
    assert isinstance(order, AutoPolicy) and order.sample_shift == 7
    store.check_invariants()
    cache = replay_sim.PolicyCache(AutoPolicy(), 1 << 20)
    assert cache.policy.sample_shift == 7  # type: ignore[attr-defined]
    assert replay_sim.PolicyCache(AutoPolicy(), 10_000).policy.sample_shift == 3  # type: ignore[attr-defined]
    LRUPolicy().expect(1 << 20)  # an order that sizes nothing by it takes it all the same
