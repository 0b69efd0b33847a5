"""Findings of a review of the newest code: the stop's drain, the SSD tenant orders.

The stop closed the remote store, then wrote what only DRAM held to the SSD tier and
synced its index.  A close that failed (``GuardedBackend.close`` raises
``UnavailableError`` when a backend's close outlasts its timeout, and a plugin's close
may raise ``BackendError``) ended the drain there: no write-back to SSD, no sync, and the
blocks only DRAM held were lost at exit.  A stand-in daemon, as in tests/ops/test_ops_stop_sync.py: its remote store's close
fails."""

from __future__ import annotations

import asyncio
from operator import attrgetter
from types import SimpleNamespace
from typing import Any

from kvstore.errors import UnavailableError
from kvstore.scheduler.eviction import LRUPolicy
from kvstore.scheduler.tenant_orders import TenantOrders
from kvstore.server import drain_server
from kvstore.stopping import StopDeadline


class Remote:
    async def drain(self) -> None:
        return None

    async def flush(self) -> int:
        return 0

    async def close(self) -> None:
        raise UnavailableError("redis backend: close did not finish within 5 s")


class Ssd:
    write_through = False
    lost = None  # (the directory still there)

    def __init__(self) -> None:
        self.synced = False

    async def drain(self) -> None:
        self.synced = True


class Moves:
    room = SimpleNamespace(stop=lambda: None)

    def __init__(self) -> None:
        self.flushed = False

    async def stop_copying_ssd(self) -> None:
        return None

    async def drain(self) -> None:
        return None

    async def flush_to_ssd(self) -> int:
        self.flushed = True
        return 3


def test_a_remote_store_that_fails_to_close_leaves_the_ssd_steps_of_the_stop() -> None:
    exits: list[int] = []
    deadline = StopDeadline(exit=exits.append)
    ssd, moves = Ssd(), Moves()
    server: Any = SimpleNamespace(
        stop_deadline=deadline, transport=SimpleNamespace(stop_reading=lambda: None),
        moves=moves, _tasks=set(), remote=Remote(), gpu=None, ssd=ssd,
        store=SimpleNamespace(allow_demote=True, namespaces={}),  # (no copy to withdraw)
        verbs=SimpleNamespace(commits=SimpleNamespace(stop=lambda: None)),
        sessions=SimpleNamespace(closes=SimpleNamespace(finish=lambda: None)))
    deadline.begin(30.0)
    asyncio.run(drain_server(server, 30.0))  # (before: raised the close's error)
    assert moves.flushed, "what only DRAM holds is written to the ssd tier"
    assert ssd.synced, "the ssd tier's index is synced"
    assert not exits


def test_a_short_stop_leaves_its_drain_steps_time() -> None:
    """``server.stop_seconds`` may be 1: the drain's steps were each left a millisecond
    (the 2 s kept for syncing and closing were more than the whole stop), so a stop of a
    second or two wrote nothing back.  Now a short stop keeps less, in proportion."""
    deadline = StopDeadline(exit=lambda code: None)
    deadline.begin(1.0)
    try:
        assert 0.4 < deadline.left(30.0) <= 0.5, "the drain's steps: half the stop"
        assert 0.75 < deadline.left(30.0, keep=0.5) <= 0.875, "the sync: most of the rest"
    finally:
        assert deadline._timer is not None
        deadline._timer.cancel()
    long = StopDeadline(exit=lambda code: None)
    long.begin(60.0)
    try:
        assert 57.0 < long.left(100.0) <= 58.0, "a long stop keeps CLOSE_SECONDS, as before"
        assert long.left(5.0) == 5.0
    finally:
        assert long._timer is not None
        long._timer.cancel()


class _Copy:
    """An SSD copy as the tenant orders see it: its tenant, and a name."""

    def __init__(self, tenant: str, name: str) -> None:
        self.tenant, self.name = tenant, name

    def __repr__(self) -> str:
        return self.name


