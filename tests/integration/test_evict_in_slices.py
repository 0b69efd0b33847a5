"""Evicting a key that heads a big subtree, against a real daemon: in slices, the loop
serving others.

While the evict is under way, other clients look up, commit below the evicted key,
evict again, close their session or stop the daemon; the daemon checks its invariants
after every request (``--debug-invariants``) and the fixture fails on any violation.
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
    """A trunk, and chains hanging below its blocks: one subtree of ``BLOCKS`` blocks,
    headed by the trunk's first key; and a chain of its own beside it."""
    ns = client.namespace(IDENT)
    trunk = [rng.randbytes(16) for _ in range(CHAIN)]
    ns.reserve(trunk).commit()
    chains = [trunk]
    for i in range(1, BLOCKS // CHAIN):
        keys = [rng.randbytes(16) for _ in range(CHAIN)]
        ns.reserve(keys, parent=trunk[i]).commit()
        chains.append(trunk[:i + 1] + keys)
    alone = [rng.randbytes(16) for _ in range(CHAIN)]
    ns.reserve(alone).commit()
    return chains + [alone]


def test_other_clients_are_served_while_a_big_subtree_is_evicted(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="192MiB")
    rng = random.Random(7)
    with Client(d.endpoint, tenant="acme") as filler:
        chains = fill(filler, rng)
        ns = filler.namespace(IDENT)
        head = chains[0][0]
        pin = ns.acquire(chains[5][-20:])  # held: it and its prefix stay
        kept = len(chains[5])
        later = [rng.randbytes(16) for _ in range(30)]

        async def run() -> tuple[int, int, list[int], list[str], int]:
            async with AsyncClient(d.endpoint, tenant="acme") as a, \
                    AsyncClient(d.endpoint, tenant="acme") as b:
                ans, bns = await a.namespace(IDENT), await b.namespace(IDENT)
                first = asyncio.ensure_future(ans.evict([head]))
                await asyncio.sleep(0)
                order: list[str] = []
                hits: list[int] = []
                # served while the evict is under way: a chain only ever shortens
                for _ in range(5):
                    hits.append((await bns.lookup(chains[9])).blocks)
                    order.append("lookup" if not first.done() else "after")
                # committed below the evicted key meanwhile: kept by the first evict
                await (await bns.reserve(later, parent=chains[0][0])).commit()
                second = asyncio.ensure_future(bns.evict([head]))  # waits for the first
                await asyncio.sleep(0)
                count1 = await first
                count2 = await second
                left = (await bns.lookup(later)).blocks
                return count1, count2, hits, order, left

        count1, count2, hits, order, left = asyncio.run(run())
        assert "lookup" in order, "no request was served while the evict was under way"
        assert hits == sorted(hits, reverse=True), hits
        # the first kept what was committed meanwhile (and the head it hangs from); the
        # second, its first slice at once and the rest after the first, took that: each
        # counts what it removed itself
        assert count1 <= BLOCKS - kept < count1 + count2
        assert count1 + count2 == BLOCKS - kept + len(later) and left == 0
        assert ns.lookup(chains[5]).blocks == kept
        assert ns.lookup(chains[-1]).blocks == CHAIN  # beside the subtree: untouched
        assert filler.stats()["tiers"]["dram"]["blocks"] == kept + CHAIN
        pin.release()
        assert ns.evict([head]) == kept


def test_an_evict_goes_on_when_its_session_closes_and_a_shutdown_waits(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="192MiB")
    rng = random.Random(8)
    with Client(d.endpoint, tenant="acme") as filler:
        chains = fill(filler, rng)

    async def evict_and_leave() -> None:
        a = AsyncClient(d.endpoint, tenant="acme")
        await a.connect()
        ans = await a.namespace(IDENT)
        asyncio.ensure_future(ans.evict([chains[0][0]]))
        await asyncio.sleep(0.05)  # sent: its session ends before the reply
        await a.close()

    asyncio.run(evict_and_leave())
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        # a slice at once, then the rest after the first, which took what it reached
        assert ns.evict([chains[0][0]]) < BLOCKS
        assert ns.lookup(chains[5]).blocks == 0
        assert c.stats()["tiers"]["dram"]["blocks"] == CHAIN
        chains = fill(c, rng)
        # an evict under way when the daemon is told to stop: it ends cleanly
        c._send(p.Evict(c._next_rid(), ns.id, [chains[0][0]]))
        assert c.ping() is None  # read, and served, while the evict goes on
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0
    assert "Traceback" not in d.log() and "invariant violated" not in d.log()
