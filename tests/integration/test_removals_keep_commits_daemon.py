"""Against a real daemon: an evict or drop in slices keeps every block committed after it
was asked for (with its prefix), though its walk starts later: its task had not run yet,
or it waited behind another removal of the namespace.  What was there when it was asked
for goes, and a commit made between two requests is kept by the first and taken by the
second.  The daemon checks its invariants after every request (``--debug-invariants``)
and the fixture fails on any violation.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from kvtest import make_identity

from kvstore import AsyncClient, Client

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks
CHAIN = 500


def subtree(client: Client, rng: random.Random, teeth: int) -> list[bytes]:
    """A trunk of ``teeth`` keys with a chain of ``CHAIN`` keys below each (more blocks
    than an evict's first slice takes): the trunk."""
    ns = client.namespace(IDENT)
    trunk = [rng.randbytes(16) for _ in range(teeth)]
    ns.reserve(trunk).commit()
    for key in trunk:
        ns.reserve([rng.randbytes(16) for _ in range(CHAIN)], parent=key).commit()
    return trunk


def test_a_commit_right_behind_an_evict_request_is_kept(daemon_factory: Any) -> None:
    """The evict's first slice does not reach the end; a commit below its key is read
    with it (pipelined on one connection), before its task has run."""
    d = daemon_factory(dram_capacity="128MiB")
    rng = random.Random(1)
    with Client(d.endpoint, tenant="acme") as c:
        trunk = subtree(c, rng, 20)  # 10_020 blocks
        ns = c.namespace(IDENT)
        later = [rng.randbytes(16) for _ in range(8)]
        r = ns.reserve(later, parent=trunk[6])
        evict = ns._evict_request([trunk[0]])
        commit = r._commit_request()
        c._send(evict)  # both go before either reply is read
        c._send(commit)
        count = ns._on_count(c._wait(evict.rid))
        assert r._on_commit(c._wait(commit.rid)) == len(later)
        assert ns.lookup(trunk[:7] + later).blocks == 7 + len(later)
        assert count == 20 + 20 * CHAIN - 7
        assert c.stats()["tiers"]["dram"]["blocks"] == 7 + len(later)


def test_removals_queued_behind_an_evict_keep_what_was_committed_while_they_waited(
        daemon_factory: Any) -> None:
    """An evict of 40k blocks walks; an evict of another subtree, then a drop of the
    namespace, wait behind it while a second client commits: below the second evict's
    key between the two requests (kept by the evict, taken by the drop), and after both
    (kept by both)."""
    d = daemon_factory(dram_capacity="256MiB")
    rng = random.Random(2)
    with Client(d.endpoint, tenant="acme") as filler:
        big = subtree(filler, rng, 80)  # 40_080 blocks
        other = subtree(filler, rng, 16)  # 8_016 blocks
        total = filler.stats()["tiers"]["dram"]["blocks"]
        assert total == 80 + 80 * CHAIN + 16 + 16 * CHAIN
    between = [rng.randbytes(16) for _ in range(5)]
    after = [rng.randbytes(16) for _ in range(6)]

    async def run() -> tuple[list[int], int]:
        async with AsyncClient(d.endpoint, tenant="acme") as a, \
                AsyncClient(d.endpoint, tenant="acme") as b:
            ans, bns = await a.namespace(IDENT), await b.namespace(IDENT)
            first = asyncio.ensure_future(ans.evict([big[0]]))
            # (two connections: go on once the first has begun)
            while (await b.stats())["tiers"]["dram"]["blocks"] >= total:
                await asyncio.sleep(0.001)
            second = asyncio.ensure_future(bns.evict([other[0]]))
            await (await bns.reserve(between, parent=other[3])).commit()  # read after it
            third = asyncio.ensure_future(bns.drop())
            await (await bns.reserve(after, parent=other[9])).commit()
            # (the first still walking, its head last: the others had not begun)
            walking = (await bns.lookup([big[0]])).blocks == 1
            return list(await asyncio.gather(first, second, third)), walking

    counts, walking = asyncio.run(run())
    assert walking, "the first evict ended before the commits: nothing was checked"
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        assert ns.lookup(other[:10] + after).blocks == 10 + len(after)
        assert ns.lookup(other[:4] + between).blocks == 4
        assert c.stats()["tiers"]["dram"]["blocks"] == 10 + len(after)
    # each counts what it removed itself: the second kept both commits and their
    # prefixes, the third took the first commit
    assert counts == [80 + 80 * CHAIN, 16 + 16 * CHAIN - 10, len(between)]
