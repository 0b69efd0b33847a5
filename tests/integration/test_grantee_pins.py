"""A grantee's pins against a real daemon with credentials (``auth.grantee_pin_share``):
a grantee pins up to its share of the owner's arena and no more, so the owner keeps
room for its own puts; a co-grantee learns nothing of the other's pins; the counts go
back to nothing on release and when a session's lease runs out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client
from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret
from kvstore.errors import CapacityError, LimitExceededError

SHARED = make_identity(tenant="public", model="system-prompt", num_layers=4,
                       num_kv_heads=4, head_dim=64)  # 64 KiB blocks
SLOTS = 32  # in each tenant's 2 MiB arena
SHARE = SLOTS // 4  # blocks: the default share, a quarter


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()


def start(daemon_factory: Any, tmp_path: Path, share: float | None = None,
          lease: float = 30.0, tcp: bool = False,
          total: float | None = None, writers: bool = False) -> tuple[DaemonProcess, Path]:
    secret = tmp_path / "secret"
    cli("keygen", "--secret", str(secret))
    config = tmp_path / "grants.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret}"\noperators = ["ops"]\n'
                      + ("" if share is None else f"grantee_pin_share = {share}\n")
                      + ("" if total is None else f"grantee_pin_total = {total}\n")
                      + '[auth.shared_tenants]\npublic = ["acme", "globex"]\n'
                      + ('[auth.shared_writers]\npublic = ["acme"]\n' if writers else ""))
    d = daemon_factory(dram_capacity="2MiB", lease=lease, tcp=tcp,
                       extra=["--config", str(config), "--slab-size", "1MiB"])
    return d, secret


def token(secret: Path, tenant: str) -> str:
    """What ``kvstore token --secret-file SECRET --tenant TENANT`` prints, without a
    Python start per client (a test made a dozen, the poll below one each look)."""
    return issue_token(read_secret(secret), tenant, 86400.0)


def connect(d: DaemonProcess, secret: Path, tenant: str) -> Client:
    return Client(d.endpoint, token=token(secret, tenant))


def chain(ns: Any, n: int, start: int = 0) -> list[bytes]:
    keys: list[bytes] = ns.keys(range(start, start + n * SHARED.block_tokens))
    return keys


def fill(ns: Any, keys: list[bytes]) -> None:
    ns.put(keys, [os.urandom(ns.block_bytes) for _ in keys])


def pinned_blocks(ops: Client) -> int:
    stats = ops.stats()
    assert stats["invariant_violations"] == 0
    count: int = stats["tiers"]["dram"]["pinned_blocks"]
    return count


def test_a_grantee_pins_up_to_its_share_and_the_owner_keeps_room(
        daemon_factory: Any, tmp_path: Path) -> None:
    d, secret = start(daemon_factory, tmp_path)
    slot = SHARED.block_bytes
    with connect(d, secret, "public") as owner, connect(d, secret, "acme") as acme, \
            connect(d, secret, "globex") as globex, connect(d, secret, "ops") as ops:
        mine = owner.namespace(SHARED)
        keys = chain(mine, 24)
        fill(mine, keys)
        ns = acme.namespace(SHARED)
        held = ns.acquire(keys[:SHARE])
        assert acme.stats()["grantee_pinned_bytes"] == {"acme": {"public": SHARE * slot}}
        with pytest.raises(LimitExceededError, match="grantee_pin_share"):
            ns.acquire(keys[SHARE:SHARE + 1])
        assert pinned_blocks(ops) == SHARE  # the refused acquire left no pin
        # over its share, lookup_pin answers the lookup and pins nothing
        found, none = ns.lookup_pin(keys)
        assert found.blocks == 24 and none is None and pinned_blocks(ops) == SHARE
        found, again = ns.lookup_pin(keys[:SHARE])  # blocks it pins already: no more room
        assert again is not None and len(again.offsets) == SHARE
        again.release()
        # the owner's own puts still find room: everything but the grantee's share
        fresh = chain(mine, SLOTS - SHARE, start=10**6)
        fill(mine, fresh)
        assert mine.lookup(fresh).blocks == SLOTS - SHARE
        assert ns.lookup(keys[:SHARE]).tiers == ["dram"] * SHARE  # the pins held
        # a co-grantee has its own share, and learns nothing of the other's pins
        other = globex.namespace(SHARED)
        before = globex.stats()
        assert "acme" not in repr(before)
        assert before["grantee_pinned_bytes"] == {"globex": {}}
        assert before["eviction_orders"] == []  # the owner's order counts acme's pins
        held.release()
        assert acme.stats()["grantee_pinned_bytes"] == {"acme": {}}
        assert globex.stats() == before  # acme's release moved none of globex's figures
        held = ns.acquire(keys[:SHARE])
        assert globex.stats() == before
        theirs = other.acquire(keys[:SHARE])
        assert globex.stats()["grantee_pinned_bytes"] == {"globex": {"public": SHARE * slot}}
        theirs.release()
        held.release()
        globex.stats(), acme.stats()  # (a release is posted: done before their next request)
        assert ops.stats()["grantee_pinned_bytes"] == {}
        assert pinned_blocks(ops) == 0


def test_pins_of_a_session_that_goes_are_given_back(daemon_factory: Any,
                                                    tmp_path: Path) -> None:
    d, secret = start(daemon_factory, tmp_path, lease=2.0)
    with connect(d, secret, "public") as owner:
        keys = chain(owner.namespace(SHARED), SHARE)
        fill(owner.namespace(SHARED), keys)
    with connect(d, secret, "acme") as acme:
        held = acme.namespace(SHARED).acquire(keys)  # never released (kept: one dropped
        # is released at the client's next call)
        assert acme.stats()["grantee_pinned_bytes"] == {"acme": {"public": SHARE *
                                                                 SHARED.block_bytes}}
        assert not held.released
    deadline = time.monotonic() + 20
    while True:  # (each look is a new session, past the last one's lease)
        with connect(d, secret, "ops") as ops:
            stats = ops.stats()
        if stats["grantee_pinned_bytes"] == {} and stats["tiers"]["dram"]["pinned_blocks"] == 0:
            break
        assert time.monotonic() < deadline, stats["grantee_pinned_bytes"]
        time.sleep(0.5)
    with connect(d, secret, "acme") as acme:  # its whole share again
        acme.namespace(SHARED).acquire(keys).release()


def test_without_the_bound_one_grantee_starves_the_owner(daemon_factory: Any,
                                                         tmp_path: Path) -> None:
    """What the share prevents: at 1 (no bound), a grantee pins the owner's arena full
    and the owner's next put finds no room."""
    d, secret = start(daemon_factory, tmp_path, share=1.0, total=1.0)
    with connect(d, secret, "public") as owner, connect(d, secret, "acme") as acme:
        mine = owner.namespace(SHARED)
        keys = chain(mine, SLOTS)
        fill(mine, keys)
        held = acme.namespace(SHARED).acquire(keys)
        with pytest.raises(CapacityError):
            fill(mine, chain(mine, 4, start=10**6))
        held.release()
        acme.stats()  # (a release is posted: done before acme's next request)
        fill(mine, chain(mine, 4, start=10**6))


