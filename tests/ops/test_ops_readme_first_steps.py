"""A new user's first steps, taken from the README alone, against real daemon processes:
where the daemon or the client did otherwise than the README says, the case that showed
it.

- ``[ssd] path = "~/..."``, as the README's configuration example writes it, made a
  directory named ``~`` in the daemon's working directory and kept the tier there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def start_serving(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """``python -m kvstore serve ARGS``, read up to its "serving on" line."""
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "serving on" in line:
            return proc
    proc.wait(30)
    raise AssertionError(f"the daemon did not start: {proc.stderr.read() if proc.stderr else ''}")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_an_ssd_path_under_home_is_the_users_home(tmp_path: Path) -> None:
    home, cwd, shm = tmp_path / "home", tmp_path / "cwd", tmp_path / "shm"
    for d in (home, cwd, shm):
        d.mkdir()
    config = tmp_path / "kvstore.toml"
    config.write_text('[ssd]\npath = "~/kvstore/ssd"\ncapacity = "16MiB"\nslab_size = "4MiB"\n')
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
           "HOME": str(home), "KVSTORE_DRAM_DIRECTORY": str(shm)}
    shown = subprocess.run([sys.executable, "-m", "kvstore", "config", "show", str(config)],
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert f'path = "{home / "kvstore" / "ssd"}"' in shown.stdout, shown.stdout + shown.stderr
    proc = start_serving(["--config", str(config), "--endpoint", f"ipc://{tmp_path / 's.sock'}",
                          "--dram-capacity", "16MiB", "--slab-size", "4MiB",
                          "--log-level", "warning"], cwd=cwd, env=env)
    stop(proc)
    assert list(cwd.iterdir()) == []                       # no "~" made where it ran
    assert (home / "kvstore" / "ssd").is_dir()
    assert list((home / "kvstore" / "ssd").iterdir())      # the tier's files are there
