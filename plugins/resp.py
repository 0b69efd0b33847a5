"""A small RESP2 connection for the redis backend's data path: GET and SET of large values
without the copies a general client makes.

redis-py reads a reply through asyncio's StreamReader into hiredis and out as ``bytes``,
about four copies of each value before the backend copies it again into the slot.  Here
the connection is an ``asyncio.BufferedProtocol``: while a bulk reply is awaited, the
event loop receives the socket's bytes straight into the caller's buffer (a DRAM slot),
so a value is copied once, by the kernel.  Outgoing values are handed to the transport
as they are (header, payload and framing as separate buffers; the transport writes them
with one vectored send), and every write waits until the transport has flushed, so no
reference to a caller's buffer outlives the call.

Only what the backend needs: commands as lists of byte strings, replies as ``bytes``,
``int``, ``None``, lists, or :class:`ReplyError` values (error replies are values, not
exceptions, so a pipeline reads every reply).  Any failure of the connection itself
raises ``ConnectionError`` and leaves the connection closed; a connection whose call was
cancelled part-way is closed too (``abort``), never reused.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Union, cast

from .base import BytesLike

_SMALL_BUFFER = 64 * 1024  # for reply headers and small replies; bulk payloads bypass it
_CRLF = b"\r\n"

Reply = Union[bytes, int, None, "ReplyError", list["Reply"]]


class ReplyError:
    """An error reply (``-ERR ...``, ``-MOVED ...``) as a value."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"ReplyError({self.message!r})"

    @property
    def kind(self) -> str:
        """The error's first word: ``ERR``, ``MOVED``, ``OOM``, ``WRONGTYPE`` ..."""
        return self.message.partition(" ")[0]


def pack_command(parts: Sequence[BytesLike]) -> list[BytesLike]:
    """A command as buffers for the transport: the small framing joined, each large part
    passed on as it is (no copy of a value)."""
    out: list[BytesLike] = []
    small = bytearray(b"*%d\r\n" % len(parts))
    for part in parts:
        size = memoryview(part).nbytes
        small += b"$%d\r\n" % size
        if size < 16 * 1024:
            small += part
            small += _CRLF
        else:
            out.append(bytes(small))
            out.append(part)
            small = bytearray(_CRLF)
    out.append(bytes(small))
    return out


