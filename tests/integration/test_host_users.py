"""A host service for engines of many users: the daemon as its own user, each tenant's
engine as another, all in the socket group, tenants taken from the uid.

Each engine offloads and reloads through its arena; tenant B finds tenant A's bytes in
nothing it can open (``/dev/shm``, the runtime directory, ``/proc/*/fd``, and the
daemon's and A's ``/proc/PID/mem``), and the protocol refuses A's namespace to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import mmap
import os
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import uvloop  # noqa: F401  (imported here: the daemon's child cannot read site-packages)
import zmq
from host_users import HostUsers, User, as_user
from kvtest import make_identity

import kvstore.cli
import kvstore.logs  # noqa: F401
import kvstore.metrics  # noqa: F401
import kvstore.sdnotify  # noqa: F401
import kvstore.server  # noqa: F401
from kvstore import Client
from kvstore import protocol as p
from kvstore.client_wire import make_socket
from kvstore.errors import ForbiddenError, UnavailableError
from kvstore.tiers.arena_fds import admit, fetch_arena, side_path

IDENT_A = make_identity(tenant="acme")
IDENT_B = make_identity(tenant="globex")


@pytest.fixture
def users() -> Iterator[HostUsers]:
    host = HostUsers()
    try:
        yield host
    finally:
        host.close()


def _serve(conn: Connection, config: str, endpoint: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # pytest's capture replaced sys.stdout and sys.stderr in the parent: write to the log
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    kvstore.cli.main(["serve", "--config", config, "--endpoint", endpoint,
                      "--dram-capacity", "8MiB", "--ssd-capacity", "0",
                      "--log-level", "warning", "--debug-invariants"])


@contextlib.contextmanager
def host_daemon(users: HostUsers, daemon: User, peer_tenants: dict[str, str],
                auth: str = "") -> Iterator[tuple[str, int, Path]]:
    """The daemon running as ``daemon``, sockets in a runtime directory of the users'
    group; yields its endpoint, pid and runtime directory."""
    top = Path(tempfile.mkdtemp(prefix="kvstore-host-"))
    os.chmod(top, 0o755)
    os.chown(top, daemon.uid, daemon.gid)
    run = top / "run"
    config = top / "kvstore.toml"
    tenants = ", ".join(f'{user} = "{tenant}"' for user, tenant in peer_tenants.items())
    config.write_text(f'[server]\nsocket_group = "{users.group}"\n'
                      f'[auth]\npeer_tenants = {{ {tenants} }}\n{auth}')
    log = top / "daemon.log"
    log.touch()
    os.chown(log, daemon.uid, daemon.gid)
    endpoint = f"ipc://{run / 'kvstore.sock'}"
    proc, conn = as_user(daemon, _serve, str(config), endpoint, str(log))
    try:
        side = side_path(endpoint)
        assert side is not None
        deadline = time.monotonic() + 30
        while not os.path.exists(side):
            assert proc.is_alive(), log.read_text()
            assert time.monotonic() < deadline, "the daemon did not come up: " + log.read_text()
            time.sleep(0.05)
        assert proc.pid is not None
        yield endpoint, proc.pid, run
    finally:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
        proc.join(15)
        text = log.read_text()
        for path in sorted(top.rglob("*"), reverse=True):
            path.unlink() if not path.is_dir() else path.rmdir()
        top.rmdir()
        assert "Traceback" not in text and "invariant violated" not in text, text


def _engine_a(conn: Connection, endpoint: str, marker: bytes) -> None:
    """Tenant A's engine: offload blocks through its arena, read them back, then stay
    (its memory and descriptors open) until told to go."""
    side = side_path(endpoint)
    assert side is not None
    spare = admit(side, "")                              # a ticket for acme, to leak to B
    with Client(endpoint) as client:                     # no token: the uid decides
        assert client.hello is not None
        ns = client.namespace(IDENT_A)
        block = (marker * (ns.block_bytes // len(marker) + 1))[:ns.block_bytes]
        keys = ns.keys(range(64))
        with ns.reserve(keys) as r:
            for buf in r.buffers:
                buf[:] = block
            r.commit()
        with ns.acquire(keys) as held:
            read_back = all(bytes(b) == block for b in held.buffers)
        conn.send({"tenant": client.hello.tenant, "arena": client.hello.arena_path,
                   "session": client.hello.session, "ticket": spare,
                   "arena_bytes": client.hello.arena_bytes, "read_back": read_back,
                   "pid": os.getpid()})
        conn.recv()  # B has looked


def _readable_hits(path: str, marker: bytes) -> bool | None:
    """Whether ``path`` opens as a regular file holding ``marker`` (None: it does not open
    or is not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return marker in f.read(64 << 20)
    except OSError:
        return None
    finally:
        os.close(fd)


def _engine_b(conn: Connection, endpoint: str, a: dict[str, Any], marker: bytes,
              daemon_pid: int, runtime: str) -> None:
    """Tenant B's engine: its own blocks work; A's namespace, tenant and arena are refused;
    and nothing B can open holds A's bytes."""
    out: dict[str, Any] = {}
    with Client(endpoint) as client:
        assert client.hello is not None
        out["tenant"] = client.hello.tenant
        ns = client.namespace(IDENT_B)
        keys = ns.keys(range(32))
        with ns.reserve(keys) as r:
            r.buffers[0][:] = b"\7" * ns.block_bytes
            r.commit()
        with ns.acquire(keys) as held:
            out["read_back"] = bytes(held.buffers[0]) == b"\7" * ns.block_bytes
        refusals = []
        side = side_path(endpoint)
        assert side is not None
        label = a["arena"].removeprefix("memfd:")
        for attempt in (lambda: client.namespace(IDENT_A),
                        lambda: client._view_of(a["arena"], a["arena_bytes"]),
                        # A's session id, leaked to B: no use from B's uid
                        lambda: os.close(fetch_arena(side, a["session"], label)[0]),
                        lambda: Client(endpoint, tenant="acme", timeout=5)):
            try:
                attempt()
                refusals.append("allowed")
            except ForbiddenError as exc:
                refusals.append(str(exc))
        out["refusals"] = refusals
        out["a_ticket_said_hello"] = _hello_with_ticket(endpoint, *a["ticket"])
        # a file of B's own, open: the scan below must open it (its own arena, a memory
        # file of the daemon's user, 0600, it holds but cannot open again)
        own = tempfile.TemporaryFile()
        own.write(b"B's own")
        own.flush()
        paths = glob.glob("/dev/shm/*") + glob.glob(os.path.join(runtime, "*"))
        paths += glob.glob("/proc/[0-9]*/fd/*")
        out["opened"] = sum(_readable_hits(p, marker) is not None for p in paths)
        out["hits"] = [p for p in paths if _readable_hits(p, marker)]
        own.close()
        mem = {}
        for pid in (daemon_pid, a["pid"]):
            try:
                with open(f"/proc/{pid}/mem", "rb"):
                    mem[pid] = "opened"
            except OSError as exc:
                mem[pid] = type(exc).__name__
        out["mem"] = mem
        fds = {}
        for pid in (daemon_pid, a["pid"]):
            try:
                fds[pid] = len(os.listdir(f"/proc/{pid}/fd"))
            except OSError as exc:
                fds[pid] = type(exc).__name__
        out["fd_dirs"] = fds
    conn.send(out)


def _hello_with_ticket(endpoint: str, tenant: str, ticket: str) -> bool:
    """Whether a connection presenting ``ticket`` (as its ZeroMQ PLAIN credentials)
    gets an answer to its hello."""
    ctx = zmq.Context()
    sock = make_socket(ctx, endpoint, admission=(tenant, ticket))
    try:
        sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, tenant, "")))
        return bool(sock.poll(3000))
    finally:
        sock.close(linger=0)
        ctx.term()


