"""Test daemons forked from the session's server (``daemon_proc.py``) behave as daemons
started afresh: their own pid and session, signals and exit status, stdout a pipe that
ends with them, stderr appended to the log across restarts, ``KVSTORE_*`` variables
read in the daemon."""

from __future__ import annotations

import os
import signal
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