def pack_set(key: bytes, head: bytes, value: BytesLike, ttl_s: int | None) -> list[BytesLike]:
    """``SET key head+value [EX ttl_s]`` as buffers: one bulk string whose two parts go out
    as they are, so the value is not copied."""
    size = len(head) + memoryview(value).nbytes
    first = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (
        3 if ttl_s is None else 5, len(key), key, size, head)
    if ttl_s is None:
        return [first, value, _CRLF]
    ttl = str(ttl_s).encode()
    return [first, value, b"\r\n$2\r\nEX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl)]


class RespConnection(asyncio.BufferedProtocol):
    """One connection to one server; one caller at a time (the backend's pools see to it)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray(_SMALL_BUFFER)
        self._start = 0  # unread bytes are _buffer[_start:_end]
        self._end = 0
        self._target: memoryview | None = None  # a bulk payload's destination, if awaited
        self._filled = 0
        self._into_target = False  # where the loop's current receive goes
        self._then = _SMALL_BUFFER  # room once the target is full (bytes the reader expects)
        self._room = _SMALL_BUFFER  # bytes the small buffer may take before reading pauses
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._paused_reading = False
        self._paused_writing = False
        self._failure: ConnectionError | None = None

    # -- opening and closing ---------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        *,
        host: str | None = None,
        port: int = 6379,
        path: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
    ) -> RespConnection:
        """Connect (TCP, TLS or a Unix socket), authenticate and select ``db``."""
        loop = asyncio.get_running_loop()
        conn = cls()
        if path is not None:
            await loop.create_unix_connection(lambda: conn, path)
        elif host is None:
            raise ValueError("a redis connection needs a host or a path")
        else:
            await loop.create_connection(
                lambda: conn, host, port, ssl=ssl_context,
                server_hostname=host if ssl_context is not None else None,
            )
        try:
            setup: list[list[bytes]] = []
            if password is not None:
                auth = [b"AUTH", password.encode()]
                if username:
                    auth.insert(1, username.encode())
                setup.append(auth)
            if db:
                setup.append([b"SELECT", str(db).encode()])
            if setup:
                for reply in await conn.pipeline(setup):
                    if isinstance(reply, ReplyError):
                        raise ConnectionError(f"redis refused the connection: {reply.message}")
        except BaseException:
            conn.abort()
            raise
        return conn

    @property
    def usable(self) -> bool:
        """Open, and with nothing unread (a connection that holds stray bytes is not reused)."""
        return (
            self._failure is None and self._transport is not None
            and not self._transport.is_closing() and self._start == self._end
        )

    def abort(self) -> None:
        """Close at once, dropping unsent data; no buffer of a caller is written after this."""
        self._target = None
        if self._failure is None:
            self._failure = ConnectionError("connection closed")
        if self._transport is not None:
            self._transport.abort()
        self._wake()

    # -- asyncio.BufferedProtocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but are one
        self._transport = cast(asyncio.Transport, transport)
        self._transport.set_write_buffer_limits(high=0)  # pause_writing whenever anything waits

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self._target
        if target is not None and self._start == self._end and self._filled < target.nbytes:
            self._into_target = True
            return target[self._filled:]
        self._into_target = False
        if self._end == len(self._buffer):  # compact; grow only for a line that fills it
            unread = self._end - self._start
            grown = bytearray(max(_SMALL_BUFFER, 2 * unread))
            grown[:unread] = self._buffer[self._start:self._end]
            self._buffer, self._start, self._end = grown, 0, unread
        room = max(1, min(self._room, len(self._buffer) - self._end))
        return memoryview(self._buffer)[self._end:self._end + room]

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_target:
            self._filled += nbytes
            assert self._target is not None
            if self._filled == self._target.nbytes:
                # Take no more than the reader expects next (the framing and header of
                # the next reply), so the next payload too arrives straight in its buffer.
                self._room = self._then
        else:
            self._end += nbytes
            self._room -= nbytes
        if self._room <= 0 and not self._paused_reading and self._transport is not None:
            self._transport.pause_reading()
            self._paused_reading = True
        self._wake()

    def eof_received(self) -> bool:
        self._lost(ConnectionError("the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(ConnectionError(f"connection lost: {exc}" if exc else "connection closed"))
        self._wake_drained()

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        self._wake_drained()

    def _lost(self, failure: ConnectionError) -> None:
        self._target = None
        if self._failure is None:
            self._failure = failure
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drained(self) -> None:
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    # -- writing ---------------------------------------------------------------------------
    async def write(self, buffers: Sequence[BytesLike]) -> None:
        """Send ``buffers`` in order; returns once the transport holds none of them."""
        transport = self._live_transport()
        transport.writelines(buffers)
        while self._paused_writing and self._failure is None:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None
        if self._failure is not None:
            raise self._failure

    async def pipeline(self, commands: Sequence[Sequence[BytesLike]]) -> list[Reply]:
        """Send the commands, then read one reply for each."""
        buffers: list[BytesLike] = []
        for command in commands:
            buffers.extend(pack_command(command))
        await self.write(buffers)
        return [await self.read_reply() for _ in commands]

    # -- reading ---------------------------------------------------------------------------
    async def read_reply(self) -> Reply:
        """The next reply, whole."""
        line = await self._read_line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            data = bytearray(size)
            await self.read_into(memoryview(data))
            await self._expect_crlf()
            return bytes(data)
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [await self.read_reply() for _ in range(count)]
        raise self._protocol_error(f"unexpected reply {line[:40]!r}")

    async def read_bulk_header(self, *, ahead: int = _SMALL_BUFFER) -> int | ReplyError | None:
        """The start of a bulk reply: its length (read the payload next, then
        :meth:`end_bulk`), None for a nil reply, or the error reply.  ``ahead``: how many
        bytes to receive into the connection's buffer at most, if it must wait."""
        line = await self._read_line(ahead)
        kind = line[:1]
        if kind == b"$":
            size = int(line[1:])
            return None if size < 0 else size
        if kind == b"-":
            return ReplyError(line[1:].decode(errors="replace"))
        raise self._protocol_error(f"expected a bulk reply, got {line[:40]!r}")

    async def end_bulk(self) -> None:
        await self._expect_crlf()

    async def read_into(self, out: memoryview, *, then: int = _SMALL_BUFFER) -> None:
        """Fill ``out`` with the next ``out.nbytes`` bytes: what is buffered first, then
        straight from the socket.  ``then``: how many bytes the caller will read next
        before it reads into a buffer of its own again (0 if at once); no more than that
        is received ahead into the connection's buffer meanwhile."""
        size = out.nbytes
        have = min(size, self._end - self._start)
        if have:
            out[:have] = memoryview(self._buffer)[self._start:self._start + have]
            self._consumed(have)
        if have == size:
            return
        self._target, self._filled, self._then = out, have, then
        try:
            while self._filled < size:
                await self._wait(None)
        finally:
            self._target = None
            self._into_target = False
            self._then = _SMALL_BUFFER

    async def skip(self, size: int) -> None:
        """Read and drop ``size`` bytes."""
        scratch = memoryview(bytearray(min(size, 1 << 20)))
        while size:
            part = min(size, scratch.nbytes)
            await self.read_into(scratch[:part])
            size -= part

    async def _read_line(self, room: int = _SMALL_BUFFER) -> bytes:
        searched = 0  # bytes past _start known to hold no CRLF (the buffer may move)
        while True:
            at = self._buffer.find(_CRLF, self._start + searched, self._end)
            if at >= 0:
                line = bytes(self._buffer[self._start:at])
                self._consumed(at + 2 - self._start)
                return line
            searched = max(0, self._end - self._start - 1)
            await self._wait(room)

    async def _expect_crlf(self) -> None:
        while self._end - self._start < 2:
            await self._wait(2 - (self._end - self._start))
        if self._buffer[self._start:self._start + 2] != _CRLF:
            raise self._protocol_error("a bulk reply did not end with CRLF")
        self._consumed(2)

    def _consumed(self, count: int) -> None:
        self._start += count
        if self._start == self._end:
            self._start = self._end = 0

    def idle(self) -> None:
        """Between calls: keep receiving, so that a close by the server is seen."""
        self._room = max(self._room, _SMALL_BUFFER)
        self._resume()

    def _resume(self) -> None:
        if self._paused_reading and self._failure is None:
            self._paused_reading = False
            assert self._transport is not None
            self._transport.resume_reading()

    async def _wait(self, room: int | None) -> None:
        """Until more bytes arrive: into the target, or (``room`` not None) up to ``room``
        bytes into the small buffer; ConnectionError if the connection failed."""
        if self._failure is not None:
            raise self._failure
        if room is not None:
            self._room = max(room, 1)
        self._resume()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._failure is not None:
            raise self._failure

    def _live_transport(self) -> asyncio.Transport:
        if self._failure is not None:
            raise self._failure
        assert self._transport is not None, "open() sets the transport"
        return self._transport

    def _protocol_error(self, what: str) -> ConnectionError:
        self.abort()
        failure = ConnectionError(f"redis protocol error: {what}")
        self._failure = failure
        return failure
