"""The directory an ipc socket is bound in must not be another user's to change: one
that another user made first (``/tmp/kvstore-<uid>`` when there is no
``$XDG_RUNTIME_DIR``), a symbolic link, or one writable by others without the sticky bit
let that user move the daemon's socket aside, bind one of its own, and read the next
client's hello with its tenant and token.  The daemon refuses to start there, and says
why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess

from kvstore import Client
from kvstore.errors import ConfigError


def serve(endpoint_dir: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``kvstore serve`` with its socket in ``endpoint_dir``, run to its exit (60 s at most)."""
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", *extra,
         "--endpoint", f"ipc://{endpoint_dir / 'kvstore.sock'}", "--dram-capacity", "8MiB",
         "--ssd-capacity", "0", "--ssd-path", str(tmp_path / "ssd")],
        capture_output=True, text=True, timeout=60)


def serves_in(workdir: Path, bound_in: Path) -> None:
    """A daemon started in ``workdir`` serves, its socket bound in ``bound_in``."""
    daemon = DaemonProcess(workdir).start()
    try:
        assert daemon.alive() and (bound_in / "kvstore.sock").exists()
    finally:
        daemon.stop()


def test_a_socket_directory_others_may_change_is_refused(tmp_path: Path) -> None:
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)  # (as another user's mkdir under a umask of 0 leaves it)
    run = serve(open_to_all, tmp_path)
    assert run.returncode == 2, run.stderr
    assert "writable by others" in run.stderr and "mode 777" in run.stderr, run.stderr
    assert not (open_to_all / "kvstore.sock").exists()

    # a folder above it others may change: they rename the socket's folder away
    inner = open_to_all / "kv"
    inner.mkdir(mode=0o700)
    run = serve(inner, tmp_path)
    assert run.returncode == 2, run.stderr
    assert f"{open_to_all}, where the socket" in run.stderr, run.stderr
    assert not (inner / "kvstore.sock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_socket_directory_or_link_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # nobody's
    tmp_path.chmod(0o755)
    run = serve(theirs, tmp_path)
    assert run.returncode == 2, run.stderr
    assert "belongs to uid 65534" in run.stderr, run.stderr
    # a link they own may be pointed elsewhere at any time; one of the daemon's may not
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "their-link"
    link.symlink_to(target)
    os.lchown(link, 65534, 65534)
    run = serve(link, tmp_path)
    assert run.returncode == 2 and "is a link of another user's" in run.stderr, run.stderr
    assert not (target / "kvstore.sock").exists()


def test_a_link_of_the_daemons_own_is_followed(tmp_path: Path) -> None:
    # (as /var/run, root's link to /run): its target and the folders above it are checked
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    serves_in(link, target)


def test_a_shared_sticky_directory_is_taken(tmp_path: Path) -> None:
    # as /tmp: others may write there, but not move or remove what the daemon binds
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    serves_in(sticky, sticky)


def test_an_event_socket_in_a_directory_others_may_change_is_refused(tmp_path: Path) -> None:
    # a subscriber's ticket and the stream itself go through the event sockets
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[events]\nendpoint = "ipc://{open_to_all / "events.sock"}"\n')
    run = serve(tmp_path, tmp_path, "--config", str(config))
    assert run.returncode == 2 and "writable by others" in run.stderr, run.stderr
    assert not (open_to_all / "events.sock").exists()


def test_a_client_of_the_default_endpoint_checks_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the default endpoint's directory is this user's (by its uid): one that others may
    # change could hold another user's socket, which would read the client's hello
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    (runtime / "kvstore").mkdir()
    (runtime / "kvstore").chmod(0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("KVSTORE_ENDPOINT", raising=False)
    with pytest.raises(ConfigError, match="writable by others"):
        Client(tenant="acme", timeout=1)
