"""Authentication and isolation against the real daemon: tokens, CurveZMQ, shared namespaces."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret, verify_token
from kvstore.client import CurveKeys
from kvstore.errors import ForbiddenError, UnavailableError, UnknownNamespaceError
from kvstore.router import Router
from kvstore.tiers.arena_fds import admit, fetch_arena, side_path

IDENT_A = make_identity(tenant="acme")
IDENT_B = make_identity(tenant="globex")
SHARED = make_identity(tenant="public", model="system-prompt")


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          text=True, check=True, timeout=60).stdout


@pytest.fixture
def token_daemon(daemon_factory: Any, tmp_path: Path) -> tuple[Any, bytes, Path]:
    secret_file = tmp_path / "secret"
    cli("keygen", "--secret", str(secret_file))
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\noperators = ["acme"]\n'
                      '[auth.shared_tenants]\npublic = ["acme", "globex"]\n'
                      '[auth.shared_writers]\npublic = ["acme"]\n')
    d = daemon_factory(extra=["--config", str(config)])
    return d, read_secret(secret_file), secret_file


def hello_by_hand(endpoint: str, cases: list[tuple[tuple[str, str] | None, bool]]) -> None:
    """For each case, a bare DEALER says hello with those PLAIN credentials (None: none)
    and is answered as tenant acme, or never answered."""
    ctx = zmq.Context()
    try:
        for creds, answered in cases:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if creds is not None:
                sock.plain_username, sock.plain_password = creds[0].encode(), creds[1].encode()
            try:  # (closed whatever happens: an open socket hangs the context's term)
                sock.connect(endpoint)
                sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "")))
                if answered:
                    assert sock.poll(10_000), f"{creds}: no answer in 10 s"
                    reply = p.reply_decoder.decode(sock.recv())
                    assert isinstance(reply, p.HelloReply) and reply.tenant == "acme"
                else:
                    assert not sock.poll(1500), f"{creds}: answered, {sock.recv()!r}"
            finally:
                sock.close()
    finally:
        ctx.term()


def test_tokens_decide_the_tenant(token_daemon: tuple[Any, bytes, Path]) -> None:
    d, secret, secret_file = token_daemon
    token_a = cli("token", "--secret-file", str(secret_file), "--tenant", "acme").strip()
    assert verify_token(secret, token_a) == "acme"
    with Client(d.endpoint, token=token_a) as a:
        assert a.hello is not None and a.hello.tenant == "acme"
        ns = a.namespace(IDENT_A)
        keys = ns.keys(range(64))
        ns.put(keys, [b"\1" * ns.block_bytes] * 4)
        with pytest.raises(ForbiddenError):
            a.namespace(IDENT_B)                   # another tenant's identity
    with pytest.raises(ForbiddenError, match="credentials are for tenant"):
        Client(d.endpoint, token=token_a, tenant="globex")   # naming another tenant
    with pytest.raises(ForbiddenError, match="requires a token"):
        Client(d.endpoint, tenant="acme")          # no token
    forged = issue_token(b"x" * 32, "acme", 60)
    with pytest.raises(ForbiddenError, match="signature"):
        Client(d.endpoint, token=forged)           # wrong key
    expired = issue_token(secret, "acme", -1)
    with pytest.raises(ForbiddenError, match="expired"):
        Client(d.endpoint, token=expired)
    with pytest.raises(ForbiddenError):
        Client(d.endpoint, token="garbage")


def test_a_replayed_hello_gets_no_second_session(token_daemon: tuple[Any, bytes, Path]) -> None:
    d, secret, _ = token_daemon
    token = issue_token(secret, "acme", 60)
    side = side_path(d.endpoint)
    assert side is not None
    admitted = admit(side, token)           # the ipc endpoint is gated: a ticket first
    assert admitted is not None and admitted[0] == "acme"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.plain_username, sock.plain_password = admitted[0].encode(), admitted[1].encode()
    sock.connect(d.endpoint)
    try:
        hello = p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "", token))
        for expected in (p.HelloReply, p.ErrorReply):
            sock.send(hello)
            assert sock.poll(5000)
            reply = p.reply_decoder.decode(sock.recv())
            assert isinstance(reply, expected), reply
        assert isinstance(reply, p.ErrorReply) and reply.code == "forbidden"
    finally:
        sock.close()
        ctx.term()


def test_isolation_for_every_verb_with_a_shared_namespace(
        token_daemon: tuple[Any, bytes, Path]) -> None:
    d, secret, _ = token_daemon
    with Client(d.endpoint, token=issue_token(secret, "acme", 60)) as a, \
            Client(d.endpoint, token=issue_token(secret, "globex", 60)) as b:
        ns_a = a.namespace(IDENT_A)
        keys = ns_a.keys(range(64))
        ns_a.put(keys, [b"\2" * ns_a.block_bytes] * 4)
        ns_b = b.namespace(IDENT_B)
        assert ns_b.lookup(keys).blocks == 0           # A's keys in B's namespace: a miss
        ns_b.id = ns_a.id                              # forge A's namespace id
        for call in (lambda: ns_b.lookup(keys), lambda: ns_b.acquire(keys),
                     lambda: ns_b.get(keys), lambda: ns_b.reserve(keys),
                     lambda: ns_b.put(keys, [b"\3" * ns_b.block_bytes] * 4),
                     lambda: ns_b.evict(keys), ns_b.drop):
            with pytest.raises(UnknownNamespaceError):
                call()
        # both tenants share the "public" namespace: A may write there, B only read
        shared_a, shared_b = a.namespace(SHARED), b.namespace(SHARED)
        sys_keys = shared_a.keys(range(32))
        shared_a.put(sys_keys, [b"\4" * shared_a.block_bytes] * 2)
        assert shared_b.get(shared_b.keys(range(32))) == [b"\4" * shared_b.block_bytes] * 2
        before = a.stats()["tiers"]["dram"]
        other = shared_b.keys(range(1000, 1032))
        for call in (lambda: shared_b.reserve(other),
                     lambda: shared_b.put(other, [b"\6" * shared_b.block_bytes] * 2),
                     lambda: shared_b.put(sys_keys, [b"\6" * shared_b.block_bytes] * 2),
                     lambda: shared_b.evict(sys_keys), shared_b.drop,
                     lambda: shared_b.keep_warm(sys_keys, 60)):
            with pytest.raises(ForbiddenError, match="may read the namespaces of tenant 'public'"):
                call()
        after = a.stats()["tiers"]["dram"]  # refused before anything: nothing reserved,
        assert after["blocks"] == before["blocks"]  # nothing gone
        assert after["reserved_slots"] == before["reserved_slots"] == 0
        assert shared_b.lookup(shared_b.keys(range(32))).blocks == 2
        assert shared_b.lookup(other).blocks == 0
        # nor may it make namespaces of the owner's: each would count against the
        # owner's cap, and be recorded in its name
        namespaces = a.stats()["namespaces"]
        for n in range(3):
            with pytest.raises(ForbiddenError, match="a grantee opens only namespaces"):
                b.namespace(make_identity(tenant="public", model=f"made-up-{n}"))
        assert a.stats()["namespaces"] == namespaces
        assert shared_a.get(sys_keys) == [b"\4" * shared_a.block_bytes] * 2
        assert ns_a.get(keys) == [b"\2" * ns_a.block_bytes] * 4


def test_lookup_misses_take_the_same_time_whoever_holds_the_key(
        token_daemon: tuple[Any, bytes, Path]) -> None:
    d, secret, _ = token_daemon
    with Client(d.endpoint, token=issue_token(secret, "acme", 60)) as a, \
            Client(d.endpoint, token=issue_token(secret, "globex", 60)) as b:
        ns_a = a.namespace(IDENT_A)
        held = ns_a.keys(range(16 * 64))
        ns_a.put(held, [b"\5" * ns_a.block_bytes] * 64)
        ns_b = b.namespace(IDENT_B)
        never = ns_b.keys(range(10**6, 10**6 + 16 * 64))

        samples: dict[int, list[float]] = {0: [], 1: []}
        for i in range(600):          # interleaved, so that noise hits both alike
            keys = held if i % 2 else never
            start = time.perf_counter()
            assert ns_b.lookup(keys).blocks == 0
            samples[i % 2].append(time.perf_counter() - start)
        a_keys, b_keys = (sorted(v)[len(v) // 2] for v in (samples[1], samples[0]))
        assert abs(a_keys - b_keys) < 0.25 * max(a_keys, b_keys) + 100e-6, (a_keys, b_keys)


def test_curve_on_tcp(daemon_factory: Any, tmp_path: Path) -> None:
    keys_dir, clients_dir = tmp_path / "server", tmp_path / "clients"
    cli("keygen", str(keys_dir), "--name", "server")
    cli("keygen", str(tmp_path / "acme"), "--name", "acme")
    cli("keygen", str(tmp_path / "stranger"), "--name", "stranger")
    clients_dir.mkdir()
    (clients_dir / "acme.key").write_bytes((tmp_path / "acme" / "acme.key").read_bytes())
    config = tmp_path / "curve.toml"
    config.write_text(f'[auth]\ncurve_secret_key_file = "{keys_dir / "server.key_secret"}"\n'
                      f'curve_clients_dir = "{clients_dir}"\n')
    d = daemon_factory(tcp=True, extra=["--config", str(config)])
    assert d.tcp_endpoint is not None
    server_key = str(keys_dir / "server.key")
    acme = CurveKeys.from_files(server_key, str(tmp_path / "acme" / "acme.key_secret"))
    with Client(d.tcp_endpoint, curve=acme, tenant="acme") as c:
        assert c.hello is not None and c.hello.tenant == "acme"
        ns = c.namespace(IDENT_A)
        ns.put(ns.keys(range(16)), [b"\6" * ns.block_bytes])
        with pytest.raises(ForbiddenError):
            c.namespace(IDENT_B)
    with pytest.raises(ForbiddenError):
        Client(d.tcp_endpoint, curve=acme, tenant="globex")
    stranger = CurveKeys.from_files(server_key,
                                    str(tmp_path / "stranger" / "stranger.key_secret"))
    with pytest.raises(ForbiddenError, match="refused the handshake .*CurveZMQ key"):
        Client(d.tcp_endpoint, curve=stranger, timeout=60)       # unknown key: refused
    with pytest.raises(UnavailableError):
        Client(d.tcp_endpoint, tenant="acme", timeout=1.5)       # no key at all
    with Client(d.endpoint, tenant="acme") as local:             # ipc: trusted local users
        assert local.namespace(IDENT_A).lookup(
            local.namespace(IDENT_A).keys(range(16))).blocks == 1


def test_tokens_over_tcp_are_checked_in_the_handshake(daemon_factory: Any,
                                                      tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    cli("keygen", "--secret", str(secret_file))
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\noperators = ["acme"]\n')
    d = daemon_factory(tcp=True, extra=["--config", str(config)])
    assert d.tcp_endpoint is not None
    secret = read_secret(secret_file)
    token_a = cli("token", "--secret-file", str(secret_file), "--tenant", "acme").strip()
    with Client(d.tcp_endpoint, token=token_a) as a:         # no side socket over tcp
        assert a.hello is not None and a.hello.tenant == "acme"
        ns = a.namespace(IDENT_A)
        keys = ns.keys(range(32))
        ns.put(keys, [b"\7" * ns.block_bytes] * 2)
        assert ns.get(keys) == [b"\7" * ns.block_bytes] * 2
        with pytest.raises(ForbiddenError):
            a.namespace(IDENT_B)
    with Router([d.tcp_endpoint], token=token_a) as router:  # routing queries, too
        assert router.route(keys, deadline=5.0)[0].answered
    # refused in the handshake, which the socket never says: the client hears it from
    # ZeroMQ's monitor at once (within a timeout of a minute), and says what it checks
    async def refused_async(token: str, tenant: str | None) -> None:
        with pytest.raises(ForbiddenError, match="refused the handshake .*, the token"):
            await AsyncClient(d.tcp_endpoint, token=token, tenant=tenant, timeout=60).connect()

    for token, tenant in ((issue_token(b"x" * 32, "acme", 60), None),   # forged
                          (issue_token(secret, "acme", -1), None),       # expired
                          (token_a, "globex"),                           # another tenant's
                          ("garbage.x", "acme")):
        with pytest.raises(ForbiddenError, match="refused the handshake .*, the token"):
            Client(d.tcp_endpoint, token=token, tenant=tenant, timeout=60)
        asyncio.run(refused_async(token, tenant))
    with pytest.raises(ForbiddenError, match="not a kvstore token"):
        Client(d.tcp_endpoint, token="garbage", timeout=1)
    # what the client would send, by hand: only a good token of the named tenant
    hello_by_hand(d.tcp_endpoint, [(("acme", token_a), True), (("globex", token_a), False),
                                   (None, False)])
    with Client(d.endpoint, token=token_a) as local:         # ipc: tickets, as before
        again = local.namespace(IDENT_A)
        assert again.get(keys) == [b"\7" * again.block_bytes] * 2
        assert local.stats()["before_hello"]["dropped"] == 0   # nothing got in unchecked


def test_a_handshake_refused_before_the_hello_is_sent_is_heard_not_waited_on(
        daemon_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handshake the daemon refuses before the client's hello went (a loaded machine:
    the refusal outran the thread) took the connection's queue with it, and the hello's
    blocking send then waited for a connection for good, whatever the timeout (the
    full suite hung 300 s on it once).  Now the refusal is heard, as when it comes
    later (the async client's send never blocked)."""
    import threading

    import kvstore.aclient
    import kvstore.client

    secret_file = tmp_path / "secret"
    cli("keygen", "--secret", str(secret_file))
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n')
    d = daemon_factory(tcp=True, extra=["--config", str(config)])
    expired = issue_token(read_secret(secret_file), "acme", -1)

    def refused_first(make: Any) -> Any:
        def made(*args: Any, **kwargs: Any) -> Any:
            sock = make(*args, **kwargs)
            time.sleep(2.0)  # the handshake is refused meanwhile
            return sock
        return made

    monkeypatch.setattr(kvstore.client, "make_socket", refused_first(kvstore.client.make_socket))
    monkeypatch.setattr(kvstore.aclient, "make_socket",
                        refused_first(kvstore.aclient.make_socket))
    outcome: list[BaseException | str] = []

    def connect() -> None:
        try:
            Client(d.tcp_endpoint, token=expired, tenant="", timeout=5)
            outcome.append("connected")
        except BaseException as exc:  # (any outcome, reported below)
            outcome.append(exc)

    async def connect_async() -> None:
        await AsyncClient(d.tcp_endpoint, token=expired, tenant="", timeout=5).connect()

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the hello's send waited for good"
    assert isinstance(outcome[0], ForbiddenError), outcome
    assert "refused the handshake" in str(outcome[0])
    with pytest.raises(ForbiddenError, match="refused the handshake"):
        asyncio.run(connect_async())