def test_a_share_of_zero_leaves_grantees_lookups_only(daemon_factory: Any,
                                                     tmp_path: Path) -> None:
    d, secret = start(daemon_factory, tmp_path, share=0)
    with connect(d, secret, "public") as owner, connect(d, secret, "acme") as acme:
        keys = chain(owner.namespace(SHARED), 2)
        data = [os.urandom(SHARED.block_bytes) for _ in keys]
        owner.namespace(SHARED).put(keys, data)
        ns = acme.namespace(SHARED)
        with pytest.raises(LimitExceededError):
            ns.acquire(keys)
        with pytest.raises(LimitExceededError):  # a get pins until its reply is sent
            ns.get(keys)
        found, none = ns.lookup_pin(keys)
        assert found.blocks == 2 and none is None
        assert ns.lookup(keys).blocks == 2
        assert [bytes(b) for b in owner.namespace(SHARED).get(keys)] == data  # its own
        owner.namespace(SHARED).acquire(keys).release()


def test_gets_a_grantee_never_reads_pin_no_more_than_its_share(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A get's blocks stay pinned until zmq has sent the reply: a grantee that sends
    gets and never reads them held the owner's whole arena (its put refused) before
    its gets counted against its share."""
    d, secret = start(daemon_factory, tmp_path, tcp=True)
    acme_token = token(secret, "acme")
    assert d.tcp_endpoint is not None
    with connect(d, secret, "public") as owner, connect(d, secret, "ops") as ops:
        mine = owner.namespace(SHARED)
        keys = chain(mine, SLOTS)
        fill(mine, keys)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)  # a grantee that stops reading after its hello
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.plain_username, sock.plain_password = b"acme", acme_token.encode()
            sock.connect(d.tcp_endpoint)
            for msg in (p.Hello(1, p.PROTOCOL_VERSION, "acme", acme_token),
                        p.OpenNamespace(2, SHARED)):
                sock.send(p.encoder.encode(msg))
                assert sock.poll(10_000)
                assert not isinstance(p.reply_decoder.decode(sock.recv_multipart()[0]),
                                      p.ErrorReply)
            for rid in range(3, 40):  # every block, again and again; never read
                sock.send(p.encoder.encode(p.Get(rid, mine.id, keys[(rid % 4) * SHARE:
                                                                   (rid % 4 + 1) * SHARE])))
            deadline = time.monotonic() + 20  # the first get read and pinned (a loaded
            while ops.stats()["grantee_pinned_bytes"] == {}:  # host may take a while)
                assert time.monotonic() < deadline, "the gets were not read"
                time.sleep(0.05)
            time.sleep(1.0)  # the gets behind it, read meanwhile, must not pin more
            stats = ops.stats()
            assert stats["grantee_pinned_bytes"] == {"acme": {"public": SHARE *
                                                              SHARED.block_bytes}}
            assert stats["tiers"]["dram"]["pinned_blocks"] == SHARE
            fill(mine, chain(mine, SLOTS - SHARE, start=10**6))  # the owner's room
        finally:
            sock.close()
            ctx.term()
        deadline = time.monotonic() + 20  # gone unread: the pins go back
        while ops.stats()["grantee_pinned_bytes"] != {}:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert pinned_blocks(ops) == 0


def test_a_writer_grantee_s_reservations_count_against_its_share(daemon_factory: Any,
                                                                  tmp_path: Path) -> None:
    """A ``shared_writers`` grantee's open reservations in the owner's namespaces hold
    DRAM slots: within its share (a quarter of 32 slots), else refused, and the owner
    can still put; back once it aborts."""
    d, secret = start(daemon_factory, tmp_path, writers=True)
    ident = make_identity(tenant="public", model="sp", num_layers=4, num_kv_heads=4,
                          head_dim=64)  # 64 KiB blocks: 32 in the 2 MiB arena
    with connect(d, secret, "public") as owner, connect(d, secret, "acme") as writer:
        mine, theirs = owner.namespace(ident), writer.namespace(ident)
        other = mine.keys(range(10**6, 10**6 + 16 * 32))
        with pytest.raises(LimitExceededError, match="reserved slots"):
            theirs.reserve(other[:32])  # the whole arena, before
        r = theirs.reserve(other[:8])  # a quarter
        with pytest.raises(LimitExceededError, match="reserved slots"):
            theirs.reserve(other[8:9], parent=other[7])
        keys = mine.keys(range(5 * 10**6, 5 * 10**6 + 16 * 4))
        mine.put(keys, [b"\1" * mine.block_bytes] * 4)  # the owner still has room
        r.abort()
        theirs.reserve(other[:8]).abort()  # its slots came back
