"""Requests that wait for the arena they need, and those that came after them.

A tenant's own arena is made on a thread when the tenant first comes (``Arenas.make``):
its hello, or a shared writer's first namespace of its owner's, waits for it in a task
(``kvstore.verbs.arena_to_make`` says which do).  The requests of that connection that
come meanwhile wait behind it, and are handled in order once it is answered: a peer may
send its next request before the hello's reply (the router does), and that one, served
first, met no session.  A making that failed answers the request with its error, never
made again on the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import zmq

from kvstore import protocol as p
from kvstore.errors import LimitExceededError

log = logging.getLogger("kvstore.server")

QUEUED_MOST = 1024  # requests of one connection waiting behind another, at most


class Handle(Protocol):
    """``Server._on_message``: ``made`` True once the arena is made, else the error that
    stopped its making (the request is answered with it)."""

    def __call__(self, routing_id: bytes, frames: list[zmq.Frame], secure: bool,
                 made: bool | BaseException | None = None) -> None: ...


class ArenaWaits:
    """The connections with a request waiting for an arena, and what came after it."""

    def __init__(self, handle: Handle,
                 spawn: Callable[[Coroutine[Any, Any, None]], object],
                 send: Callable[[bytes, p.Message], object]) -> None:
        self._handle = handle
        self._spawn = spawn
        self._send = send
        self._queued: dict[bytes, list[tuple[list[zmq.Frame], bool]]] = {}

    def __len__(self) -> int:
        return len(self._queued)

    def holds(self, routing_id: bytes, frames: list[zmq.Frame], secure: bool) -> bool:
        """Whether the request waits behind one of its connection's (taken: True)."""
        queued = self._queued.get(routing_id)
        if queued is None:
            return False
        if len(queued) >= QUEUED_MOST:
            header = frames[1].bytes if len(frames) > 1 else b""
            rid = p.request_id_of(header) if len(header) <= p.MAX_HEADER_BYTES else 0
            self._send(routing_id, p.ErrorReply(rid, LimitExceededError.code, (
                f"{QUEUED_MOST} requests already wait behind this connection's hello; "
                f"wait for its reply")))
        else:
            queued.append((frames, secure))
        return True

    def wait(self, making: Coroutine[Any, Any, None], routing_id: bytes,
             frames: list[zmq.Frame], secure: bool) -> None:
        """Handle the request once ``making`` ended, then those queued behind it."""
        self._queued[routing_id] = []
        self._spawn(self._after(making, routing_id, frames, secure))

    async def _after(self, making: Coroutine[Any, Any, None], routing_id: bytes,
                     frames: list[zmq.Frame], secure: bool) -> None:
        made: bool | BaseException = True
        try:
            await making
        except Exception as exc:  # answered with it (a bug's is logged there)
            made = exc
        finally:
            queued = self._queued.pop(routing_id, [])
        self._handle(routing_id, frames, secure, made)
        for later, later_secure in queued:  # (one may wait again: the rest queue anew)
            self._handle(routing_id, later, later_secure)
