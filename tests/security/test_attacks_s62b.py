"""A hostile local environment against the daemon's files (session 62, second round):
what is left at the paths the daemon serves from.  Real daemon processes."""

from __future__ import annotations

from pathlib import Path
import pytest
from daemon_proc import DaemonProcess

from kvstore import Client

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
