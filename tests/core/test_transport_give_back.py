"""The daemon keeps freed receive buffers while messages come (no page faults for the
next put's frames), and has the allocator give them back once a reaper period passed
with no message after some did: once per quiet spell, never while messages keep coming,
and off the loop (in the default executor)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import zmq

from kvstore import transport as t
from kvstore.auth import Auth
from kvstore.config import Config, ServerConfig


def test_buffers_go_back_once_after_each_quiet_spell(tmp_path: Path, monkeypatch: Any) -> None:
    config = Config(server=ServerConfig(endpoint=f"ipc://{tmp_path / 'k.sock'}"))
    trims: list[str] = []
    monkeypatch.setattr(t, "give_back_free_memory", lambda: trims.append("trim"))

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        transport = t.Transport(config, Auth(config), lambda *a: None, lambda pin: None,
                                lambda: None)
        transport.open(loop)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(config.endpoint)
        counts: list[int] = []

        async def tick() -> None:  # a reaper period, and the executor's work done
            transport.give_back_buffers_when_quiet()
            await asyncio.sleep(0.05)
            counts.append(len(trims))

        async def message() -> None:
            before = transport.received
            sock.send(b"x")
            while transport.received == before:
                await asyncio.sleep(0.005)
        try:
            await tick()          # nothing received yet: nothing kept
            await message()
            await tick()          # messages came this period: kept
            await message()
            await tick()          # still coming: kept
            await tick()          # a quiet period after them: given back
            await tick()          # quiet still: nothing more to give back
            await message()
            await tick()
            await tick()          # the next quiet spell: given back again
        finally:
            sock.close()
            ctx.term()
            transport.close()
        return counts

    assert asyncio.run(main()) == [0, 0, 0, 1, 1, 1, 2]


def test_giving_back_free_memory_is_safe_to_call() -> None:
    t.give_back_free_memory()  # the real one: glibc's malloc_trim, or nothing elsewhere
    t.keep_receive_buffers()
