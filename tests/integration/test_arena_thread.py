"""The arenas' one thread (``kvstore.tiers.dram.Arenas``), which allocates the memory of
per-tenant arenas' slabs and gives it back, off the daemon's loop: what fails there is
told, not lost with the thread's future."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvstore.arena_budget import ArenaBudget
from kvstore.tiers.dram import Arenas

SLAB = 1 << 20


def test_a_failure_on_the_arenas_thread_is_logged_not_lost(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backing or a release that raised on the thread (not the file system's ENOSPC,
    which is an answer) left no trace: the release's future was never read, and the
    backing's answer said only 'no memory'."""
    budget = ArenaBudget(4, {})
    answers: list[tuple[str, int, bool | None]] = []
    budget.backed = (  # type: ignore[method-assign]
        lambda name, index, ok: answers.append((name, index, ok)))

    async def main() -> None:
        arenas = Arenas(4 * SLAB, "/dev/shm", populate=False, memfd=True, budget=budget)
        try:
            arena = arenas.get("a")

            def broken(offset: int, length: int) -> bool:
                raise RuntimeError("a bug in the backing")

            monkeypatch.setattr(arena, "back", broken)
            monkeypatch.setattr(arena, "release", broken)
            wait = arenas.waiter()
            arenas.back("a", 1, SLAB, SLAB)
            arenas.release("a", 2 * SLAB, SLAB)
            await wait()  # (the backing's answer; the release's task ends by ``close``)
        finally:
            arenas.close()

    with caplog.at_level(logging.ERROR, logger="kvstore.dram"):
        asyncio.run(main())
    assert answers == [("a", 1, False)]  # (not backed: its slots are not handed out)
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failed) == 2, caplog.text
    assert all(r.exc_info and "a bug in the backing" in str(r.exc_info[1])
               for r in failed), caplog.text
