"""The daemon's sockets: ZeroMQ ROUTERs drained from the loop's reader callback.

A plain non-blocking zmq socket drained from the reader callback on its file descriptor
is cheaper than zmq.asyncio.  ZeroMQ's descriptor is edge-triggered, so every drain reads
until the socket says it has nothing more.  The transport hands each message's frames to
the daemon and sends its replies; it knows nothing of verbs.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import grp
import logging
import os
import secrets
import socket
import stat
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from kvstore import protocol as p
from kvstore.auth import Auth, address_uid
from kvstore.config import Config
from kvstore.errors import ConfigError, KVStoreError, UnavailableError
from kvstore.files import check_socket_directory
from kvstore.unread import UnreadBytes

log = logging.getLogger("kvstore.server")

_DRAIN_BATCH = 256
# ...or as many as this long serves: a client streaming requests (a paged snapshot's
# pages, an ingest of 1024-key commits) held the loop 23-110 ms in one drain at 400k
# blocks, every other client waiting; bounded, 3.2-4.4 ms, for 2-4% more daemon CPU
_DRAIN_SECONDS = 0.002
CLOSE_LINGER_MS = 1000  # how long replies queued at exit may take to go out
# Before a peer has a session it may send only a hello: one small header frame, and
# only a few messages; the rest are dropped unread and unanswered.
PRE_HELLO_BYTES = 4096
PRE_HELLO_MESSAGES = 8
_UNKNOWN_PEERS = 65536   # peers without a session remembered (their message counts)
# Messages queued per peer inside ZeroMQ (a per-connection limit: past it ZeroMQ stops
# reading that connection until the daemon drains it), so no peer's backlog is unbounded.
RCVHWM = 256
# A reply without payload frames this big or bigger (a snapshot, a big stats) is sent
# without a copy and tracked: its bytes count as unread by its peer until ZeroMQ has
# handed them to the connection, and a connection with ``max_bytes_in_flight`` of them
# unread is refused more requests.  Smaller replies are bounded in number per peer
# (``server.max_unread_replies``: ZeroMQ's send queue), so a peer that never reads holds
# at most that many of them (16 MiB at the very most; stats and lookups are a KiB or
# two), never a queue as long as its requests.
TRACK_REPLY_BYTES = 16 << 10
# What freed receive buffers the C allocator keeps (``keep_receive_buffers``)
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 64 << 20
# ints: ``&`` on zmq's PollEvent flag goes through the enum machinery (a few us a reply)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)

# (peer, frames, secure): the peer is the socket's index byte, then the routing id;
# secure says the socket checks credentials in its handshake (CurveZMQ, tickets or
# tokens): its frames carry the tenant as User-Id.
OnMessage = Callable[[bytes, list[zmq.Frame], bool], None]


class PinnedFrames(list[Any]):
    """Zero-copy payload frames of arena slots, pinned until zmq has sent them."""

    def __init__(self, frames: list[memoryview], pin: int) -> None:
        super().__init__(frames)
        self.pin = pin


class EncodedHeader(list[Any]):
    """No payload frames, and the reply's header encoded already: sent as it is, without
    a copy, in place of the reply's encoding (the reply stands beside it for its rid).
    For a big header built a piece at a time across loop turns (``routing``'s whole
    snapshot): encoding and copying 17 MB at the end held the loop for 20 ms.
    ``on_sent`` is called once ZeroMQ no longer holds the header (sent, or dropped for a
    gone or full peer): the daemon counts such a reply as held until then.  ``tenant``:
    the one that asked for it, charged with its bytes while unread (its session may
    have ended before it is sent)."""

    def __init__(self, header: bytes | bytearray,
                 on_sent: Callable[[], None] | None = None, tenant: str | None = None) -> None:
        super().__init__()
        self.header = header
        self.on_sent = on_sent
        self.tenant = tenant

    def sent(self) -> tuple[Callable[[], None] | None, str | None]:
        """Its ``on_sent``, taken (the caller calls it, once), and its ``tenant``."""
        done, self.on_sent = self.on_sent, None
        return done, self.tenant


# a reply ZeroMQ is still sending: its tracker, its pin, its bytes counted unread, the
# tenant they are charged to, and what to call once it is sent (``EncodedHeader.on_sent``)
_Sending = tuple[zmq.MessageTracker, int | None, int, str | None, Callable[[], None] | None]


def _call(done: Callable[[], None] | None, result: bool) -> bool:
    """``done()``, if any; ``result``."""
    if done is not None:
        done()
    return result


class RepliesInFlight:
    """The replies zmq is still sending that the daemon waits on: (tracker, pin, bytes)
    per peer, in the order sent.  A get's reply pins its blocks until sent; a big reply
    without payload frames (``TRACK_REPLY_BYTES``) counts its bytes in ``unread`` per
    peer until sent, so a peer that does not read is refused more work
    (``Sessions.admit``).  zmq sends a peer's replies in that order, so a reaping pass
    looks at each peer's up to its first not yet sent: O(peers), not O(replies) (a peer
    that never read held 15k, and each pass, every millisecond, looked at them all: half
    a core).  A reply done as it is added (pyzmq copies frames under its
    ``copy_threshold``, and such a tracker is done at once) waits behind none: its pin
    goes at the next reap, not after the peer's big replies queued ahead of it."""

    def __init__(self) -> None:
        self.by_peer: dict[bytes, deque[_Sending]] = {}
        self.ready: list[int] = []  # pins of replies done as they were added
        self.count = 0
        # bytes of big replies zmq still holds, by peer (shared with ``Sessions``)
        self.unread_bytes = UnreadBytes()
        self.unread = self.unread_bytes.by_peer

    def __len__(self) -> int:
        return self.count

    def add(self, peer: bytes, tracker: zmq.MessageTracker, pin: int | None,
            size: int = 0, on_sent: Callable[[], None] | None = None,
            tenant: str | None = None) -> None:
        """A reply handed to zmq; ``size`` bytes of it counted unread, charged to
        ``tenant`` (None: the peer's session's, ``UnreadBytes.add``)."""
        if tracker.done:  # copied as it was sent: done ahead of the peer's queued ones
            if pin is not None:
                self.count += 1
                self.ready.append(pin)
            if on_sent is not None:
                on_sent()
            return
        self.count += 1
        queue = self.by_peer.get(peer)
        if queue is None:
            queue = self.by_peer[peer] = deque()
        charged = self.unread_bytes.add(peer, size, tenant) if size else None
        queue.append((tracker, pin, size, charged, on_sent))

    def reap(self, release: Callable[[int], None], peer: bytes | None = None) -> int:
        """``release`` the pin of each reply sent (to ``peer`` only, if given, and those
        done as they were added), and its bytes from ``unread``; how many pins."""
        pins = len(self.ready)
        freed = pins
        if pins:
            ready, self.ready = self.ready, []
            for done in ready:
                release(done)
        for each in (peer,) if peer is not None else list(self.by_peer):
            queue = self.by_peer.get(each)
            while queue and queue[0][0].done:
                _, pin, size, charged, on_sent = queue.popleft()
                freed += 1
                if on_sent is not None:
                    on_sent()
                if pin is not None:
                    release(pin)
                    pins += 1
                if size:
                    self.unread_bytes.sent(each, size, charged)
            if queue is not None and not queue:
                del self.by_peer[each]
        self.count -= freed
        return pins

    def trackers(self, pins: set[int] | None = None) -> list[zmq.MessageTracker]:
        """The trackers of the replies pinning ``pins`` (all, if None)."""
        return [tracker for queue in self.by_peer.values() for tracker, pin, _, _, _ in queue
                if pins is None or pin in pins]


