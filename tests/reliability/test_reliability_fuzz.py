"""Fuzzing the wire protocol against a real daemon run with ``--debug-invariants``.

Malformed messages of every kind are pipelined over raw DEALER sockets (thousands in
flight, then the replies collected): hypothesis strategies over frames (valid tags with
wrong, missing, extra or huge fields; random MessagePack structures; multi-frame
messages with bogus payload frames; put/get with wrong frame counts and sizes; requests
before hello; requests on namespaces not opened), then byte-level mutations of valid
messages, then plain random bytes.  Every message must get exactly one well-formed reply
(matched by request id, the ids counted as a multiset), no reply may be an internal
error, and afterwards the daemon holds nothing it was not asked to hold, counts no
invariant violation, and still serves a well-formed client bit-exact.

The tests share one daemon and run in file order; together they send at least
100,000 malformed messages (the mutation/random test tops the count up), and each prints
its count and time (``pytest -s``).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import time
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from daemon_proc import DaemonProcess, error_records
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from kvtest import make_identity

from kvstore import Client
from kvstore import protocol as p
from kvstore.errors import KVStoreError
from kvstore.keys import chain_keys
from kvstore.transport import PRE_HELLO_BYTES, PRE_HELLO_MESSAGES

MALFORMED_MESSAGES = 100_000  # refused by the daemon (undecodable or invalid), all tests
MUTATED_MESSAGES = 35_000
BATCH = 2_000                # messages in flight per peer before the replies are collected
REPLY_TIMEOUT = 20.0         # seconds without any reply before the daemon counts as stuck
MAX_KEYS = 256               # the daemon's max_keys_per_request here, so "too many" is cheap
REQUEST_LIMIT = 1 << 20      # the daemon's max_request_bytes here (the smallest it takes)
# ZeroMQ cuts the connection of a peer that sends a frame over the socket's MAXMSGSIZE
# (the request limit plus the header limit): no reply, and the session is gone with its
# routing id.  Such frames go to a socket of their own (see the oversized-frame test).
FRAME_LIMIT = REQUEST_LIMIT + p.MAX_HEADER_BYTES
# 32 KiB blocks: the 1 MiB arena (the smallest the daemon takes) holds 32, not 128.  With
# --debug-invariants the daemon checks its invariants after every message, walking every
# block it holds: most of a message's cost (the random-bytes phase took 80 s, now 45 s).
HEAD_DIM = 128

IDENT = make_identity(head_dim=HEAD_DIM)                   # opened by the fuzzed session
OTHER = make_identity(model="someone-else", head_dim=HEAD_DIM)  # opened by another only
NEVER = make_identity(model="never-opened", head_dim=HEAD_DIM)  # opened by no one
BLOCK = IDENT.block_bytes
NS_OPEN, NS_OTHER, NS_NEVER = (i.namespace_id for i in (IDENT, OTHER, NEVER))
CHAIN = chain_keys(NS_OPEN, list(range(16 * 12)), IDENT.block_tokens)   # 12 chained keys
SIDE = chain_keys(NS_OPEN, list(range(5000, 5000 + 16 * 4)), IDENT.block_tokens)
OTHER_KEYS = chain_keys(NS_OTHER, list(range(16 * 4)), OTHER.block_tokens)



def _error_codes(cls: type[KVStoreError] = KVStoreError) -> set[str]:
    codes = {cls.code}
    for sub in cls.__subclasses__():
        codes |= _error_codes(sub)
    return codes


ERROR_CODES = _error_codes() - {"internal"}   # the typed errors; "internal" is a daemon bug
REPLY_FOR: dict[type[Any], type[Any]] = {
    p.Hello: p.HelloReply, p.OpenNamespace: p.NamespaceReply, p.Lookup: p.LookupReply,
    p.Reserve: p.ReserveReply, p.Commit: p.CommitReply, p.Abort: p.OkReply,
    p.Acquire: p.AcquireReply, p.Release: p.OkReply, p.Put: p.PutReply, p.Get: p.GetReply,
    p.Evict: p.CountReply, p.DropNamespace: p.CountReply, p.Stats: p.StatsReply,
    p.Ping: p.OkReply, p.LookupPin: p.LookupPinReply, p.ReserveBatch: p.BatchReply,
    p.Warm: p.CountReply, p.Prefetch: p.PrefetchReply, p.Report: p.OkReply,
    p.GpuAttach: p.GpuReply, p.Snapshot: p.SnapshotReply, p.Probe: p.ProbeReply,
}

RID = "\x00rid\x00"  # stands for "the next unique request id", filled in when sent


def content(key: bytes, size: int = BLOCK) -> bytes:
    """Bytes that follow from the key, so any reader can check any block."""
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def strict(header: bytes) -> Any:
    """The request the daemon decodes from a header, or None where it is malformed."""
    if len(header) > p.MAX_HEADER_BYTES:
        return None
    try:
        return p.request_decoder.decode(header)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None


def loose(header: bytes) -> Any:
    """Any MessagePack value of a header; raises for bytes that are not MessagePack."""
    return msgspec.msgpack.decode(header)


def expected_rid(header: bytes, req: Any) -> int:
    """The request id the daemon must answer a header with: the request's; for a header
    that does not decode, the protocol's ``request_id_of`` (0 when it cannot be told);
    for a header over the size limit, 0 (it is not read)."""
    if req is not None:
        return int(req.rid)
    if len(header) > p.MAX_HEADER_BYTES:
        return 0
    return p.request_id_of(header)


class Malformed:
    """What a peer remembers of a request the daemon cannot decode."""

    def __repr__(self) -> str:
        return "Malformed()"


MALFORMED = Malformed()


class Peer:
    """A raw DEALER socket that pipelines requests and accounts for every reply.

    Replies are matched to requests by request id (a multiset: several malformed requests
    may share an id, or have none); holdings the daemon granted (reservations, pins) are
    tracked from the replies, so a leak shows as a difference from the daemon's stats.
    """

    def __init__(self, endpoint: str, name: str, *, must_fail: bool = False) -> None:
        self.name = name
        self.endpoint = endpoint
        self.must_fail = must_fail            # before hello: every reply is an error
        # A peer without a session is answered only for its first few small messages
        # (the daemon's bound on work before hello); the rest get no reply.
        self.unanswered = 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self.sock.setsockopt(opt, 0)
        self.sock.connect(endpoint)
        self._rids = itertools.count(10_000_000)
        self.pending: dict[int, deque[Any]] = {}
        self.outstanding = 0
        self.sent = 0
        self.refused = 0                      # answered with an error
        self.codes: Counter[str] = Counter()
        self.reservations: set[int] = set()
        self.pins: set[int] = set()
        self.newest_id = 0                    # the store's ids are one counter
        self.session = ""

    def next_rid(self) -> int:
        return next(self._rids)

    def send(self, frames: list[bytes]) -> None:
        self.sent += 1
        if self.must_fail and (self.sent > PRE_HELLO_MESSAGES or len(frames) != 1
                               or len(frames[0]) > PRE_HELLO_BYTES):
            self.unanswered += 1
            self.sock.send_multipart(frames)
            return
        header = frames[0]
        req = strict(header)
        entry = req if req is not None else MALFORMED
        self.pending.setdefault(expected_rid(header, req), deque()).append(entry)
        self.outstanding += 1
        self.sock.send_multipart(frames)

    def send_request(self, msg: p.Message, payload: list[bytes] | None = None) -> None:
        self.send([p.encoder.encode(msg), *(payload or [])])

    def collect(self, daemon: DaemonProcess) -> None:
        """Read replies until every request sent so far has one."""
        while self.outstanding:
            if not self.sock.poll(int(REPLY_TIMEOUT * 1000)):
                raise AssertionError(
                    f"{self.name}: {self.outstanding} requests unanswered after "
                    f"{REPLY_TIMEOUT}s; daemon alive: {daemon.alive()}\n{daemon.log()[-3000:]}")
            frames = self.sock.recv_multipart()
            self._account(frames)

    def _account(self, frames: list[bytes]) -> None:
        reply = p.reply_decoder.decode(frames[0])   # the daemon's replies are well formed
        queue = self.pending.get(reply.rid)
        assert queue, f"{self.name}: a reply to request id {reply.rid} that is not pending"
        # Requests that share an id (a mutated copy keeps it) need not be answered in the
        # order sent: a put deferred for room is answered after a later stats.  A reply
        # of a request's kind goes to the first such request; an error to the first
        # request that cannot decode (answered as it comes), else to the first.
        req = queue[0]
        if isinstance(reply, p.ErrorReply):
            req = next((r for r in queue if isinstance(r, Malformed)), req)
        else:
            req = next((r for r in queue if not isinstance(r, Malformed)
                        and isinstance(reply, REPLY_FOR[type(r)])), req)
        queue.remove(req)
        if not queue:
            del self.pending[reply.rid]
        self.outstanding -= 1
        if isinstance(reply, p.ErrorReply):
            assert reply.message
            self.refused += 1
            assert reply.code in ERROR_CODES, f"{self.name}: {reply} answering {req!r}"
            self.codes[reply.code] += 1
            if reply.code == "not_found" and isinstance(req, p.Release):
                # released already, by a mutated copy whose ok went to another request
                # of its id (an ok answers many kinds): the daemon's stats say the rest
                self.pins.discard(req.pin)
            elif reply.code == "not_found" and isinstance(req, p.Abort):
                self.reservations.discard(req.reservation)
        else:
            assert not self.must_fail, f"{self.name}: {reply} answering {req!r} before hello"
            assert not isinstance(req, Malformed), f"{self.name}: {reply} answering {req!r}"
            assert isinstance(reply, REPLY_FOR[type(req)]), f"{reply} answering {req!r}"
            self.codes["ok"] += 1
        if isinstance(reply, p.GetReply):
            assert len(frames) - 1 == reply.blocks
        elif isinstance(reply, p.ReserveReply):
            self.reservations.add(reply.reservation)
            self.newest_id = max(self.newest_id, reply.reservation)
        elif isinstance(reply, p.AcquireReply):
            self.pins.add(reply.pin)
            self.newest_id = max(self.newest_id, reply.pin)
        elif isinstance(reply, p.LookupPinReply) and reply.pin:
            self.pins.add(reply.pin)
            self.newest_id = max(self.newest_id, reply.pin)
        elif isinstance(reply, p.BatchReply) and reply.admitted:
            self.reservations.update(reply.reservations)
            self.newest_id = max(self.newest_id, *reply.reservations, 0)
        elif isinstance(reply, p.CommitReply):
            self.reservations.discard(req.reservation)
        elif isinstance(reply, p.OkReply) and isinstance(req, p.Abort):
            self.reservations.discard(req.reservation)
        elif isinstance(reply, p.OkReply) and isinstance(req, p.Release):
            self.pins.discard(req.pin)
        elif isinstance(reply, p.HelloReply):
            self.session = reply.session

    def ask(self, msg: p.Message, daemon: DaemonProcess) -> Any:
        """One well-formed request, answered before anything else is sent."""
        assert self.outstanding == 0
        self.sock.send(p.encoder.encode(msg))
        assert self.sock.poll(int(REPLY_TIMEOUT * 1000)), f"no reply; {daemon.log()[-2000:]}"
        reply = p.reply_decoder.decode(self.sock.recv_multipart()[0])
        assert reply.rid == msg.rid, reply
        return reply

    def give_back(self, daemon: DaemonProcess) -> None:
        """Abort every reservation and release every pin the daemon granted, then check
        (from the daemon's own stats) that nothing at all is held."""
        for r in sorted(self.reservations):
            self.send_request(p.Abort(self.next_rid(), r))
        for pin in sorted(self.pins):
            self.send_request(p.Release(self.next_rid(), pin))
        self.collect(daemon)
        assert not self.reservations and not self.pins, (self.reservations, self.pins)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def renewed(self) -> Peer:
        """The same peer on a new connection (a new routing id, so no session and the
        whole allowance of messages before hello), its reply counts carried over."""
        assert self.outstanding == 0
        self.close()
        fresh = Peer(self.endpoint, self.name, must_fail=self.must_fail)
        fresh.codes = self.codes
        return fresh


def check_nothing_held(peer: Peer, daemon: DaemonProcess) -> dict[str, Any]:
    stats = peer.ask(p.Stats(peer.next_rid()), daemon).stats
    dram = stats["tiers"]["dram"]
    assert stats["invariant_violations"] == 0, daemon.log()[-3000:]
    assert dram["reserved_slots"] == 0 and dram["reserved"] == 0, dram
    assert dram["pinned_blocks"] == 0, dram
    return dict(stats)


# -- strategies ------------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=12) | st.binary(max_size=24))
ANYTHING = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=2),
                        max_leaves=5)
