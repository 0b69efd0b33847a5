"""Attacks on the daemon's sockets beside its request endpoint: the KV event stream's
PUB and replay sockets, the side socket, the metrics port.  A peer there must not make
the daemon hold memory or descriptors out of proportion to what it sends, nor keep them
for longer than a peer on the request endpoint can.  Real daemon processes, real
ZeroMQ and real sockets; what the daemon holds is read from ``/proc``.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import zmq
from daemon_proc import DaemonProcess, check_invariants_from_now, free_port
from kvtest import make_identity

from kvstore import Client
from kvstore.metrics import Metrics

IDENT = make_identity(tenant="acme")


def rss_bytes(d: DaemonProcess) -> int:
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def events_daemon(factory: Any, config: Path | None = None,
                  **env: str) -> tuple[DaemonProcess, str, str]:
    """A daemon publishing events, with a replay socket; ``config`` (a file holding
    ``debug_invariants = false``): its invariant check off until
    ``check_invariants_from_now``."""
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    off = {} if config is None else {"extra": ["--config", str(config)],
                                     "debug_invariants": False}
    d = factory(**off, env={"KVSTORE_EVENTS_ENDPOINT": pub,
                            "KVSTORE_EVENTS_REPLAY_ENDPOINT": rep,
                            "KVSTORE_EVENTS_TOPIC": "kv@pod-a@tiny-llama", **env})
    return d, pub, rep


def test_replay_answers_share_the_rings_batches_not_copy_them(daemon_factory: Any,
                                                               tmp_path: Path) -> None:
    # Each batch of a replay answer went out "by reference", but pyzmq copies a buffer
    # under 64 KiB all the same: peers that asked for the ring again and again and did
    # not read held a copy of it per request in their queues (300 peers asking 20 times
    # for a ring of 0.6 MB: 3.6 GiB resident).  Now every answer sends the batch's one
    # message.
    peers_n, asks = 10, 30
    # (the invariant check, a walk of every block after each request, is turned on once
    # the 32000 blocks are in: run all along, it was 9 of the test's 11 s)
    config = tmp_path / "kvstore.toml"
    config.write_text("[server]\ndebug_invariants = false\n")
    d, _, rep = events_daemon(daemon_factory, config)
    ctx = zmq.Context()
    peers: list[zmq.Socket[bytes]] = []
    honest = ctx.socket(zmq.DEALER)
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            for i in range(2000):  # batches of many events each, all well under 64 KiB
                with ns.reserve(ns.keys(range(i * 16, i * 16 + 16))) as r:
                    r.commit()
            events = c.stats()["events"]
            ring_bytes, batches = events["buffered_bytes"], events["buffered"]
            assert ring_bytes > 300_000 and ring_bytes / batches < 32 * 1024, events
            before = rss_bytes(d)
            for _ in range(peers_n):
                peer = ctx.socket(zmq.DEALER)
                peer.setsockopt(zmq.RCVHWM, 1)
                peer.setsockopt(zmq.RCVBUF, 4096)
                peer.connect(rep)
                for _ in range(asks):  # the whole ring, again and again, never read
                    peer.send_multipart([b"", (0).to_bytes(8, "big")])
                peers.append(peer)
            deadline = time.monotonic() + 60
            while c.stats()["events"]["replays"] < peers_n * asks:
                assert time.monotonic() < deadline, c.stats()["events"]
                time.sleep(0.05)
            honest.connect(rep)  # answered once the others' are (but 16 at most) sent
            honest.send_multipart([b"", (0).to_bytes(8, "big")])
            got = 0
            while True:
                assert honest.poll(30_000), "the honest replay went unanswered"
                _, seq, _ = honest.recv_multipart()
                got += 1
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
            assert got >= batches
            grown = rss_bytes(d) - before
            copies = peers_n * asks * ring_bytes
            assert grown < copies / 4, f"{grown >> 20} MiB for {copies >> 20} MiB of answers"
            c.ping()  # the daemon serves
            check_invariants_from_now(d, config, c)
    finally:
        for sock in [*peers, honest]:
            sock.close(linger=0)
        ctx.term()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the daemon closes ``sock`` (read past its greeting) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def test_a_silent_connection_to_the_stream_is_closed_as_on_the_endpoint(
        daemon_factory: Any) -> None:
    # The stream's sockets kept ZeroMQ's default handshake limit, 30 s, six times the
    # daemon's: a peer without credentials held that many more descriptors open with
    # silent connections (each one the daemon's; at the limit on open files ZeroMQ
    # aborts the process in an ipc socket's accept).
    d, pub, rep = events_daemon(daemon_factory, KVSTORE_SERVER_HANDSHAKE_SECONDS="1")
    silent = []
    try:
        for endpoint in (pub, rep):
            host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
            silent.append(socket.create_connection((host, int(port)), timeout=10))
        assert all(_closed_within(sock, 10) for sock in silent)
        with Client(d.endpoint, tenant="acme") as c:
            c.ping()  # the daemon serves
    finally:
        for sock in silent:
            sock.close()


def _http(port: int, request: bytes) -> bytes:
    """The answer to ``request`` (b"": closed without one, or cut before it came)."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(request)
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:  # (cut before it read all that was sent)
            pass
        return answer


def test_a_request_head_past_16_kib_is_refused_before_it_is_held() -> None:
    # The HTTP server's own bounds, 100 headers of up to 64 KiB each, let a peer
    # without the token make each metrics connection hold 6.4 MB of headers: 16
    # connections at a time, four times over, left the daemon 640 MB above idle.
    port = free_port()
    token = b"t" * 32
    close = Metrics(lambda: {}).start_http_server(port, "127.0.0.1", token)
    assert close is not None
    try:
        scrape = b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer " + token + b"\r\n"
        assert _http(port, scrape + b"\r\n").startswith(b"HTTP/1.0 200")
        headers = b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(20))
        assert _http(port, scrape + headers + b"\r\n").startswith(b"HTTP/1.0 431")
        headers = b"".join(b"X-%d: %s\r\n" % (i, b"a" * 65000) for i in range(99))
        answer = _http(port, b"GET /metrics HTTP/1.1\r\n" + headers + b"\r\n")
        assert answer == b"" or answer.startswith(b"HTTP/1.0 431")  # (cut as it sent)
        assert _http(port, b"GET /" + b"a" * 40000 + b" HTTP/1.1\r\n\r\n") == b""
        assert _http(port, scrape + b"\r\n").startswith(b"HTTP/1.0 200")
    finally:
        close()
