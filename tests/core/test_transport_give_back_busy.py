"""A busy daemon gives a flood's receive buffers back too: once a reaper period passes
with no payload frames after some came, though small requests (lookups) keep coming in
every period; puts back to back still keep them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import zmq

from kvstore import transport as t
from kvstore.auth import Auth
from kvstore.config import Config, ServerConfig


def test_buffers_go_back_while_small_requests_keep_coming(tmp_path: Path,
                                                          monkeypatch: Any) -> None:
    config = Config(server=ServerConfig(endpoint=f"ipc://{tmp_path / 'k.sock'}"))
    trims: list[str] = []
    monkeypatch.setattr(t, "give_back_free_memory", lambda: trims.append("trim"))

    async def main() -> list[int]:
        transport = t.Transport(config, Auth(config), lambda *a: None, lambda pin: None,
                                lambda: None)
        transport.open(asyncio.get_running_loop())
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(config.endpoint)
        counts: list[int] = []

        async def send(*frames: bytes) -> None:
            before = transport.received
            sock.send_multipart(list(frames))
            while transport.received == before:
                await asyncio.sleep(0.005)

        async def period(*messages: tuple[bytes, ...]) -> None:  # a reaper period
            for frames in messages:
                await send(*frames)
            transport.give_back_buffers_when_quiet()
            await asyncio.sleep(0.05)  # the executor's work done
            counts.append(len(trims))

        lookup, put = (b"header",), (b"header", b"\0" * 65536)
        try:
            await period(lookup, put)   # a put came: its buffers kept
            await period(put, lookup)   # puts go on: kept
            await period(lookup)        # lookups only: the puts' buffers go back
            await period(lookup)        # lookups still: nothing more to give back
            await period(lookup)
            await period(put)           # puts again: kept
            await period(lookup)        # then lookups only: given back again
        finally:
            sock.close()
            ctx.term()
            transport.close()
        return counts

    assert asyncio.run(main()) == [0, 0, 1, 1, 1, 1, 2]
