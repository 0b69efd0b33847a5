"""The asyncio client's sends: with no connection to queue on, and the edge of the
socket's descriptor that a send takes."""

from __future__ import annotations

import asyncio
import select
import time

import pytest
import zmq
from daemon_proc import free_port

from kvstore import protocol as p
from kvstore.aclient import AsyncClient
from kvstore.errors import UnavailableError


def test_a_send_with_no_connection_to_queue_on_ends_at_the_request_deadline() -> None:
    """A DEALER whose peer's connection is gone (ZeroMQ dropped it after a refused
    handshake; here one that never came up, with ``IMMEDIATE``) takes no message: the
    request fails with UnavailableError at its deadline, not a send retried for ever."""
    async def ping() -> None:
        client = AsyncClient(f"tcp://127.0.0.1:{free_port()}", tenant="acme", timeout=0.2)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(client.endpoint)  # nothing listens there
        client._sock, client._loop = sock, asyncio.get_running_loop()
        try:
            with pytest.raises(UnavailableError, match="no reply from the daemon"):
                await asyncio.wait_for(client.ping(), 60)
        finally:
            sock.close(linger=0)
            ctx.term()

    asyncio.run(ping())


def test_a_post_that_takes_the_descriptors_edge_reads_the_replies_it_let_in() -> None:
    """A give-back posted while another caller's reply is queued: the send takes the
    edge of ZeroMQ's edge-triggered descriptor, which the loop then never sees, so the
    post reads the replies itself.  The peer (a real ROUTER) answers the first request
    only: no later reply stirs the descriptor again."""
    async def main() -> None:
        client = AsyncClient("tcp://127.0.0.1:1", tenant="acme", timeout=30)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        peer, sock = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        port = peer.bind_to_random_port("tcp://127.0.0.1")
        sock.connect(f"tcp://127.0.0.1:{port}")
        loop = asyncio.get_running_loop()
        client._sock, client._loop, client._fd = sock, loop, sock.getsockopt(zmq.FD)
        try:
            ping = asyncio.ensure_future(client.ping())
            while not client._waiting:
                await asyncio.sleep(0)
            who, header = peer.recv_multipart()
            rid = p.request_decoder.decode(header).rid
            peer.send_multipart([who, p.encoder.encode(p.OkReply(rid))])
            assert select.select([client._fd], [], [], 30)[0]  # the reply's edge
            time.sleep(0.01)  # past ZeroMQ's throttle: the next send reads its commands
            client._post_now([p.Ping(client._next_rid())])
            loop.add_reader(client._fd, client._drain)
            await asyncio.wait_for(ping, 30)  # not a timing: it hung before
        finally:
            if client._fd >= 0:
                loop.remove_reader(client._fd)
            client._sock = None
            sock.close(linger=0)
            peer.close(linger=0)
            ctx.term()

    asyncio.run(main())