class Big:
    """A large value drawn as a field or frame, shown by name (hypothesis prints the
    drawn examples of a failure, and a megabyte of repr helps no one)."""

    def __init__(self, value: Any, label: str) -> None:
        self.value = value
        self.label = label

    def __repr__(self) -> str:
        return f"<{self.label}>"


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Big):
        return obj.value
    raise NotImplementedError(type(obj).__name__)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

HUGE = [Big(b"h" * (p.MAX_HEADER_BYTES + 1), "bytes over the header limit"),
        Big("t" * 300_000, "300 kB of text"),
        Big([CHAIN[0]] * (MAX_KEYS + 1), "one key too many"),
        Big(list(range(60_000)), "60k ints"),
        Big(eval("[" * 40 + "]" * 40), "40 nested arrays")]
_ODD: st.SearchStrategy[Any] = st.sampled_from([
    None, True, False, 0, -1, 1 << 63, (1 << 64) - 1, -(1 << 63), 1.5, float("nan"),
    float("inf"), "", "x" * 300, b"", b"\0" * 15, b"\0" * 17, b"\xff" * 16, [], {},
    [[]], {"a": 1}, [None] * 3, msgspec.msgpack.Ext(7, b"ext"), *HUGE,
])
JUNK = st.one_of(_ODD, _ODD, _scalars, ANYTHING)   # drawing ANYTHING is slow: not too often