class Transport:
    """The ROUTER sockets of the daemon's endpoints, their drains and their replies.

    ``release_pin`` gives back the pin of a ``PinnedFrames`` reply once zmq has sent it
    (or could not); ``on_sent`` runs when the pins of sent replies went back, since that
    may free room for a request that waits; ``unread`` is kept with the bytes of each
    peer's big replies not yet sent (``RepliesInFlight``).
    """

    def __init__(self, config: Config, auth: Auth, on_message: OnMessage,
                 release_pin: Callable[[int], None], on_sent: Callable[[], None],
                 unread: UnreadBytes | None = None) -> None:
        self.config = config
        self.auth = auth
        self.on_message = on_message
        self.release_pin = release_pin
        self.on_sent = on_sent
        self.endpoints: list[str] = []
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socks: list[zmq.Socket[bytes]] = []
        self._secure: list[bool] = []
        self._ipc: list[bool] = []  # per socket: whether its endpoints are ipc ones
        self._fds: list[int] = []
        self._open = False
        # whether requests are read: from ``open`` till ``close`` (a drain asked of the
        # loop before then finds it off, and reads nothing); after ``stop_reading`` each
        # is answered at once that the daemon is stopping
        self._reading = False
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight = RepliesInFlight()
        if unread is not None:
            self._in_flight.unread_bytes = unread
            self._in_flight.unread = unread.by_peer
        self.unread = self._in_flight.unread
        self._reap_timer = False
        self.group = socket_gid(config.server.socket_group)
        # gives a socket file its mode (and group): the daemon's other sockets' too
        self.secure_file: Callable[[str, int], None] = functools.partial(
            secure_file, group=self.group)
        # whether a peer has a session (set by the daemon); None takes every message
        self.admitted: Callable[[bytes], bool] | None = None
        self._unknown: dict[bytes, int] = {}  # peer without a session -> messages seen
        self.dropped_before_hello = 0
        self.dropped_unread = 0  # replies refused by a peer's full queue (not reading)
        self.received = 0  # messages read (for ``give_back_buffers_when_quiet``)
        self.received_payloads = 0  # ... of them with payload frames (a put's)
        self._received_before = 0
        self._payloads_before = 0
        self._buffers_kept = False  # messages came since the allocator last gave back
        self._payloads_kept = False  # ... payload frames among them
        self._draining = -1  # the socket whose drain is running, if one is
        # per socket: whether a drain of it is asked of the loop (``_drain_soon``) and
        # has not run yet
        self._drain_asked: list[bool] = []

    def __repr__(self) -> str:
        return (f"Transport(endpoints={self.endpoints}, open={self._open}, "
                f"replies_in_flight={len(self._in_flight)})")

    @property
    def is_open(self) -> bool:
        """Bound and not yet closed."""
        return self._open

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind every endpoint (ipc ones on a socket gated by handshake tickets when the
        daemon has credentials for them; tcp ones on a CurveZMQ socket when curve is on,
        else on one gated by tokens in the handshake when there is a token secret) and
        start draining them on ``loop``."""
        self._loop = loop
        self._ctx = zmq.Context()
        try:
            self._bind_all(loop)
        except BaseException:
            self.close()  # the sockets made so far, those bound or not, and their files
            raise
        self._open = self._reading = True

    def _bind_all(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._ctx is not None
        config = self.config
        endpoints = [config.endpoint, *config.server.extra_endpoints]
        auth = self.auth
        ipc = [e for e in endpoints if e.startswith("ipc://")]
        tcp = [e for e in endpoints if e.startswith("tcp://")]
        tcp_kind = ("curve" if auth.curve_enabled
                    else "token" if auth.secret is not None else "open")
        if tcp and tcp_kind == "open":
            # ZeroMQ takes a message in whole, every frame of it, before the daemon sees
            # it: MAXMSGSIZE bounds a frame, not their number (a peer without a session
            # sent 16 frames of 255 MiB, and the daemon held 7.7 GiB until it could drop
            # them); nothing but the handshake keeps such a peer out
            log.warning("%s: tcp endpoints take no credentials%s (any peer that reaches "
                        "them may connect and send, and ZeroMQ reads a message whole, up "
                        "to server.max_request_bytes a frame and any number of frames, "
                        "before the daemon can drop it): set auth.secret_file (tokens) or "
                        "auth.curve_secret_key_file (CurveZMQ) to gate them in the "
                        "handshake", ", ".join(tcp),
                        " under auth.peer_tenants alone (every hello is refused)"
                        if auth.gated else "")
        # ipc endpoints on sockets of their own: their peers' uids are known (peer_uid)
        groups: list[tuple[str, list[str]]] = [
            ("gated" if auth.gated else "open", ipc),
            ("open", [e for e in endpoints if e not in ipc and e not in tcp]),
            (tcp_kind, tcp)]
        for kind, group in groups:
            if not group:
                continue
            i = len(self._socks)
            sock = self._ctx.socket(zmq.ROUTER)
            self._socks.append(sock)  # at once: a bind that fails leaves it to ``close``
            # replies to a peer past its queue's bound are refused at once (sent NOBLOCK),
            # not queued: dropped and counted (``dropped_unread``), as to a gone peer
            sock.setsockopt(zmq.SNDHWM, config.server.max_unread_replies)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.HANDSHAKE_IVL, round(config.server.handshake_seconds * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, config.max_request_bytes + p.MAX_HEADER_BYTES)
            if kind == "curve":
                self.auth.make_curve_server(self._ctx, sock)
            elif kind == "gated":
                self.auth.make_gated_server(self._ctx, sock)
            elif kind == "token":
                self.auth.make_token_server(self._ctx, sock)
            for endpoint in group:
                setting = ("server.endpoint" if endpoint == config.endpoint
                           else "server.extra_endpoints")
                self.endpoints.append(_bind(sock, endpoint, setting))
                if endpoint.startswith("ipc://"):  # (once listed: ``close`` removes it)
                    self.secure_file(endpoint[len("ipc://"):], 0o600)
            self._secure.append(kind != "open")  # its frames carry the tenant as User-Id
            self._ipc.append(group is ipc)
            fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
            self._fds.append(fd)
            self._drain_asked.append(False)
            loop.add_reader(fd, self._drain, i)
            self._drain_soon(i)

    def stop_reading(self) -> None:
        """Take no more requests: each that comes now is refused at once, ``unavailable``
        (it got no reply before, its client waiting out its timeout); replies still go
        out."""
        self._stopping = True

    def close(self) -> None:
        """Close the sockets (those of an ``open`` that failed part way too), remove ipc
        socket files, end authentication and the context."""
        if self._socks:
            if self._loop is not None:
                for fd in self._fds:
                    self._loop.remove_reader(fd)
            for sock in self._socks:
                # the replies queued go out, a peer that reads nothing holding the exit
                # up no longer than this (with none, the reply of a request finished on
                # the way out was dropped: its client waited out its timeout)
                sock.close(linger=CLOSE_LINGER_MS)
            for endpoint in self.endpoints:
                if endpoint.startswith("ipc://"):
                    try:
                        os.unlink(endpoint[len("ipc://"):])
                    except FileNotFoundError:
                        pass
            # closed once: a second close must not remove a socket file another daemon
            # has bound since
            self._socks.clear()
            self._fds.clear()
        self.auth.close()
        if self._ctx is not None:
            self._ctx.term()
        self._open = self._reading = False

    def _drain(self, index: int = 0) -> None:
        if not self._reading:
            return
        sock = self._socks[index]
        secure = self._secure[index]
        # Receive until there is nothing; replies sent meanwhile leave EVENTS to this
        # loop (see send).  After the first message a look at EVENTS says whether more
        # wait: most often none do (a blocking client's round trip), and the look costs
        # less than a failed receive (1.5 us against 3.7: pyzmq raises zmq.Again).  With
        # more waiting, the rest are received until one fails (one call a message, not
        # two); either reads ZeroMQ's commands, which re-arms its edge-triggered descriptor.
        self._draining = index
        until = time.perf_counter() + _DRAIN_SECONDS
        try:
            for taken in range(_DRAIN_BATCH):
                if taken and time.perf_counter() > until:
                    self._drain_soon(index)  # the rest next turn
                    break
                if taken == 1:
                    events: int = sock.getsockopt(_EVENTS)  # type: ignore[assignment]
                    if not events & _POLLIN:
                        break
                try:
                    frames = receive(sock)
                except zmq.Again:
                    break
                self.received += 1
                if len(frames) > 2:  # (routing id, header, payload frames)
                    self.received_payloads += 1
                # peers of different sockets may share routing ids: key them by socket too
                peer = bytes((index,)) + frames[0].bytes
                if (self.admitted is not None and not self.admitted(peer)
                        and not self._may_say_hello(peer, frames)):
                    self.dropped_before_hello += 1
                    continue
                if self.unread and peer in self.unread:  # its replies read since?
                    self.reap_sends(peer)
                if self._stopping:
                    self._refuse_stopping(peer, frames)
                    continue
                self.on_message(peer, frames, secure)
            else:
                self._drain_soon(index)  # more waiting: others first
        finally:
            self._draining = -1
        self.reap_sends()

    def peer_uid(self, peer: bytes, frames: list[zmq.Frame]) -> int | None:
        """The uid of the process that sent ``frames`` over an ipc endpoint (ZeroMQ reads
        it with SO_PEERCRED: its Peer-Address ends ``:uid:gid:pid``); None over tcp."""
        if not self._ipc[peer[0]]:
            return None
        try:
            return address_uid(str(frames[-1].get("Peer-Address")))
        except zmq.ZMQError:
            return None

    def _may_say_hello(self, peer: bytes, frames: list[zmq.Frame]) -> bool:
        """Whether a message of a peer without a session is one to read: a small single
        header (a hello, or a request it is told to say hello first), among its first
        few.  Anything else is bounded work: dropped before it is decoded or answered."""
        seen = self._unknown.pop(peer, 0) + 1
        self._unknown[peer] = seen  # most recent last: the oldest are forgotten first
        if len(self._unknown) > _UNKNOWN_PEERS:
            del self._unknown[next(iter(self._unknown))]
        return (seen <= PRE_HELLO_MESSAGES and len(frames) == 2
                and len(frames[1]) <= PRE_HELLO_BYTES)

    def send(self, peer: bytes, reply: p.Message, payload: list[Any]) -> bool:
        """Reply to ``peer``: the socket's index byte, then the peer's routing id.  A reply
        that cannot be encoded (a bug) is logged and answered with an internal error
        instead, never raised (into the drain, or a request's task): False then."""
        on_sent, asker = payload.sent() if isinstance(payload, EncodedHeader) else (None, None)
        if not self._open:
            return _call(on_sent, True)
        sock, routing_id = self._socks[peer[0]], peer[1:]
        encoded = True
        try:
            header = (payload.header if isinstance(payload, EncodedHeader)
                      else p.encoder.encode(reply))
        except Exception as exc:  # a reply that cannot be encoded (a bug): an error goes
            log.exception("could not encode a %s reply", type(reply).__name__)
            if isinstance(payload, PinnedFrames):  # (from a task too, not only the drain)
                self.release_pin(payload.pin)
            payload, encoded = [], False
            header = p.encoder.encode(p.ErrorReply(
                getattr(reply, "rid", 0), "internal",
                f"internal error: the reply could not be encoded: {exc!r}"))
        tracked = False
        try:
            if payload:
                if isinstance(payload, PinnedFrames):
                    tracker = sock.send_multipart([routing_id, header, *payload], _NOBLOCK,
                                                  copy=False, track=True)
                    assert tracker is not None, "track=True returns a tracker"
                    self._in_flight.add(peer, tracker, payload.pin)
                else:
                    sock.send_multipart([routing_id, header, *payload], _NOBLOCK, copy=False)
            elif len(header) >= TRACK_REPLY_BYTES:  # counted as unread until sent
                sock.send(routing_id, _MORE_NOBLOCK)
                # (a frame of its own: pyzmq copies anything under 64 KiB it is handed,
                # and a copy's tracker is done at once, counting nothing)
                tracker = sock.send(zmq.Frame(header, track=True, copy=False, copy_threshold=0),
                                    _NOBLOCK, copy=False, track=True)
                self._in_flight.add(peer, tracker, None, len(header), on_sent, asker)
                on_sent, tracked = None, True
            else:
                # two sends, not send_multipart: half its cost for the one-frame replies
                # of the control verbs (both copy: the frames are small)
                sock.send(routing_id, _MORE_NOBLOCK)
                sock.send(header, _NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EAGAIN:  # its queue is full: the peer does not read
                self.dropped_unread += 1
                if self.dropped_unread & (self.dropped_unread - 1) == 0:  # 1, 2, 4, ...
                    log.warning("dropping a reply to a peer that does not read its replies "
                                "(%d queued; %d dropped so far)",
                                self.config.server.max_unread_replies, self.dropped_unread)
            elif exc.errno == errno.EHOSTUNREACH:
                log.debug("dropping a reply to a gone peer")
            else:
                log.warning("dropping a reply: %s", exc)
            if isinstance(payload, PinnedFrames):
                self.release_pin(payload.pin)
        _call(on_sent, True)  # (not handed to zmq, or copied by it: nothing held)
        if tracked or isinstance(payload, PinnedFrames):
            # outside the try: a pin it released is never released twice.  This peer's
            # earlier replies only (the others' on the timer: each pinned reply looked
            # at every peer's, a cost another tenant's unread replies could raise)
            self.reap_sends(peer)
        # ZeroMQ's descriptor is edge-triggered: a send may take in messages that arrived
        # meanwhile and clear the edge, and a reply sent from a task (not from the drain)
        # would then leave them waiting with no wake-up.  Drain again if any are queued
        # (the drain of this socket, when the reply is sent from it, receives next anyway).
        if peer[0] == self._draining:
            return encoded
        events: int = sock.getsockopt(_EVENTS)  # type: ignore[assignment]
        if events & _POLLIN:
            self._drain_soon(peer[0])
        return encoded

    def _refuse_stopping(self, peer: bytes, frames: list[zmq.Frame]) -> None:
        rid = (p.request_id_of(frames[1].bytes)
               if len(frames) > 1 and len(frames[1]) <= p.MAX_HEADER_BYTES else 0)
        self.send(peer, p.ErrorReply(rid, UnavailableError.code, "the daemon is stopping; "
                                     "connect again once it is back"), [])

    def _drain_soon(self, index: int) -> None:
        """Drain socket ``index`` in a later turn of the loop, once however often asked
        before it runs: each reply sent from a task with requests waiting asked for a
        drain, and the next turn ran every one, each serving its ``_DRAIN_SECONDS`` and
        asking again (twenty replies in a turn held the loop twenty times the bound, turn
        after turn, while a client kept requests coming)."""
        if self._drain_asked[index] or self._loop is None:
            return
        self._drain_asked[index] = True
        self._loop.call_soon(self._drain_asked_for, index)

    def _drain_asked_for(self, index: int) -> None:
        self._drain_asked[index] = False
        self._drain(index)

    def reap_sends(self, peer: bytes | None = None) -> None:
        """Give back the pins of replies that zmq has finished sending (to ``peer``
        only, if given)."""
        if not self._in_flight:
            return
        if self._in_flight.reap(self.release_pin, peer):
            self.on_sent()
        if self._in_flight and not self._reap_timer and self._loop is not None:
            self._reap_timer = True
            # uvloop rounds delays down to whole milliseconds: less than 1 ms would spin
            self._loop.call_later(0.001, self._reap_timer_fired)

    def _reap_timer_fired(self) -> None:
        self._reap_timer = False
        self.reap_sends()

    def sending(self) -> list[zmq.MessageTracker]:
        """The pinned replies ZeroMQ is still sending (reaped first)."""
        self.reap_sends()
        return self._in_flight.trackers()

    def trackers_of(self, pins: set[int]) -> list[zmq.MessageTracker]:
        """The replies pinning ``pins`` that ZeroMQ is still sending."""
        return self._in_flight.trackers(pins)

    async def sent(self, trackers: list[zmq.MessageTracker], timeout: float = 1.0) -> None:
        """Wait (up to ``timeout``) until ``trackers`` are sent, then give back their pins.
        Looks after 1 ms, then twice as long each time: a few wake-ups a wait, however
        long (many waits at once must not keep the loop busy)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pause = 0.001
        while not all(t.done for t in trackers) and (left := deadline - loop.time()) > 0:
            await asyncio.sleep(min(pause, left))
            pause *= 2
        self.reap_sends()

    def give_back_buffers_when_quiet(self) -> None:
        """Called now and then (the daemon's reaper, about a second apart): once no
        message came since the last call, after some did, or once none with payload
        frames came, after some did, while small requests go on (lookups never stop
        on a busy daemon: waiting for them to stop kept a flood's heaps resident for
        good), have the C allocator give the free pages inside its heaps back to the
        kernel, in a thread (``malloc_trim`` releases the GIL): after a flood of 8 MiB
        frames, 115 MiB resident (as idle before it) against 332 without.  What stays is
        the free top of ZeroMQ's thread's heap, up to the trim threshold
        (``keep_receive_buffers``: only a free in that heap trims it), kept for the next
        put."""
        received, payloads = self.received, self.received_payloads
        came, frames_came = received != self._received_before, payloads != self._payloads_before
        self._received_before, self._payloads_before = received, payloads
        self._buffers_kept |= came
        if frames_came:
            self._payloads_kept = True  # (a put's receive buffers: kept for the next)
        elif (self._payloads_kept or (not came and self._buffers_kept)) and self._loop is not None:
            self._buffers_kept = self._payloads_kept = False
            self._loop.run_in_executor(None, give_back_free_memory)

    def reap_some(self) -> bool:
        """Reap the pinned replies ZeroMQ has sent since the last look, without
        waiting (a wait on the loop, even a short one, was a stall any peer could ask
        for again and again by leaving replies unread); whether any went."""
        before = len(self._in_flight)
        self.reap_sends()
        return len(self._in_flight) < before



def secure_file(path: str, mode: int, group: int | None) -> None:
    """Give a socket file ``mode`` (0600), or with ``server.socket_group`` (``group``) the
    group's read and write too, and its directory 0750 with that group where that is the
    daemon's sockets' own: of the daemon's user, not world-writable, holding nothing but
    the daemon's sockets (one it made, systemd's RuntimeDirectory, one kept from an
    earlier run).  A directory shared with anything else (/run, a state directory, a
    home) is left as it is, with a warning of what to do."""
    if group is None:
        os.chmod(path, mode)
        return
    os.chown(path, -1, group)
    os.chmod(path, mode | 0o060)
    directory = os.path.dirname(path) or "."
    info = os.stat(directory)
    if (info.st_uid == os.getuid() and not info.st_mode & stat.S_IWOTH
            and _sockets_only(directory, os.path.basename(path))):
        os.chown(directory, -1, group)
        os.chmod(directory, 0o750)
    elif not (info.st_mode & stat.S_IXOTH
              or (info.st_gid == group and info.st_mode & stat.S_IXGRP)):
        name = _group_name(group)
        log.warning("server.socket_group: %s holds more than the daemon's sockets (or is "
                    "not the daemon's own), so its mode and group are left as they are, "
                    "and engines of group %s cannot reach %s through it: let them in "
                    "(chgrp %s %s && chmod g+x %s), or bind the endpoint in a directory "
                    "of its own, which the daemon makes", directory, name, path, name,
                    directory, directory)


def _sockets_only(directory: str, name: str) -> bool:
    """Whether every entry of ``directory`` is a socket named as the daemon's socket
    ``name`` is (the same first part: ``kvstore.sock``, ``kvstore.sock.fd``)."""
    stem = name.split(".", 1)[0]
    try:
        with os.scandir(directory) as entries:
            return all(e.name.split(".", 1)[0] == stem
                       and stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)
                       for e in entries)
    except OSError:
        return False


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def receive(sock: zmq.Socket[bytes]) -> list[zmq.Frame]:
    """A whole message's frames without blocking (zmq.Again when there is none):
    ``recv_multipart(zmq.NOBLOCK, copy=False)`` at half its cost, reading each frame's
    ``more`` flag where it asks the socket for RCVMORE (a getsockopt) frame by frame.
    The frames of a message arrive together, so the rest never waits."""
    frames = [sock.recv(zmq.NOBLOCK, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(zmq.NOBLOCK, copy=False))
    return frames


def unpredictable_routing_ids() -> None:
    """Seed the C library's ``rand()``, which libzmq's ROUTER sockets take the start of
    their peers' routing ids from (a counter, one a connection): never seeded, it starts
    every daemon's counter at the same few values, and a peer that names the next ones
    as its own routing id (any peer may name any) aborts the daemon when the next peer
    is numbered onto one it holds (an assertion in libzmq).  Seeded, that peer must
    guess 32 bits.  Best effort where no C library's ``srand`` can be found."""
    try:
        libc = ctypes.CDLL(None)
        libc.srand(ctypes.c_uint(secrets.randbits(32)))
    except (OSError, AttributeError) as exc:
        log.warning("could not seed rand() for libzmq's routing ids: %s", exc)


def keep_receive_buffers() -> None:
    """Have the C allocator keep freed receive buffers for the next message rather than
    give their pages back to the kernel.  ZeroMQ's I/O thread reads each large frame into
    a buffer of its own, freed as soon as the loop has copied it into the arena; glibc
    then trimmed its heap's top (its threshold follows the largest block it handed out
    by mmap, a few MiB) and the next put's receive faulted every page in again: 160-350
    minor faults and a third of the I/O thread's time per 4 MiB put.  The price: up to
    ``_TRIM_THRESHOLD`` free at that heap's top stays resident while the daemon is idle
    (a 32 MiB put's frames, 25 MiB, measured).  Best effort where the C library has no
    ``mallopt`` (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    # glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD: frames up to 32 MiB (the most it
    # takes) come from the heap, and up to 64 MiB free at its top stays mapped
    mallopt(ctypes.c_int(-3), ctypes.c_int(_MMAP_THRESHOLD))
    mallopt(ctypes.c_int(-1), ctypes.c_int(_TRIM_THRESHOLD))


def give_back_free_memory() -> None:
    """The C allocator's free pages back to the kernel (glibc's ``malloc_trim``); best
    effort elsewhere."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(ctypes.c_size_t(0))


def socket_gid(group: str) -> int | None:
    """``server.socket_group`` as a gid (None when unset); ConfigError if no such group."""
    if not group:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"server.socket_group: no group named {group!r} on this host"
                          ) from None


