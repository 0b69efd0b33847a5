"""Transfer queues: class priority, aging, weighted fairness, concurrency, quotas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError, MalformedError, NotFoundError
from kvstore.scheduler.queues import TenantUsage, Transfer, TransferKind, TransferQueues

RELOAD, PREFETCH, WRITEBACK = TransferKind.RELOAD, TransferKind.PREFETCH, TransferKind.WRITEBACK
MiB = 1 << 20


def _drain(queues: TransferQueues[int], now: float, count: int) -> list[Transfer[int]]:
    """Start and finish ``count`` transfers one at a time."""
    out = []
    for _ in range(count):
        transfer = queues.next(now)
        assert transfer is not None
        queues.done(transfer)
        out.append(transfer)
    return out


def test_classes_go_in_priority_order() -> None:
    queues: TransferQueues[int] = TransferQueues(1, aging={})
    queues.submit(1, kind=WRITEBACK, tenant="a", nbytes=MiB, now=0.0)
    queues.submit(2, kind=PREFETCH, tenant="a", nbytes=MiB, now=0.0)
    queues.submit(3, kind=RELOAD, tenant="a", nbytes=MiB, now=0.0)
    assert [t.key for t in _drain(queues, 0.0, 3)] == [3, 2, 1]


def test_aging_bounds_how_long_a_lower_class_waits() -> None:
    queues: TransferQueues[int] = TransferQueues(1, aging={WRITEBACK: 2.0})
    queues.submit(0, kind=WRITEBACK, tenant="a", nbytes=MiB, now=0.0)
    started: list[tuple[float, int]] = []
    now = 0.0
    for key in range(1, 40):  # a steady stream of reloads, one every 0.1 s
        now = key * 0.1
        queues.submit(key, kind=RELOAD, tenant="b", nbytes=MiB, now=now)
        transfer = queues.next(now)
        assert transfer is not None
        started.append((now, transfer.key))
        queues.done(transfer)
    writeback_at = next(at for at, key in started if key == 0)
    assert 2.0 < writeback_at <= 2.2  # it jumped the reloads once overdue, not before


def test_two_backlogged_tenants_share_bytes_by_weight() -> None:
    queues: TransferQueues[int] = TransferQueues(1, weights={"a": 1.0, "b": 3.0})
    for key in range(400):
        queues.submit(key, kind=PREFETCH, tenant="a", nbytes=MiB, now=0.0)
        queues.submit(key, kind=PREFETCH, tenant="b", nbytes=MiB // 2, now=0.0)
    served = _drain(queues, 0.0, 300)
    bytes_a = sum(t.nbytes for t in served if t.tenant == "a")
    bytes_b = sum(t.nbytes for t in served if t.tenant == "b")
    assert bytes_b / bytes_a == pytest.approx(3.0, rel=0.05)


def test_a_burst_from_one_tenant_does_not_starve_another() -> None:
    queues: TransferQueues[int] = TransferQueues(1)
    for key in range(1000):
        queues.submit(key, kind=RELOAD, tenant="noisy", nbytes=MiB, now=0.0)
    _drain(queues, 0.0, 10)
    queues.submit(-1, kind=RELOAD, tenant="quiet", nbytes=MiB, now=1.0)
    assert -1 in [t.key for t in _drain(queues, 1.0, 2)]


def test_an_idle_tenant_earns_no_credit_for_later() -> None:
    queues: TransferQueues[int] = TransferQueues(1)
    for key in range(100):
        queues.submit(key, kind=RELOAD, tenant="a", nbytes=MiB, now=0.0)
    _drain(queues, 0.0, 50)
    for key in range(100, 200):
        queues.submit(key, kind=RELOAD, tenant="b", nbytes=MiB, now=1.0)
    served = _drain(queues, 1.0, 40)
    share_b = sum(t.tenant == "b" for t in served) / len(served)
    assert 0.4 <= share_b <= 0.6  # b joins at the current virtual time: an even split


def test_concurrency_is_bounded_overall_and_per_class() -> None:
    queues: TransferQueues[int] = TransferQueues(3, class_limits={WRITEBACK: 1})
    for key in range(5):
        queues.submit(key, kind=WRITEBACK, tenant="a", nbytes=MiB, now=0.0)
    first = queues.next(0.0)
    assert first is not None and queues.next(0.0) is None  # write-back limited to one
    for key in range(5, 10):
        queues.submit(key, kind=RELOAD, tenant="a", nbytes=MiB, now=0.0)
    second, third = queues.next(0.0), queues.next(0.0)
    assert second is not None and third is not None
    assert queues.next(0.0) is None and queues.in_flight == 3  # overall limit
    queues.done(second)
    assert queues.next(0.0) is not None
    queues.check()


def test_quota_hook_holds_a_tenant_back_without_blocking_others() -> None:
    def at_most_two_running(transfer: Transfer[int], usage: TenantUsage) -> bool:
        return usage.in_flight < 2

    queues: TransferQueues[int] = TransferQueues(10, quota=at_most_two_running)
    for key in range(5):
        queues.submit(key, kind=RELOAD, tenant="a", nbytes=MiB, now=0.0)
    queues.submit(99, kind=WRITEBACK, tenant="b", nbytes=MiB, now=0.0)
    started = [queues.next(0.0) for _ in range(4)]
    assert [t.key if t else None for t in started] == [0, 1, 99, None]
    assert queues.usage("a") == TenantUsage(2, 2 * MiB)
    queues.done(started[0])  # type: ignore[arg-type]
    third = queues.next(0.0)
    assert third is not None and third.key == 2


def test_cancel_done_and_bad_input() -> None:
    queues: TransferQueues[str] = TransferQueues(2)
    kept = queues.submit("x", kind=PREFETCH, tenant="a", nbytes=1, now=0.0)
    dropped = queues.submit("y", kind=PREFETCH, tenant="a", nbytes=1, now=0.0)
    assert queues.cancel(dropped) and not queues.cancel(dropped)
    assert len(queues) == 1 and "prefetch=1" in repr(queues)
    started = queues.next(0.0)
    assert started is kept and not queues.cancel(kept)
    queues.done(kept)
    with pytest.raises(NotFoundError):
        queues.done(kept)
    with pytest.raises(MalformedError):
        queues.submit("z", kind=RELOAD, tenant="a", nbytes=-1, now=0.0)
    with pytest.raises(ConfigError):
        TransferQueues(0)
    with pytest.raises(ConfigError):
        queues.set_weight("a", 0.0)


operations = st.lists(
    st.tuples(
        st.sampled_from(["submit", "next", "done", "cancel"]),
        st.sampled_from(list(TransferKind)),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 4 * MiB),
    ),
    max_size=80,
)


@given(operations)
@settings(max_examples=200, deadline=None)
def test_counters_stay_consistent_and_every_transfer_finishes(
    ops: list[tuple[str, TransferKind, str, int]],
) -> None:
    queues: TransferQueues[int] = TransferQueues(3, class_limits={PREFETCH: 2})
    submitted: list[Transfer[int]] = []
    running: list[Transfer[int]] = []
    now = 0.0
    for key, (verb, kind, tenant, nbytes) in enumerate(ops):
        now += 0.25
        if verb == "submit":
            submitted.append(queues.submit(key, kind=kind, tenant=tenant, nbytes=nbytes, now=now))
        elif verb == "next":
            transfer = queues.next(now)
            if transfer is not None:
                running.append(transfer)
        elif verb == "done" and running:
            queues.done(running.pop(0))
        elif verb == "cancel" and submitted:
            queues.cancel(submitted[key % len(submitted)])
        queues.check()
        assert queues.in_flight == len(running) <= 3
    for transfer in running:
        queues.done(transfer)
    while (transfer := queues.next(now)) is not None:
        queues.done(transfer)
    assert len(queues) == 0 and queues.in_flight == 0
    queues.check()