def _stranger(conn: Connection, endpoint: str) -> None:
    """A user outside the socket group: the daemon's sockets are out of its reach."""
    try:
        Client(endpoint, tenant="acme", timeout=1)
        conn.send("connected")
    except UnavailableError:
        conn.send("unavailable")


def test_engines_of_two_users_share_the_host_and_not_their_bytes(users: HostUsers) -> None:
    daemon = users.add("d")
    alice, bob = users.add("a"), users.add("b")
    stranger = users.add("x", in_group=False)
    marker = os.urandom(8).hex().encode() + b"-acme-only-"
    with host_daemon(users, daemon, {alice.name: "acme", str(bob.uid): "globex"}) as (
            endpoint, daemon_pid, run):
        # socket access by group: 0750 directory, 0660 sockets, of the users' group
        for path, mode in ((run, 0o750), (run / "kvstore.sock", 0o660),
                           (Path(str(side_path(endpoint))), 0o660)):
            info = os.stat(path)
            assert (stat.S_IMODE(info.st_mode), info.st_gid, info.st_uid) == (
                mode, users.gid, daemon.uid), path
        proc_a, conn_a = as_user(alice, _engine_a, endpoint, marker)
        assert conn_a.poll(60), "engine A did not report"
        a = conn_a.recv()
        assert "error" not in a, a
        assert a["tenant"] == "acme" and a["read_back"]
        assert a["arena"].startswith("memfd:")
        proc_b, conn_b = as_user(bob, _engine_b, endpoint, a, marker, daemon_pid, str(run))
        assert conn_b.poll(120), "engine B did not report"
        b = conn_b.recv()
        conn_a.send("done")
        proc_a.join(30)
        proc_b.join(30)
        assert "error" not in b, b
        assert b["tenant"] == "globex" and b["read_back"]
        assert "cannot open a namespace of tenant 'acme'" in b["refusals"][0]
        assert "no such arena" in b["refusals"][1]
        assert "no such arena" in b["refusals"][2]
        assert "credentials are for tenant 'globex', not 'acme'" in b["refusals"][3]
        assert b["a_ticket_said_hello"] is False   # a ticket of A's uid is no use to B
        assert b["opened"] > 0            # B's scan did open files (its own, at least)
        assert b["hits"] == []
        assert b["mem"] == {daemon_pid: "PermissionError", a["pid"]: "PermissionError"}
        assert b["fd_dirs"] == {daemon_pid: "PermissionError", a["pid"]: "PermissionError"}
        assert proc_a.exitcode == 0 and proc_b.exitcode == 0
        proc_x, conn_x = as_user(stranger, _stranger, endpoint)
        assert conn_x.poll(30)
        assert conn_x.recv() == "unavailable"
        proc_x.join(10)
        # a uid with no tenant (root here) gets no ticket, so no session
        with pytest.raises(ForbiddenError, match="uid 0 has no tenant"):
            Client(endpoint, timeout=5)


