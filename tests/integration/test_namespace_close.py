"""A session closes the namespaces it is done with, so that one that uses many over its
life (an engine serving many cache salts or adapters: a namespace each) stays within
``server.max_namespaces_per_session``.  Before, only the session's end closed one: past
the cap, every new salt was refused its namespace for the rest of the engine's life.

A real daemon (its cap lowered to 4), a real client."""

from __future__ import annotations

from typing import Any

import pytest
from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore.errors import LimitExceededError, UnknownNamespaceError

CAP = {"KVSTORE_SERVER_MAX_NAMESPACES_PER_SESSION": "4"}


def salted(i: int) -> Any:
    return make_identity(salt=f"user-{i}")


def test_closing_namespaces_keeps_a_session_within_its_cap(daemon_factory: Any) -> None:
    d = daemon_factory(env=CAP)
    with Client(d.endpoint, tenant="acme") as c:
        first = c.namespace(salted(0))
        keys = first.keys(range(64))
        first.put(keys, [bytes([7]) * first.block_bytes for _ in keys])
        opened = [first] + [c.namespace(salted(i)) for i in range(1, 4)]
        with pytest.raises(LimitExceededError, match="namespaces open"):
            c.namespace(salted(4))
        for ns in opened:
            ns.close()
        with pytest.raises(UnknownNamespaceError):
            first.lookup(keys)  # the closed object's requests are refused
        with pytest.raises(UnknownNamespaceError):
            first.close()
        # as many more as the engine serves, a few open at a time
        for i in range(4, 40):
            ns = c.namespace(salted(i))
            ns.put(ns.keys(range(16)), [bytes([i]) * ns.block_bytes])
            ns.close()
        # the blocks stayed: opened again, the first salt's are there
        again = c.namespace(salted(0))
        assert again.lookup(keys).blocks == len(keys)
        assert again.get(keys[:1]) == [bytes([7]) * again.block_bytes]
        stats = c.stats()
        # the namespaces closed with no block are forgotten; those with blocks stay
        assert stats["namespaces"] == 1 + 36, stats["namespaces"]  # salt 0 and 4..39
        assert stats["invariant_violations"] == 0


def test_a_namespace_with_a_reservation_open_is_not_closed(daemon_factory: Any) -> None:
    d = daemon_factory(env=CAP)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(salted(0))
        keys = ns.keys(range(32))
        r = ns.reserve(keys)
        with pytest.raises(LimitExceededError, match="reservations open"):
            ns.close()
        for buf in r.buffers:
            buf[:] = bytes([1]) * len(buf)
        assert r.commit() == len(keys)  # still open: the commit went in
        held = ns.acquire(keys)  # a pin keeps the blocks, not the namespace open
        ns.close()
        held.release()
        assert c.namespace(salted(0)).lookup(keys).blocks == len(keys)
        assert c.stats()["tiers"]["dram"]["reserved_slots"] == 0


def test_the_async_client_closes_too(daemon_factory: Any) -> None:
    import asyncio

    d = daemon_factory(env=CAP)

    async def run() -> None:
        async with AsyncClient(d.endpoint, tenant="acme") as c:
            for i in range(8):
                ns = await c.namespace(salted(i))
                await ns.close()

    asyncio.run(run())


def test_an_engines_link_serves_more_salts_than_a_session_may_open(
        daemon_factory: Any) -> None:
    """An engine's link (``DaemonLink``, as the vLLM, SGLang and LMCache integrations
    use) opened a namespace per cache salt and never closed one: past the daemon's cap
    every new salt was a miss for the engine's life.  Now it closes the least recently
    used, keeping one a save is writing into."""
    from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings

    d = daemon_factory(env=CAP)
    link = DaemonLink(DaemonSettings(d.endpoint, "acme", None, timeout=10.0))
    try:
        busy = link.namespace("salt-0", lambda: salted(0))
        assert busy is not None
        saving = busy.reserve(busy.keys(range(16)))  # a save under way in it
        for i in range(1, 24):
            ns = link.namespace(f"salt-{i}", lambda i=i: salted(i))  # type: ignore[misc]
            assert ns is not None, (i, link.last_error)
            ns.put(ns.keys(range(16)), [bytes([i]) * ns.block_bytes])
        assert link.namespace("salt-0", lambda: salted(0)) is busy  # kept open
        saving.abort()
        for i in (1, 12, 23):  # closed or not, every salt's block is there
            ns = link.namespace(f"salt-{i}", lambda i=i: salted(i))  # type: ignore[misc]
            assert ns is not None and ns.lookup(ns.keys(range(16))).blocks == 1
        assert link.failures == 0
    finally:
        link.close()


def test_a_request_waiting_for_room_in_a_closed_namespace_passes_the_room_on(
        daemon_factory: Any) -> None:
    """A session closes a namespace while its reserves there wait for room (deferred:
    they hold no reservation yet, so the close is let through).  Room frees: the oldest
    waiters, those reserves, are woken, and refused (the namespace is closed).  Before,
    they ended without passing the wake on, and the request behind it, which the room fitted,
    waited until theirs (a wait for room with the room free: its client gave up first)."""
    import asyncio
    import threading

    from kvstore.errors import KVStoreError

    big = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB blocks
    d = daemon_factory(dram_capacity=str(8 * big.block_bytes),
                       extra=["--slab-size", str(8 * big.block_bytes)],
                       env={"KVSTORE_DRAM_DEFER_SECONDS": "30"})
    holder = Client(d.endpoint, tenant="acme")
    full = holder.namespace(big)
    keys = full.keys(range(16 * 8))
    full.put(keys, [bytes(big.block_bytes)] * 8)
    held = full.acquire(keys)  # the tier is full of pins: reserves wait for room
    out: dict[str, str] = {}
    first_waits = threading.Event()

    async def closing() -> None:
        async with AsyncClient(d.endpoint, tenant="acme", timeout=30) as c:
            ns = await c.namespace(big)
            # three (a release wakes a waiter or two: each must pass the room on)
            waiting = [asyncio.ensure_future(ns.reserve(ns.keys(range(s, s + 16))))
                       for s in (10**6, 10**6 + 16, 10**6 + 32)]
            await asyncio.sleep(0.3)
            first_waits.set()
            await ns.close()  # no reservation open yet: closed
            ended = await asyncio.gather(*waiting, return_exceptions=True)
            out["closed"] = ",".join(type(e).__name__ for e in ended)

    def behind() -> None:
        first_waits.wait(10)
        # (it waits 5 s at most for its answer: the room comes long before, or, when
        # the wake is lost, the refused waiters' deadlines 30 s on)
        with Client(d.endpoint, tenant="acme", timeout=5) as c:
            ns = c.namespace(big)
            try:
                ns.reserve(ns.keys(range(2 * 10**6, 2 * 10**6 + 16))).abort()
                out["behind"] = "granted"
            except KVStoreError as exc:
                out["behind"] = f"{type(exc).__name__}: {exc}"

    try:
        first = threading.Thread(target=asyncio.run, args=(closing(),))
        second = threading.Thread(target=behind)
        first.start()
        second.start()
        first_waits.wait(10)
        import time
        time.sleep(0.5)  # (the second reserve waits behind the first)
        held.release()  # room for 8 blocks: the woken first is refused, the second fits
        second.join(20)
        first.join(40)
        assert out == {"closed": ",".join(["UnknownNamespaceError"] * 3),
                       "behind": "granted"}, out
        stats = holder.stats()
        assert stats["tiers"]["dram"]["reserved_slots"] == 0
        assert stats["invariant_violations"] == 0
    finally:
        holder.close()