@st.composite
def maybe_junk(draw: st.DrawFn, good: st.SearchStrategy[Any], one_in: int = 6) -> Any:
    """Mostly a good value for the field, one time in ``one_in`` anything at all (weighted
    by hand: ``one_of`` of repeated branches does not weight them)."""
    return draw(JUNK) if draw(st.integers(1, one_in)) == one_in else draw(good)


KEY = st.sampled_from([*CHAIN, *SIDE, *OTHER_KEYS]) | st.binary(min_size=16, max_size=16)
KEYS = (st.tuples(st.integers(0, 11), st.integers(0, 6)).map(lambda t: CHAIN[t[0]:t[0] + t[1]])
        | st.lists(maybe_junk(KEY), max_size=6))
NS = st.one_of(st.sampled_from([NS_OPEN, NS_OPEN, NS_OPEN, NS_OTHER, NS_NEVER]),
               st.sampled_from([NS_OPEN, NS_OTHER]), st.binary(max_size=20))
PARENT = st.none() | st.sampled_from(CHAIN) | KEY
_IDENTITY_FIELDS = msgspec.to_builtins(IDENT)


@st.composite
def identities(draw: st.DrawFn) -> Any:
    fields = dict(_IDENTITY_FIELDS)
    if draw(st.booleans()):
        fields["model"] = draw(st.sampled_from(["m2", "someone-else",
                                                  Big("x" * 70_000, "70 kB model name")]))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        how = draw(st.sampled_from(["drop", "junk", "int"]))
        if how == "drop":
            del fields[name]
        elif how == "junk":
            fields[name] = draw(JUNK)
        else:
            fields[name] = draw(st.integers(-2, 1 << 21))
    if draw(st.integers(0, 9)) == 0:
        fields[draw(st.text(max_size=5))] = draw(JUNK)
    return fields