def test_a_probe_gives_a_tenant_no_daemon_wide_figures(daemon_factory: Any,
                                                       tmp_path: Path) -> None:
    """With credentials, a tenant's probe carries the configured load bandwidths and no
    queue, as its stats carry none of the whole daemon's figures: the measured ones move
    with other tenants' reads (a tenant read another's SSD reads through them); an
    operator's carries the measured ones."""
    import os

    secret_file = tmp_path / "secret"
    cli("keygen", "--secret", str(secret_file))
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\noperators = ["ops"]\n'
                      '[ssd]\nwrite_policy = "write-through"\n')
    d = daemon_factory(dram_capacity="2MiB", ssd_capacity="64MiB",
                       extra=["--config", str(config)])
    secret = read_secret(secret_file)
    ident = make_identity(tenant="acme", num_layers=4, num_kv_heads=4, head_dim=64)
    with Client(d.endpoint, token=issue_token(secret, "acme", 600)) as acme, \
            Client(d.endpoint, token=issue_token(secret, "spy", 600)) as spy, \
            Client(d.endpoint, token=issue_token(secret, "ops", 600)) as ops:
        configured = spy.probe().bandwidth
        ns = acme.namespace(ident)
        chains = [[os.urandom(16) for _ in range(24)] for _ in range(6)]
        for keys in chains:  # 64 KiB blocks, 2 MiB of DRAM: most leave for the SSD tier
            ns.put(keys, [os.urandom(ident.block_bytes)] * len(keys))
        time.sleep(0.5)
        for keys in chains:  # read back from SSD: the daemon measures its bandwidth
            hits = ns.lookup(keys).blocks
            if hits:
                ns.get(keys[:hits])
        measured = ops.probe()
        assert measured.bandwidth["ssd"] != configured["ssd"], (measured, configured)
        seen = spy.probe()
        assert seen.bandwidth == configured and seen.queue_seconds == 0.0, seen


