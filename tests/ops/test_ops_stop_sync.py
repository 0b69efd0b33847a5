"""The stop's last step, syncing the SSD tier (its index's pending withdrawals, the
records of copies the daemon dropped), keeps time of its own under the stop's deadline.

Before, every step's bound ended ``CLOSE_SECONDS`` before the deadline, the sync's too:
a write-back to SSD that used its whole bound left the sync a millisecond, it was cut,
and the index kept the records of copies the daemon had dropped (a namespace dropped on
request came back at the next start).  A stand-in daemon: its write-back never ends."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from kvstore.server import drain_server
from kvstore.stopping import StopDeadline


class Ssd:
    write_through = False
    lost = None  # (its directory still there)

    def __init__(self) -> None:
        self.synced = False

    async def drain(self) -> None:
        await asyncio.sleep(0.2)  # pending withdrawals, the index's sync
        self.synced = True


class Moves:
    room = SimpleNamespace(stop=lambda: None)

    async def drain(self) -> None:
        return None

    async def flush_to_ssd(self) -> int:
        await asyncio.Event().wait()  # as a disk that writes slowly: never done in time
        return 0


def test_the_ssd_sync_is_not_starved_by_the_write_back_before_it() -> None:
    exits: list[int] = []
    deadline = StopDeadline(exit=exits.append)
    ssd = Ssd()
    server: Any = SimpleNamespace(
        stop_deadline=deadline, transport=SimpleNamespace(stop_reading=lambda: None),
        verbs=SimpleNamespace(commits=SimpleNamespace(stop=lambda: None)),
        moves=Moves(), _tasks=set(), remote=None, gpu=None, ssd=ssd,
        store=SimpleNamespace(allow_demote=True, namespaces={}),  # (no copy to withdraw)
        sessions=SimpleNamespace(closes=SimpleNamespace(finish=lambda: None)))
    deadline.begin(3.0)  # the write-back is cut at 1 s (2 s kept for what follows)
    asyncio.run(drain_server(server, 30.0))
    assert ssd.synced
    assert not exits
