"""Arenas as capabilities: anonymous memory files handed out as descriptors.

An arena made with ``memfd_create`` has no path: no other process can open it, only
receive its descriptor.  The daemon hands it, over a plain unix socket beside its ipc
endpoint (the *side socket*, ``<socket path>.fd``: ZeroMQ cannot carry descriptors), to
a client whose hello authenticated it, with ``SCM_RIGHTS``.  The arena goes away with its
last holder, so a daemon killed with SIGKILL leaves nothing in ``/dev/shm``.

The side socket also admits clients to the ZeroMQ socket of a daemon with credentials:
the client presents its token there (or none: the daemon reads the peer's uid with
``SO_PEERCRED`` and looks it up in ``auth.peer_tenants``), and gets its tenant and a
one-time ticket back, or a clear refusal.  It connects to the ipc endpoint with the
ticket as its ZeroMQ PLAIN password, checked during the handshake: a peer without one
never gets to send the daemon a single message.

The side socket speaks one request and one reply per connection, each a 4-byte
big-endian length and a MessagePack array; a reply that grants an arena carries its
descriptor.  This module holds the wire format, the arena file itself and the client's
side of the exchange; the daemon's side is ``kvstore.side_socket``.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import socket
import struct
from typing import Union

import msgspec

from kvstore.auth import token_tenant
from kvstore.errors import ConfigError, ForbiddenError, KVStoreError, UnavailableError
from kvstore.files import FILE_SIZE_LIMIT_FROM, file_size_limit

MEMFD_PREFIX = "memfd:"        # an arena path naming a descriptor to ask for, not a file
SIDE_SUFFIX = ".fd"
MAX_SIDE_MESSAGE = 4096        # a side socket request or reply is small, always
SIDE_TIMEOUT_S = 5.0
_LENGTH = struct.Struct(">I")
_FD = struct.Struct("i")
_SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)
          | getattr(fcntl, "F_SEAL_SEAL", 0x1))


class ArenaAsk(msgspec.Struct, tag="arena", array_like=True):
    """An arena's descriptor, for the session (its secret id) that was told its label."""

    session: str
    label: str


class Admit(msgspec.Struct, tag="admit", array_like=True):
    """A one-time handshake ticket, for a token ("": for this peer's uid)."""

    token: str


SideRequest = Union[ArenaAsk, Admit]


class SideReply(msgspec.Struct, array_like=True):
    ok: bool
    message: str = ""   # why not, when not ok
    ticket: str = ""    # an Admit's ticket ("": the daemon takes no handshake credentials)
    size: int = 0       # an ArenaAsk's arena size; its descriptor rides along
    tenant: str = ""    # an Admit's tenant, the PLAIN user name the ticket goes with


side_request_decoder = msgspec.msgpack.Decoder(SideRequest)
side_reply_decoder = msgspec.msgpack.Decoder(SideReply)
side_encoder = msgspec.msgpack.Encoder()


def side_path(endpoint: str) -> str | None:
    """The side socket beside an ipc endpoint (None for tcp: no descriptors there)."""
    if not endpoint.startswith("ipc://"):
        return None
    return endpoint[len("ipc://"):] + SIDE_SUFFIX


def frame(message: msgspec.Struct) -> bytes:
    body = side_encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def unframe(data: bytes) -> bytes | None:
    """The body of a complete framed message, None while more is to come; ValueError
    when it claims more than a side message may hold."""
    if len(data) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(data)
    if length > MAX_SIDE_MESSAGE:
        raise ValueError(f"a side socket message of {length} bytes (limit {MAX_SIDE_MESSAGE})")
    if len(data) < _LENGTH.size + length:
        return None
    return data[_LENGTH.size:_LENGTH.size + length]


# -- the arena file ------------------------------------------------------------------------

def create_memfd(capacity_bytes: int, name: str = "kvstore-arena", *,
                 allocate: bool = True) -> int:
    """An anonymous memory file of ``capacity_bytes``, allocated now (unless not
    ``allocate``: its pages come as they are written) and sealed against resizing (a
    holder could otherwise shrink it and crash every mapper); its descriptor.

    Its mode is 0600 (a memory file is made 0777): a client of another user handed a
    read-only descriptor of it (a namespace granted to read) could otherwise open it
    again read-write through ``/proc/self/fd``."""
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise ConfigError(f"dram.arena_kind: cannot create a memory file: {exc.strerror}"
                          ) from None
    try:
        os.fchmod(fd, 0o600)
        try:
            if allocate:
                os.posix_fallocate(fd, 0, capacity_bytes)
            else:
                os.ftruncate(fd, capacity_bytes)
        except OSError as exc:
            raise ConfigError(f"dram.capacity: cannot allocate {capacity_bytes} bytes of "
                              f"shared memory: {exc.strerror}{size_limit_note(exc, 'dram.capacity')}") from None
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def allocated(fd: int, size: int) -> bool:
    """Whether the arena file ``fd`` holds all of its ``size`` bytes: a sparse one (per-
    tenant arenas, whose memory follows their slabs: ``kvstore.arena_budget``) is mapped
    without populating it, which would take the memory of every slab, used or not."""
    return os.fstat(fd).st_blocks * 512 >= size


# -- the client's side -----------------------------------------------------------------------

