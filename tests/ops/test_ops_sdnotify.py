"""sd_notify against real AF_UNIX datagram sockets, as systemd listens."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.sdnotify import Notifier, notify, watchdog_interval


class Listener:
    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name  # what NOTIFY_SOCKET says

    @property
    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.name}

    def recv(self) -> bytes:
        return self.sock.recv(4096)

    def pending(self) -> list[bytes]:
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(4096))
        except BlockingIOError:
            return out
        finally:
            self.sock.setblocking(True)


def _listener(address: str, name: str) -> Listener:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return Listener(sock, name)


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    if request.param == "path":
        path = str(tmp_path / "notify")
        if len(path) >= 100:  # sun_path holds 108 bytes
            path = f"/tmp/kvstore-notify-{secrets.token_hex(6)}"
        lis = _listener(path, path)
    else:
        name = f"kvstore-test-{secrets.token_hex(8)}"
        lis = _listener("\0" + name, "@" + name)
    yield lis
    lis.sock.close()
    if request.param == "path" and os.path.exists(lis.name):
        os.unlink(lis.name)


def test_notify_sends_one_datagram(listener: Listener) -> None:
    assert notify("READY=1", listener.env)
    assert listener.recv() == b"READY=1"


def test_notifier_states_arrive(listener: Listener) -> None:
    n = Notifier(listener.env)
    assert n.enabled
    assert n.ready("serving on ipc:///run/kvstore/kvstore.sock")
    assert listener.recv() == b"READY=1\nSTATUS=serving on ipc:///run/kvstore/kvstore.sock"
    assert n.ready()
    assert listener.recv() == b"READY=1"
    assert n.status("draining 3 requests")
    assert listener.recv() == b"STATUS=draining 3 requests"
    assert n.watchdog()
    assert listener.recv() == b"WATCHDOG=1"
    assert n.stopping()
    assert listener.recv() == b"STOPPING=1"
    assert n.reloading()
    lines = listener.recv().decode().split("\n")
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=")
    assert int(lines[1].split("=")[1]) > 0


def test_notify_reads_os_environ_by_default(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", listener.name)
    assert notify("STATUS=from the environment")
    assert listener.recv() == b"STATUS=from the environment"


def test_notify_without_a_socket_is_a_no_op(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    assert notify("READY=1", {}) is False
    assert notify("READY=1", {"NOTIFY_SOCKET": ""}) is False
    assert notify("READY=1", {"NOTIFY_SOCKET": "relative/path"}) is False
    assert notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody")}) is False
    n = Notifier({})
    assert not n.enabled and n.ready() is False and n.watchdog() is False


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    pid = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "1000"}) == 0.0005
    assert watchdog_interval({"WATCHDOG_USEC": "30000000",
                              "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "-5"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "x"}) is None
    assert Notifier({"WATCHDOG_USEC": "8000000"}).watchdog_interval == 4.0


def test_watchdog_pings_from_the_loop_until_stopped(listener: Listener) -> None:
    n = Notifier({**listener.env, "WATCHDOG_USEC": "20000"})  # a ping every 10 ms
    healthy = True

    async def main() -> None:
        nonlocal healthy
        stop = n.start_watchdog(asyncio.get_running_loop(), lambda: healthy)
        await asyncio.sleep(0.2)
        assert len(listener.pending()) >= 3
        healthy = False
        await asyncio.sleep(0.05)
        listener.pending()
        await asyncio.sleep(0.1)
        assert listener.pending() == []  # unhealthy: no pings, systemd will act
        healthy = True
        await asyncio.sleep(0.1)
        assert set(listener.pending()) == {b"WATCHDOG=1"}
        stop()
        await asyncio.sleep(0.05)
        listener.pending()
        await asyncio.sleep(0.1)
        assert listener.pending() == []

    asyncio.run(main())


def test_watchdog_without_watchdog_usec_does_nothing(listener: Listener) -> None:
    async def main() -> None:
        stop = Notifier(listener.env).start_watchdog(asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        stop()

    asyncio.run(main())
    assert listener.pending() == []


def test_notify_never_blocks_on_a_listener_that_stopped_reading(listener: Listener) -> None:
    sent = [notify(f"STATUS={i}", listener.env) for i in range(5000)]
    assert sent[0] and not sent[-1]  # the queue filled and later states were dropped
    assert listener.recv() == b"STATUS=0"
