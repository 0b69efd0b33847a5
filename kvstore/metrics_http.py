"""The metrics port's HTTP server: ``/metrics`` from a background thread, bounded.

Each connection has a thread of its own, before any token check: so at most
``METRICS_MAX_CONNECTIONS`` at once, each with ``METRICS_READ_TIMEOUT`` seconds for its
request line and headers (``_Deadlines``) and ``MAX_REQUEST_HEAD`` bytes of them
(``_HeadBound``); past the connections, a new one cuts one still waiting for its
request, of the peer address holding the most.  Scrapes of the same page under way at
once share it (``_shared``); with a token, only scrapes that carry it get one
(``_bearer_only``).  ``kvstore.metrics`` holds what the pages say.
"""

from __future__ import annotations

import http.client
import io
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import (
    ThreadingWSGIServer,
    _get_best_family,
    _SilentHandler,
    make_wsgi_app,
)

from kvstore.auth import bearer_matches

# the metrics port's connections served at once, and how long each waits for a read
METRICS_MAX_CONNECTIONS = 16
CUT_WAIT = 1.0  # how long a new connection waits for the slot of one it had cut
METRICS_READ_TIMEOUT = 5.0
# The most a request line and its headers may hold: a scrape's are well under a KiB.
# The HTTP server's own bounds (100 headers of up to 64 KiB each) let a peer without
# the token make each connection hold 6.4 MB of headers: 16 connections at a time,
# four times over, left the daemon's resident memory 640 MB above idle, for good.
MAX_REQUEST_HEAD = 16 * 1024


class _HeadBound:
    """A connection's reader whose lines, the request line and headers, end at
    ``MAX_REQUEST_HEAD`` bytes in all: a request past them is answered 431 (or, its
    request line alone too long, closed); everything else is the reader's own."""

    def __init__(self, raw: io.BufferedIOBase) -> None:
        self._raw = raw
        self._left = MAX_REQUEST_HEAD

    def readline(self, size: int = -1) -> bytes:
        want = self._left + 1 if size < 0 else min(size, self._left + 1)
        line = self._raw.readline(want)
        self._left -= len(line)
        if self._left < 0:  # (raised in the headers, the handler answers 431)
            raise http.client.LineTooLong(f"request line and headers past "
                                          f"{MAX_REQUEST_HEAD} bytes")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str, token: bytes,
                  max_connections: int, read_timeout: float) -> Callable[[], None]:
    """``Metrics.start_http_server`` (its docstring says how) for ``registry``."""
    # prometheus_client.start_http_server's own pieces (its app, its threading
    # server, its quiet handler, its choice of address family), with the app
    # behind the token check: that function takes no check of its own
    app = _shared(make_wsgi_app(registry))
    if token:
        app = _bearer_only(app, token)

    slots = threading.BoundedSemaphore(max_connections)
    deadlines = _Deadlines()

    class Handler(_SilentHandler):
        """prometheus_client's quiet handler, with a read timeout (set on its
        socket by ``StreamRequestHandler.setup``) and the same bound on the whole
        request line and headers: a peer sending a byte every few seconds passes
        each read's timeout, and 16 of them held every slot for good.  Its reads of
        them stop at ``MAX_REQUEST_HEAD`` bytes (``_HeadBound``)."""

        timeout = read_timeout

        def setup(self) -> None:
            super().setup()
            self.rfile = _HeadBound(self.rfile)  # type: ignore[assignment]

        def handle(self) -> None:
            deadlines.watch(self.connection, read_timeout, str(self.client_address[0]))
            try:
                super().handle()
            finally:
                deadlines.forget(self.connection)

        def parse_request(self) -> bool:
            parsed = bool(super().parse_request())  # (the headers read too)
            deadlines.forget(self.connection)  # the request is in: the app answers it
            return parsed

    class Server(ThreadingWSGIServer):
        """Its address family set for ``addr`` (as prometheus_client does); at most
        ``max_connections`` connections served at once."""

        def process_request(self, request: Any, client_address: Any) -> None:
            # all taken: a connection waiting for its request makes room, of the
            # address with the most waiting (a peer holding connections half-sent,
            # or reopening them, loses its own, not a scrape's); with none
            # waiting for a request, or none gone in time, closed at once, no thread
            if not slots.acquire(blocking=False) and not (
                    deadlines.cut_oldest() and slots.acquire(timeout=CUT_WAIT)):
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a peer that timed out or went: nothing to report on stderr

    # (untyped in prometheus_client: an address family and the host to bind)
    Server.address_family, host = _get_best_family(addr, port)  # type: ignore[no-untyped-call]
    httpd = make_server(host, port, app, Server, handler_class=Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="kvstore-metrics",
                              daemon=True)
    thread.start()

    def close() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        deadlines.close()

    return close

