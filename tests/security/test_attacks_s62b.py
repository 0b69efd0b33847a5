"""A hostile local environment (session 62, second round): what is left at the paths
the daemon serves from (real daemon processes), and what answers at the socket path a
``kvstore`` command is pointed at."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_proc import DaemonProcess

from kvstore import Client
from kvstore import protocol as p
from kvstore.cli import main

MEMFD = '[dram]\narena_kind = "memfd"\nper_tenant_arenas = true\n'


def side_daemon(tmp_path: Path) -> DaemonProcess:
    """A daemon, not yet started, that serves a side socket (memfd arenas)."""
    config = tmp_path / "memfd.toml"
    config.write_text(MEMFD)
    return DaemonProcess(tmp_path / "d", dram_capacity="8MiB", extra=["--config", str(config)])


def test_a_directory_at_the_side_socket_path_is_refused_by_name(tmp_path: Path) -> None:
    # A directory where the side socket goes (``<socket path>.fd``) killed the daemon at
    # start with an IsADirectoryError traceback: its removal of a stale socket file was
    # made outside the error handling of the bind.  It is refused with the path and why.
    d = side_daemon(tmp_path)
    (d.workdir / "kvstore.sock.fd").mkdir()
    try:
        with pytest.raises(RuntimeError) as refused:
            d.start()
        text = str(refused.value)
        assert "Traceback" not in text, text
        assert "cannot serve the side socket" in text and "kvstore.sock.fd" in text, text
        assert "Is a directory" in text, text
        assert d.proc is not None and d.proc.wait(10) == 1
    finally:
        d.stop()


def test_a_dangling_link_at_the_side_socket_path_is_replaced(tmp_path: Path) -> None:
    # A link to nowhere left where the side socket goes was taken for no file (it was
    # checked with ``exists``, which follows links), and the bind then failed with
    # "Address already in use", naming no link: the daemon would not start.  It is
    # removed as a stale socket file is, and the daemon serves.
    d = side_daemon(tmp_path)
    side = d.workdir / "kvstore.sock.fd"
    side.symlink_to(tmp_path / "nowhere")
    try:
        d.start()
        with Client(d.endpoint, tenant="acme") as client:
            client.ping()
        assert side.is_socket() and not (tmp_path / "nowhere").exists()
    finally:
        d.stop()



def start_or_hang(d: DaemonProcess, seconds: float = 20.0) -> str:
    """"started", "refused: <why>", or "hung" (the daemon killed after ``seconds``)."""
    outcome: list[str] = []

    def start() -> None:
        try:
            d.start(timeout=seconds)
            outcome.append("started")
        except RuntimeError as exc:
            outcome.append(f"refused: {exc}")

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():   # (its start blocks on the daemon's output: kill it to end)
        assert d.proc is not None
        d.proc.kill()
        thread.join(10)
        return "hung"
    return outcome[0]


def test_a_fifo_for_the_ssd_index_is_refused_not_waited_on(tmp_path: Path) -> None:
    # A FIFO where the SSD index's data file goes (data.mdb) held the daemon's start for
    # ever, with nothing logged: the check for an index cut short opened it to read,
    # which waits for a writer that never comes.  It is refused, saying what to delete.
    d = DaemonProcess(tmp_path / "d", ssd_capacity="16MiB", extra=["--slab-size", "1MiB"])
    index = d.workdir / "ssd" / "index"
    index.mkdir(parents=True, mode=0o700)
    os.chmod(index.parent, 0o700)
    os.mkfifo(index / "data.mdb")
    try:
        outcome = start_or_hang(d)
        assert outcome.startswith("refused"), outcome
        assert "Traceback" not in outcome and "data.mdb" in outcome, outcome
        assert "delete it to start the tier cold" in outcome, outcome
    finally:
        d.stop()

class FakeDaemon:
    """A ROUTER at ``endpoint`` that takes any hello and answers stats with ``stats``:
    what a ``kvstore`` command meets at a socket path that no daemon of its own holds."""

    def __init__(self, endpoint: str, stats: dict[str, Any], error: str = "") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.stats = stats
        self.error = error  # if given, every request is refused with this message
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            if not self.sock.poll(50):
                continue
            peer, header, *_ = self.sock.recv_multipart()
            req = p.request_decoder.decode(header)
            reply: p.Message
            if self.error:
                reply = p.ErrorReply(req.rid, "forbidden", self.error)
            elif isinstance(req, p.Hello):
                reply = p.HelloReply(req.rid, p.PROTOCOL_VERSION, "s" * 32, req.tenant, "",
                                     0, 30.0, 1024, 1 << 20)
            elif isinstance(req, p.Stats):
                reply = p.StatsReply(req.rid, self.stats)
            else:
                continue
            self.sock.send_multipart([peer, p.encoder.encode(reply)])

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


@pytest.mark.parametrize("stats", [
    {"tiers": 5},
    {"tiers": {}},
    {"tiers": {"dram": {"capacity": "x"}}, "sessions": 0, "namespaces": 0,
     "invariant_violations": 0},
    {"tenant_dram_bytes": [1, 2]},
], ids=["tiers-a-number", "no-sessions", "capacity-a-string", "tenant-bytes-a-list"])
def test_stats_of_another_shape_are_a_clear_error_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], stats: dict[str, Any]) -> None:
    # ``kvstore stats`` pointed at whatever answers at a socket path (a daemon of
    # another version, or a hostile one) died with a KeyError, TypeError or
    # AttributeError traceback when the figures were not of the shape it draws.
    endpoint = f"ipc://{tmp_path / 'fake.sock'}"
    fake = FakeDaemon(endpoint, stats)
    try:
        code = main(["stats", "--endpoint", endpoint, "--timeout", "5"])
    finally:
        fake.close()
    err = capsys.readouterr().err
    assert code == 1, err
    assert "do not have the shape" in err and "--json" in err, err


def test_stats_names_cannot_drive_the_terminal(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # A tier named with escape sequences went to the terminal as it came: an endpoint's
    # figures could retitle the terminal, clear it or move the cursor over what was shown.
    endpoint = f"ipc://{tmp_path / 'fake.sock'}"
    fake = FakeDaemon(endpoint, {"tiers": {"\x1b]0;pwned\x07\x1b[2J": {"capacity": 1}},
                                 "sessions": 0, "namespaces": 0, "invariant_violations": 0})
    try:
        assert main(["stats", "--endpoint", endpoint, "--timeout", "5"]) == 0
    finally:
        fake.close()
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    assert "\\x1b]0;pwned\\x07" in out, repr(out)


@pytest.mark.parametrize("verb", ["ping", "stats"])
def test_an_endpoints_error_message_cannot_drive_the_terminal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str) -> None:
    # An error's message comes from the endpoint, and was printed as it came.
    endpoint = f"ipc://{tmp_path / 'fake.sock'}"
    fake = FakeDaemon(endpoint, {}, error="\x1b]0;pwned\x07\x1b[2Jgo away")
    try:
        assert main([verb, "--endpoint", endpoint, "--timeout", "5"]) == 1
    finally:
        fake.close()
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err, repr(err)
    assert "go away" in err, err
