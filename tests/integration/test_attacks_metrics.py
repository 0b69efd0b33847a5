"""A peer that opens connections to the metrics port faster than a scrape sends its
request: each connection past the limit cuts one still waiting for its request, and it
must be one of the peer address holding the most, not the scrape that came from another
address and is about to send its request."""

from __future__ import annotations

import socket
import time

from daemon_proc import free_port

from kvstore.metrics import Metrics

SLOTS = 4


def _closed(sock: socket.socket) -> bool:
    """Whether the server has cut ``sock`` (without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_flood_of_half_sent_connections_from_one_address_does_not_cut_a_scrape() -> None:
    port = free_port()
    close = Metrics(lambda: {}).start_http_server(port, "127.0.0.1",
                                                  max_connections=SLOTS, read_timeout=60)
    assert close is not None
    held: list[socket.socket] = []
    try:
        scrape = socket.create_connection(("127.0.0.1", port), timeout=10)
        held.append(scrape)
        time.sleep(0.2)  # (its handler watches it: the oldest connection waiting)
        flood = []
        for _ in range(3 * SLOTS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                            source_address=("127.0.0.2", 0))
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            flood.append(sock)
            held.append(sock)
        # every connection past the slots cut one: wait until the server has seen all
        deadline = time.monotonic() + 30
        while (sum(map(_closed, flood)) + _closed(scrape) < len(flood) - (SLOTS - 1)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert sum(map(_closed, flood)) == len(flood) - (SLOTS - 1)  # the flood's own
        scrape.setblocking(True)
        scrape.settimeout(10)
        try:
            scrape.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            answer = scrape.recv(64)
        except OSError:
            answer = b""
        assert answer.startswith(b"HTTP/1.0 200"), answer
    finally:
        for sock in held:
            sock.close()
        close()
