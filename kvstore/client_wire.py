"""What a client sends and receives, without state: the DEALER socket and its connection
settings, reply frames decoded and checked, block checksums, and how many keys or bytes
one request may carry.  ``kvstore.client_core`` builds the verbs on it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import xxhash

from kvstore import protocol as p
from kvstore.errors import (
    CorruptError,
    KVStoreError,
    MalformedError,
    UnavailableError,
    error_from_code,
)

if TYPE_CHECKING:
    import zmq

R = TypeVar("R", bound=p.Message)
T = TypeVar("T")
BYE_LINGER_MS = 20  # how long a closing socket may take to hand its goodbye over

Outgoing = tuple[p.Message, Sequence[Any]]  # a request and its payload frames
Received = tuple[p.Message, list["zmq.Frame"]]  # a reply and its payload frames
Exchange = Generator[Outgoing, Received, T]  # a verb of one or more requests


# ----------------------------------------------------------------------------------------
# connection settings
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ for ``tcp://``: the daemon's public key and this client's key pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_public_file: str, client_secret_file: str) -> CurveKeys:
        """From ``kvstore keygen`` files: the server's ``.key`` and the client's
        ``.key_secret``."""
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(server_public_file)
        public, secret = zmq.auth.load_certificate(client_secret_file)
        if secret is None:
            raise MalformedError(f"{client_secret_file} holds no secret key")
        return cls(server_public, public, secret)


def _token(token: str | None) -> str:
    return token if token is not None else os.environ.get("KVSTORE_TOKEN", "")


def _tenant(tenant: str | None, token: str | None) -> str:
    """The tenant to name in hello: given, from the environment, or (with credentials) left
    for the daemon to take from them."""
    if tenant:
        return tenant
    if os.environ.get("KVSTORE_TENANT"):
        return os.environ["KVSTORE_TENANT"]
    return "" if _token(token) else "default"


def _curve_from_env() -> CurveKeys | None:
    server = os.environ.get("KVSTORE_CURVE_SERVER_KEY")
    client = os.environ.get("KVSTORE_CURVE_CLIENT_CERT")
    return CurveKeys.from_files(server, client) if server and client else None


def _credentials(sock: Any, endpoint: str, curve: CurveKeys | None,
                 admission: tuple[str, str] | None) -> None:
    """A socket's CurveZMQ keys (tcp only) or PLAIN user name and password."""
    if curve is not None and endpoint.startswith("tcp://"):
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    if admission is not None:
        sock.plain_username = admission[0].encode()
        sock.plain_password = admission[1].encode()


