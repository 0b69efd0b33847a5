"""One drain of the daemon's socket serves at most a couple of milliseconds of requests
before other work of the loop runs: a client streaming requests (a paged snapshot's
pages, an ingest of big commits) held the loop 23-110 ms in one drain at 400k blocks,
every other client's request and every timer waiting behind it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import zmq

from kvstore.auth import Auth
from kvstore.config import Config, ServerConfig
from kvstore.transport import Transport


def test_a_stream_of_slow_requests_yields_the_loop_between_drains(tmp_path: Path) -> None:
    config = Config(server=ServerConfig(endpoint=f"ipc://{tmp_path / 'k.sock'}"))
    served: list[int] = []
    seen_between: list[int] = []

    def on_message(peer: bytes, frames: list[Any], secure: bool) -> None:
        time.sleep(0.001)                     # a request of a millisecond's work
        served.append(len(frames))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        transport = Transport(config, Auth(config), on_message, lambda pin: None, lambda: None)
        transport.open(loop)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(config.endpoint)
        try:
            for _ in range(60):
                sock.send(b"request")
            done = loop.create_future()

            def watch() -> None:              # another piece of the loop's work, each turn
                seen_between.append(len(served))
                if len(served) >= 60:
                    done.set_result(None)
                else:
                    loop.call_later(0, watch)

            loop.call_soon(watch)
            await asyncio.wait_for(done, 30)
        finally:
            sock.close()
            ctx.term()
            transport.close()

    asyncio.run(main())
    assert len(served) == 60
    # turns of the loop came between the requests, each after a few of them
    between = sorted({n for n in seen_between if 0 < n < 60})
    assert len(between) >= 10, seen_between
    assert max(b - a for a, b in zip([0, *between], [*between, 60])) <= 10, seen_between