def ids(peer: Peer) -> st.SearchStrategy[int]:
    """Reservation/pin ids near the newest one the daemon granted (so some are real)."""
    return st.integers(-3, 8).map(lambda d: max(0, peer.newest_id + d)) | st.integers(0, 50)


def verb_fields(peer: Peer, hello_ok: bool) -> dict[str, list[st.SearchStrategy[Any]]]:
    rid_ish = ids(peer)
    return {
        "hello": [st.just(p.PROTOCOL_VERSION) if hello_ok else st.integers(-2, 3),
                  st.sampled_from(["acme", "other", ""]) | st.text(max_size=8),
                  st.just("") | st.text(max_size=8), st.just("") | st.text(max_size=40)],
        "open": [identities()],
        "lookup": [NS, KEYS], "acquire": [NS, KEYS], "get": [NS, KEYS], "evict": [NS, KEYS],
        "reserve": [NS, KEYS, PARENT], "put": [NS, KEYS, PARENT],
        "commit": [rid_ish], "abort": [rid_ish], "release": [rid_ish],
        "drop": [NS], "stats": [], "ping": [],
    }


BLOCKY = st.builds(lambda n, b: Big(bytes([b]) * n, f"{n} bytes of {b}"),
                   st.sampled_from([0, 1, BLOCK - 1, BLOCK, BLOCK, BLOCK + 1, 2 * BLOCK]),
                   st.integers(0, 255))


# The frames after a header that is not a put's.  Strategies are built once, not per
# draw: hypothesis works out a new strategy's properties (labels, emptiness) on its first
# draw, and that was a good part of the hypothesis phase's time.
_FEW_FRAMES: list[list[bytes | Big]] = [[], [], [], [b""], [Big(b"x" * BLOCK, "a block")]]
NOT_PUT_FRAMES: st.SearchStrategy[list[Any]] = st.one_of(
    st.sampled_from(_FEW_FRAMES), st.lists(st.binary(max_size=32), max_size=3))
PUT_MODES = st.sampled_from(["exact", "exact", "fewer", "more", "sizes", "none"])


