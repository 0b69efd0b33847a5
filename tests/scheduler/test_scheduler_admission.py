"""Token-plan block counts, all-or-none admission, and policy-chain plans."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import CapacityError, ConfigError, MalformedError
from kvstore.scheduler.admission import (
    DEFAULT_CHAIN,
    Plan,
    PolicyChain,
    Shortfall,
    TokenRequest,
    admit_batch,
    blocks_needed,
)


@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 600))
def test_blocks_needed_counts_the_new_blocks_positions_touch(t: int, s: int, b: int) -> None:
    held = {p // b for p in range(t)}
    after = {p // b for p in range(t + s)}
    assert blocks_needed(t, s, b) == len(after - held)


@pytest.mark.parametrize(
    ("t", "s", "expected"),
    [(0, 0, 0), (0, 1, 1), (15, 1, 0), (16, 1, 1), (16, 0, 0), (1, 32, 2), (0, 33, 3)],
)
def test_blocks_needed_examples(t: int, s: int, expected: int) -> None:
    assert blocks_needed(t, s, 16) == expected


@pytest.mark.parametrize(("t", "s", "b"), [(-1, 1, 16), (1, -1, 16), (1, 1, 0)])
def test_blocks_needed_refuses_bad_input(t: int, s: int, b: int) -> None:
    with pytest.raises(MalformedError):
        blocks_needed(t, s, b)


def test_batch_is_all_or_none_and_reports_what_would_fit() -> None:
    plan = [TokenRequest(0, 48), TokenRequest(0, 100), TokenRequest(16, 16)]  # 3, 7, 1
    fits = admit_batch(plan, 16, available=11)
    assert fits.admitted and fits.blocks == (3, 7, 1) and fits.total == 11
    assert fits.fitting == (0, 1, 2) and fits.shortfall == 0

    short = admit_batch(plan, 16, available=5)
    assert not short.admitted and short.shortfall == 6
    assert short.fitting == (0, 2)  # the 7-block request is skipped, the 1-block fits
    in_order = admit_batch(plan, 16, available=5, stop_at_first_misfit=True)
    assert in_order.fitting == (0,)


@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=20),
    st.integers(0, 200),
)
def test_batch_greedy_report_never_exceeds_what_is_available(
    pairs: list[tuple[int, int]], available: int
) -> None:
    decision = admit_batch([TokenRequest(t, s) for t, s in pairs], 16, available)
    assert decision.admitted == (decision.total <= available)
    assert sum(decision.blocks[i] for i in decision.fitting) <= available
    if decision.admitted:
        assert decision.fitting == tuple(range(len(pairs)))


def test_no_shortfall_needs_no_action() -> None:
    assert PolicyChain().plan(Shortfall(need=4, free=4, evictable=0)) == Plan()


def test_default_chain_evicts_then_demotes() -> None:
    chain = PolicyChain()
    assert chain.steps == DEFAULT_CHAIN
    assert chain.plan(Shortfall(need=10, free=2, evictable=20)) == Plan(evict=8)
    assert chain.plan(
        Shortfall(need=10, free=2, evictable=5, demotable=10, next_tier_room=4)
    ) == Plan(evict=5, demote=3)


def test_demote_first_keeps_blocks_when_the_next_tier_has_room() -> None:
    chain = PolicyChain(("demote", "evict", "reject"))
    assert chain.plan(
        Shortfall(need=10, free=2, evictable=20, demotable=9, next_tier_room=5)
    ) == Plan(evict=3, demote=5)


def test_defer_when_allowed_otherwise_reject_with_cause() -> None:
    chain = PolicyChain()
    deferred = chain.plan(Shortfall(need=10, free=2, evictable=3, now=1.0, defer_until=4.0))
    assert deferred == Plan(defer_until=4.0)  # nothing evicted for a request that waits
    assert not deferred.admitted

    expired = chain.plan(Shortfall(need=10, free=2, evictable=3, now=5.0, defer_until=4.0))
    assert expired.reject is not None and "5 short" in expired.reject
    assert isinstance(expired.error(), CapacityError)


def test_the_last_step_ends_the_request_whatever_it_is() -> None:
    only_evict = PolicyChain(("evict",))
    plan = only_evict.plan(Shortfall(need=10, free=0, evictable=4))
    assert plan.reject is not None and "4 evictable" in plan.reject
    only_defer = PolicyChain(("defer",))
    assert only_defer.plan(Shortfall(need=1, free=0, evictable=9)).reject is not None


def test_a_request_larger_than_the_class_is_rejected_at_once() -> None:
    plan = PolicyChain().plan(
        Shortfall(need=100, free=0, evictable=50, defer_until=9.0, capacity=60)
    )
    assert plan.reject is not None and "60" in plan.reject


@pytest.mark.parametrize(
    "steps",
    [(), ("evict", "evict"), ("reject", "evict"), ("evict", "drop")],
)
def test_bad_chains_are_config_errors(steps: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError):
        PolicyChain(steps)  # type: ignore[arg-type]


chains = st.permutations(["evict", "demote", "defer"]).flatmap(
    lambda order: st.integers(1, 3).map(lambda n: tuple(order[:n]) + ("reject",))
)


@given(
    chains,
    st.lists(st.integers(0, 50), min_size=5, max_size=5),
    st.one_of(st.none(), st.floats(-5, 5)),
)
def test_every_plan_is_sound(
    steps: tuple[str, ...], counts: list[int], defer_until: float | None
) -> None:
    need, free, evictable, demotable, room = counts
    s = Shortfall(need, free, evictable, demotable, room, now=0.0, defer_until=defer_until)
    plan = PolicyChain(steps).plan(s)  # type: ignore[arg-type]
    assert plan.evict <= evictable
    assert plan.demote <= min(demotable, room)
    if "demote" not in steps:
        assert plan.demote == 0
    if plan.admitted:
        assert free + plan.evict + plan.demote == max(need, free)  # no more than needed
    else:
        assert plan.evict == plan.demote == 0
        assert (plan.defer_until is None) != (plan.reject is None)
        reachable = free + ("evict" in steps) * evictable
        reachable += ("demote" in steps) * min(demotable, room)
        assert reachable < need or plan.defer_until is not None
    if plan.defer_until is not None:
        assert "defer" in steps and plan.defer_until > 0.0


@pytest.mark.parametrize("steps,early,late", [
    (("evict", "demote", "defer", "reject"), (("evict", "demote"),), (("evict", "demote"),)),
    (("demote", "evict", "defer", "reject"), (("demote", "evict"),), (("demote", "evict"),)),
    (("evict", "defer", "demote", "reject"), (("evict",),), (("evict",), ("demote",))),
    (("defer", "evict", "demote", "reject"), (), (("evict", "demote"),)),
    (("defer", "reject"), (), ()),
    (("demote", "reject"), (("demote",),), (("demote",),)),
    (("evict", "reject"), (("evict",),), (("evict",),)),
])
def test_the_chain_decides_the_room_making_passes_in_its_order(
        steps: tuple[str, ...], early: tuple[tuple[str, ...], ...],
        late: tuple[tuple[str, ...], ...]) -> None:
    chain = PolicyChain(steps)  # type: ignore[arg-type]
    assert chain.room_passes(may_defer=True) == early   # before its deadline
    assert chain.room_passes(may_defer=False) == late   # after it, or may not defer


def test_a_batch_s_held_blocks_take_no_slot() -> None:
    requests = [TokenRequest(0, 64), TokenRequest(64, 32)]  # 4 blocks, then 2 of 16 tokens
    assert not admit_batch(requests, 16, 3).admitted
    d = admit_batch(requests, 16, 3, held=[4, 1])
    assert d.admitted and d.blocks == (4, 2) and d.total == 1
    refused = admit_batch(requests, 16, 0, held=[4, 1])
    assert refused.fitting == (0,) and refused.shortfall == 1
    with pytest.raises(MalformedError):
        admit_batch(requests, 16, 3, held=[5, 0])
