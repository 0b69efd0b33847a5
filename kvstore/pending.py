"""What a verb answers when its reply cannot go out at once.

A handler returns its reply with its payload frames; or a ``Plan`` (``kvstore.plans``:
moves to carry out first, after which the request runs again: writes for room, a
promotion, a fetch from the remote store, a wait for room); or ``Later``, whose
coroutine makes the reply (a lookup that asks the remote store, a prefetch that waits).
The server finishes both in a task and sends the one reply at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvstore import protocol as p
from kvstore.plans import Plan


@dataclass(eq=False)
class Later:
    """The reply comes from a coroutine."""

    # the reply, or the reply and its payload frames (a get's, pinned until sent)
    reply: Coroutine[Any, Any, p.Message | tuple[p.Message, list[Any]]]
    # what the reply holds from the moment it is made (a removal's claim on commits:
    # ``Removals``), let go of at once if it is given up before it ran: closing a
    # coroutine that never started runs none of its ``finally``
    give_up: Callable[[], None] | None = None
    # its work already counts as under way (``kvstore.under_way``): a waiting prefetch's
    # reply waits on its task, counted while it runs; counted again for the request, a
    # session was refused at half the bound; a removal done, its reply waiting for the
    # SSD index (``Removals``), is never refused for the bound
    counted: bool = False

    def gave_up(self) -> None:
        """The reply was closed before it ever ran (the server gave the request up)."""
        if self.give_up is not None:
            self.give_up()


Pending = Plan | Later