def payload_frames(draw: st.DrawFn, tag: str, keys: Any) -> list[bytes | Big]:
    """Frames after the header: for put, the right count and sizes or not; for the other
    verbs, mostly none, sometimes some (they must be ignored or refused)."""
    n = len(keys) if isinstance(keys, list) else 0
    if tag != "put":
        frames: list[bytes | Big] = draw(NOT_PUT_FRAMES)
        return frames
    mode = draw(PUT_MODES)
    good: list[bytes | Big] = [
        Big(content(k) if isinstance(k, bytes) else b"\0" * BLOCK, "content")
        for k in keys] if n else []
    if mode == "exact":
        return good
    if mode == "fewer":
        return good[:max(0, n - draw(st.integers(1, 3)))]
    if mode == "more":
        return good + list(draw(st.lists(BLOCKY, min_size=1, max_size=3)))
    if mode == "sizes":
        return list(draw(st.lists(BLOCKY, min_size=n, max_size=n))) if n else [b"x"]
    return []


RID_OR_JUNK = maybe_junk(st.just(RID), 8)
SHAPES = st.sampled_from(["array"] * 8 + ["missing", "extra", "dict", "tag", "any", "bytes"])
BAD_TAGS = (st.sampled_from(["ok", "error", "count", "HELLO", "", "stats "])
            | st.text(max_size=8) | JUNK)
EXTRA_FIELDS = st.lists(JUNK, min_size=1, max_size=3)
HEADER_BYTES = st.binary(max_size=64) | st.sampled_from(HUGE[:1])


def messages(peer: Peer, hello_ok: bool = False,
             only: list[str] | None = None) -> st.SearchStrategy[list[Any]]:
    """One message: [header object or bytes, *payload frames].  The strategies are built
    here, once, not on each draw (see NOT_PUT_FRAMES)."""
    fields_of = {tag: [maybe_junk(f) for f in fields]
                 for tag, fields in verb_fields(peer, hello_ok).items()}
    tags = st.sampled_from(only or sorted(fields_of))

    @st.composite
    def message(draw: st.DrawFn) -> list[Any]:
        tag = draw(tags)
        fields = [draw(f) for f in fields_of[tag]]
        rid: Any = draw(RID_OR_JUNK)
        shape = draw(SHAPES)
        if shape == "missing":
            fields = fields[:draw(st.integers(0, max(0, len(fields) - 1)))]
            if draw(st.booleans()):
                return [[tag]]                                   # not even a request id
        elif shape == "extra":
            fields += draw(EXTRA_FIELDS)
        elif shape == "dict":
            return [{"op": tag, "rid": rid, **{str(i): f for i, f in enumerate(fields)}}]
        elif shape == "tag":
            tag = draw(BAD_TAGS)
        elif shape == "any":
            return [draw(ANYTHING)]
        elif shape == "bytes":
            return [draw(HEADER_BYTES)]
        keys = fields[1] if tag in ("put",) and len(fields) > 1 else None
        return [[tag, rid, *fields], *payload_frames(draw, tag, keys)]

    return message()


def encode(peer: Peer, msg: list[Any]) -> list[bytes] | None:
    """The frames of a drawn message, its RID placeholder replaced by a unique id."""
    header = msg[0]
    if isinstance(header, list) and len(header) > 1 and header[1] == RID:
        header = [header[0], peer.next_rid(), *header[2:]]
    elif isinstance(header, dict) and header.get("rid") == RID:
        header = {**header, "rid": peer.next_rid()}
    if isinstance(header, Big):
        header = header.value
    if not isinstance(header, bytes):
        try:
            header = _encoder.encode(header)
        except (OverflowError, TypeError, NotImplementedError):
            return None
    frames = [header, *(f.value if isinstance(f, Big) else f for f in msg[1:])]
    if any(len(f) > FRAME_LIMIT for f in frames):
        return None
    return frames


def defang_hello(frames: list[bytes]) -> list[bytes]:
    """A well-formed hello would start (or replace) a session: make its version wrong;
    a goodbye would end it: a ping instead."""
    req = strict(frames[0])
    if isinstance(req, p.Hello) and req.version == p.PROTOCOL_VERSION and req.tenant:
        frames[0] = p.encoder.encode(p.Hello(req.rid, p.PROTOCOL_VERSION + 1, req.tenant,
                                             req.token, req.attach))
    elif isinstance(req, p.Bye):
        frames[0] = p.encoder.encode(p.Ping(req.rid))
    return frames



# -- the daemon and its peers ----------------------------------------------------------------

