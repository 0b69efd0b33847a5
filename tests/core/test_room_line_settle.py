"""``Finisher._settle``'s waits for room, driven alone: the real line of waiters
(``RoomWaiters``) under a host whose moves only wait, and handlers that answer as the
store would (a plan of room coming, or room).  In-memory: the daemon's own tests of the
same behaviour are ``tests/integration/test_room_line.py``."""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any

import pytest

import kvstore.later as later
from kvstore.errors import CapacityError
from kvstore.later import Finisher
from kvstore.moves import RoomWaiters
from kvstore.plans import Plan

ROOM_COMING_WAIT = 0.5  # (as ``kvstore.moves._ROOM_COMING_WAIT``)


class WaitingMoves:
    """``Moves.carry_out``'s waits, and nothing else to carry out."""

    def __init__(self) -> None:
        self.room = RoomWaiters(time.monotonic)

    async def carry_out(self, plan: Plan) -> None:
        if plan.defer_until is not None:
            plan.expired = not await self.room.wait(plan.defer_until, plan.ticket or None)
        elif plan.room_coming:
            plan.expired = not await self.room.wait(time.monotonic() + ROOM_COMING_WAIT,
                                                    plan.ticket or None)

    def abandon(self, plan: Plan) -> None:
        pass

    def freed(self) -> None:
        self.room.freed()


def host(defer_seconds: float) -> Any:
    return types.SimpleNamespace(
        clock=time.monotonic, moves=WaitingMoves(), defer=True, metrics=None,
        scheduling={"defers": 0, "defer_timeouts": 0},
        config=types.SimpleNamespace(dram=types.SimpleNamespace(defer_seconds=defer_seconds)),
        store=types.SimpleNamespace(early=False),
        sessions=types.SimpleNamespace(by_id={"s": object()}))


SESSION: Any = types.SimpleNamespace(id="s")


def test_a_deferred_request_waiting_on_room_coming_takes_its_late_steps_at_its_deadline(
        ) -> None:
    """Deferred for 0.25 s, woken, and then answered "room coming" by the steps before
    "defer" again and again: at its deadline it runs the steps after "defer" (which here
    find room).  Before, its deadline was read only when it waited in its deferral, and
    it waited on for room coming until that bound (30 s) refused it, the steps after
    "defer" never tried."""
    d = host(0.25)
    finisher = Finisher(d)
    early: list[bool] = []

    def handler(session: Any, request: Any, payload: Any) -> Any:
        early.append(d.store.early)
        return Plan(room_coming=True) if d.store.early else ("in", [])

    async def run() -> tuple[Any, float]:
        pending = finisher.deferral("t", CapacityError("no room"))
        asyncio.get_running_loop().call_later(0.05, d.moves.room.freed)
        start = time.monotonic()
        answer = await finisher._settle("reserve", "t", handler, SESSION, None, [], pending)
        return answer, time.monotonic() - start

    answer, took = asyncio.run(run())
    assert answer == ("in", [])
    assert early[-1] is False and early[0] is True
    assert took < 0.25 + ROOM_COMING_WAIT + 2


def test_wakes_while_waiting_for_room_coming_do_not_use_up_its_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request waits for room coming while the remote store's sends end every 5 ms, each
    waking the line: it is refused when the bound on waiting for room coming passes (here
    1 s), saying so.  Before, every wake was one of its 1000 rounds: refused within about
    5 s, "blocks kept moving between tiers", whatever the bound."""
    monkeypatch.setattr(later, "ROOM_COMING_SECONDS", 1.0)
    monkeypatch.setattr(later, "_MAX_ROUNDS", 50)  # (fewer than the wakes in 1 s)
    d = host(0.25)
    d.defer = False
    finisher = Finisher(d)
    attempts = [0]

    def handler(session: Any, request: Any, payload: Any) -> Any:
        attempts[0] += 1
        return Plan(room_coming=True)

    async def run() -> None:
        async def sends() -> None:
            while True:
                await asyncio.sleep(0.005)
                d.moves.room.freed()

        sending = asyncio.create_task(sends())
        try:
            await finisher._settle("put", "t", handler, SESSION, None, [],
                                   Plan(room_coming=True))
        finally:
            sending.cancel()

    with pytest.raises(CapacityError, match="did not end within 1s"):
        asyncio.run(run())
    assert attempts[0] > 50


def test_a_wake_the_oldest_cannot_use_is_passed_to_the_next() -> None:
    """Two requests wait for room coming, the older still short when woken: the one wake
    reaches the younger, which fits, at once (each wait otherwise 0.5 s long)."""
    d = host(0.25)
    d.defer = False
    finisher = Finisher(d)
    fits = {"older": False, "younger": True}

    def handler_of(name: str) -> Any:
        def handler(session: Any, request: Any, payload: Any) -> Any:
            return (name, []) if fits[name] else Plan(room_coming=True)
        return handler

    async def run() -> float:
        older = asyncio.ensure_future(finisher._settle(
            "put", "t", handler_of("older"), SESSION, None, [], Plan(room_coming=True)))
        await asyncio.sleep(0.01)
        younger = asyncio.ensure_future(finisher._settle(
            "put", "t", handler_of("younger"), SESSION, None, [], Plan(room_coming=True)))
        await asyncio.sleep(0.01)
        woken = time.monotonic()
        d.moves.room.freed()  # (wakes the oldest: the older)
        await younger
        took = time.monotonic() - woken
        older.cancel()
        return took

    assert asyncio.run(run()) < 0.2
