"""What a request that cannot finish at once raises, for the server to finish it later.

None of these is an error.  A verb (or the store, with ``DemotionNeeded`` and
``PromotionNeeded``) raises one when bytes must move between tiers, room must free, or the
reply comes from a coroutine; the server catches it, carries it out in a task, runs the
request again, and sends the one reply at the end.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from kvstore import protocol as p
from kvstore.store import DemotionNeeded, Namespace, PromotionNeeded


class Later(Exception):
    """Not an error: the reply comes from a coroutine (a prefetch that waits)."""

    def __init__(self, reply: Coroutine[Any, Any, p.Message]) -> None:
        super().__init__("later")
        self.reply = reply


class Deferred(Exception):
    """Not an error: no room now; wait for some, in order, until the deadline."""

    def __init__(self, deadline: float, cause: str = "") -> None:
        super().__init__("deferred")
        self.deadline = deadline
        self.waited = False
        self.expired = False  # the deadline passed: the last attempt runs every step
        self.cause = cause  # why there was no room, the last time it was tried


class RemoteFetch(Exception):
    """Not an error: the keys missing here may be in the remote store; fetch, then retry."""

    def __init__(self, ns: Namespace, keys: list[bytes]) -> None:
        super().__init__("fetch from the remote tier")
        self.ns = ns
        self.keys = keys


class RemoteLookup(Exception):
    """Not an error: ask the remote store for the part of the chain not found here."""

    def __init__(self, rid: int, ns: Namespace, keys: list[bytes], tiers: list[str]) -> None:
        super().__init__("look up in the remote tier")
        self.rid = rid
        self.ns = ns
        self.keys = keys
        self.tiers = tiers


Plan = DemotionNeeded | PromotionNeeded | RemoteFetch | RemoteLookup | Deferred | Later
