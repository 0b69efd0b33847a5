"""The blocking client keeps a reply that comes early only for a request still awaited.

It kept every reply to a request id it had given whose reply was not posted or given
up on, so an endpoint answering each request again later (a hostile one, or one
replaying) had every such reply kept for good, each with its payload frames: memory
without bound over a long-lived client's requests.  The endpoint here is a ROUTER
socket of the test's own that answers a hello as a daemon would, and every later
request with a second reply to the one before it and then its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from kvstore import Client
from kvstore import protocol as p


@contextmanager
def replaying() -> Iterator[str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(20):
                continue
            peer, header, *_ = sock.recv_multipart()
            req = p.request_decoder.decode(header)
            if isinstance(req, p.Hello):
                sock.send_multipart([peer, p.encoder.encode(p.HelloReply(
                    req.rid, p.PROTOCOL_VERSION, "s", "acme", "", 0, 60.0, 4096, 1 << 28))])
                continue
            again = p.encoder.encode(p.OkReply(req.rid - 1))  # type: ignore[attr-defined]
            sock.send_multipart([peer, again, b"\x00" * 65536])  # answered already
            sock.send_multipart([peer, p.encoder.encode(p.OkReply(req.rid))])  # type: ignore[attr-defined]

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join()
        sock.close(linger=0)
        ctx.term()


def test_replies_to_requests_answered_already_are_not_kept() -> None:
    with replaying() as endpoint:
        with Client(endpoint, tenant="acme", map_arena=False, timeout=10) as client:
            for _ in range(50):
                client.ping()
            assert len(client._early) == 0, f"{len(client._early)} replies kept"


@contextmanager
def flooding() -> Iterator[str]:
    """An endpoint that answers a hello, then sends replies to no request without end."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        peer = None
        # (slow to decode, quick to send: the client never catches up)
        junk = p.encoder.encode(p.StatsReply(1 << 50, {str(i): i for i in range(5000)}))
        while not stop.is_set():
            if sock.poll(0 if peer is not None else 20):
                peer, header, *_ = sock.recv_multipart()
                req = p.request_decoder.decode(header)
                if isinstance(req, p.Hello):
                    sock.send_multipart([peer, p.encoder.encode(p.HelloReply(
                        req.rid, p.PROTOCOL_VERSION, "s", "acme", "", 0, 60.0, 4096,
                        1 << 28))])
                    continue
            if peer is not None:
                for _ in range(20):
                    sock.send_multipart([peer, junk], copy=False)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join()
        sock.close(linger=0)
        ctx.term()


def test_a_posted_release_returns_while_replies_to_nothing_keep_coming() -> None:
    # a posted request read what had come while any posted reply was unread and more
    # was there: an endpoint that kept sending held the caller's release() for good
    with flooding() as endpoint:
        with Client(endpoint, tenant="acme", map_arena=False, timeout=10) as client:
            posted = threading.Thread(target=lambda: [
                client._post(p.Release(client._next_rid(), pin)) for pin in (1, 2)])
            posted.start()
            posted.join(20)
            alive = posted.is_alive()
            client._unread.clear()  # (so that a loop still running would end)
            posted.join()
            assert not alive, "release() held by replies to no request"
