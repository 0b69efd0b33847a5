"""``SliceTurns``: the slices of work done in slices, one a loop turn over all of it."""

from __future__ import annotations

import asyncio

from kvstore.slice_turns import SliceTurns


def test_one_slice_a_loop_turn_in_the_order_asked() -> None:
    async def main() -> list[tuple[int, str]]:
        turns, ran = SliceTurns(), []
        turn = 0

        async def count_turns() -> None:
            nonlocal turn
            while True:
                await asyncio.sleep(0)
                turn += 1

        async def slicer(name: str, slices: int) -> None:
            for _ in range(slices):
                await turns.turn()
                ran.append((turn, name))

        counter = asyncio.ensure_future(count_turns())
        await asyncio.gather(slicer("a", 3), slicer("b", 3), slicer("c", 1))
        counter.cancel()
        assert turns.waiting == 0
        return ran

    ran = asyncio.run(main())
    assert [name for _, name in ran] == ["a", "b", "c", "a", "b", "a", "b"]
    loop_turns = [t for t, _ in ran]
    assert len(set(loop_turns)) == len(loop_turns), ran  # never two in one turn


def test_a_slicer_cancelled_while_waiting_holds_up_no_other() -> None:
    async def main() -> None:
        turns = SliceTurns()
        first = asyncio.ensure_future(turns.turn())
        second = asyncio.ensure_future(turns.turn())
        await asyncio.sleep(0)  # both wait
        first.cancel()
        await asyncio.wait_for(second, 1.0)
        assert turns.waiting == 0

    asyncio.run(main())
