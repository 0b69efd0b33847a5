"""The directories the daemon keeps its files in are no other user's to change: an SSD
tier directory (its index and data file) or a DRAM directory of arena files (clients
map them by their path) writable by others without the sticky bit let another user put
files of its own in their place, served to every tenant as cached blocks.  The daemon
refuses to start there, saying which directory and why, as it refuses such a directory
for its sockets; a sticky one (as /tmp and /dev/shm are) is taken."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint",
         f"ipc://{tmp_path}/kvstore.sock", "--log-level", "warning", *args],
        capture_output=True, text=True, timeout=60)


def shared(tmp_path: Path, mode: int) -> Path:
    folder = tmp_path / f"shared-{mode:o}"
    folder.mkdir()
    os.chmod(folder, mode)
    return folder


@pytest.mark.parametrize("below", [False, True])
def test_an_ssd_directory_others_may_write_in_is_refused(tmp_path: Path, below: bool) -> None:
    folder = shared(tmp_path, 0o777)
    path = folder / "ssd" if below else folder  # the directory, or one above it
    r = serve(tmp_path, "--ssd-capacity", "16MiB", "--ssd-path", str(path))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"{folder}, where the SSD tier keeps its files, is writable by others" in r.stderr
    assert list(folder.iterdir()) == []  # nothing made there


def test_a_dram_directory_others_may_write_in_is_refused_for_file_arenas(
        tmp_path: Path) -> None:
    folder = shared(tmp_path, 0o777)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[dram]\ndirectory = "{folder}"\narena_kind = "file"\n')
    r = serve(tmp_path, "--config", str(config), "--ssd-capacity", "0")
    assert r.returncode == 2, r.stderr
    assert f"{folder}, where dram.directory keeps the arena files clients map" in r.stderr
    assert list(folder.iterdir()) == []  # no arena file made there


def test_sticky_shared_directories_are_taken(tmp_path: Path) -> None:
    folder = shared(tmp_path, 0o1777)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[dram]\ndirectory = "{folder}"\narena_kind = "file"\n')
    d = DaemonProcess(tmp_path / "d", extra=["--config", str(config), "--ssd-path",
                                             str(folder / "ssd")], ssd_capacity="16MiB")
    d.start()
    try:
        assert d.alive()
    finally:
        d.stop()
