"""The async client's reader hands over a bounded number of replies a loop turn: it read
while any reply was there, so an endpoint sending replies to nothing faster than they
decode held the engine's event loop in one callback for as long as it kept sending.
Nor does a request sent meanwhile: each that saw replies waiting set a drain of its own
for every later turn, 256 replies each.  The endpoint is a ROUTER socket of the test's own: it answers a hello as a daemon
would, then sends a few thousand replies to no request (slow to decode)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import zmq

from kvstore import AsyncClient
from kvstore import protocol as p

JUNK = 3000


def replies_read_by_turn(asks: int) -> list[int]:
    """The replies the client had read at each turn of its loop while a flood of replies
    to nothing came, its caller sending ``asks`` requests (one a turn) as it began."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)  # (as the daemon's: none dropped)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    greeted = threading.Event()

    def serve() -> None:
        peer, header, *_ = sock.recv_multipart()
        req = p.request_decoder.decode(header)
        sock.send_multipart([peer, p.encoder.encode(p.HelloReply(
            req.rid, p.PROTOCOL_VERSION, "s", "acme", "", 0, 60.0, 4096, 1 << 28))])
        greeted.wait(10)
        junk = p.encoder.encode(p.StatsReply(1 << 50, {str(i): i for i in range(2000)}))
        for _ in range(JUNK):
            sock.send_multipart([peer, junk], copy=False)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    read_by_turn: list[int] = []
    sent: list[asyncio.Future[Any]] = []

    async def main() -> None:
        client = AsyncClient(f"tcp://127.0.0.1:{port}", tenant="acme", map_arena=False,
                             timeout=10)
        await client.connect()
        read = 0
        deliver = client._deliver

        def counted(frames: list[Any]) -> None:
            nonlocal read
            read += 1
            deliver(frames)

        client._deliver = counted  # type: ignore[method-assign]
        greeted.set()
        try:
            while read < JUNK:
                read_by_turn.append(read)
                if read and len(sent) < asks:  # replies wait: the send sees them
                    sent.append(asyncio.ensure_future(client.stats()))
                await asyncio.sleep(0)
        finally:
            for ask in sent:
                ask.cancel()
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        thread.join()
        sock.close(linger=0)
        ctx.term()
    return read_by_turn


def test_a_flood_of_replies_to_nothing_leaves_the_loop_turning() -> None:
    read_by_turn = replies_read_by_turn(0)
    steps = [b - a for a, b in zip(read_by_turn, read_by_turn[1:])]
    assert max(steps) <= 256, max(steps)


def test_requests_sent_in_a_flood_of_replies_add_no_drain_to_a_turn() -> None:
    read_by_turn = replies_read_by_turn(8)
    steps = [b - a for a, b in zip(read_by_turn, read_by_turn[1:])]
    assert max(steps) <= 256, max(steps)


def test_a_client_connected_again_on_another_loop_reads_its_replies(
        daemon_factory: Any) -> None:
    # A drain is set once however often asked (above), and the descriptor's reader
    # drains only when none is: a drain left set by a loop that ended before it ran would
    # have kept the client's next connection, on another loop, from reading any reply.
    d = daemon_factory()
    client = AsyncClient(d.endpoint, tenant="acme", timeout=5)

    async def use() -> None:
        await client.connect()
        try:
            await client.ping()
        finally:
            await client.close()

    asyncio.run(use())
    client._drain_set = True  # (as a close whose loop ended right after it leaves it)
    asyncio.run(use())