def make_socket(ctx: Any, endpoint: str, curve: CurveKeys | None = None,
                admission: tuple[str, str] | None = None, *, watch: bool = False,
                send_hwm: int = 0) -> Any:
    """The DEALER socket of a shell (``ctx`` is a ``zmq.Context`` or a
    ``zmq.asyncio.Context``), set up the same way for both; ``admission`` is the tenant
    and ticket of a gated ipc endpoint, or tenant and token on tcp (``_admission``).
    With ``watch``, a monitor hears of a handshake the daemon refuses, from the first
    one on: ``sock.get_monitor_socket()`` returns it (``handshake_refusal`` reads it).
    ``send_hwm``: the most messages queued toward the daemon (0: no bound).
    MalformedError for an endpoint ZeroMQ cannot connect to."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.RCVHWM, 0)
    _credentials(sock, endpoint, curve, admission)
    if watch:
        sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        if watch:
            stop_watching(sock)
        sock.close(linger=0)
        why = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
        raise MalformedError(f"cannot connect to the endpoint {endpoint!r}: {why} (an "
                             f"endpoint is ipc://PATH or tcp://HOST:PORT)") from None
    return sock


def event_socket(ctx: Any, kind: int, endpoint: str, *, token: str = "", tenant: str = "",
                 curve: CurveKeys | None = None, daemon: str = "") -> Any:
    """A socket of ``kind`` (``zmq.SUB`` for the stream, ``zmq.DEALER`` for replays)
    connected to a daemon's event stream ``endpoint`` with the credentials it asks of
    ``events.readers`` when it takes credentials: on tcp a CurveZMQ key pair (``curve``)
    or a token (``token``, of ``tenant`` or the tenant it names); on ipc a ticket, asked
    with ``token`` (or for this process's uid) of the side socket beside ``daemon``, the
    daemon's ipc endpoint.  A daemon without credentials takes none."""
    import zmq

    from kvstore.tiers.arena_fds import admit, side_path, tcp_credentials

    admission: tuple[str, str] | None = None
    if endpoint.startswith("tcp://"):
        admission = tcp_credentials(endpoint, token, tenant, curve is not None)
    elif daemon:
        side = side_path(daemon)
        if side is None:
            raise MalformedError(f"daemon {daemon!r}: tickets come from an ipc endpoint")
        admission = admit(side, token)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    _credentials(sock, endpoint, curve, admission)
    sock.connect(endpoint)
    return sock


def handshake_refusal(monitor: Any) -> int | None:
    """The ZeroMQ status of a handshake refused, if the monitor of a socket made with
    ``watch`` heard of one (its events read without waiting).  ZeroMQ tells it only
    there: the socket itself stays silent, and connects again and again."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return None
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return int(event["value"])


def no_daemon_hint(endpoint: str) -> str:
    """What to check when no daemon ever answered at ``endpoint``: the message said only
    that none did, and left the user to guess whether one runs, or where."""
    missing = endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://"):])
    return ("; is a daemon serving there" + (" (no socket file)" if missing else "")
            + "? Start one (kvstore serve), or name its endpoint (endpoint=, --endpoint "
            "or KVSTORE_ENDPOINT)")


def say_bye(sock: Any, bye: bytes | None) -> int:
    """Send a closing client's goodbye (``SessionCore._bye_request``), unread; how many
    milliseconds its socket may linger to hand it over (0: none went: a daemon gone, or
    nothing to say; the lease ends the session)."""
    import zmq

    if bye is None:
        return 0
    try:
        sock.send(bye, zmq.NOBLOCK)
    except zmq.ZMQError:
        return 0
    return BYE_LINGER_MS


def stop_watching(sock: Any) -> None:
    """Close the monitor of a socket made with ``watch`` (once its hello is answered)."""
    monitor = sock.get_monitor_socket()
    sock.disable_monitor()
    monitor.close(linger=0)


# ----------------------------------------------------------------------------------------
# replies and payloads
# ----------------------------------------------------------------------------------------

def receive(sock: zmq.Socket[bytes], flags: int = 0) -> list[zmq.Frame]:
    """A whole message's frames: ``recv_multipart(flags, copy=False)`` at half its cost,
    reading each frame's ``more`` flag where it asks the socket for RCVMORE (a getsockopt)
    frame by frame.  The frames of a message arrive together: the rest never wait."""
    frames = [sock.recv(flags, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(flags, copy=False))
    return frames


def decode_reply(frames: list[zmq.Frame]) -> Received:
    """A reply's header and its payload frames; KVStoreError if the header is not a reply."""
    try:
        reply = p.reply_decoder.decode(frames[0].buffer)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        # (a stats reply's values are any msgpack: nested deep enough, msgspec gives up
        # with a RecursionError, which reached the caller, or the async client's reader)
        raise KVStoreError(f"undecodable reply from the daemon: {exc}") from None
    return reply, frames[1:]


def check_reply(reply: p.Message, expected: type[R]) -> R:
    """The reply if it is an ``expected``; the typed error of an error reply; else
    KVStoreError."""
    if isinstance(reply, expected):
        return reply
    if isinstance(reply, p.ErrorReply):
        raise error_from_code(reply.code, reply.message)
    raise KVStoreError(f"expected a {expected.__name__}, got {type(reply).__name__}")


def got_blocks(reply: p.GetReply, frames: Sequence[Any], count: int,
               block_bytes: int) -> list[bytes]:
    """The bytes of a get reply's ``count`` blocks, or KVStoreError: a daemon answers a
    get whole or with an error, never with a short list, which its caller would take for
    the blocks of the keys it asked for."""
    blocks = [f.bytes for f in frames]
    if (reply.blocks != count or len(blocks) != count
            or any(len(b) != block_bytes for b in blocks)):
        raise KVStoreError(
            f"a get of {count} blocks of {block_bytes} bytes was answered with "
            f"{len(blocks)} frames of {sorted({len(b) for b in blocks})} bytes "
            f"({reply.blocks} announced)")
    return blocks


def map_named_arena(path: str, size: int) -> mmap.mmap:
    """A mapping of the arena a daemon named by its path, or KVStoreError (a path or
    size no arena has: the open's OSError reached the caller before); UnavailableError
    where no file has the path: the daemon that named it is gone (killed after its
    reply, its arena swept by the next start), as a caller that retries should hear."""
    from kvstore.tiers.dram import map_arena

    try:
        return map_arena(path, size)
    except FileNotFoundError:
        raise UnavailableError(f"cannot map the daemon's arena {path!r}: it is gone, the "
                               f"daemon that named it exited (or restarted); open a new "
                               f"client") from None
    except (OSError, ValueError) as exc:
        raise KVStoreError(f"cannot map the daemon's arena {path!r} of {size} bytes: "
                           f"{exc}") from exc


def checksum(block: Any) -> int:
    """xxh3_64 of a block's bytes: what writers send and readers check."""
    return xxhash.xxh3_64_intdigest(block)


def verify(blocks: Sequence[Any], sums: Sequence[int]) -> None:
    """CorruptError unless every block matches its checksum (0: not known)."""
    for i, (block, want) in enumerate(zip(blocks, sums)):
        if want and checksum(block) != want:
            raise CorruptError(f"block {i} does not match the checksum it was written with")


def _listed(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` as a list, refused (MalformedError) where it is plainly no list of keys:
    one bytes object (or text) in its place, or a first key that is no key of
    ``p.KEY_BYTES`` bytes (the first only, at no cost per key: the daemon checks each,
    but said only "Expected `bytes` of length >= 16 - at `$[3][0]`")."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise MalformedError(f"keys are a list of {p.KEY_BYTES}-byte keys, as ns.keys() "
                             f"gives, not one {type(keys).__name__} object (one key: [key])")
    listed = keys if isinstance(keys, list) else list(keys)
    if listed and _key_bytes(listed[0]) != p.KEY_BYTES:
        got = (f"{_key_bytes(listed[0])} bytes" if _key_bytes(listed[0]) >= 0
               else f"of type {type(listed[0]).__name__}")
        raise MalformedError(f"key 0 is {got}: keys are {p.KEY_BYTES} bytes each, "
                             f"as ns.keys() gives")
    return listed


def _key_bytes(key: object) -> int:
    """How many bytes a key is (bytes, or a bytearray or memoryview the wire takes as
    bytes too); -1 for anything else."""
    if isinstance(key, (bytes, bytearray)):
        return len(key)
    return key.nbytes if isinstance(key, memoryview) else -1


def _per(size: int, max_keys: int, max_bytes: int) -> int:
    """Keys of ``size`` bytes each that one request may carry."""
    return max(1, min(max_keys, max_bytes // max(size, 1)))


def _check_blocks(blocks: Sequence[Any], count: int, size: int) -> None:
    if len(blocks) != count:
        raise MalformedError(f"{count} keys but {len(blocks)} blocks")
    for i, block in enumerate(blocks):
        try:
            n = memoryview(block).nbytes
        except TypeError:  # text, a list of ints, None: say which block, as a value error
            raise MalformedError(f"block {i} is a {type(block).__name__}; blocks are bytes-like "
                                 f"objects (bytes, bytearray, a contiguous array) of {size} "
                                 f"bytes") from None
        if n != size:
            raise MalformedError(f"block {i} holds {n} bytes; this namespace's blocks are {size}")


def slot_views(view: memoryview, offsets: Sequence[int], size: int) -> list[memoryview]:
    """Views of an arena's slots at ``offsets``; at an offset -1 (a key the daemon holds
    already, given no slot) one scratch buffer, so a caller that fills every buffer
    writes those keys' bytes nowhere that counts."""
    if not offsets or min(offsets) >= 0:
        return [view[o:o + size] for o in offsets]
    scratch = memoryview(bytearray(size))
    return [view[o:o + size] if o >= 0 else scratch for o in offsets]


def _cache_device(kv_caches: Any) -> Any:
    """The torch device of an engine's paged cache (a tensor, or a list or tuple of them)."""
    import torch

    first = kv_caches
    while isinstance(first, (list, tuple)):
        first = first[0]
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")


def _copies_done(kv_caches: Any) -> None:
    """Wait for the copies queued on the cache's device (none off CUDA).  The copy
    kernel and torch's ``non_blocking`` copies return once queued: an offload committed
    (published to readers, checksummed) slots the device had not written yet, and a
    reload let its pin go while the device still read the slots."""
    device = _cache_device(kv_caches)
    if device.type == "cuda":
        from kvstore.tiers.gpu import CopyFence

        CopyFence.record(device).wait()


def _same_device(a: Any, b: Any) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    import torch

    def index(d: Any) -> int:
        return d.index if d.index is not None else torch.cuda.current_device()

    return index(a) == index(b)


def client_timeout(timeout: Any) -> float:
    """A client's ``timeout``, checked: seconds a call waits for its reply, or any
    negative number (or infinity) for no bound.  Before, None or text failed with a
    bare comparison error naming no argument, NaN deep in a conversion, and 0 made every
    call fail at once."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds (negative: no bound), "
                        f"not {timeout!r}")
    if timeout != timeout or timeout == 0:  # (NaN is not equal to itself)
        raise ValueError(f"timeout must be a positive number of seconds (negative: no "
                         f"bound), not {timeout!r}")
    return -1.0 if timeout == float("inf") else float(timeout)
