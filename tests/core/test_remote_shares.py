"""The ledger of each tenant's values in the remote store (``kvstore.remote_shares``):
exact across sends, deletes for room, failures, misses and a store that lost it all."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.remote_shares import TenantShares

SIZE = 100


def make(bound: int, concurrency: int = 1) -> tuple[TenantShares, Any, Any]:
    store: Any = SimpleNamespace(namespaces={}, changed=lambda b: None)
    a = SimpleNamespace(tenant="a", id=b"A", block_bytes=SIZE)
    b = SimpleNamespace(tenant="b", id=b"B", block_bytes=SIZE)
    return TenantShares(store, bound, concurrency), a, b


def keys(*ids: int) -> list[bytes]:
    return [bytes([i]) for i in ids]


def send(shares: TenantShares, ns: Any, ks: list[bytes], ok: bool = True) -> Any:
    plan = shares.plan(ns, ks)
    victims = [entry for entry, _ in plan.victims]
    shares.deleted(plan, True)
    shares.done(plan, [ok] * len(plan.send))
    return plan, victims


def test_a_tenant_past_its_bound_loses_its_own_oldest_values_only() -> None:
    shares, a, b = make(3 * SIZE)
    send(shares, b, keys(50, 51))
    send(shares, a, keys(1, 2, 3))
    _, victims = send(shares, a, keys(4, 5))
    assert victims == [(b"A", bytes([1])), (b"A", bytes([2]))]
    stats = shares.stats()
    assert stats["a"] == {"bytes": 3 * SIZE, "share_deleted": 2, "share_refused": 0}
    assert stats["b"]["bytes"] == 2 * SIZE


def test_more_than_the_bound_at_once_is_refused_past_it() -> None:
    shares, a, _ = make(2 * SIZE)
    plan, _ = send(shares, a, keys(1, 2, 3, 4))
    assert plan.send == [0, 1]
    assert shares.stats()["a"] == {"bytes": 2 * SIZE, "share_deleted": 0,
                                   "share_refused": 2}


def test_failures_give_back_what_was_planned() -> None:
    shares, a, _ = make(2 * SIZE)
    send(shares, a, keys(1, 2))
    plan = shares.plan(ns=a, keys=keys(3))
    shares.deleted(plan, False)  # the delete failed: the victim may still be there
    shares.done(plan, [])  # (and the put was never sent)
    assert shares.stats()["a"] == {"bytes": 2 * SIZE, "share_deleted": 0,
                                   "share_refused": 0}
    send(shares, a, keys(2), ok=False)  # sent again, refused: the old value stays
    assert shares.stats()["a"]["bytes"] == 2 * SIZE


def test_misses_and_a_lost_store_leave_the_ledger() -> None:
    shares, a, _ = make(4 * SIZE)
    send(shares, a, keys(1, 2, 3))
    shares.gone(a, keys(2, 9))
    assert shares.stats()["a"]["bytes"] == 2 * SIZE
    shares.seen(a, keys(7, 1))  # read there: 1 the newest now, 7 not this daemon's
    assert shares.stats()["a"]["bytes"] == 2 * SIZE
    plan = shares.plan(a, keys(4))
    shares.forget()  # the store lost what it held, the send under way with it
    shares.done(plan, [True])
    assert shares.stats() == {}  # (holding and counting nothing, the tenant left)


def test_no_bound_keeps_no_ledger() -> None:
    shares, a, _ = make(0)
    plan, _ = send(shares, a, keys(1, 2, 3))
    assert plan.send == [0, 1, 2] and shares.stats() == {}


def test_values_read_that_this_daemon_did_not_write_count_nothing() -> None:
    """Before, every value read was added: 100000 reads of another daemon's values left
    100000 entries (and a tenant each), and the next write past the bound deleted
    another daemon's values.  Now the ledger holds this daemon's writes only."""
    shares, a, b = make(2 * SIZE)
    for i in range(100_000):
        shares.seen(b, [i.to_bytes(4, "big")])
    assert shares.stats() == {}
    assert "0 values, 0 tenants" in repr(shares), shares
    send(shares, a, keys(1, 2))
    shares.seen(a, [i.to_bytes(4, "big") for i in range(1000)] + keys(1))  # 1 newest
    assert "2 values, 1 tenants" in repr(shares), shares
    _, victims = send(shares, a, keys(3))
    assert victims == [(b"A", bytes([2]))]  # its own oldest, never a value only read
    shares.check()


def test_a_tenant_that_holds_and_counted_nothing_leaves_the_ledger() -> None:
    shares, a, _ = make(4 * SIZE)
    send(shares, a, keys(1, 2))
    shares.gone(a, keys(1, 2))
    assert "0 values, 0 tenants" in repr(shares), shares
    plan = shares.plan(a, keys(3))
    shares.done(plan, [])  # none sent
    shares.check()
    assert shares.stats() == {}


def test_a_put_that_failed_or_timed_out_counts_what_it_may_have_written() -> None:
    """Before, a failed put's values were left out of the ledger though the store may
    have written them: here 1 value counted of the 3 the store may hold, and the next
    send deleted nothing, 4 values of a bound of 3 there.  Now they count."""
    shares, a, _ = make(3 * SIZE)
    send(shares, a, keys(1))
    plan = shares.plan(a, keys(2, 3))
    shares.deleted(plan, True)
    shares.done(plan, None)  # failed (timed out): any of them may be written
    assert shares.stats()["a"]["bytes"] == 3 * SIZE, shares.stats()
    _, victims = send(shares, a, keys(4))
    assert victims == [(b"A", bytes([1]))]
    shares.check()


def test_put_in_share_counts_a_failed_put_but_not_one_never_sent() -> None:
    """``put_in_share`` over a backend whose put fails (after the store took the
    values, as a timeout may): they count; one whose delete for room fails sends
    nothing, and nothing more counts."""
    import asyncio

    from kvstore.errors import KVStoreError
    from kvstore.remote_shares import put_in_share

    class Backend:
        def __init__(self) -> None:
            self.fail_delete = False

        async def delete(self, ns_id: bytes, keys: list[bytes]) -> int:
            if self.fail_delete:
                raise KVStoreError("delete refused")
            return len(keys)

        async def put_checksummed(self, *args: Any) -> list[bool]:
            raise KVStoreError("timed out")

    async def call(what: str, make: Any) -> Any:
        return await make()

    async def put(ks: list[bytes]) -> None:
        try:
            await put_in_share(shares, backend, a, ks, [memoryview(b"")] * len(ks),
                               [None] * len(ks), "write", call)
        except KVStoreError:
            pass

    shares, a, _ = make(2 * SIZE)
    backend: Any = Backend()
    asyncio.run(put(keys(1, 2)))
    assert shares.stats()["a"]["bytes"] == 2 * SIZE, shares.stats()
    backend.fail_delete = True
    asyncio.run(put(keys(3)))
    assert shares.stats()["a"]["bytes"] == 2 * SIZE, shares.stats()
    shares.check()


def test_a_bound_below_one_block_says_so_naming_the_block_size(
        caplog: pytest.LogCaptureFixture) -> None:
    """Before, every write was refused without a word (only ``share_refused`` moved)."""
    shares, a, _ = make(SIZE // 2)
    with caplog.at_level(logging.WARNING, logger="kvstore.remote"):
        send(shares, a, keys(1))
        send(shares, a, keys(2))
    said = [r.getMessage() for r in caplog.records if "max_bytes_per_tenant" in r.getMessage()]
    assert len(said) == 1 and f"one block of {SIZE} bytes" in said[0], said
    assert shares.stats()["a"]["share_refused"] == 2
