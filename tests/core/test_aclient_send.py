"""The asyncio client's send when its socket has no connection to queue on."""

from __future__ import annotations

import asyncio

import pytest
import zmq
from daemon_proc import free_port

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