def test_a_tcp_endpoint_without_credentials_is_warned_of(daemon_factory: Any) -> None:
    # ZeroMQ reads a message whole before the daemon can drop it: only the handshake
    # keeps a stranger's frames out of its memory
    d = daemon_factory(tcp=True)
    assert "tcp endpoints take no credentials (any peer" in d.log()
    assert "any number of frames" in d.log()
    quiet = daemon_factory()  # ipc alone: nothing to warn of
    assert "take no credentials" not in quiet.log()


def test_peer_tenants_alone_leave_tcp_open_and_say_so(daemon_factory: Any,
                                                      tmp_path: Path) -> None:
    config = tmp_path / "peer.toml"
    config.write_text(f'[auth]\npeer_tenants = {{ "{os.getuid()}" = "acme" }}\n')
    d = daemon_factory(tcp=True, extra=["--config", str(config)])
    assert "take no credentials under auth.peer_tenants" in d.log()
    assert "auth.secret_file" in d.log()
    with pytest.raises(ForbiddenError, match="takes the tenant from the client's uid"):
        Client(d.tcp_endpoint, tenant="acme")


def test_per_tenant_arenas_hold_only_what_their_tenant_may_read(
        daemon_factory: Any, tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    cli("keygen", "--secret", str(secret_file))
    secret = read_secret(secret_file)
    config = tmp_path / "arenas.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\noperators = ["acme"]\n'
                      '[auth.shared_tenants]\npublic = ["acme", "globex"]\n'
                      '[dram]\nper_tenant_arenas = true\n')
    d = daemon_factory(dram_capacity="8MiB", extra=["--config", str(config)])
    with Client(d.endpoint, token=issue_token(secret, "acme", 60)) as a, \
            Client(d.endpoint, token=issue_token(secret, "globex", 60)) as b:
        assert a.hello is not None and b.hello is not None
        assert a.hello.arena_path != b.hello.arena_path
        secret_a = b"acme-only " * (IDENT_A.block_bytes // 10) + b"\0" * (
            IDENT_A.block_bytes % 10)
        ns_a = a.namespace(IDENT_A)
        with ns_a.reserve(ns_a.keys(range(16))) as r:
            r.buffers[0][:] = secret_a
            r.commit()
        ns_b = b.namespace(IDENT_B)
        ns_b.put(ns_b.keys(range(16)), [b"\7" * ns_b.block_bytes])
        # with credentials the arenas are memory files with no path, handed out by
        # descriptor to the sessions whose tenant may use them
        assert a.hello.arena_path.startswith("memfd:")
        size = a.hello.arena_bytes
        assert b"acme-only" not in bytes(b._view_of(b.hello.arena_path, size))
        assert b"acme-only" in bytes(a._view_of(a.hello.arena_path, size))
        with pytest.raises(ForbiddenError, match="no such arena"):
            b._view_of(a.hello.arena_path, size)      # B may not have A's arena
        with Client(d.endpoint, token=issue_token(secret, "public", 60)) as owner:
            shared = owner.namespace(SHARED)           # a third arena, all three may map
            assert shared.arena[0] not in (a.hello.arena_path, b.hello.arena_path)
            with shared.reserve(shared.keys(range(16))) as r:
                r.buffers[0][:] = b"\10" * shared.block_bytes
                r.commit()
        for grantee in (a, b):  # granted to read: the arena maps read-only
            ns = grantee.namespace(SHARED)
            with ns.acquire(ns.keys(range(16))) as held:
                assert bytes(held.buffers[0]) == b"\10" * ns.block_bytes
                assert held.buffers[0].readonly
            label = ns.arena[0][len("memfd:"):]
            fd, size = fetch_arena(side_path(d.endpoint), grantee.hello.session, label)
            try:
                assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
                with pytest.raises(PermissionError):  # no writable mapping of it at all
                    mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            view = grantee._view_of(*ns.arena)
            with pytest.raises(TypeError):
                view[0:1] = b"\0"
        fd, _ = fetch_arena(side_path(d.endpoint), a.hello.session, a.hello.arena_path[6:])
        try:  # its own arena still read-write
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        finally:
            os.close(fd)
        assert a.stats()["tiers"]["dram"]["arenas"] == 3


