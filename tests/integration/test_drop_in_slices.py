"""Dropping a big namespace against a real daemon: in slices, the loop serving others.

While the drop is under way, other clients look up, commit into the namespace, drop it
again, close their session or stop the daemon; the daemon checks its invariants after
every request (``--debug-invariants``) and the fixture fails on any violation.
"""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any

from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore import protocol as p

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks
BLOCKS = 40_000
CHAIN = 500


def fill(client: Client, rng: random.Random) -> list[list[bytes]]:
    ns = client.namespace(IDENT)
    chains = []
    for _ in range(BLOCKS // CHAIN):
        keys = [rng.randbytes(16) for _ in range(CHAIN)]
        ns.reserve(keys).commit()
        chains.append(keys)
    return chains


def test_other_clients_are_served_while_a_big_namespace_drops(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="192MiB")
    rng = random.Random(7)
    with Client(d.endpoint, tenant="acme") as filler:
        chains = fill(filler, rng)
        ns = filler.namespace(IDENT)
        pin = ns.acquire(chains[0][:20])  # held: it and its prefix stay
        later = [rng.randbytes(16) for _ in range(30)]

        async def run() -> tuple[int, int, list[int], list[str], int]:
            async with AsyncClient(d.endpoint, tenant="acme") as a, \
                    AsyncClient(d.endpoint, tenant="acme") as b:
                ans, bns = await a.namespace(IDENT), await b.namespace(IDENT)
                first = asyncio.ensure_future(ans.drop())
                await asyncio.sleep(0)
                order: list[str] = []
                hits: list[int] = []
                # served while the drop is under way: a chain only ever shortens
                for _ in range(5):
                    hits.append((await bns.lookup(chains[1])).blocks)
                    order.append("lookup" if not first.done() else "after")
                # the drop's request and these come on two connections: commit only once
                # the drop has begun (the daemon may have read the lookups first)
                while (await b.stats())["tiers"]["dram"]["blocks"] >= BLOCKS:
                    await asyncio.sleep(0.001)
                await (await bns.reserve(later)).commit()  # kept by the first drop
                second = asyncio.ensure_future(bns.drop())  # waits for the first
                await asyncio.sleep(0)
                count1 = await first
                count2 = await second
                left = (await bns.lookup(later)).blocks
                return count1, count2, hits, order, left

        count1, count2, hits, order, left = asyncio.run(run())
        assert "lookup" in order, "no request was served while the drop was under way"
        assert hits == sorted(hits, reverse=True), hits
        # the first kept what was committed meanwhile; the second, after it, took it
        assert count1 == BLOCKS - 20
        assert count2 == len(later) and left == 0
        assert ns.lookup(chains[0]).blocks == 20
        assert filler.stats()["tiers"]["dram"]["blocks"] == 20
        pin.release()
        assert ns.drop() == 20


def test_a_drop_goes_on_when_its_session_closes_and_a_shutdown_waits(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="192MiB")
    rng = random.Random(8)
    with Client(d.endpoint, tenant="acme") as filler:
        chains = fill(filler, rng)

    async def drop_and_leave() -> None:
        a = AsyncClient(d.endpoint, tenant="acme")
        await a.connect()
        ans = await a.namespace(IDENT)
        asyncio.ensure_future(ans.drop())
        await asyncio.sleep(0.05)  # sent: its session ends before the reply
        await a.close()

    asyncio.run(drop_and_leave())
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        assert ns.drop() == 0  # waited for the first, which dropped everything
        assert ns.lookup(chains[5]).blocks == 0
        assert c.stats()["tiers"]["dram"]["blocks"] == 0
        chains = fill(c, rng)
        # a drop under way when the daemon is told to stop: it ends cleanly
        c._send(p.DropNamespace(c._next_rid(), ns.id))
        assert c.ping() is None  # read, and served, while the drop goes on
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0
    assert "Traceback" not in d.log() and "invariant violated" not in d.log()