class Fuzz:
    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.sent = 0
        self.seconds = 0.0
        self.phases: dict[str, tuple[int, float]] = {}
        self.session = Peer(daemon.endpoint, "session")        # hello'd, opened IDENT
        self.anon = Peer(daemon.endpoint, "anon", must_fail=True)  # never says hello
        self.greeter = Peer(daemon.endpoint, "greeter")        # hellos of every kind
        self.stranger = Peer(daemon.endpoint, "stranger")      # owns OTHER's namespace
        for peer, ident in ((self.session, IDENT), (self.stranger, OTHER)):
            hello = peer.ask(p.Hello(peer.next_rid(), p.PROTOCOL_VERSION, "acme"), daemon)
            assert isinstance(hello, p.HelloReply), hello
            opened = peer.ask(p.OpenNamespace(peer.next_rid(), ident), daemon)
            assert isinstance(opened, p.NamespaceReply), opened
        put = [p.encoder.encode(p.Put(self.stranger.next_rid(), NS_OTHER, OTHER_KEYS)),
               *(content(k, OTHER.block_bytes) for k in OTHER_KEYS)]
        self.stranger.sock.send_multipart(put)
        assert self.stranger.sock.poll(10_000)
        assert isinstance(p.reply_decoder.decode(self.stranger.sock.recv_multipart()[0]),
                          p.PutReply)

    @property
    def peers(self) -> list[Peer]:
        return [self.session, self.anon, self.greeter]

    def flush(self) -> None:
        """Collect every reply, give back what the daemon granted, and check nothing is
        held: a failed request that kept a slot or a pin shows up here."""
        for peer in self.peers:
            peer.collect(self.daemon)
        self.session.give_back(self.daemon)
        check_nothing_held(self.session, self.daemon)

    @property
    def refused(self) -> int:
        return sum(peer.refused for peer in self.peers)

    def record(self, phase: str, count: int, seconds: float) -> None:
        n, s = self.phases.get(phase, (0, 0.0))
        self.phases[phase] = (n + count, s + seconds)
        self.sent += count
        self.seconds += seconds

    def close(self) -> None:
        for peer in [*self.peers, self.stranger]:
            peer.close()


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:
    daemon = DaemonProcess(
        Path(tmp_path_factory.mktemp("fuzz")), dram_capacity="1MiB",
        extra=["--slab-size", "256KiB"], debug_invariants=True,
        env={"KVSTORE_SERVER_MAX_KEYS_PER_REQUEST": str(MAX_KEYS),
             "KVSTORE_SERVER_MAX_REQUEST_BYTES": str(REQUEST_LIMIT)}).start()
    state = Fuzz(daemon)
    try:
        yield state
    finally:
        state.close()
        alive = daemon.alive()
        daemon.stop()
        log = daemon.log()
        assert alive, f"the daemon died under fuzzing:\n{log[-5000:]}"
        assert "invariant violated" not in log, log[-5000:]
        unexpected = error_records(log)
        assert not unexpected, "\n".join(unexpected[:5])


# -- the tests -------------------------------------------------------------------------------

