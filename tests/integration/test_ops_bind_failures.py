"""A daemon that cannot bind an endpoint at start-up: one line naming the setting and
why, a non-zero exit, and nothing left behind (it printed zmq's traceback and left its
full-size arena file in the DRAM directory, its SSD tier open and its other sockets)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess

from kvstore import Client


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A tcp port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--dram-capacity", "16MiB",
         "--slab-size", "4MiB", "--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity",
         "16MiB", "--log-level", "warning", *args],
        capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if k != "KVSTORE_ENDPOINT"},
             "KVSTORE_DRAM_DIRECTORY": str(shm)})


def assert_refused_cleanly(tmp_path: Path, run: subprocess.CompletedProcess[str],
                           setting: str, why: str) -> None:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvstore: configuration error: {setting}: cannot bind "), last
    assert why in last, last
    assert list((tmp_path / "shm").iterdir()) == []          # no arena file left
    assert not (tmp_path / "kvstore.sock").exists()          # nor a bound socket's file


@pytest.mark.parametrize("where", ["endpoint", "extra_endpoint"])
def test_an_endpoint_in_use_is_a_config_error_and_leaves_nothing(
        tmp_path: Path, taken_port: int, where: str) -> None:
    taken = f"tcp://127.0.0.1:{taken_port}"
    if where == "endpoint":
        run = serve(tmp_path, "--endpoint", taken)
        setting = "server.endpoint"
    else:  # the ipc endpoint is bound first, then undone
        run = serve(tmp_path, "--endpoint", f"ipc://{tmp_path / 'kvstore.sock'}",
                    "--extra-endpoint", taken)
        setting = "server.extra_endpoints"
    assert_refused_cleanly(tmp_path, run, setting, "Address already in use")
    # the SSD tier was closed: a daemon on the same directory starts and serves
    DaemonProcess(tmp_path / "again", ssd_capacity="16MiB",
                  extra=["--ssd-path", str(tmp_path / "ssd")]).start().stop()


@pytest.mark.parametrize("endpoint, why", [
    ("ipc:///proc/kvstore-test.sock", "No such file or directory"),
    ("tcp://256.1.1.1:5", "No such device"),
    ("ipc://LONG", "File name too long"),
])
def test_an_endpoint_that_cannot_be_bound_is_a_config_error(
        tmp_path: Path, endpoint: str, why: str) -> None:
    if endpoint == "ipc://LONG":  # past sockaddr_un's 108 bytes
        endpoint = f"ipc://{tmp_path / ('a' * 120)}.sock"
    run = serve(tmp_path, "--endpoint", endpoint)
    assert_refused_cleanly(tmp_path, run, "server.endpoint", why)


def test_an_event_endpoint_in_use_is_a_config_error(tmp_path: Path,
                                                    taken_port: int) -> None:
    config = tmp_path / "events.toml"
    config.write_text(f'[events]\nendpoint = "tcp://127.0.0.1:{taken_port}"\n')
    run = serve(tmp_path, "--config", str(config),
                "--endpoint", f"ipc://{tmp_path / 'kvstore.sock'}")
    assert_refused_cleanly(tmp_path, run, "events.endpoint", "Address already in use")


def test_an_ipc_endpoint_another_daemon_serves_is_a_config_error(tmp_path: Path) -> None:
    """The README's "an endpoint in use": exit 2 and one line naming the setting (it was
    exit 1, "kvstore: another daemon is serving ...", unlike a tcp port in use)."""
    first = DaemonProcess(tmp_path / "first").start()
    try:
        run = serve(tmp_path, "--endpoint", first.endpoint)
        assert run.returncode == 2, run.stderr
        last = run.stderr.strip().splitlines()[-1]
        assert last == (f"kvstore: configuration error: server.endpoint: another daemon is "
                        f"serving {first.endpoint}"), last
        assert list((tmp_path / "shm").iterdir()) == []      # no arena file left
        with Client(first.endpoint, tenant="acme", timeout=10) as client:
            client.ping()                                    # the first still serves
    finally:
        first.stop()


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1",
                                      "tcp://[::1]"])
def test_a_tcp_endpoint_with_no_port_says_so(tmp_path: Path, endpoint: str) -> None:
    """Port 99999 was bound as 34463 (modulo 65536), where no client looks (or, taken,
    "Address already in use"); no port was "Invalid argument"."""
    run = serve(tmp_path, "--endpoint", endpoint)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"kvstore: configuration error: server.endpoint: {endpoint} has no port: give "
        "tcp://HOST:PORT, PORT 1 to 65535 (0 or * for any free one)"), run.stderr
    assert list((tmp_path / "shm").iterdir()) == []


def test_an_event_endpoint_with_no_port_says_so(tmp_path: Path) -> None:
    config = tmp_path / "events.toml"
    config.write_text('[events]\nendpoint = "tcp://127.0.0.1:70000"\n')
    run = serve(tmp_path, "--config", str(config),
                "--endpoint", f"ipc://{tmp_path / 'kvstore.sock'}")
    assert run.returncode == 2, run.stderr
    assert "events.endpoint: tcp://127.0.0.1:70000 has no port" in run.stderr, run.stderr
    assert list((tmp_path / "shm").iterdir()) == []
