"""A client pointed at a hostile endpoint: its replies must end in a typed error, and a
route over it must still rank the honest daemons.

The hostile endpoint is a ROUTER socket of the test's own that answers every request
under its request id; the honest one a real daemon process.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
from daemon_proc import DaemonProcess

from kvstore import AsyncClient, Client
from kvstore import protocol as p
from kvstore.errors import KVStoreError, UnavailableError
from kvstore.router import Router
from kvtest import make_identity


def too_deep(rid: int) -> bytes:
    """A stats reply whose one value is an array nested a million deep: valid msgpack."""
    reply = p.encoder.encode(p.StatsReply(rid, {"a": 1}))
    assert reply.endswith(b"\x01")
    return reply[:-1] + b"\x91" * 1_000_000 + b"\xc0"


def nan_probe(rid: int) -> bytes:
    """What a probe is answered by a daemon that claims a cost that is not a number."""
    nan = float("nan")
    return p.encoder.encode(p.ProbeReply(rid, [("dram", 1)], 4096, 16, nan,
                                         {"dram": nan, "ssd": nan, "remote": nan}))


@contextmanager
def hostile(answer: Callable[[p.Message], bytes | list[bytes] | None]) -> Iterator[str]:
    """An endpoint that answers each request with ``answer(request)``, as long as the
    block lasts."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(20):
                peer, header = sock.recv_multipart()[:2]
                reply = answer(p.request_decoder.decode(header))
                if isinstance(reply, list):  # a header and payload frames
                    sock.send_multipart([peer, *reply])
                elif reply is not None:
                    sock.send_multipart([peer, reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join()
        sock.close(linger=0)
        ctx.term()


def honest_hello(then: Callable[[int], bytes]) -> Callable[[p.Message], bytes | None]:
    """Answer a hello as a daemon would (through the client's own checks), then every
    other request with ``then``."""
    def answer(request: p.Message) -> bytes | None:
        if isinstance(request, p.Hello):
            return None  # (a router sends its probe without waiting for the hello)
        return then(request.rid)  # type: ignore[attr-defined]
    return answer


def test_a_reply_nested_too_deep_is_a_typed_error() -> None:
    # msgspec gives up on it with a RecursionError, which reached the caller
    with hostile(lambda request: too_deep(request.rid)) as endpoint:  # type: ignore[attr-defined]
        with pytest.raises(KVStoreError, match="undecodable reply"):
            Client(endpoint, tenant="acme", timeout=30)


def test_the_async_client_fails_its_waiter_at_once_on_such_a_reply() -> None:
    # the RecursionError escaped the socket's reader: its waiter waited out the timeout
    # and was told the daemon did not answer
    async def connect(endpoint: str) -> None:
        client = AsyncClient(endpoint, tenant="acme", timeout=30)
        try:
            await client.connect()
        finally:
            await client.close()

    with hostile(lambda request: too_deep(request.rid)) as endpoint:  # type: ignore[attr-defined]
        with pytest.raises(KVStoreError, match="undecodable reply"):
            asyncio.run(asyncio.wait_for(connect(endpoint), 25))


@pytest.mark.parametrize("answer", [too_deep, nan_probe])
def test_a_hostile_endpoint_in_a_route_leaves_the_honest_daemon_ranked_first(
        daemon_factory: Any, answer: Callable[[int], bytes]) -> None:
    # a reply nested too deep raised out of the whole route; a cost of NaN compared
    # neither less nor more than any other, and kept the hostile endpoint first
    d: DaemonProcess = daemon_factory(tcp=True)
    assert d.tcp_endpoint is not None
    with hostile(honest_hello(answer)) as endpoint:
        with Router([endpoint, d.tcp_endpoint], tenant="acme") as router:
            results: list[Any] = []
            for _ in range(50):  # (the first deadlines may pass before the hellos)
                results = router.route([b"k" * 16], deadline=0.5)
                if any(r.answered and r.endpoint == d.tcp_endpoint for r in results):
                    break
            assert [r.endpoint for r in results] == [d.tcp_endpoint, endpoint], results


@pytest.mark.timeout(60)
def test_replies_to_other_requests_do_not_hold_a_caller_past_its_timeout() -> None:
    # each receive waited the timeout anew, and every reply was kept: an endpoint that
    # answered with other request ids, one every 20 ms, held ``Client()`` for good
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        peer = None
        rid = 1 << 40
        while not stop.is_set():
            if sock.poll(20):
                peer = sock.recv_multipart()[0]
            if peer is not None:
                rid += 1
                sock.send_multipart([peer, p.encoder.encode(
                    p.ErrorReply(rid, "internal", "not yours"))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(UnavailableError):
            Client(f"tcp://127.0.0.1:{port}", tenant="acme", timeout=1.0)
    finally:
        stop.set()
        thread.join()
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("frames", [[], [b"\x01" * 8192], [b"\x01" * 8192, b"\x01" * 100]])
def test_a_get_answered_short_or_with_wrong_sizes_is_an_error_not_blocks(
        frames: list[bytes]) -> None:
    # the client took whatever frames came for the blocks of the keys it asked for
    identity = make_identity()

    def answer(request: p.Message) -> bytes | list[bytes] | None:
        rid = request.rid  # type: ignore[attr-defined]
        if isinstance(request, p.Hello):
            return p.encoder.encode(p.HelloReply(rid, p.PROTOCOL_VERSION, "s", "acme", "",
                                                 0, 30.0, 4096, 1 << 26))
        if isinstance(request, p.OpenNamespace):
            return p.encoder.encode(p.NamespaceReply(rid, b"n" * 16, identity.block_bytes,
                                                     identity.block_bytes))
        if isinstance(request, p.Get):
            return [p.encoder.encode(p.GetReply(rid, len(request.keys))), *frames]
        return None

    with hostile(answer) as endpoint:
        with Client(endpoint, tenant="acme", timeout=5, map_arena=False) as c:
            ns = c.namespace(identity)
            with pytest.raises(KVStoreError, match="a get of 2 blocks"):
                ns.get(ns.keys(range(2 * identity.block_tokens)), verify=False)

        async def scenario() -> None:
            async with AsyncClient(endpoint, tenant="acme", timeout=5, map_arena=False) as ac:
                ans = await ac.namespace(identity)
                with pytest.raises(KVStoreError, match="a get of 2 blocks"):
                    await ans.get(ans.keys(range(2 * identity.block_tokens)), verify=False)
        asyncio.run(scenario())


def test_an_arena_that_cannot_be_mapped_is_a_typed_error() -> None:
    # an arena path no file has: FileNotFoundError reached the caller of the constructor
    def answer(request: p.Message) -> bytes | None:
        if isinstance(request, p.Hello):
            return p.encoder.encode(p.HelloReply(
                request.rid, p.PROTOCOL_VERSION, "s", "acme", "/nonexistent/arena", 1 << 20,
                30.0, 4096, 1 << 26))
        return None

    with hostile(answer) as endpoint:
        with pytest.raises(KVStoreError, match="cannot map the daemon's arena"):
            Client(endpoint, tenant="acme", timeout=5)
