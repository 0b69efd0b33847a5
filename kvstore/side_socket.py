"""The daemon's side socket: arena descriptors and handshake tickets, over a unix socket.

Beside the ipc endpoint (``<socket path>.fd``), served from the event loop with no
thread: each connection sends one small request and gets one reply, then is closed.
An arena's descriptor goes only to a session that hello authenticated (its id is the
secret it presents), asked by a process of a uid that said hello for it over an ipc
endpoint (SO_PEERCRED on both sockets), and only for an arena its tenant may use; a handshake ticket goes
to a client with a valid token, or to a uid that ``auth.peer_tenants`` names.  Work per
connection is bounded: a request over ``MAX_SIDE_MESSAGE`` bytes, or one that does not
come within ``SIDE_TIMEOUT_S``, closes it, and at most ``MAX_CONNECTIONS`` are open at
once: past that, a new connection closes the oldest of the uid holding the most, so a
peer that opens many and says nothing delays no other user's request.  The wire format is
``kvstore.tiers.arena_fds``'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections import Counter
from collections.abc import Callable

import msgspec

from kvstore.auth import Auth
from kvstore.errors import KVStoreError
from kvstore.sessions import Sessions
from kvstore.tiers.arena_fds import (
    MAX_SIDE_MESSAGE,
    SIDE_TIMEOUT_S,
    Admit,
    ArenaAsk,
    SideReply,
    frame,
    side_request_decoder,
    unframe,
)
from kvstore.tiers.dram import Arenas

log = logging.getLogger("kvstore.server")

MAX_CONNECTIONS = 256
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return int(_PEERCRED.unpack(creds)[1])


class SideSocket:
    """The listening side socket and its connections, on the daemon's loop."""

    def __init__(self, path: str, auth: Auth, sessions: Sessions,
                 arenas: Callable[[], Arenas | None],
                 secure_file: Callable[[str, int], None]) -> None:
        self.path = path
        self.auth = auth
        self.sessions = sessions
        self.arenas = arenas  # the daemon's arenas, once made
        self.secure_file = secure_file  # gives the socket file its mode and group
        self.counts = {"arenas": 0, "tickets": 0, "refused": 0, "dropped": 0}
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # descriptor -> (connection, bytes so far, its timer, its peer's uid), oldest first
        self._conns: dict[int, tuple[socket.socket, bytearray, asyncio.TimerHandle, int]] = {}

    def __repr__(self) -> str:
        return f"SideSocket({self.path}, open={len(self._conns)}, {self.counts})"

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # the ipc endpoint's bind checked no daemon serves here: what is left is a
            # stale socket file or a link (``lexists``: one to nowhere too, else the bind
            # said "address in use"); a directory is refused below, by name, as unlink
            # fails (it escaped as a traceback, the daemon not started)
            if os.path.lexists(self.path):
                os.unlink(self.path)
            listener.bind(self.path)
            self.secure_file(self.path, 0o600)
            listener.listen(128)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise KVStoreError(f"cannot serve the side socket {self.path}: {exc}") from None
        self._listener = listener
        loop.add_reader(listener.fileno(), self._accept)

    def close(self) -> None:
        for fd in list(self._conns):
            self._drop(fd)
        if self._listener is not None:
            assert self._loop is not None
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        for _ in range(64):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("side socket: accept failed: %s", exc)
                return
            try:
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                continue
            if len(self._conns) >= MAX_CONNECTIONS:
                self._make_room()
            conn.setblocking(False)
            fd = conn.fileno()
            timer = self._loop.call_later(SIDE_TIMEOUT_S, self._timed_out, fd)
            self._conns[fd] = (conn, bytearray(), timer, uid)
            self._loop.add_reader(fd, self._read, fd)

    def _make_room(self) -> None:
        """Close the oldest connection of the uid that holds the most."""
        held = Counter(uid for _, _, _, uid in self._conns.values())
        greediest = held.most_common(1)[0][0]
        oldest = next(fd for fd, (_, _, _, uid) in self._conns.items() if uid == greediest)
        self.counts["dropped"] += 1
        self._drop(oldest)

    def _timed_out(self, fd: int) -> None:
        self.counts["dropped"] += 1
        self._drop(fd)

    def _drop(self, fd: int) -> None:
        held = self._conns.pop(fd, None)
        if held is None:
            return
        conn, _, timer, _ = held
        timer.cancel()
        assert self._loop is not None
        self._loop.remove_reader(fd)
        conn.close()

    def _read(self, fd: int) -> None:
        conn, data, _, uid = self._conns[fd]
        try:
            chunk = conn.recv(MAX_SIDE_MESSAGE + 4 - len(data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(fd)
            return
        data += chunk
        try:
            body = unframe(bytes(data))
            if body is None:
                return
            request = side_request_decoder.decode(body)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.counts["dropped"] += 1
            self._reply(fd, SideReply(False, f"bad request: {exc}"))
            return
        if isinstance(request, Admit):
            self._admit(fd, uid, request.token)
        else:
            self._arena(fd, uid, request)

    def _admit(self, fd: int, uid: int, token: str) -> None:
        try:
            tenant, ticket = self.auth.admission(uid, token)
        except KVStoreError as exc:
            self.counts["refused"] += 1
            self._reply(fd, SideReply(False, str(exc)))
            return
        self.counts["tickets"] += bool(ticket)
        self._reply(fd, SideReply(True, ticket=ticket, tenant=tenant))

    def _arena(self, fd: int, uid: int, ask: ArenaAsk) -> None:
        session = self.sessions.by_id.get(ask.session)
        arenas = self.arenas()
        held = arenas.by_label.get(ask.label) if arenas is not None else None
        # one answer for every refusal: the asker learns nothing of other sessions' arenas.
        # The session id is a secret, and the asker must also be of a uid that said hello
        # for the session over an ipc endpoint: an id that leaked is no use to another user
        if (session is None or uid not in session.uids
                or held is None or held[1].fd is None
                or (held[0] and not self.auth.may_open(session.tenant, held[0]))):
            self.counts["refused"] += 1
            self._reply(fd, SideReply(False, "no such arena for this session (say hello "
                                             "first, over the ipc endpoint, from a process "
                                             "of this uid; a tenant gets only its own "
                                             "arenas)"))
            return
        arena = held[1]
        assert arena.fd is not None
        handed = arena.fd
        if held[0] and not self.auth.may_write(session.tenant, held[0]):
            try:  # granted to read: a descriptor that maps only for reading
                handed = arena.read_only_fd()
            except OSError as exc:
                self.counts["refused"] += 1
                self._reply(fd, SideReply(False, f"the arena cannot be handed read-only "
                                                 f"here ({exc}); use get instead"))
                return
        self.counts["arenas"] += 1
        self._reply(fd, SideReply(True, size=arena.capacity_bytes), handed)

    def _reply(self, fd: int, reply: SideReply, pass_fd: int | None = None) -> None:
        conn = self._conns[fd][0]
        try:
            # a reply is tiny: the socket's buffer takes it whole, or the peer is gone
            if pass_fd is None:
                conn.send(frame(reply))
            else:
                socket.send_fds(conn, [frame(reply)], [pass_fd])
        except OSError as exc:
            log.debug("side socket: a reply to a gone peer: %s", exc)
        self._drop(fd)
