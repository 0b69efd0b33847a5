"""The side socket and memfd arenas against the real daemon: descriptors only for a
session's own arenas, bad requests bounded, nothing left in /dev/shm after SIGKILL;
and the start-up refusals of the settings around them."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client
from kvstore.auth import Auth
from kvstore.config import load_config
from kvstore.errors import ConfigError, ForbiddenError, KVStoreError
from kvstore.side_socket import MAX_CONNECTIONS
from kvstore.tiers.arena_fds import (
    ArenaAsk,
    create_memfd,
    fetch_arena,
    frame,
    side_path,
    side_reply_decoder,
    unframe,
)


def memfd_daemon(daemon_factory: Any, tmp_path: Path) -> DaemonProcess:
    config = tmp_path / "memfd.toml"
    config.write_text('[dram]\narena_kind = "memfd"\nper_tenant_arenas = true\n')
    d: DaemonProcess = daemon_factory(dram_capacity="8MiB", extra=["--config", str(config)])
    return d


def ask_raw(path: str, data: bytes, wait: float = 10.0) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(wait)
        sock.connect(path)
        if data:
            sock.sendall(data)
        out = b""
        while chunk := sock.recv(4096):
            out += chunk
        return out


def test_an_arena_goes_only_to_a_session_of_its_tenant(daemon_factory: Any,
                                                      tmp_path: Path) -> None:
    d = memfd_daemon(daemon_factory, tmp_path)
    side = side_path(d.endpoint)
    assert side is not None and os.stat(side).st_mode & 0o777 == 0o600
    with Client(d.endpoint, tenant="acme") as a, Client(d.endpoint, tenant="globex") as b:
        assert a.hello is not None and b.hello is not None
        label = a.hello.arena_path.removeprefix("memfd:")
        assert label != a.hello.arena_path
        ns = a.namespace(make_identity(tenant="acme"))
        keys = ns.keys(range(32))
        with ns.reserve(keys) as r:
            r.buffers[0][:] = b"\5" * ns.block_bytes
            r.commit()
        fd, size = fetch_arena(side, a.hello.session, label)     # A's own: granted
        try:
            assert size == a.hello.arena_bytes
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
            assert not os.get_inheritable(fd)                    # close-on-exec
            with pytest.raises(OSError):
                os.ftruncate(fd, 4096)                           # sealed against shrinking
        finally:
            os.close(fd)
        for session in (b.hello.session, "0" * 32, ""):
            with pytest.raises(ForbiddenError, match="no such arena"):
                fetch_arena(side, session, label)
        with pytest.raises(ForbiddenError, match="no such arena"):
            fetch_arena(side, a.hello.session, "nonsense")


def test_bad_side_requests_are_bounded_and_the_daemon_keeps_serving(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = memfd_daemon(daemon_factory, tmp_path)
    side = side_path(d.endpoint)
    assert side is not None
    garbage = side_reply_decoder.decode(unframe(ask_raw(side, struct.pack(">I", 5) + b"\xc1" * 5))
                                        or b"")
    assert not garbage.ok and "bad request" in garbage.message
    oversize = side_reply_decoder.decode(unframe(ask_raw(side, struct.pack(">I", 1 << 20)))
                                         or b"")
    assert not oversize.ok and "limit" in oversize.message
    with ThreadPoolExecutor(2) as pool:  # (both wait out the same timer, side by side)
        start = time.monotonic()
        silent = pool.submit(ask_raw, side, b"", 15)
        half = pool.submit(ask_raw, side, frame(ArenaAsk("x", "y"))[:6], 15)
        assert silent.result() == b""                             # silent: closed on a timer
        assert time.monotonic() - start < 10
        assert half.result() == b""                               # half a request
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(32))
        with ns.reserve(keys) as r:
            r.buffers[0][:] = b"\6" * ns.block_bytes
            r.commit()
        with ns.acquire(keys) as held:
            assert bytes(held.buffers[0]) == b"\6" * ns.block_bytes
        counts = client.stats()["side_socket"]
        assert counts["dropped"] >= 4 and counts["arenas"] >= 1


def test_memfd_arenas_leave_nothing_behind_a_killed_daemon(daemon_factory: Any,
                                                           tmp_path: Path) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    d = memfd_daemon(daemon_factory, tmp_path)
    assert d.proc is not None
    client = Client(d.endpoint, tenant="acme")
    try:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(32))
        with ns.reserve(keys) as r:
            r.buffers[0][:] = b"\7" * ns.block_bytes
            r.commit()
        daemon_fds = [os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
                      for fd in os.listdir(f"/proc/{d.proc.pid}/fd")]
        assert any(target.startswith("/memfd:kvstore-arena") for target in daemon_fds)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        # its own arenas' names (its pid in them): other daemons may run beside it
        mine = [name for name in set(os.listdir("/dev/shm")) - shm_before
                if name.startswith(f"kvstore-{os.getuid()}-{d.proc.pid}-")]
        assert mine == []
        # the client's mapping holds the arena alive until it goes
        assert bytes(client._slots([r.offsets[0]], ns.block_bytes, True, ns.arena)[0]) == \
            b"\7" * ns.block_bytes
    finally:
        client.close()


def test_credentials_keep_tenants_in_arenas_of_their_own(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    auth = f'[auth]\nsecret_file = "{secret}"\n'
    path = tmp_path / "c.toml"
    path.write_text(auth)
    config = load_config(path, env={})
    assert config.tenant_arenas and config.memfd_arenas
    path.write_text(auth + '[gpu]\ndevice = "cpu"\n')
    with pytest.raises(ConfigError, match="dram.shared_arena_with_credentials"):
        load_config(path, env={})
    path.write_text(auth + '[gpu]\ndevice = "cpu"\n'
                    '[dram]\nshared_arena_with_credentials = true\n')
    allowed = load_config(path, env={})
    assert not allowed.tenant_arenas
    # an explicit shared arena with credentials: refused, unless allowed
    path.write_text(auth + '[dram]\nper_tenant_arenas = false\n')
    with pytest.raises(ConfigError, match="dram.shared_arena_with_credentials = true"):
        load_config(path, env={})
    path.write_text(auth + '[dram]\nper_tenant_arenas = false\n'
                    'shared_arena_with_credentials = true\n')
    assert not load_config(path, env={}).tenant_arenas
    for word, expected in (("false", False), ("true", True), ("auto", False)):
        env = {"KVSTORE_DRAM_PER_TENANT_ARENAS": word}
        assert load_config(None, env=env).tenant_arenas is expected
    path.write_text('[auth]\npeer_tenants = { "no-such-user-here" = "acme" }\n')
    with pytest.raises(ConfigError, match="no user named 'no-such-user-here'"):
        Auth(load_config(path, env={}))
    path.write_text('[dram]\narena_kind = "tmpfs"\n')
    with pytest.raises(ConfigError, match="dram.arena_kind"):
        load_config(path, env={})


def test_create_memfd_is_sealed_and_sized() -> None:
    fd = create_memfd(1 << 20)
    try:
        assert os.fstat(fd).st_size == 1 << 20
        for size in (4096, 2 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    finally:
        os.close(fd)


def test_tcp_clients_of_a_memfd_daemon_use_frames(daemon_factory: Any, tmp_path: Path) -> None:
    config = tmp_path / "memfd.toml"
    config.write_text('[dram]\narena_kind = "memfd"\n')
    d = daemon_factory(dram_capacity="8MiB", tcp=True, extra=["--config", str(config)])
    assert d.tcp_endpoint is not None
    with Client(d.tcp_endpoint, tenant="acme") as client:      # maps nothing at hello
        ns = client.namespace(make_identity())
        keys = ns.keys(range(32))
        ns.put(keys, [b"\4" * ns.block_bytes] * 2)
        assert ns.get(keys) == [b"\4" * ns.block_bytes] * 2
        with pytest.raises(KVStoreError, match="only over its ipc endpoint"):
            with ns.acquire(keys) as held:
                held.buffers


def test_silent_connections_do_not_lock_others_out(daemon_factory: Any,
                                                   tmp_path: Path) -> None:
    """More silent connections than the side socket holds: a new one closes the oldest
    of the uid holding the most, so a client that asks still gets its arena."""
    d = memfd_daemon(daemon_factory, tmp_path)
    side = side_path(d.endpoint)
    assert side is not None
    silent = []
    try:
        for _ in range(MAX_CONNECTIONS + 40):
            silent.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            silent[-1].connect(side)  # blocking: waits while the backlog is full
        time.sleep(0.5)  # the daemon has accepted them all
        with Client(d.endpoint, tenant="acme", timeout=10) as client:   # maps its arena
            ns = client.namespace(make_identity())
            keys = ns.keys(range(32))
            with ns.reserve(keys) as r:
                r.buffers[0][:] = b"\3" * ns.block_bytes
                r.commit()
            assert client.stats()["side_socket"]["dropped"] >= 40
    finally:
        for sock in silent:
            sock.close()


def test_descriptors_sent_to_the_side_socket_are_not_kept(daemon_factory: Any,
                                                          tmp_path: Path) -> None:
    """A peer that passes descriptors with its request leaves none open in the daemon."""
    d = memfd_daemon(daemon_factory, tmp_path)
    side = side_path(d.endpoint)
    assert side is not None and d.proc is not None
    fd_dir = f"/proc/{d.proc.pid}/fd"
    with Client(d.endpoint, tenant="acme") as client:
        assert client.hello is not None
        before = len(os.listdir(fd_dir))
        ours = [os.open(os.devnull, os.O_RDONLY) for _ in range(16)]
        try:
            for i in range(20):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(10)
                    sock.connect(side)
                    request = frame(ArenaAsk(client.hello.session, "nonsense"))
                    socket.send_fds(sock, [request[:3] if i % 2 else request], ours)
                    if not i % 2:
                        assert not side_reply_decoder.decode(unframe(sock.recv(4096))
                                                             or b"").ok
        finally:
            for fd in ours:
                os.close(fd)
        time.sleep(0.5)
        assert len(os.listdir(fd_dir)) <= before + 1
        assert client.stats()["side_socket"]["refused"] >= 10


def _memfd_fds_and_maps() -> tuple[list[int], int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:kvstore-arena"):
                fds.append(int(name))
        except OSError:
            pass  # the listing's own descriptor, gone
    maps = Path("/proc/self/maps").read_text().count("/memfd:kvstore-arena")
    return fds, maps


def test_a_client_holds_its_arenas_only_while_open(daemon_factory: Any,
                                                   tmp_path: Path) -> None:
    """Each mapping holds a descriptor (Python's mmap keeps a dup of the one it mapped),
    close-on-exec; the client's close unmaps them and closes them all."""
    d = memfd_daemon(daemon_factory, tmp_path)
    before = _memfd_fds_and_maps()
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity(tenant="acme"))
        with ns.reserve(ns.keys(range(32))) as r:
            r.buffers[0][:] = b"\1" * ns.block_bytes
            r.commit()
        fds, maps = _memfd_fds_and_maps()
        assert maps > before[1] and len(fds) > len(before[0])
        assert not any(os.get_inheritable(fd) for fd in fds)
    assert _memfd_fds_and_maps() == before
