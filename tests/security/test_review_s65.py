"""Second reading of the remote tier's per-tenant share, the closes of ended sessions'
namespaces and their neighbours (defects found, each with the test that showed it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvstore.remote_shares import TenantShares

SIZE = 100


def _shares(bound: int) -> tuple[TenantShares, Any]:
    store: Any = SimpleNamespace(namespaces={}, changed=lambda b: None)
    ns = SimpleNamespace(tenant="a", id=b"A", block_bytes=SIZE)
    return TenantShares(store, bound), ns


def _send(shares: TenantShares, ns: Any, keys: list[bytes]) -> Any:
    plan = shares.plan(ns, keys)
    shares.deleted(plan, True)
    shares.done(plan, [True] * len(plan.send))
    return plan


def test_a_victim_read_again_while_its_delete_fails_is_counted_once() -> None:
    """A send past the bound picks the tenant's oldest value to delete; a read of that
    value lands while the delete is under way (the ledger counts it again, newest), and
    the delete fails (the value is still there: counted again).  Before, the second
    count added its bytes once more: 300 bytes for two values, for good (nothing took
    the extra 100 off), and each such race took a block off the tenant's share until
    every send of the tenant was refused."""
    shares, ns = _shares(2 * SIZE)
    _send(shares, ns, [b"1", b"2"])
    for _ in range(2):
        plan = shares.plan(ns, [b"3"])
        victim = [key for (_, key), _ in plan.victims]
        assert victim, plan
        shares.seen(ns, victim)  # read from the store meanwhile
        shares.deleted(plan, False)  # the delete failed: the value is still there
        shares.done(plan, None)
        assert shares.stats()["a"]["bytes"] == 2 * SIZE, shares.stats()
    plan = _send(shares, ns, [b"4"])
    assert plan.send == [0], plan  # room made by deleting its oldest: not refused
    shares.check()
    assert shares.stats()["a"] == {"bytes": 2 * SIZE, "share_deleted": 1,
                                   "share_refused": 0}