def _engine_without_credentials(conn: Connection, endpoint: str) -> None:
    with Client(endpoint, tenant="acme") as client:
        assert client.hello is not None
        ns = client.namespace(IDENT_A)
        keys = ns.keys(range(32))
        with ns.reserve(keys) as r:
            r.buffers[0][:] = b"\1" * ns.block_bytes
            r.commit()
        with ns.acquire(keys) as held:
            conn.send({"arena": client.hello.arena_path,
                       "read_back": bytes(held.buffers[0]) == b"\1" * ns.block_bytes})


def test_a_socket_group_without_credentials_hands_out_arenas(users: HostUsers) -> None:
    """Engines of another user than the daemon's reach their arena (a memfd: a file of
    the daemon's user, 0600, they could not open), and the daemon warns that any user in
    the group may name any tenant."""
    daemon, alice = users.add("d"), users.add("a")
    with host_daemon(users, daemon, {}) as (endpoint, _, run):
        proc, conn = as_user(alice, _engine_without_credentials, endpoint)
        assert conn.poll(60), "the engine did not report"
        out = conn.recv()
        proc.join(30)
        assert "error" not in out, out
        assert out["arena"].startswith("memfd:") and out["read_back"]
        log = run.parent / "daemon.log"
        assert "may connect and name any tenant" in log.read_text()


def _grantee(conn: Connection, endpoint: str, a: dict[str, Any], marker: bytes) -> None:
    """Tenant B, granted A's namespaces to read: it reads A's blocks, through a mapping
    that cannot write, and can get no writable one."""
    out: dict[str, Any] = {}
    with Client(endpoint) as client:
        ns = client.namespace(IDENT_A)
        keys = ns.keys(range(64))
        with ns.acquire(keys) as held:
            out["read"] = all(marker in bytes(b) for b in held.buffers)
            out["view_readonly"] = all(b.readonly for b in held.buffers)
        side = side_path(endpoint)
        assert side is not None and client.hello is not None
        fd, size = fetch_arena(side, client.hello.session, a["arena"].removeprefix("memfd:"))
        try:
            out["handed_read_only"] = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            attempts = {}
            for name, attempt in (
                    ("mmap", lambda: mmap.mmap(fd, size, flags=mmap.MAP_SHARED)),
                    ("reopen", lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDWR))):
                try:
                    attempt()
                    attempts[name] = "allowed"
                except OSError as exc:
                    attempts[name] = type(exc).__name__
            out["attempts"] = attempts
        finally:
            os.close(fd)
        try:
            with ns.reserve(ns.keys(range(64, 96))) as r:
                r.commit()
            out["reserve"] = "allowed"
        except ForbiddenError as exc:
            out["reserve"] = str(exc)
        with ns.acquire(keys) as held:  # A's bytes as A wrote them
            out["still_read"] = all(marker in bytes(b) for b in held.buffers)
    conn.send(out)


def test_a_tenant_granted_to_read_maps_the_owners_arena_read_only(users: HostUsers) -> None:
    daemon, alice, bob = users.add("d"), users.add("a"), users.add("b")
    marker = os.urandom(8).hex().encode() + b"-acme-shared-"
    with host_daemon(users, daemon, {alice.name: "acme", bob.name: "globex"},
                     '[auth.shared_tenants]\nacme = ["globex"]\n') as (endpoint, _, run):
        proc_a, conn_a = as_user(alice, _engine_a, endpoint, marker)
        assert conn_a.poll(60), "engine A did not report"
        a = conn_a.recv()
        assert "error" not in a and a["read_back"], a
        proc_b, conn_b = as_user(bob, _grantee, endpoint, a, marker)
        assert conn_b.poll(120), "engine B did not report"
        b = conn_b.recv()
        conn_a.send("done")
        proc_a.join(30)
        proc_b.join(30)
        assert "error" not in b, b
        assert b["read"] and b["view_readonly"] and b["handed_read_only"]
        assert b["attempts"] == {"mmap": "PermissionError", "reopen": "PermissionError"}
        assert "may read the namespaces of tenant 'acme'" in b["reserve"]
        assert b["still_read"]
