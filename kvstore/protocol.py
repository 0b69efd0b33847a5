"""The wire protocol: one MessagePack header frame per message, then raw payload frames.

Every message is a tagged ``msgspec.Struct`` (encoded as an array, tag first, then the
request id), one union per direction, one typed decoder each.  Payload bytes never pass
through the header: ``Put`` is followed by one frame per block, and so is a ``GetReply``.
New fields get defaults and go at the end.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from kvstore.identity import Identity

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20


RequestId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
# The most tokens one Report may count (a trillion, far past any engine's interval): the
# daemon sums reports, and the sum must stay an int that msgpack can encode in stats.
MAX_REPORTED_TOKENS = 1 << 40
KEY_BYTES = 16
MAX_SNAPSHOT_PAGE = 1 << 16  # the most entries one page of a snapshot may go through
SNAPSHOT_PAGE = 4096  # a page's entries when the client says not (a few ms of the loop)
Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
# an xxh3_64 (0: not known; MessagePack has no integer past 64 bits unsigned): a negative
# one was taken, and the writer's own copies then read back from SSD as damaged
Checksum = Annotated[int, msgspec.Meta(ge=0)]


class Message(msgspec.Struct, tag_field="op", array_like=True, omit_defaults=False):
    rid: RequestId


# -- requests (client -> daemon) ---------------------------------------------------------

class Hello(Message, tag="hello"):
    version: int
    tenant: str
    token: str = ""
    attach: str = ""  # an existing session's id, for a second socket of the same client


class OpenNamespace(Message, tag="open"):
    identity: Identity


class Lookup(Message, tag="lookup"):
    ns: bytes
    keys: list[Key]


class Reserve(Message, tag="reserve"):
    ns: bytes
    keys: list[Key]
    parent: Key | None = None
    # Keys whose blocks the daemon holds in DRAM take no slot: offset -1 in the reply,
    # a duplicate at the commit (an older daemon ignores it and gives every key a slot).
    skip_held: bool = False
    # With skip_held, nor do keys another session's open reservation holds a slot for:
    # the commit waits for that writer, and stores nothing from one it did not store on
    # (CommitReply.dropped).  Sent by clients that read ``dropped``: an older client's
    # skip_held gives those keys a slot each, as it did (it would report them stored).
    skip_pending: bool = False


class Commit(Message, tag="commit"):
    reservation: int
    checksums: list[Checksum] = []  # xxh3_64 of each block as written, for readers to verify
    # Each block's token ids as msgpack integers (kvstore.token_ids: uint32 or int64
    # each, laid out; b"": not known), as older clients send them; else nothing.
    tokens: list[bytes] = []
    # Every block's token ids in one buffer, laid out so, when the daemon publishes
    # events and its reply said it wants them (someone hears them); else b"".
    token_ids: bytes = b""


class Abort(Message, tag="abort"):
    reservation: int


class Acquire(Message, tag="acquire"):
    ns: bytes
    keys: list[Key]


class Release(Message, tag="release"):
    pin: int


class LookupPin(Message, tag="lookup_pin"):
    """A lookup that also pins the leading hits in DRAM, for a client that will read
    them (one round trip, not a lookup then an acquire).  A daemon that predates it
    refuses it as malformed: ask again with ``Lookup`` then ``Acquire``."""

    ns: bytes
    keys: list[Key]


class Put(Message, tag="put"):
    ns: bytes
    keys: list[Key]
    parent: Key | None = None
    checksums: list[Checksum] = []
    tokens: list[bytes] = []  # as Commit's
    token_ids: bytes = b""    # as Commit's


class Get(Message, tag="get"):
    ns: bytes
    keys: list[Key]


class Evict(Message, tag="evict"):
    ns: bytes
    keys: list[Key]


class DropNamespace(Message, tag="drop"):
    ns: bytes


class CloseNamespace(Message, tag="close"):
    """The session stops using a namespace (its blocks stay): one fewer open of its
    ``server.max_namespaces_per_session``."""

    ns: bytes


class Stats(Message, tag="stats"):
    pass


class Warm(Message, tag="warm"):
    """Keep blocks warm (eviction takes them last) for ``seconds``."""

    ns: bytes
    keys: list[Key]
    seconds: float


class Prefetch(Message, tag="prefetch"):
    """Promote blocks to DRAM ahead of use: best effort (reply now), or wait up to
    ``timeout_ms`` (0: until done)."""

    ns: bytes
    keys: list[Key]
    wait: bool = False
    timeout_ms: int = 0


class PlanItem(msgspec.Struct, array_like=True):
    """One request of a token plan: tokens it holds, tokens it adds, and the keys of the
    blocks those complete (``ceil((T+s)/B) - ceil(T/B)`` of them), after ``parent``."""

    reserved_tokens: int
    new_tokens: int
    keys: list[Key]
    parent: Key | None = None


class ReserveBatch(Message, tag="reserve_batch"):
    ns: bytes
    plan: list[PlanItem]
    skip_held: bool = False  # as Reserve's, for every item
    skip_pending: bool = False  # as Reserve's


class Report(Message, tag="report"):
    """What an engine tells the daemon for its metrics."""

    recomputed_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_REPORTED_TOKENS)] = 0


class GpuAttach(Message, tag="gpu"):
    """Ask for the GPU tier's device pool, to reload blocks device to device."""


