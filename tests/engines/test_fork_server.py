"""The engine runs forked from a server that imported the engines' packages once
(fork_server.py) behave as ``python ARGS`` started afresh: arguments, directory,
environment, output, exit status, timeouts; runs it cannot stand in for start afresh."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from engine_envs import last_json, run_in_env


@pytest.fixture(autouse=True)
def fork_server_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are of the fork server: on even where the other engine tests run
    without it (``KVSTORE_TEST_FORK_SERVER=0``)."""
    monkeypatch.setenv("KVSTORE_TEST_FORK_SERVER", "1")

SCRIPT = """
import atexit, json, os, sys, threading, time
def late():
    time.sleep(0.5)
    print("thread joined", flush=True)
threading.Thread(target=late).start()
atexit.register(lambda: print("atexit ran", file=sys.stderr))
print(json.dumps({"preloaded": "torch" in sys.modules, "argv": sys.argv, "cwd": os.getcwd(),
                  "path0": sys.path[0], "name": __name__, "tenant": os.environ.get("KVSTORE_T"),
                  "session": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_script_runs_forked_as_it_would_afresh(tmp_path: Path) -> None:
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    proc = run_in_env("lmcache", [str(script), "3", "x y"], timeout=120, cwd=work,
                      check=False, KVSTORE_T="acme")
    assert proc.returncode == 3, proc.stderr
    first, joined = proc.stdout.splitlines()
    out = json.loads(first)
    assert out == {"preloaded": True, "argv": [str(script), "3", "x y"], "cwd": str(work),
                   "path0": str(script.parent), "name": "__main__", "tenant": "acme",
                   "session": True, "stdin": ""}
    assert joined == "thread joined"  # the interpreter's exit joins non-daemon threads
    assert proc.stderr.splitlines()[-2:] == ["to stderr", "atexit ran"]


def test_code_and_failures_exit_as_they_would_afresh() -> None:
    code = "import sys; print('torch' in sys.modules, sys.argv, __name__)"
    ok = run_in_env("lmcache", ["-c", code, "a"], timeout=120)
    assert ok.stdout == "True ['-c', 'a'] __main__\n" and ok.returncode == 0
    raised = run_in_env("lmcache", ["-c", "raise ValueError('boom')"], timeout=120,
                        check=False)
    assert raised.returncode == 1
    assert raised.stderr.rstrip().endswith("ValueError: boom"), raised.stderr
    said = run_in_env("lmcache", ["-c", "import sys; sys.exit('bad input')"], timeout=120,
                      check=False)
    assert (said.returncode, said.stderr) == (1, "bad input\n")
    killed = run_in_env("lmcache", ["-c", "import os; os.kill(os.getpid(), 9)"],
                        timeout=120, check=False)
    assert killed.returncode == -signal.SIGKILL


def test_a_run_past_its_time_is_killed_with_its_children(tmp_path: Path) -> None:
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(300)\n")
    with pytest.raises(pytest.fail.Exception, match="ran past 5s") as failed:
        run_in_env("lmcache", ["-c", code], timeout=5)
    child = int(str(failed.value).split("ran past 5s")[1].split()[0])
    for _ in range(100):
        if not _running(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the timed-out run's child {child} still runs")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_variable_read_at_import_runs_afresh() -> None:
    # torch takes its thread count at import: a forked run would keep the server's.
    code = ("import json, sys\npreloaded = 'torch' in sys.modules\nimport torch\n"
            "print(json.dumps([preloaded, torch.get_num_threads()]))")
    assert last_json(run_in_env("lmcache", ["-c", code], timeout=120,
                                OMP_NUM_THREADS="1").stdout) == [False, 1]


def test_the_escape_hatch_runs_every_run_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TEST_FORK_SERVER", "0")
    code = "import sys; print('torch' in sys.modules)"
    assert run_in_env("lmcache", ["-c", code], timeout=120).stdout == "False\n"