def _orders(weights: dict[str, float]) -> TenantOrders[_Copy]:
    return TenantOrders(attrgetter("tenant"), LRUPolicy, weights)


def test_tenant_orders_rank_again_after_weights_changed_and_back() -> None:
    """The ranking was made anew only when the weights differed from those of its last
    making: counts pushed under weights a reload changed, then a second reload put back,
    were keyed by the weights between, held no more, and were dropped where they came
    to the top.  The victim came from a tenant under its share, or none came while
    tenants held evictable copies (SSD eviction found nothing to evict)."""
    weights = {"a": 1.0, "b": 1.0}
    orders = _orders(weights)
    weights["b"] = 0.25  # a reload
    orders.insert(_Copy("a", "a1"))
    for n in range(3):
        orders.insert(_Copy("b", f"b{n}"))
    weights["b"] = 1.0  # and another, back
    victim = orders.pop_victim(lambda c: True)
    assert victim is not None and victim.tenant == "b", (
        f"b holds 3 copies for its weight 1, a 1: {victim} was taken")

    weights = {"a": 1.0, "b": 1.0}
    orders = _orders(weights)
    weights.update(a=0.5, b=0.25)
    orders.insert(_Copy("a", "a1"))
    orders.insert(_Copy("b", "b1"))
    weights.update(a=1.0, b=1.0)
    assert orders.pop_victim(lambda c: True) is not None, "two copies, none taken"
    assert len(orders.pop_victims(lambda c: True, 4, lambda c: None)) == 1


def test_a_drain_that_fails_still_closes_the_tiers(tmp_path: Any,
                                                   monkeypatch: Any) -> None:
    """``Server.serve`` closed the daemon's parts (sockets, the SSD tier and its index,
    the arenas) only when the drain returned: a drain that raised left the SSD tier's
    threads and index open at exit, and the arena files in place."""
    import kvstore.server as server_module
    from kvstore.config import load_config
    from kvstore.server import Server

    async def failing_drain(server: Any, bound: float) -> None:
        raise RuntimeError("a step of the drain failed")

    monkeypatch.setattr(server_module, "drain_server", failing_drain)
    config = load_config(env={}, overrides={
        "server": {"endpoint": f"ipc://{tmp_path / 'kv.sock'}"},
        "dram": {"capacity": "8MiB", "slab_size": "1MiB", "directory": str(tmp_path),
                 "populate": False, "per_tenant_arenas": False},
        "ssd": {"capacity": "16MiB", "path": str(tmp_path / "ssd")}})
    server = Server(config)
    arenas: list[str] = []

    def ready(s: Server) -> None:
        assert s.ssd is not None and s.arenas is not None
        arenas.extend(a.path for a in s.arenas.by_name.values())
        s.stop()

    try:
        asyncio.run(server.serve(ready))
    except RuntimeError as exc:
        assert "drain failed" in str(exc)
    else:
        raise AssertionError("the drain's error was not raised")
    assert arenas and not any((tmp_path / a.rsplit("/", 1)[-1]).exists() for a in arenas)
    assert server.ssd is None, "the ssd tier was closed"


def test_requests_of_no_keys_under_way_are_counted_and_given_back() -> None:
    """A request of no keys that finishes in a task (a whole snapshot) was counted as 0
    keys for its tenant, and the first to finish deleted the tenant's count: the next
    one's give-back raised KeyError in the task that sends its reply, and the client
    waited for a reply that never came (found by the full suite: whole snapshots under
    way, drops in slices, removals queued behind an evict all hung)."""
    from kvstore.under_way import UnderWay

    session: Any = SimpleNamespace(id="s1", tenant="acme")
    under_way = UnderWay()
    under_way.take(session, 0)
    under_way.take(session, 0)
    under_way.take(session, 5)
    assert under_way.sessions == {"s1": 3} and under_way.tenant_keys == {"acme": 5}
    under_way.give(session, 0)
    under_way.give(session, 5)
    under_way.give(session, 0)
    assert under_way.sessions == {} and under_way.tenant_keys == {}
