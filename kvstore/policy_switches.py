"""A change of the DRAM eviction policy (a SIGHUP that names another
``dram.eviction_policy``) carried through on the daemon's loop, a slice a loop turn.

``BlockStore.set_eviction_policy`` starts the change: each class's order passes its
blocks to the new one in steps (``kvstore.scheduler.switch``), the old order's coldest
first, while requests are served; this takes the steps the requests leave, between
them.  A second change before the first is through takes the order as it is then.

The same loop turns take what ``auto``'s miniatures were left of a request's sampled
references (``kvstore.scheduler.duel_samples``): a request takes its share at once,
the rest wait, a slice a turn, each after the request's reply (``after_request``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kvstore.blocks import DRAM
from kvstore.scheduler.duel_samples import A_TURN
from kvstore.scheduler.eviction import POLICIES, make_policy
from kvstore.store import BlockStore

log = logging.getLogger("kvstore.server")

# Blocks a loop turn passes to the new order (about 1-5 us a block: a millisecond or so)
SWITCH_A_TURN = 256

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class PolicySwitches:
    """The change under way, if any, and how the last one went (for ``stats``)."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        # One order of every policy built and let go now: each compiles its lists' hot
        # loops once per process (a duel's, its miniatures' too: 4-5 ms, which a first
        # change to ``auto`` by SIGHUP paid on the loop, in its handler)
        for name in POLICIES:
            make_policy(name, links=DRAM).release()
        self.task: asyncio.Task[None] | None = None
        self.done = 0  # changes carried through
        self.last_turns = 0  # loop turns the last one took
        self._catching_up = False  # a slice of the duels' backlogs is due
        # DRAM evictions made under each policy that was in charge before, and the
        # store's count when the one in charge now took over (``evictions_by_policy``)
        self._evicted_under: dict[str, int] = {}
        self._evictions_at_change = 0

    def after_request(self) -> None:
        """A request was answered: the next one takes its share of the duels' sampled
        references at once again, and a slice of those left waiting is due."""
        backlogs = self.store.backlogs
        if backlogs is not None:
            backlogs.next_request()
            self._catch_up_soon()

    def _catch_up_soon(self) -> None:
        """A slice of the duels' backlogs in the loop's next turn, if any wait and none
        is due already (a request's end; a switch's step, which feeds a new duel)."""
        backlogs = self.store.backlogs
        if backlogs is not None and backlogs.waiting and not self._catching_up:
            self._catching_up = True
            asyncio.get_running_loop().call_soon(self._catch_up)

    def _catch_up(self) -> None:
        backlogs = self.store.backlogs
        assert backlogs is not None
        self._catching_up = False
        try:
            backlogs.catch_up(A_TURN)
        except Exception:  # a bug: that duel's references were let go; serve on
            log.exception("auto's sampled references: a slice failed")
        self._catch_up_soon()

    def change(self, name: str, spawn: Spawn) -> None:
        """Order the DRAM classes by ``name`` from now on, if not already (unknown:
        ``ValueError``, nothing changed); ``spawn`` runs the steps on the running loop
        (with none yet, the requests' own calls carry the change through)."""
        if self.store.dram_args[3] == name:
            return
        leaving = self.store.dram_args[3]
        self.store.set_eviction_policy(name)  # (first: an unknown name changes nothing)
        evictions = self.store.counters.evictions
        self._evicted_under[leaving] = (self._evicted_under.get(leaving, 0)
                                        + evictions - self._evictions_at_change)
        self._evictions_at_change = evictions
        if self.store.switches and self.task is None and _loop_running():
            self.task = spawn(self._steps())

    async def _steps(self) -> None:
        store = self.store
        try:
            started, cpu, turns = time.perf_counter(), time.thread_time(), 1
            log.info("eviction policy changing to %s, %d blocks a loop turn",
                     store.dram_args[3], SWITCH_A_TURN)
            while store.switch_step(SWITCH_A_TURN):
                self._catch_up_soon()  # (a new duel's references from the blocks passed)
                await asyncio.sleep(0)
                turns += 1
            self._catch_up_soon()
            self.done += 1
            self.last_turns = turns
            log.info("eviction policy %s in charge after %d loop turns (%.2f s, %.2f s "
                     "of CPU)", store.dram_args[3], turns, time.perf_counter() - started,
                     time.thread_time() - cpu)
        finally:
            self.task = None

    def evictions_by_policy(self) -> dict[str, int]:
        """DRAM evictions made while each policy was in charge, since start: every
        policy that was, the one in charge now included (a policy's count goes on
        from where it stood when it comes back)."""
        now = self.store.dram_args[3]
        out = dict(self._evicted_under)
        out[now] = (out.get(now, 0) + self.store.counters.evictions
                    - self._evictions_at_change)
        return out

    def stats(self) -> dict[str, Any]:
        switches = self.store.switches
        return {"under_way": bool(switches), "passed": sum(s.passed for s in switches),
                "done": self.done, "last_turns": self.last_turns}
