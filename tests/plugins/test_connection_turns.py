"""A backend's connections are handed out in the remote tier's turns: reads first,
tenants in turn.  A semaphore handed them out in the order asked, so another tenant's
one-block read waited behind every piece of one tenant's big reads let in before it
(benchmarks/remote_fairness.py: 2.5 ms alone, 74-100 ms median beside three 64 MiB
reads; 12 ms now)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore.plugins.redis_backend import _Pool
from kvstore.plugins.turns import calling


class Conn:
    usable = True

    def idle(self) -> None:
        pass

    def abort(self) -> None:
        pass


def test_another_tenants_read_takes_the_next_connection() -> None:
    async def scenario() -> list[str]:
        async def opener() -> Any:
            return Conn()

        pool = _Pool(opener, 1)
        order: list[str] = []
        gate = asyncio.Event()

        async def job(name: str, urgent: bool, tenant: str) -> None:
            with calling(urgent, tenant):
                async with pool.connection():
                    order.append(name)
                    await gate.wait()

        first = asyncio.create_task(job("a0", True, "a"))
        await asyncio.sleep(0)
        jobs = [asyncio.create_task(job(f"a{i}", True, "a")) for i in (1, 2, 3)]
        jobs.append(asyncio.create_task(job("w", False, "a")))  # a write-through's
        await asyncio.sleep(0)
        jobs.append(asyncio.create_task(job("b", True, "b")))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *jobs)
        return order

    assert asyncio.run(scenario()) == ["a0", "a1", "b", "a2", "a3", "w"]