class Ping(Message, tag="ping"):
    pass


class Bye(Message, tag="bye"):
    """The client closes: its session ends now, its reservations and pins rolled back,
    rather than at its lease's end (a session with other connections attached goes on
    without this one; the last one's goodbye ends it: one that went without a goodbye
    counts till the lease ends, as the daemon hears of no disconnect).
    Sent without waiting for the reply (an older daemon refuses it: the lease ends it)."""


class Snapshot(Message, tag="snapshot"):
    """Every cached block per tier, as of an event sequence number, in pages: ``cursor``
    0 begins a snapshot, a reply's nonzero ``cursor`` asks for its next page.  ``limit``:
    the most entries the daemon goes through for one page (0: the whole snapshot in one
    reply, as older clients ask it; the daemon still builds it a page a loop turn)."""

    cursor: int = 0
    limit: Annotated[int, msgspec.Meta(ge=0, le=MAX_SNAPSHOT_PAGE)] = 0


class Probe(Message, tag="probe"):
    """What a router asks: the longest cached prefix of a key chain, per tier, and the
    figures to estimate the cost of serving it here.  Nothing is touched."""

    keys: list[Key]


Request = Union[
    Hello, OpenNamespace, Lookup, Reserve, Commit, Abort, Acquire, Release, Put, Get,
    Evict, DropNamespace, Stats, Ping, Warm, Prefetch, ReserveBatch, Report, GpuAttach,
    Snapshot, Probe, LookupPin, Bye, CloseNamespace,
]


# -- replies (daemon -> client) ----------------------------------------------------------

class HelloReply(Message, tag="hello"):
    version: int
    session: str
    tenant: str
    arena_path: str
    arena_bytes: int
    lease_seconds: float
    max_keys: int
    max_request_bytes: int
    events: bool = False  # the daemon publishes KV events: send token ids with commits
    # the daemon takes a commit's or put's token ids in one buffer (token_ids); an older
    # one ignores that field: send each block's (tokens) instead
    token_buffer: bool = False


class NamespaceReply(Message, tag="open"):
    ns: bytes
    block_bytes: int
    slot_bytes: int
    arena_path: str = ""   # the arena this namespace's blocks live in ("": the hello's)
    arena_bytes: int = 0


class LookupReply(Message, tag="lookup"):
    blocks: int
    tier_runs: list[tuple[str, int]]  # (tier, count) runs over the hit blocks, in order


class ReserveReply(Message, tag="reserve"):
    reservation: int
    offsets: list[int]  # each key's slot in the arena; -1: held already (``skip_held``)
    lease_seconds: float
    # Whether to send token ids with the commit: the daemon publishes events someone
    # hears (or keeps for replay).  Told in each reserve, put and batch reply.
    tokens: bool = True


class CommitReply(Message, tag="commit"):
    created: int
    duplicates: int
    # keys not stored: from the first key the reserve gave no slot, as another open
    # reservation held one for it (``skip_held``), that was not cached at the commit
    # (that reservation aborted or not committed yet), on: a later miss
    dropped: int = 0


class AcquireReply(Message, tag="acquire"):
    pin: int
    offsets: list[int]
    checksums: list[int] = []  # as written (0: not known)
    gpu_offsets: list[int] = []  # each block's slot in the GPU tier's pool (-1: none)


class LookupPinReply(Message, tag="lookup_pin"):
    """``LookupReply``'s answer, and the pin of the leading ``len(offsets)`` hits, which
    are in DRAM at those arena offsets (``pin`` 0 and no offsets: nothing pinned, as
    when the session holds all the pins it may, or the first hit is below DRAM).
    Released with ``Release`` as an acquire's pin."""

    blocks: int
    tier_runs: list[tuple[str, int]]
    pin: int = 0
    offsets: list[int] = []
    checksums: list[int] = []