def _bind(sock: zmq.Socket[bytes], endpoint: str, setting: str) -> str:
    """Bind ``endpoint`` (the value of ``setting``); the address bound.  ConfigError,
    naming the setting, when it cannot be: in use, an ipc path too long or in a
    directory that cannot be made, a tcp address that is no interface here."""
    check_tcp_port(setting, endpoint)
    try:
        if endpoint.startswith("ipc://"):
            path = Path(endpoint[len("ipc://"):])
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_socket_directory(path.parent)
            if path.exists():
                if socket_alive(endpoint):
                    raise ConfigError(f"{setting}: another daemon is serving {endpoint}")
                path.unlink()
        sock.bind(endpoint)
    except (zmq.ZMQError, OSError) as exc:
        raise bind_error(setting, endpoint, exc) from None
    bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound


def check_tcp_port(setting: str, endpoint: str) -> None:
    """ConfigError for a tcp endpoint with no port of 0 to 65535 (or *) after its host:
    ZeroMQ bound port 99999 as 34463 (modulo 65536), and said "Invalid argument" of
    none."""
    if not endpoint.startswith("tcp://"):
        return
    _, colon, port = endpoint[len("tcp://"):].rpartition(":")
    if not colon or not (port == "*" or (port.isdigit() and int(port) <= 65535)):
        raise ConfigError(f"{setting}: {endpoint} has no port: give tcp://HOST:PORT, "
                          "PORT 1 to 65535 (0 or * for any free one)")


def bind_error(setting: str, endpoint: str, exc: zmq.ZMQError | OSError) -> ConfigError:
    """The error of an endpoint (``setting``'s) that cannot be bound, saying why in the
    system's words (pyzmq's own text repeats the address, or runs to a paragraph)."""
    why = exc.strerror
    if isinstance(exc, zmq.ZMQError) and exc.errno is not None:
        why = zmq.strerror(exc.errno)
    return ConfigError(f"{setting}: cannot bind {endpoint}: {why}")


def socket_alive(endpoint: str) -> bool:
    """Whether something answers on an ipc endpoint (a stale socket file does not)."""
    path = endpoint[len("ipc://"):]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True