class _Deadlines:
    """The time each metrics connection has left to send its request, kept by one
    thread for all of them: a ``threading.Timer`` a connection doubled the threads a
    peer holding half-sent requests made the daemon keep (two a connection, not one)."""

    def __init__(self) -> None:
        self._due: dict[socket.socket, float] = {}
        self._peer: dict[socket.socket, str] = {}  # its peer's address
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-metrics-deadlines",
                                        daemon=True)
        self._thread.start()

    def watch(self, conn: socket.socket, seconds: float, peer: str = "") -> None:
        with self._changed:
            self._due[conn] = time.monotonic() + seconds
            self._peer[conn] = peer
            self._changed.notify()

    def forget(self, conn: socket.socket) -> None:
        with self._changed:
            self._due.pop(conn, None)
            self._peer.pop(conn, None)

    def cut_oldest(self) -> bool:
        """Cut the connection that has waited longest for its request among those of
        the peer address with the most waiting, if one still waits (its handler's read
        ends, and its slot comes back): else a peer opening connections faster than a
        scrape sends its request cut the scrape, the oldest once the peer's were cut."""
        with self._changed:
            if not self._due:
                return False
            held: dict[str, int] = {}
            for peer in self._peer.values():
                held[peer] = held.get(peer, 0) + 1
            greediest = max(held, key=held.__getitem__)
            conn = min((c for c in self._due if self._peer[c] == greediest),
                       key=self._due.__getitem__)
            del self._due[conn]
            del self._peer[conn]
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # gone already
        return True

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                now = time.monotonic()
                late = [conn for conn, due in self._due.items() if due <= now]
                for conn in late:
                    del self._due[conn]
                    del self._peer[conn]
                    try:
                        conn.shutdown(socket.SHUT_RDWR)  # its handler's read ends
                    except OSError:
                        pass  # gone already
                wait = min(self._due.values(), default=now + 60.0) - now
                self._changed.wait(max(wait, 0.01))


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _bearer_only(app: WsgiApp, token: bytes) -> WsgiApp:
    """``app`` for requests that carry the bearer ``token``; 401 for any other (what
    Prometheus' ``authorization: credentials_file`` sends passes)."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if bearer_matches(environ.get("HTTP_AUTHORIZATION"), token):
            return app(environ, start_response)
        start_response("401 Unauthorized", [
            ("WWW-Authenticate", 'Bearer realm="kvstore metrics"'),
            ("Content-Type", "text/plain; charset=utf-8")])
        return [b"this daemon's metrics need a bearer token (server.metrics_token_file)\n"]
    return guarded


def _shared(app: WsgiApp) -> WsgiApp:
    """``app`` whose scrapes under way at once share one page: a scrape that comes
    while another of the same page is being made waits for that one and answers it,
    so scrapes in parallel read the daemon's stats on its loop and build a page once
    between them, not once each (8 threads scraping without pause, 256 tenants'
    series, slowed another client's ping p50 from 0.09 to 10 ms).  One after another,
    each makes its own: never an older page than the scrape asked for."""
    lock = threading.Lock()
    making: dict[tuple[Any, ...], tuple[threading.Event, list[Any]]] = {}

    def shared(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        key = tuple(environ.get(name) for name in (
            "PATH_INFO", "QUERY_STRING", "HTTP_ACCEPT", "HTTP_ACCEPT_ENCODING"))
        with lock:
            first = key not in making
            if first:
                making[key] = (threading.Event(), [])
            done, page = making[key]
        if first:
            try:
                def keep(status: str, headers: list[Any], *_: Any) -> Callable[..., Any]:
                    page[:] = [status, headers]
                    return lambda data: None
                page.append(b"".join(app(environ, keep)))
            finally:
                with lock:
                    del making[key]
                done.set()
        elif not done.wait(30.0):
            page = []  # (the first never finished: made here, as if alone)
        if len(page) != 3:  # the first failed: this one makes its own
            return app(environ, start_response)
        start_response(page[0], page[1])
        return [page[2]]
    return shared