def test_structured_frames_from_hypothesis(fuzz: Fuzz) -> None:
    """Hypothesis draws batches of malformed (and some valid) messages for three peers: a
    session with an open namespace, a socket that never said hello, and one that only
    says hello in every shape; each batch is pipelined, then every reply accounted for."""
    started = time.perf_counter()
    sent = 0
    session, anon, greeter = fuzz.session, fuzz.anon, fuzz.greeter

    batches = st.tuples(
        st.lists(messages(session), min_size=10, max_size=60),
        st.lists(messages(anon), min_size=2, max_size=20),
        st.lists(messages(greeter, hello_ok=True, only=["hello", "hello", "ping", "stats"]),
                 max_size=6))

    @settings(max_examples=300, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(batches)
    def flood(batch: tuple[list[Any], list[Any], list[Any]]) -> None:
        nonlocal sent
        # a greeter without a session is answered for a few small messages only: each
        # batch greets on a new connection, in single frames (anon sends the rest)
        fuzz.greeter = fuzz.greeter.renewed()
        for peer, msgs in zip((session, anon, fuzz.greeter), batch):
            for msg in msgs:
                frames = encode(peer, msg)
                if frames is None:
                    continue
                if peer is not fuzz.greeter:
                    frames = defang_hello(frames)
                elif len(frames) != 1 or len(frames[0]) > PRE_HELLO_BYTES:
                    continue
                note(f"{peer.name}: {[f[:80] for f in frames]}")
                peer.send(frames)
                sent += 1
        fuzz.flush()

    flood()
    fuzz.record("hypothesis", sent, time.perf_counter() - started)
    codes = session.codes + anon.codes + fuzz.greeter.codes
    print(f"\nfuzz/hypothesis: {sent} messages in {time.perf_counter() - started:.1f}s; "
          f"replies {dict(codes)}")
    assert sent >= 2_000
    assert session.codes["unknown_namespace"] > 0
    # the peer without a session: its first few small messages refused, the rest dropped
    assert 0 < sum(anon.codes.values()) <= PRE_HELLO_MESSAGES and anon.unanswered > 0
    # the unanswered messages went out on another socket than this stats request: the
    # daemon may read its last few after answering it, so the count may catch up
    deadline = time.monotonic() + REPLY_TIMEOUT
    while True:
        stats = session.ask(p.Stats(session.next_rid()), fuzz.daemon).stats
        if stats["before_hello"]["dropped"] >= anon.unanswered or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["before_hello"]["dropped"] >= anon.unanswered
    assert session.codes["ok"] > 0 and session.codes["malformed"] > 0


MUTATIONS = ("flip", "truncate", "insert", "splice", "frames", "bytetype", "drop_payload")


def corpus(peer: Peer) -> list[list[bytes]]:
    """Well-formed messages of every verb, to mutate."""
    r = peer.next_rid
    reqs: list[list[bytes]] = [
        [p.encoder.encode(p.Hello(r(), p.PROTOCOL_VERSION + 1, "acme"))],
        [p.encoder.encode(p.OpenNamespace(r(), IDENT))],
        [p.encoder.encode(p.Lookup(r(), NS_OPEN, CHAIN[:6]))],
        [p.encoder.encode(p.Reserve(r(), NS_OPEN, CHAIN[6:9], CHAIN[5]))],
        [p.encoder.encode(p.Commit(r(), 1))],
        [p.encoder.encode(p.Abort(r(), 2))],
        [p.encoder.encode(p.Acquire(r(), NS_OPEN, CHAIN[:2]))],
        [p.encoder.encode(p.Release(r(), 3))],
        [p.encoder.encode(p.Put(r(), NS_OPEN, CHAIN[:3])), *(content(k) for k in CHAIN[:3])],
        [p.encoder.encode(p.Get(r(), NS_OPEN, CHAIN[:2]))],
        [p.encoder.encode(p.Evict(r(), NS_OPEN, SIDE[-1:]))],
        [p.encoder.encode(p.DropNamespace(r(), NS_NEVER))],
        [p.encoder.encode(p.Stats(r()))],
        [p.encoder.encode(p.Ping(r()))],
        # the later verbs (a goodbye would end the fuzzed session: never sent)
        [p.encoder.encode(p.LookupPin(r(), NS_OPEN, CHAIN[:3]))],
        [p.encoder.encode(p.ReserveBatch(r(), NS_OPEN, [
            p.PlanItem(0, 2 * IDENT.block_tokens, SIDE[:2]),
            p.PlanItem(IDENT.block_tokens, IDENT.block_tokens + 1, SIDE[2:3], SIDE[1])]))],
        [p.encoder.encode(p.Warm(r(), NS_OPEN, CHAIN[:4], 0.5))],
        [p.encoder.encode(p.Prefetch(r(), NS_OPEN, CHAIN[:4], True, 50))],
        [p.encoder.encode(p.Report(r(), 123))],
        [p.encoder.encode(p.GpuAttach(r()))],
        [p.encoder.encode(p.Snapshot(r(), 0, 4))],
        [p.encoder.encode(p.Probe(r(), CHAIN[:5]))],
    ]
    return reqs


def mutate(rng: random.Random, frames: list[bytes], others: list[list[bytes]]) -> list[bytes]:
    header = bytearray(frames[0])
    payload = list(frames[1:])
    how = rng.choice(MUTATIONS)
    if how == "flip":
        for _ in range(rng.randrange(1, 4)):
            header[rng.randrange(len(header))] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del header[rng.randrange(len(header)):]
    elif how == "insert":
        at = rng.randrange(len(header) + 1)
        header[at:at] = rng.randbytes(rng.randrange(1, 9))
    elif how == "splice":
        other = rng.choice(others)[0]
        header = header[:rng.randrange(len(header) + 1)] + other[rng.randrange(len(other)):]
    elif how == "frames":
        payload += [rng.randbytes(rng.choice([0, 1, 16, BLOCK - 1, BLOCK]))
                    for _ in range(rng.randrange(1, 4))]
    elif how == "bytetype":  # a MessagePack type byte swapped for another
        at = rng.randrange(len(header))
        header[at] = rng.choice([0x90, 0x91, 0xc0, 0xc1, 0xc2, 0xc4, 0xcc, 0xcf, 0xd0, 0xd3,
                                 0xd9, 0xdc, 0xdd, 0xde, 0xdf, 0xc7, 0xd4, 0xff, 0x7f])
    else:
        payload = payload[:rng.randrange(len(payload) + 1)] if payload else [b""]
    return [bytes(header), *payload]


def test_mutated_and_random_bytes(fuzz: Fuzz) -> None:
    """Byte-level mutations of valid messages, then plain random bytes (one to three
    frames), until the daemon has refused at least MALFORMED_MESSAGES messages (counted
    over the whole module: the hypothesis test's share included)."""
    rng = random.Random()
    seed = rng.randrange(1 << 32)
    rng.seed(seed)
    print(f"fuzz: random seed {seed}")  # (pytest shows it with a failure)
    session, anon = fuzz.session, fuzz.anon
    started = time.perf_counter()
    base = corpus(session)
    sent = 0
    while sent < MUTATED_MESSAGES:
        for _ in range(BATCH):
            peer = session if rng.random() < 0.8 else anon
            peer.send(defang_hello(mutate(rng, rng.choice(base), base)))
        sent += BATCH
        fuzz.flush()
    fuzz.record("mutations", sent, time.perf_counter() - started)

    started = time.perf_counter()
    sent = 0
    while fuzz.refused < MALFORMED_MESSAGES or sent < 20_000:
        for _ in range(BATCH):
            peer = session if rng.random() < 0.8 else anon
            frames = [rng.randbytes(rng.choice((0, 1, 2, 5, 16, 40, 100, 300)))
                      for _ in range(rng.choice((1, 1, 1, 2, 3)))]
            peer.send(defang_hello(frames))
        sent += BATCH
        fuzz.flush()
    fuzz.record("random bytes", sent, time.perf_counter() - started)
    codes = session.codes + anon.codes
    for phase, (n, s) in fuzz.phases.items():
        print(f"\nfuzz/{phase}: {n} messages in {s:.1f}s")
    print(f"fuzz: replies so far {dict(codes)}; random seed {seed}")
    print(f"fuzz/total: {fuzz.sent} messages in {fuzz.seconds:.1f}s, "
          f"{fuzz.refused} of them malformed or invalid (answered with an error)")
    assert fuzz.refused >= MALFORMED_MESSAGES


def test_oversized_frames_are_dropped_and_the_daemon_goes_on(fuzz: Fuzz) -> None:
    """A frame over the daemon's message limit cuts that connection (ZeroMQ's MAXMSGSIZE):
    no reply, nothing held, everyone else still served."""
    big = Peer(fuzz.daemon.endpoint, "big")
    try:
        reply = big.ask(p.Hello(big.next_rid(), p.PROTOCOL_VERSION, "acme"), fuzz.daemon)
        assert isinstance(reply, p.HelloReply)
        big.sock.send_multipart([p.encoder.encode(p.Put(big.next_rid(), NS_OPEN, CHAIN[:1])),
                                 b"\0" * (3 << 20)])
        assert not big.sock.poll(1000), "an oversized message got a reply"
    finally:
        big.close()
    fuzz.session.collect(fuzz.daemon)
    check_nothing_held(fuzz.session, fuzz.daemon)
    assert fuzz.daemon.alive()


def test_after_the_flood_nothing_leaks_and_a_client_is_served(fuzz: Fuzz) -> None:
    for peer in fuzz.peers:
        assert peer.outstanding == 0 and not peer.pending, peer.pending
    check_nothing_held(fuzz.session, fuzz.daemon)
    with Client(fuzz.daemon.endpoint, tenant="acme", timeout=10) as client:
        ns = client.namespace(IDENT)
        keys = ns.keys(list(range(900_000, 900_000 + 16 * 8)))
        blocks = [content(k) for k in keys]
        ns.put(keys[:4], blocks[:4])
        with ns.reserve(keys[4:]) as r:
            for buf, block in zip(r.buffers, blocks[4:]):
                buf[:] = block
            r.commit()
        assert ns.lookup(keys).blocks == 8
        assert ns.get(keys) == blocks
        with ns.acquire(keys) as held:
            assert [bytes(b) for b in held.buffers] == blocks
        stats = client.stats()
        assert stats["invariant_violations"] == 0
        assert stats["tiers"]["dram"]["reserved_slots"] == 0
        assert stats["tiers"]["dram"]["pinned_blocks"] == 0
    assert fuzz.daemon.alive()
