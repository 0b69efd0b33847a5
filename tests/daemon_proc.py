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
import resource
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

    def run_through(self, wrapper: Path) -> DaemonProcess:
        """Run the daemon through ``wrapper``, a script that patches kvstore (a stalled
        disk, a slow copy) and then runs its command line, instead of ``-m kvstore``."""
        assert self.args[1:3] == ["-m", "kvstore"], self.args[:3]
        self.args[1:3] = [str(wrapper)]
        return self

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


def refused_under_file_size_limit(d: DaemonProcess, limit: int) -> str:
    """Start ``d`` under a file size limit of ``limit`` bytes (``ulimit -f``: the
    daemon inherits it) and return why it exited early; the limit is put back."""
    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(RuntimeError, match="exited early") as failed:
            d.start()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        d.stop()
    return str(failed.value)


def check_invariants_from_now(d: DaemonProcess, config: Path, client: Any) -> None:
    """Turn on the invariant check of a daemon started with ``--config config`` holding
    ``debug_invariants = false`` (and ``debug_invariants=False``), by SIGHUP (the rest
    of the file kept), and wait until one full check of the store as it is has ended
    and found nothing wrong.  For a test whose store grows to thousands of blocks: the
    check walks every block after each request, and run all along it takes a core from
    the daemon and the clients.  A small store is checked inline after each request (the
    stats read here); a larger one in a forked child, one at a time: the second forked
    once the first reported checks the state the requests left."""
    text = config.read_text()
    assert "debug_invariants = false" in text, text
    config.write_text(text.replace("debug_invariants = false", "debug_invariants = true"))
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while not client.stats()["settings"]["server.debug_invariants"]:
        assert time.monotonic() < deadline, "the reload did not turn the check on"
        time.sleep(0.05)
    forked = client.stats()["invariant_checks_forked"]  # (a check after this request)
    if client.stats()["invariant_checks_forked"] > forked:
        while client.stats()["invariant_checks_forked"] < forked + 2:
            assert time.monotonic() < deadline, "the invariant check did not run"
            time.sleep(0.05)
    assert client.stats()["invariant_violations"] == 0, "the invariant check failed"


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


def _process_state() -> tuple[Any, ...]:
    """What a forked daemon takes from its server, not from the test that starts it, and
    a started one from the test: the umask, the resource limits, the nice value, the CPU
    affinity, the blocked signals (tests set a umask or a low open-files limit around a
    start, and check what the daemon makes of it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    limits = tuple(resource.getrlimit(getattr(resource, name)) for name in _LIMITS
                   if hasattr(resource, name))
    return (umask, limits, os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0),
            signal.pthread_sigmask(signal.SIG_BLOCK, []))


_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_DATA", "RLIMIT_STACK",
           "RLIMIT_CORE", "RLIMIT_MEMLOCK", "RLIMIT_NPROC", "RLIMIT_CPU")
# The session's as it began (this module is imported as tests are collected): the
# server is started only under them, and a daemon is forked only under them too, so
# that a test that changed one (or an environment variable other than KVSTORE_*) for
# its own daemon neither fixes it for the session's nor is forked without it.
_BASELINE = (_process_state(), {k: v for k, v in os.environ.items()
                                 if k != "KVSTORE_ENDPOINT"})
_server: list[ForkServer | None] = []  # the session's daemon fork server, once started
_server_lock = threading.Lock()


def _start(args: list[str], env: dict[str, str], log: Any) -> Any:
    """``args`` (``python -m kvstore serve ...``) with stdout a pipe and stderr ``log``:
    forked from the session's server where ``env`` allows, else a ``subprocess.Popen``."""
    baseline = _process_state() == _BASELINE[0]
    # (the server starts under the session's baseline only: see ``_BASELINE``)
    server = _fork_server() if baseline else (_server[0] if _server else None)
    why = ("off" if server is None else
           "umask, resource limits or scheduling differ" if not baseline else
           why_afresh(args[1:], env, server.env))
    if server is not None and why:
        server.afresh[why] = server.afresh.get(why, 0) + 1
    if server is None or why:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=env)
    read, write = os.pipe()
    try:
        proc = server.spawn(args[1:], env, None, write, log.fileno())
    except (OSError, RuntimeError) as exc:  # the server died: the rest start afresh
        os.close(read)
        print(f"the daemon fork server failed ({exc!r}): daemons start afresh",
              file=sys.stderr)
        with _server_lock:
            _server[:] = [None]
        return _start(args, env, log)
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
            try:
                _server.append(ForkServer("kvstore-daemon", Path(sys.executable),
                                          dict(_BASELINE[1])))
            except Exception as exc:  # (any failure: not tried again each start)
                print(f"{exc}\n(daemons start afresh)", file=sys.stderr)
                _server.append(None)
            else:
                atexit.register(_close_server, os.getpid())
        return _server[0]


def _close_server(creator: int) -> None:
    server = _server[0] if _server else None
    if server is not None and os.getpid() == creator:  # (not in a forked child's exit)
        print(server.summary(), file=sys.stderr)
        server.close()
