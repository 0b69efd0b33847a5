"""A new user's first steps, taken from the README alone, against real daemon processes:
where the daemon or the client did otherwise than the README says, the case that showed
it.

- ``[ssd] path = "~/..."``, as the README's configuration example writes it, made a
  directory named ``~`` in the daemon's working directory and kept the tier there.
- The README's client code named ``token_ids``, ``blocks`` and ``n`` and defined none:
  pasted as it stands, it stopped at a NameError.
- A misspelt ``KVSTORE_<SECTION>_<FIELD>`` variable (``KVSTORE_DRAM_CAPACTY``) was
  ignored without a word, where a misspelt key in the file is refused and named.
- A client (or ``kvstore ping``) whose daemon is not there said only "no reply from the
  daemon at ... within 30.0s": not whether a socket was there, nor what to do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore import AsyncClient, Client
from kvstore.errors import UnavailableError

README = Path(__file__).resolve().parents[2] / "README.md"
WHAT_TO_DO = "Start one (kvstore serve), or name its endpoint"


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


def test_a_client_whose_daemon_is_not_there_says_what_to_do(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'kvstore.sock'}"
    with pytest.raises(UnavailableError) as caught:
        Client(endpoint, tenant="acme", timeout=0.5)
    assert "(no socket file)" in str(caught.value) and WHAT_TO_DO in str(caught.value)

    async def connect() -> None:
        async with AsyncClient(endpoint, tenant="acme", timeout=0.5):
            pass
    with pytest.raises(UnavailableError) as caught:
        asyncio.run(connect())
    assert WHAT_TO_DO in str(caught.value), caught.value
    ping = subprocess.run([sys.executable, "-m", "kvstore", "ping", "--endpoint", endpoint],
                          capture_output=True, text=True, timeout=60)
    assert ping.returncode != 0 and WHAT_TO_DO in ping.stderr, ping.stderr


def test_a_daemon_that_went_quiet_gets_no_such_hint(daemon_factory: Any) -> None:
    """The hint is for a daemon never heard from: one that answered and then stopped
    is named as before."""
    d = daemon_factory()
    client = Client(d.endpoint, tenant="acme")  # (its hello with the usual timeout)
    try:
        client.timeout = 0.5
        d.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(UnavailableError) as caught:
                client.ping()
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert WHAT_TO_DO not in str(caught.value), caught.value
    finally:
        client.close()


def test_the_readmes_client_code_runs_as_it_stands(daemon_factory: Any,
                                                   tmp_path: Path) -> None:
    text = README.read_text()
    section = text[text.index("## Using it from Python"):]
    code = section[section.index("```python\n") + 10:section.index("\n```\n")]
    script = tmp_path / "first.py"
    script.write_text(code + "\nprint('blocks', [len(b) for b in data])\n")
    d = daemon_factory()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
           "KVSTORE_ENDPOINT": d.endpoint}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "blocks " + str([2 * 32 * 8 * 128 * 2 * 16] * 6), run.stdout


def test_a_misspelt_setting_in_the_environment_is_named(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
           "KVSTORE_DRAM_CAPACTY": "64MiB", "KVSTORE_DRAM_DIRECTORY": str(tmp_path)}
    for args in (["config", "show"],
                 ["serve", "--endpoint", f"ipc://{tmp_path / 's.sock'}", "--ssd-capacity", "0",
                  "--dram-capacity", "16MiB"]):
        run = subprocess.run([sys.executable, "-m", "kvstore", *args], env=env,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, run.stdout + run.stderr
        assert run.stderr.strip() == ("kvstore: configuration error: KVSTORE_DRAM_CAPACTY: "
                                      "[dram] has no such field"), run.stderr
    assert list(tmp_path.iterdir()) == []                   # no arena, no socket
