"""Start a real kvstore daemon process for tests, and stop it.

A start is mostly imports (0.36 of 0.45 s here, two thirds of them numpy, ZeroMQ,
prometheus_client and the standard library's), and the suite starts daemons by the
thousand: so a daemon is forked from a server that imported those once a session
(``engines/fork_server.py``, as the engine runs are; none of kvstore's own modules, so
its variables are read in the daemon as before), where its environment allows, and
started afresh otherwise.  ``KVSTORE_TEST_FORK_SERVER=0`` starts every one afresh.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

try:
    from engines.fork_server import ForkServer, why_afresh
except ModuleNotFoundError:  # (imported from tests/engines/, where it is a sibling)
    from fork_server import ForkServer, why_afresh  # type: ignore[no-redef]


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now, and none this process was handed before: the kernel may hand out
    a port just let go again, so a test that asks for two before its daemon binds them
    (a tcp endpoint and a metrics port) could get one port twice, and a daemon that
    cannot start.  (Another process may still take it before the daemon binds it.)"""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


class DaemonProcess:
    """``python -m kvstore serve`` with the given flags, waited on until it serves."""

    def __init__(self, workdir: Path, *, dram_capacity: str = "64MiB", lease: float = 30.0,
                 tcp: bool = False, extra: list[str] | None = None,
                 debug_invariants: bool = True, env: dict[str, str] | None = None,
                 ssd_capacity: str = "0") -> None:
        self.extra_env = env or {}
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.endpoint = f"ipc://{workdir / 'kvstore.sock'}"
        self.tcp_endpoint = f"tcp://127.0.0.1:{free_port()}" if tcp else None
        self.args = [sys.executable, "-m", "kvstore", "serve", "--endpoint", self.endpoint,
                     "--dram-capacity", dram_capacity, "--lease", str(lease),
                     "--ssd-capacity", ssd_capacity,
                     "--ssd-path", str(workdir / "ssd"), *(extra or [])]
        if self.tcp_endpoint:
            self.args += ["--extra-endpoint", self.tcp_endpoint]
        if "--log-level" not in self.args:
            self.args += ["--log-level", "warning"]
        if debug_invariants:
            self.args.append("--debug-invariants")
        self.log_path = workdir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        env = dict(os.environ)
        env.pop("KVSTORE_ENDPOINT", None)
        env.update(self.extra_env)
        self._log = open(self.log_path, "ab")
        self.proc = _start(self.args, env, self._log)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"daemon exited early: {self.log_path.read_text()}")
            if b"serving on" in line:
                return self
        raise RuntimeError("daemon did not come up in time")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()
        code = self.proc.returncode
        self.proc = None
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def error_records(log: str) -> list[str]:
    """The ERROR and CRITICAL records of a daemon log, each with its traceback."""
    records, current = [], ""
    for line in log.splitlines(keepends=True):
        if line[:4].isdigit() and current:
            records.append(current)
            current = ""
        current += line
    records.append(current)
    return [r for r in records if " ERROR " in r or " CRITICAL " in r or "Traceback" in r
            or "invariant violated" in r]


_server: list[ForkServer | None] = []  # the session's daemon fork server, once started
_server_lock = threading.Lock()


def _start(args: list[str], env: dict[str, str], log: Any) -> Any:
    """``args`` (``python -m kvstore serve ...``) with stdout a pipe and stderr ``log``:
    forked from the session's server where ``env`` allows, else a ``subprocess.Popen``."""
    server = _fork_server()
    why = why_afresh(args[1:], env, server.env) if server is not None else "off"
    if server is None or why:
        if server is not None:
            server.afresh[why] = server.afresh.get(why, 0) + 1
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=env)
    read, write = os.pipe()
    try:
        proc = server.spawn(args[1:], env, None, write, log.fileno())
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)  # (the daemon's copy is its stdout: the pipe ends with it)
    proc.stdout = os.fdopen(read, "rb")
    return proc


def _fork_server() -> ForkServer | None:
    if os.environ.get("KVSTORE_TEST_FORK_SERVER", "1") == "0":
        return None
    with _server_lock:  # (tests start daemons from threads too)
        if not _server:
            env = dict(os.environ)
            env.pop("KVSTORE_ENDPOINT", None)
            try:
                _server.append(ForkServer("kvstore-daemon", Path(sys.executable), env))
            except RuntimeError as exc:
                print(f"{exc}\n(daemons start afresh)", file=sys.stderr)
                _server.append(None)
            atexit.register(_close_server)
        return _server[0]


def _close_server() -> None:
    server = _server[0] if _server else None
    if server is not None:
        print(server.summary(), file=sys.stderr)
        server.close()
