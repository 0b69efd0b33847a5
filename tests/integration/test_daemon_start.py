"""Test daemons forked from the session's server (``daemon_proc.py``) behave as daemons
started afresh: their own pid and session, signals and exit status, stdout a pipe that
ends with them, stderr appended to the log across restarts, ``KVSTORE_*`` variables
read in the daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess

from kvstore import Client


def test_a_forked_daemon_serves_stops_and_dies_as_one_started_afresh(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", env={"KVSTORE_SERVER_MAX_KEYS_PER_REQUEST": "777"})
    d.start()
    try:
        assert d.proc is not None and not hasattr(d.proc, "communicate"), "not forked"
        pid = d.proc.pid
        assert os.getsid(pid) == pid  # a session of its own, as the server's runs are
        with Client(d.endpoint, tenant="t") as c:
            assert c.hello is not None and c.hello.max_keys == 777  # read in the daemon
        assert d.stop() == 0
        with open(d.log_path, "a") as log:
            log.write("-- marker between two starts --\n")
        d.start()  # a restart appends to the same log
        assert d.proc is not None and d.proc.pid != pid
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        d.start()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0 and d.proc.poll() == 0
        assert b"dram tier" in d.proc.stdout.read()  # the rest, to the end: the pipe ended
    finally:
        d.stop()
    assert "-- marker between two starts --" in d.log()  # (not truncated by a start)


def test_a_daemon_whose_environment_differs_starts_afresh(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TEST_PROBE_ONLY", "1")  # (read when used: still forked)
    d = DaemonProcess(tmp_path / "d", env={"OMP_NUM_THREADS": "1"})
    d.start()
    try:
        assert d.proc is not None and hasattr(d.proc, "communicate")  # a Popen: afresh
    finally:
        assert d.stop() == 0


def test_a_daemon_started_under_another_umask_starts_afresh(tmp_path: Path) -> None:
    # (a forked daemon has its server's umask and limits, not the test's: a test that
    # sets them around a start checks what the daemon makes of them)
    old = os.umask(0o027)
    try:
        d = DaemonProcess(tmp_path / "d")
        d.start()
    finally:
        os.umask(old)
    try:
        assert d.proc is not None and hasattr(d.proc, "communicate")
    finally:
        assert d.stop() == 0


def _parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no parent of {pid}")


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_daemon_whose_manager_died_is_killed_not_left_running(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    d.start()
    assert d.proc is not None and not hasattr(d.proc, "communicate")
    pid = d.proc.pid
    os.kill(_parent(pid), signal.SIGKILL)  # the process that forked and waits for it
    assert d.proc.wait(15) == -signal.SIGKILL
    assert _gone(pid, 15)  # (not serving on unseen, holding its endpoint and arena)
    d.stop()


def test_a_daemon_whose_test_session_died_is_stopped(tmp_path: Path) -> None:
    # A test session killed outright: its daemons were children in its process group;
    # forked ones are stopped by their managers once the session's end closes their
    # connections.
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]);"
            "from daemon_proc import DaemonProcess; from pathlib import Path;"
            "d = DaemonProcess(Path(sys.argv[2])).start();"
            "print(d.proc.pid, hasattr(d.proc, 'communicate'), flush=True); os._exit(0)")
    run = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parents[1]),
                          str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
    pid, afresh = run.stdout.split()
    assert afresh == "False", run.stderr
    assert _gone(int(pid), 20), "the daemon outlived its test session"
