"""The client's core without a socket: requests are built and replies read by hand."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from kvtest import make_identity

from kvstore import protocol as p
from kvstore.client import Client
from kvstore.client_core import HeldCore, NamespaceCore, ReservationCore, SessionCore
from kvstore.client_wire import client_timeout
from kvstore.client_wire import Exchange, check_reply, checksum
from kvstore.errors import CapacityError, CorruptError, KVStoreError, MalformedError


class Frame:
    """What a shell hands the core for a payload frame."""

    def __init__(self, data: bytes) -> None:
        self.bytes = data


def session(max_keys: int = 2, max_request_bytes: int = 1 << 20) -> SessionCore:
    s = SessionCore("ipc:///nowhere", tenant="acme", token=None, timeout=1.0,
                    map_arena=False, curve=None, checksums=False)
    s._on_hello((p.HelloReply(1, p.PROTOCOL_VERSION, "sess", "acme", "", 0, 60.0,
                              max_keys, max_request_bytes), []))
    return s


def namespace(s: SessionCore) -> NamespaceCore[SessionCore]:
    ident = make_identity()
    return NamespaceCore(s, ident, p.NamespaceReply(2, b"n" * 16, ident.block_bytes,
                                                    ident.block_bytes))


def drive(exchange: Exchange[Any], answer: Any) -> tuple[list[p.Message], Any]:
    """Run an exchange, answering each request with ``answer(request, payload)``."""
    sent: list[p.Message] = []
    try:
        req, payload = next(exchange)
        while True:
            sent.append(req)
            req, payload = exchange.send(answer(req, payload))
    except StopIteration as done:
        return sent, done.value


def test_lookup_is_batched_and_stops_at_the_first_miss() -> None:
    ns = namespace(session(max_keys=2))
    keys = ns.keys(range(16 * 5))

    def answer(req: p.Lookup, _: Any) -> Any:
        hits = 2 if req.keys[0] != keys[2] else 1       # the fourth key is missing
        return p.LookupReply(req.rid, hits, [("dram", hits)]), []

    sent, result = drive(ns._lookup(keys), answer)
    assert [r.keys for r in sent] == [keys[0:2], keys[2:4]]  # no third request
    assert (result.blocks, result.tiers) == (3, ["dram"] * 3)
    assert len({r.rid for r in sent}) == 2


def test_put_is_batched_by_bytes_and_chains_each_batch_to_the_last() -> None:
    s = session(max_keys=100)
    ns = namespace(s)
    s.hello = p.HelloReply(1, 1, "s", "acme", "", 0, 60.0, 100, 2 * ns.block_bytes)
    keys = ns.keys(range(16, 16 * 6), parent=None)
    blocks = [bytes([i]) * ns.block_bytes for i in range(5)]
    sent, created = drive(ns._put(keys, blocks, None),
                          lambda req, payload: (p.PutReply(req.rid, len(payload), 0), []))
    assert created == 5
    assert [len(r.keys) for r in sent] == [2, 2, 1]
    assert [r.parent for r in sent] == [None, keys[1], keys[3]]
    with pytest.raises(MalformedError, match="holds 1 bytes"):
        next(ns._put(keys[:1], [b"x"], None))             # refused before any request


def test_get_verifies_checksums_when_asked() -> None:
    ns = namespace(session())
    keys = ns.keys(range(32))
    good = [b"\1" * ns.block_bytes, b"\2" * ns.block_bytes]

    def answer(req: p.Get, _: Any) -> Any:
        return (p.GetReply(req.rid, 2, [checksum(good[0]), 1]),
                [Frame(b) for b in good])

    with pytest.raises(CorruptError, match="block 1"):
        drive(ns._get(keys, True), answer)
    assert drive(ns._get(keys, False), answer)[1] == good


def test_replies_of_the_wrong_kind_and_error_replies_raise() -> None:
    with pytest.raises(KVStoreError, match="expected a CommitReply, got OkReply"):
        check_reply(p.OkReply(1), p.CommitReply)
    with pytest.raises(CapacityError, match="full"):
        check_reply(p.ErrorReply(1, "capacity", "full"), p.CommitReply)


def test_reservation_and_pin_state(caplog: pytest.LogCaptureFixture) -> None:
    s = session()
    ns = namespace(s)
    r: ReservationCore[Any] = ReservationCore(ns, ns.keys(range(16)))
    assert r._abort_request() is None                     # nothing reserved, nothing to abort
    with pytest.raises(KVStoreError, match="nothing reserved"):
        r._commit_request()
    r.reserved, r.id = True, 7                            # (the buffers need a mapped arena)
    commit = r._commit_request()
    assert isinstance(commit, p.Commit) and commit.reservation == 7 and r.done
    assert r._abort_request() is None
    with pytest.raises(KVStoreError, match="already committed"):
        r._commit_request()

    held: HeldCore[Any] = HeldCore(ns, ns.keys(range(16)))
    assert held._release_request() is None                # never acquired
    held.acquired, held.pin = True, 9
    release = held._release_request()
    assert isinstance(release, p.Release) and release.pin == 9
    assert held._release_request() is None                # once only

    header = s._posted(release)
    assert p.request_decoder.decode(header) == release
    assert not s._settle(p.OkReply(release.rid + 1))      # not a posted one: the shell's
    assert s._settle(p.OkReply(release.rid)) and not s._unread
    s._posted(release)                                    # a refused posted request is logged
    with caplog.at_level("WARNING", logger="kvstore"):
        assert s._settle(p.ErrorReply(release.rid, "not_found", "no such pin"))
    assert "refused a posted release: not_found" in caplog.text and not s._unread


def test_tcp_credentials_carry_the_token_in_the_handshake() -> None:
    from kvstore.auth import issue_token
    from kvstore.errors import ForbiddenError
    from kvstore.tiers.arena_fds import refused_hint, tcp_credentials

    token = issue_token(b"k" * 32, "acme", 60)
    assert tcp_credentials("tcp://h:1", token, "", False) == ("acme", token)
    assert tcp_credentials("tcp://h:1", token, "globex", False) == ("globex", token)
    assert tcp_credentials("tcp://h:1", token, "", True) is None     # CurveZMQ instead
    assert tcp_credentials("tcp://h:1", "", "acme", False) is None   # no token
    assert tcp_credentials("ipc:///s", token, "", False) is None     # tickets there
    with pytest.raises(ForbiddenError, match="not a kvstore token"):
        tcp_credentials("tcp://h:1", "garbage", "", False)
    assert "token is forged, expired" in refused_hint("token")
    assert "ticket was used" in refused_hint("ticket")
    assert refused_hint("") == ""


class _OldHelloReply(msgspec.Struct, tag_field="op", tag="hello", array_like=True):
    """HelloReply as daemons before the one-buffer token ids define it."""

    rid: int
    version: int
    session: str
    tenant: str
    arena_path: str
    arena_bytes: int
    lease_seconds: float
    max_keys: int
    max_request_bytes: int
    events: bool = False


class _OldPut(msgspec.Struct, tag_field="op", tag="put", array_like=True):
    """Put as daemons before the one-buffer token ids define it."""

    rid: int
    ns: bytes
    keys: list[bytes]
    parent: bytes | None = None
    checksums: list[int] = []
    tokens: list[bytes] = []


def _put_with_events(hello: bytes, forget: int = 0) -> tuple[p.Put, list[int], int]:
    """The Put a client sends after ``hello`` (as it came on the wire), for three blocks
    whose token ids it remembers, less the first ``forget``'s."""
    s = SessionCore("ipc:///nowhere", tenant="acme", token=None, timeout=1.0,
                    map_arena=False, curve=None, checksums=False)
    s._on_hello((p.reply_decoder.decode(hello), []))
    ns = namespace(s)
    bt = ns.identity.block_tokens
    tokens = list(range(3 * bt))
    keys = ns.keys(tokens)
    for key in keys[:forget]:
        del ns._chains._tokens[key]
    blocks = [bytes(ns.block_bytes)] * 3
    sent, _ = drive(ns._put(keys, blocks, None),
                    lambda req, payload: (p.PutReply(req.rid, len(payload), 0), []))
    [put] = sent
    return put, tokens, bt


