"""A daemon that stops taking requests (a graceful drain on SIGTERM) reads none after:
only the descriptor's callback was taken off, and a drain asked of the loop before, or
by a reply a finishing task sent while requests waited, read and started new requests
after the drain had listed those under way (their writes could land after the SSD
index's last sync)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import zmq

from kvstore import protocol as p
from kvstore.auth import Auth
from kvstore.config import Config, ServerConfig
from kvstore.transport import Transport


def test_no_request_is_read_once_reading_stopped(tmp_path: Path) -> None:
    config = Config(server=ServerConfig(endpoint=f"ipc://{tmp_path / 'k.sock'}"))
    served: list[int] = []

    def on_message(peer: bytes, frames: list[Any], secure: bool) -> None:
        served.append(len(frames))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        transport = Transport(config, Auth(config), on_message, lambda pin: None, lambda: None)
        transport.open(loop)  # (asks the loop for a first drain)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, b"client")
        sock.connect(config.endpoint)
        try:
            for _ in range(5):
                sock.send(b"request")
            time.sleep(0.3)  # (the loop held: the requests reach the daemon's socket)
            transport.stop_reading()
            transport.send(b"\x00client", p.OkReply(1), [])  # a task's reply
            await asyncio.sleep(0.2)
            assert transport.is_open
        finally:
            sock.close()
            ctx.term()
            transport.close()

    asyncio.run(main())
    assert served == []
