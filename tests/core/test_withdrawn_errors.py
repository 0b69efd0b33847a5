"""A removal's reply waits for the SSD index to let go of the copies it dropped
(``SsdMover.withdrawn``): an error of the index's own there (an LMDB or OS error, not
one of ours) made the reply of a removal already done an internal error; now it is
logged, the records wait for the next withdrawal, and the reply goes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from kvstore.tiering import SsdMover


class Engine:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.asked: list[list[Any]] = []

    async def remove(self, ids: list[Any]) -> int:
        self.asked.append(list(ids))
        raise self.exc


def test_an_index_error_while_withdrawing_leaves_the_records_for_the_next_and_returns() -> None:
    for exc in (OSError(5, "Input/output error"), RuntimeError("lmdb: MDB_PANIC")):
        mover: Any = SimpleNamespace(engine=Engine(exc), _pending_removals=[(b"n", b"k")],
                                     _removing=set())
        mover._flush_removals = lambda more, m=mover: SsdMover._flush_removals(m, more)
        asyncio.run(SsdMover.withdrawn(mover))  # no error: the reply goes
        assert mover.engine.asked == [[(b"n", b"k")]]
        assert mover._pending_removals == [(b"n", b"k")]  # tried again with the next