def test_token_ids_go_as_the_daemon_takes_them_old_or_new() -> None:
    from kvstore.token_ids import encode_blocks, encode_chain

    facts = (1, p.PROTOCOL_VERSION, "s", "acme", "", 0, 60.0, 100, 1 << 30, True)
    # a daemon that takes one buffer says so: the client sends one
    put, tokens, bt = _put_with_events(p.encoder.encode(p.HelloReply(*facts, True)))
    assert put.token_ids == encode_chain(tokens, 3, bt) and put.tokens == []
    # an older daemon (no such field, which would ignore token_ids): each block's
    put, tokens, bt = _put_with_events(msgspec.msgpack.encode(_OldHelloReply(*facts)))
    assert put.token_ids == b"" and put.tokens == encode_blocks(tokens, 3, bt)
    old = msgspec.msgpack.decode(p.encoder.encode(put), type=_OldPut)
    assert old.tokens == encode_blocks(tokens, 3, bt)  # as the old daemon reads it
    # an older client reads the new hello, and its Put is read by the new daemon
    hello = msgspec.msgpack.decode(p.encoder.encode(p.HelloReply(*facts, True)),
                                   type=_OldHelloReply)
    assert hello.events
    new = p.request_decoder.decode(msgspec.msgpack.encode(_OldPut(**{
        f: getattr(old, f) for f in _OldPut.__struct_fields__})))
    assert isinstance(new, p.Put) and new.tokens == old.tokens and new.token_ids == b""


def test_token_ids_the_client_knows_go_when_it_does_not_know_all() -> None:
    from kvstore.token_ids import check_blocks, encode_blocks

    facts = (1, p.PROTOCOL_VERSION, "s", "acme", "", 0, 60.0, 100, 1 << 30, True, True)
    put, tokens, bt = _put_with_events(p.encoder.encode(p.HelloReply(*facts)), forget=1)
    assert put.token_ids == b""
    assert put.tokens == [b"", *encode_blocks(tokens, 3, bt)[1:]]
    check_blocks(put.tokens, 3, bt)  # as the daemon takes them


@pytest.mark.parametrize("timeout", [None, "10", True, float("nan"), 0])
def test_a_client_timeout_that_is_not_a_number_of_seconds_is_refused_naming_it(
        timeout: object) -> None:
    """Before: None or "10" failed with a bare comparison error naming no argument, NaN
    deep in a conversion, and 0 made every call fail at once."""
    with pytest.raises((TypeError, ValueError), match="timeout must be"):
        Client("ipc:///nonexistent/kvstore.sock", timeout=timeout)  # type: ignore[arg-type]


def test_an_infinite_client_timeout_is_no_bound_and_a_whole_number_is_seconds() -> None:
    assert client_timeout(float("inf")) == -1.0 and client_timeout(-1) == -1.0
    assert client_timeout(5) == 5.0 and isinstance(client_timeout(5), float)