class GpuReply(Message, tag="gpu"):
    pool: bytes  # a msgpack-encoded kvstore.tiers.gpu.PoolHandle; empty when there is none
    reason: str = ""  # why there is none


class PutReply(Message, tag="put"):
    created: int
    duplicates: int
    tokens: bool = True  # as ReserveReply's, for the next put


class GetReply(Message, tag="get"):
    blocks: int
    checksums: list[int] = []


class CountReply(Message, tag="count"):
    count: int


class OkReply(Message, tag="ok"):
    pass


class StatsReply(Message, tag="stats"):
    stats: dict[str, Any]


class PrefetchReply(Message, tag="prefetch"):
    ready: int    # leading keys whose blocks are in DRAM now
    cached: int   # leading keys cached in any tier


class BatchReply(Message, tag="reserve_batch"):
    admitted: bool
    blocks: list[int]          # blocks each request needs
    fitting: list[int]         # when not admitted: the requests that would fit, in order
    reservations: list[int]    # when admitted: one reservation per request
    offsets: list[list[int]]
    lease_seconds: float
    tokens: bool = True  # as ReserveReply's


class ErrorReply(Message, tag="error"):
    code: str
    message: str


class SnapshotReply(Message, tag="snapshot"):
    seq: int  # the batch of events it began after (-1: none); apply those after it
    blocks: list[tuple[bytes, bytes | None, str]]  # (key, parent, tier), parents first
    cursor: int = 0  # nonzero: more pages, ask with it; 0: this was the last


class ProbeReply(Message, tag="probe"):
    tier_runs: list[tuple[str, int]]  # (tier, count) runs over the leading cached keys
    block_bytes: int          # of the chain's namespace (0: no key of it is cached)
    block_tokens: int
    queue_seconds: float      # transfers waiting ahead of a new one, estimated
    bandwidth: dict[str, float]  # load bandwidth per tier, bytes a second


def tier_runs(tiers: list[str]) -> list[tuple[str, int]]:
    """Each key's tier, as runs of (tier, count): the ``tier_runs`` of lookup and probe
    replies (the daemon's, and a router's view of one)."""
    if tiers and tiers.count(tiers[0]) == len(tiers):
        return [(tiers[0], len(tiers))]  # the common case: one tier, no walk in Python
    runs: list[tuple[str, int]] = []
    for tier in tiers:
        if runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + 1)
        else:
            runs.append((tier, 1))
    return runs


Reply = Union[
    HelloReply, NamespaceReply, LookupReply, ReserveReply, CommitReply, AcquireReply,
    PutReply, GetReply, CountReply, OkReply, StatsReply, PrefetchReply, BatchReply,
    GpuReply, ErrorReply, SnapshotReply, ProbeReply, LookupPinReply,
]

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
_loose_decoder = msgspec.msgpack.Decoder()


def request_id_of(header: bytes) -> int:
    """The request id of a header that failed to decode, or 0 when it cannot be told."""
    try:
        value = _loose_decoder.decode(header)
    except (UnicodeDecodeError, msgspec.DecodeError):
        # a string that is not UTF-8 (msgspec raises either, by version) in otherwise
        # well-formed MessagePack, or not MessagePack at all: read the id off the bytes
        return _raw_request_id(header)
    except RecursionError:
        return 0
    if isinstance(value, list) and len(value) > 1 and type(value[1]) is int:
        rid: int = value[1]
        return rid if 0 <= rid < 1 << 63 else 0
    return 0


def _raw_request_id(header: bytes) -> int:
    """The id of ``[tag, rid, ...]`` read straight off the bytes (the tag may be any
    bytes, even ones that are not UTF-8); 0 when the shape is not that."""
    try:
        if not (0x90 < header[0] <= 0x9f or header[0] in (0xdc, 0xdd)):
            return 0
        at = 1 if header[0] <= 0x9f else (3 if header[0] == 0xdc else 5)
        tag = header[at]
        if 0xa0 <= tag <= 0xbf:
            at += 1 + (tag & 0x1f)
        elif tag in (0xd9, 0xda, 0xdb):
            width = {0xd9: 1, 0xda: 2, 0xdb: 4}[tag]
            at += 1 + width + int.from_bytes(header[at + 1:at + 1 + width], "big")
        else:
            return 0
        kind = header[at]
        if kind < 0x80:
            return kind
        size = {0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8}.get(kind)
        if size is None or at + 1 + size > len(header):
            return 0
        rid = int.from_bytes(header[at + 1:at + 1 + size], "big")
        return rid if rid < 1 << 63 else 0
    except IndexError:
        return 0