def _use_ticket_twice(endpoint: str, used: tuple[str, str]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.plain_username, sock.plain_password = used[0].encode(), used[1].encode()
    sock.connect(endpoint)
    sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "")))
    assert sock.poll(10_000)                              # the first use: good
    sock.close()
    ctx.term()
    Client(endpoint, timeout=60)                          # the second: refused


def test_peer_credentials_name_the_tenant(daemon_factory: Any, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "peer.toml"
    config.write_text(f'[auth]\npeer_tenants = {{ "{os.getuid()}" = "acme" }}\n'
                      'operators = ["acme"]\n')
    d = daemon_factory(dram_capacity="8MiB", extra=["--config", str(config)])
    with Client(d.endpoint) as a:                      # no token, no tenant: the uid's
        assert a.hello is not None and a.hello.tenant == "acme"
        assert a.hello.arena_path.startswith("memfd:")
        ns = a.namespace(IDENT_A)
        keys = ns.keys(range(32))
        ns.put(keys, [b"\3" * ns.block_bytes] * 2)
        with ns.acquire(keys) as held:
            assert bytes(held.buffers[1]) == b"\3" * ns.block_bytes
        with pytest.raises(ForbiddenError):
            a.namespace(IDENT_B)
    with pytest.raises(ForbiddenError, match="credentials are for tenant 'acme', not 'globex'"):
        Client(d.endpoint, tenant="globex")
    side = side_path(d.endpoint)
    assert side is not None
    admitted = admit(side, "")
    assert admitted is not None and admitted[0] == "acme"
    tenant, ticket = admitted
    # a ticket is good for one handshake, for its tenant; without one, nothing gets in
    hello_by_hand(d.endpoint, [((tenant, ticket), True), ((tenant, ticket), False),
                               (("globex", admit(side, "")[1]), False),  # type: ignore[index]
                               (None, False)])
    with Client(d.endpoint) as again:
        assert again.stats()["side_socket"]["tickets"] >= 4
    # a client whose handshake is refused (its ticket already used, here) is told what
    # the handshake checks, not only that no reply came
    used = admit(side, "")
    assert used is not None
    monkeypatch.setattr("kvstore.client_core.admit", lambda path, token, timeout=0: used)
    with pytest.raises(ForbiddenError, match="refused the handshake .*its ticket was used"):
        _use_ticket_twice(d.endpoint, used)
