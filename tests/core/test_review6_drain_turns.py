"""Replies sent from tasks while requests wait schedule one drain of the socket, not one
each: every reply sent outside the drain, with requests queued, asked the loop for a
drain of its own, and the next turn ran them all back to back, each serving up to its
couple of milliseconds (a hundred transfers ending together, while a client streamed
commits, held the loop a hundred times the bound)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvstore import protocol as p
from kvstore import transport as transport_module
from kvstore.auth import Auth
from kvstore.config import Config, ServerConfig
from kvstore.transport import Transport


def test_replies_from_tasks_schedule_one_drain_a_turn(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_module, "_DRAIN_SECONDS", 0.0)  # a drain: one request
    config = Config(server=ServerConfig(endpoint=f"ipc://{tmp_path / 'k.sock'}"))
    served: list[int] = []
    seen_by_turn: list[int] = []

    def on_message(peer: bytes, frames: list[Any], secure: bool) -> None:
        served.append(len(frames))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        transport = Transport(config, Auth(config), on_message, lambda pin: None, lambda: None)
        transport.open(loop)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, b"streamer")
        sock.connect(config.endpoint)
        try:
            for _ in range(60):
                sock.send(b"request")
            time.sleep(0.3)  # (the loop held: every request reaches the daemon's socket)
            done = loop.create_future()

            def watch() -> None:  # another piece of the loop's work, once a turn
                seen_by_turn.append(len(served))
                if len(served) >= 60:
                    done.set_result(None)
                else:
                    loop.call_soon(watch)

            loop.call_soon(watch)
            for rid in range(20):  # replies of tasks, in one turn, requests waiting
                transport.send(b"\x00streamer", p.OkReply(rid + 1), [])
            await asyncio.wait_for(done, 30)
        finally:
            sock.close()
            ctx.term()
            transport.close()

    asyncio.run(main())
    assert len(served) == 60
    steps = [b - a for a, b in zip(seen_by_turn, seen_by_turn[1:])]
    # one scheduled drain a turn, and the descriptor's callback: two requests at most
    assert max(steps) <= 2, seen_by_turn
