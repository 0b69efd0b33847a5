"""``UrgentFirst``: a bound on concurrent calls that lets urgent waiters in first."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.plugins.turns import URGENT_RUN_MOST, UrgentFirst


def test_urgent_waiters_go_before_the_others_each_in_order() -> None:
    async def scenario() -> list[str]:
        bound = UrgentFirst(1)
        order: list[str] = []
        gate = asyncio.Event()

        async def call(name: str, urgent: bool) -> None:
            async with bound.hold(urgent):
                order.append(name)
                await gate.wait()

        first = asyncio.create_task(call("first", False))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(call(name, urgent)) for name, urgent in
                 (("w1", False), ("r1", True), ("w2", False), ("r2", True))]
        await asyncio.sleep(0)
        assert bound.waiting == 4
        gate.set()
        await asyncio.gather(first, *tasks)
        assert bound.waiting == 0
        return order

    assert asyncio.run(scenario()) == ["first", "r1", "r2", "w1", "w2"]


def test_a_cancelled_waiter_neither_holds_nor_loses_a_place() -> None:
    async def scenario() -> None:
        bound = UrgentFirst(2)
        release = asyncio.Event()

        async def hold(urgent: bool) -> None:
            async with bound.hold(urgent):
                await release.wait()

        holders = [asyncio.create_task(hold(False)) for _ in range(2)]
        await asyncio.sleep(0)
        waiting = asyncio.create_task(hold(True))
        await asyncio.sleep(0)
        waiting.cancel()  # while it waits
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert bound.waiting == 0
        # one let in and cancelled before it ran passes its place on
        late = asyncio.create_task(hold(True))
        after = asyncio.create_task(hold(False))
        await asyncio.sleep(0)
        release.set()
        await asyncio.sleep(0)  # the holders leave: ``late`` is let in...
        late.cancel()           # ...and cancelled before it runs
        await asyncio.gather(*holders, after)
        with pytest.raises(asyncio.CancelledError):
            await late
        async with bound.hold(False):  # both places free again
            async with bound.hold(False):
                pass

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_urgent_waiters_take_turns_by_tenant() -> None:
    """One tenant's hundred queued reads let another's in at the next free place."""
    async def scenario() -> list[str]:
        bound = UrgentFirst(1)
        order: list[str] = []
        gate = asyncio.Event()

        async def call(name: str, urgent: bool, tenant: str) -> None:
            async with bound.hold(urgent, tenant):
                order.append(name)
                await gate.wait()

        first = asyncio.create_task(call("first", True, "acme"))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(call(f"a{i}", True, "acme")) for i in range(100)]
        tasks += [asyncio.create_task(call(name, urgent, tenant)) for name, urgent, tenant in
                  (("w1", False, "globex"), ("g1", True, "globex"), ("g2", True, "globex"),
                   ("i1", True, "initech"))]
        await asyncio.sleep(0)
        assert bound.waiting == 104
        gate.set()
        await asyncio.gather(first, *tasks)
        assert bound.waiting == 0
        return order

    order = asyncio.run(scenario())
    assert order[:7] == ["first", "a0", "g1", "i1", "a1", "g2", "a2"], order[:7]
    # the write after a bounded run of reads, not behind all of them
    assert order.index("w1") == 1 + URGENT_RUN_MOST and order.count("w1") == 1


def test_a_cancelled_tenants_waiter_leaves_no_turn_behind() -> None:
    async def scenario() -> None:
        bound = UrgentFirst(1)
        release = asyncio.Event()

        async def hold(tenant: str) -> None:
            async with bound.hold(True, tenant):
                await release.wait()

        holder = asyncio.create_task(hold("acme"))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(hold("globex"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert bound.waiting == 0 and "urgent_tenants=0" in repr(bound)
        release.set()
        await holder
        async with bound.hold(True, "globex"):  # the place is free again
            pass

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_write_waits_for_a_bounded_run_of_urgent_calls_under_a_flood_of_reads() -> None:
    """A steady flood of reads (each one's caller queueing the next before it leaves)
    let no write in: write-throughs never went, and their blocks left DRAM with no
    remote copy.  A write waits for at most ``URGENT_RUN_MOST`` urgent calls let in."""
    async def scenario() -> list[str]:
        bound = UrgentFirst(1)
        order: list[str] = []
        reads: list[asyncio.Task[None]] = []

        async def read(i: int) -> None:
            async with bound.hold(True, "acme"):
                order.append(f"r{i}")
                await asyncio.sleep(0)
                if i < 100:  # the next read queued while this one holds the place
                    reads.append(asyncio.create_task(read(i + 1)))
                    await asyncio.sleep(0)

        async def write() -> None:
            async with bound.hold(False):
                order.append("w")

        reads.append(asyncio.create_task(read(0)))
        await asyncio.sleep(0)
        writing = asyncio.create_task(write())
        while len(reads) <= 100 or not all(r.done() for r in reads):
            await asyncio.sleep(0)
        await writing
        assert bound.waiting == 0 and "free=1, holding=0" in repr(bound)
        return order

    order = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert len(order) == 102 and order.count("w") == 1
    assert order.index("w") == 1 + URGENT_RUN_MOST, order.index("w")