def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """Bytes and at most one descriptor, close-on-exec from the start (a child another
    thread execs meanwhile must not inherit an arena; ``socket.recv_fds`` drops the
    flag that says so)."""
    data, ancillary, _, _ = sock.recvmsg(MAX_SIDE_MESSAGE, socket.CMSG_SPACE(_FD.size),
                                         socket.MSG_CMSG_CLOEXEC)
    fds = [fd for level, kind, body in ancillary
           if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
           for (fd,) in _FD.iter_unpack(body[:len(body) - len(body) % _FD.size])]
    return data, fds


def _ask(path: str, request: msgspec.Struct,
         timeout: float = SIDE_TIMEOUT_S) -> tuple[SideReply, list[int]]:
    """One exchange over the side socket, each of its steps within ``timeout`` seconds
    (the client's own: negative waits as long as it takes)."""
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout if timeout >= 0 else None)
            sock.connect(path)
            sock.sendall(frame(request))
            data = b""
            while True:
                chunk, got = _recv_fds(sock)
                fds += got
                if not chunk:
                    raise ValueError("it closed without a reply")
                data += chunk
                body = unframe(data)
                if body is not None:
                    return side_reply_decoder.decode(body), fds
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        for fd in fds:
            os.close(fd)
        raise UnavailableError(f"the daemon's side socket {path}: {exc}") from None


def fetch_arena(path: str, session: str, label: str,
                timeout: float = SIDE_TIMEOUT_S) -> tuple[int, int]:
    """The descriptor and size of the arena ``label`` (a ``memfd:`` arena path's rest),
    for an authenticated session; ForbiddenError if the daemon refuses."""
    reply, fds = _ask(path, ArenaAsk(session, label), timeout)
    if not reply.ok or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        if reply.ok:
            raise KVStoreError(f"the daemon's side socket {path} sent {len(fds)} descriptors")
        raise ForbiddenError(f"the daemon refused the arena: {reply.message}")
    return fds[0], reply.size


def map_handed_arena(endpoint: str, session: str, label: str, size: int,
                     timeout: float = SIDE_TIMEOUT_S) -> mmap.mmap:
    """A client's mapping of the arena ``label`` of its session, whose descriptor the
    daemon hands over the side socket beside ``endpoint``."""
    side = side_path(endpoint)
    if side is None:
        raise KVStoreError("the daemon hands its arena out only over its ipc endpoint; "
                           "over tcp, use put/get (map_arena=False)")
    fd, handed = fetch_arena(side, session, label, timeout)
    try:
        if handed != size:
            raise KVStoreError(f"the arena handed out holds {handed} bytes, not {size}")
        # a namespace granted to read comes as a read-only descriptor: map it so
        read_only = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        populate = getattr(mmap, "MAP_POPULATE", 0) if allocated(fd, size) else 0
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate,
                         prot=mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def admit(path: str, token: str, timeout: float = SIDE_TIMEOUT_S) -> tuple[str, str] | None:
    """The tenant and one-time ticket (the ZeroMQ PLAIN user name and password) for
    ``token``, or for this process's uid when it is empty; None when the daemon takes no
    handshake credentials (or has no side socket); ForbiddenError, saying why, when the
    credentials are refused."""
    if not os.path.exists(path):
        return None
    reply, fds = _ask(path, Admit(token), timeout)
    for fd in fds:
        os.close(fd)
    if not reply.ok:
        raise ForbiddenError(reply.message)
    return (reply.tenant, reply.ticket) if reply.ticket else None


def tcp_credentials(endpoint: str, token: str, tenant: str,
                    curve: bool) -> tuple[str, str] | None:
    """The ZeroMQ PLAIN user name and password of a client with a token on a tcp endpoint
    without CurveZMQ (the daemon checks them in the handshake): its tenant, named or the
    one its token names, and the token; None otherwise.  ForbiddenError for what cannot
    go in a handshake (ZeroMQ takes 1 to 255 bytes of each)."""
    if not token or curve or not endpoint.startswith("tcp://"):
        return None
    user = tenant or token_tenant(token)
    if not user:
        raise ForbiddenError("the token is not a kvstore token")
    if len(user.encode()) > 255 or len(token.encode()) > 255:
        raise ForbiddenError("the tenant or token is too long for the tcp handshake "
                             "(255 bytes each at most)")
    return user, token


def refused_hint(credentials: str) -> str:
    """What a handshake with ``credentials`` ("ticket", "token" or "": none) checks, for a
    client that got no reply: ZeroMQ refuses a handshake silently."""
    if credentials == "ticket":
        return ("; if the daemon refused the handshake, its ticket was used, late (good "
                "for 10s) or presented by a process of another uid than the one that "
                "asked for it: connect again from the same process")
    if credentials == "token":
        return ("; if the daemon refused the handshake, the token is forged, expired or "
                "not the named tenant's, or the daemon takes no tokens on this endpoint "
                "(a token secret gates tcp endpoints; CurveZMQ needs keys instead)")
    return ""


def size_limit_note(exc: OSError, field: str) -> str:
    """What an arena's allocation refused with EFBIG adds: the file size limit
    (``files.file_size_limit``) bounds a memory file and a file in /dev/shm alike, and
    the error said only "File too large", no word of the limit."""
    if exc.errno != errno.EFBIG:
        return ""
    limit = file_size_limit()
    shown = "unlimited" if limit is None else f"{limit} bytes"
    return (f" (the daemon's file size limit is {shown}: {FILE_SIZE_LIMIT_FROM}; raise it "
            f"or lower {field})")
