"""Running code in the engines' test environments, which setup_envs.sh creates.

An engine's environment missing or broken fails its tests (never skips them): CI runs
``tests/engines/setup_envs.sh`` first, so a failure here means an engine install broke.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
try:
    from fork_server import ForkServer, why_afresh
except ModuleNotFoundError:  # imported as ``engines.engine_envs`` (a test outside engines/)
    from engines.fork_server import ForkServer, why_afresh

ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / ".engine-envs"
HERE = Path(__file__).resolve().parent


@functools.cache
def engine_python(name: str) -> Path:
    """The Python of engine ``name``'s environment, checked to import this checkout."""
    python = ENVS / name / "bin" / "python"
    if not (ENVS / name / ".kvstore-recipe").is_file() or not python.exists():
        pytest.fail(f"the {name} test environment is missing or half-built ({ENVS / name}); "
                    f"create it with: bash tests/engines/setup_envs.sh {name}", pytrace=False)
    found = subprocess.run([str(python), "-c", "import kvstore; print(kvstore.__file__)"],
                           check=False, capture_output=True, text=True, env=engine_env(),
                           timeout=60)
    expected = ROOT / "kvstore" / "__init__.py"
    if found.returncode != 0 or Path(found.stdout.strip()).resolve() != expected:
        pytest.fail(f"the {name} test environment does not import kvstore from this "
                    f"checkout ({found.stdout.strip() or found.stderr.strip()[-300:]}); "
                    f"rebuild it with: bash tests/engines/setup_envs.sh {name}", pytrace=False)
    return python


def engine_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSTORE_") and k not in ("PYTHONPATH", "PYTHONHOME")}
    # Nothing may come from the network: the tests make their own models and data.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", LMCACHE_TRACK_USAGE="false", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_in_env(name: str, args: list[str], *, timeout: float, cwd: Path | None = None,
               check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in engine ``name``'s environment; fail the test, with the
    output's tail, if it exits non-zero (when ``check``) or runs out of time."""
    command = [str(engine_python(name)), *args]
    run_env = engine_env(**env)
    server = fork_server(name)
    try:
        why = why_afresh(args, run_env, server.env) if server is not None else "off"
        if server is not None and not why:
            server.forked += 1
            proc = server.run(args, run_env, cwd, timeout)
        else:
            if server is not None:
                server.afresh[why] = server.afresh.get(why, 0) + 1
            proc = subprocess.run(command, check=False, capture_output=True, text=True,
                                  timeout=timeout, env=run_env, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name}: {' '.join(args[:2])} ran past {timeout}s\n"
                    f"{_tail(exc.stdout)}\n{_tail(exc.stderr)}", pytrace=False)
    if check and proc.returncode != 0:
        pytest.fail(f"{name}: {' '.join(args[:2])} exited {proc.returncode}\n"
                    f"--- stdout\n{_tail(proc.stdout)}\n--- stderr\n{_tail(proc.stderr)}",
                    pytrace=False)
    return proc


_servers: dict[str, ForkServer | None] = {}
_servers_lock = threading.Lock()


def fork_server(name: str) -> ForkServer | None:
    """Engine ``name``'s fork server (fork_server.py: the imports paid once a session),
    started at its first run; None when ``KVSTORE_TEST_FORK_SERVER=0`` turns them off, or
    when it did not start (its runs then start afresh, as before, and say what is wrong
    with the environment themselves)."""
    if os.environ.get("KVSTORE_TEST_FORK_SERVER", "1") == "0":
        return None
    with _servers_lock:  # two lanes' first runs start one server
        if name not in _servers:
            try:
                _servers[name] = ForkServer(name, engine_python(name), engine_env())
            except RuntimeError as exc:
                print(f"{exc}\n(its runs start afresh)", file=sys.stderr)
                _servers[name] = None
            if len(_servers) == 1:
                atexit.register(_close_servers)
        return _servers[name]


def _close_servers() -> None:
    while _servers:
        server = _servers.popitem()[1]
        if server is not None:
            print(server.summary(), file=sys.stderr)
            server.close()


def in_lanes(*lanes: Callable[[], None], workers: int = 2) -> None:
    """Run independent chains of engine runs side by side, ``workers`` at a time, each
    chain's runs in order; the first failure is raised once all have ended.  An engine
    run spends most of its time starting (imports, model load: one core, Python), and the
    test process only waits on it: two at a time keep CI's two cores busy."""
    with ThreadPoolExecutor(workers) as pool:
        running = [pool.submit(lane) for lane in lanes]
    for done in running:
        done.result()


def in_lanes_on(daemons: list[Any], *lanes: Callable[[], None], workers: int = 2) -> None:
    """``in_lanes``, then stop ``daemons`` (the list as it is then: a lane may add a
    restarted one), whatever the lanes did; none may have logged an invariant violation."""
    try:
        in_lanes(*lanes, workers=workers)
    finally:
        logs = []
        for d in daemons:
            d.stop()
            logs.append(d.log())
    for log in logs:
        assert "invariant violated" not in log, log


def run_spec(driver: str, tmp: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON result of the vLLM driver ``driver`` (a script beside this one) run on
    ``spec`` (written to ``tmp/NAME.json``), with a model of its own
    (``tmp/tiny-llama-NAME``: runs go side by side, and each writes its model on first
    use; the seeded weights are the same)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    argv = [str(HERE / driver), "--model", str(tmp / f"tiny-llama-{name}"), "--spec", str(path)]
    out: dict[str, Any] = last_json(run_in_env("vllm", argv, timeout=300, cwd=tmp).stdout)
    return out


def last_json(stdout: str) -> Any:
    """The JSON object on the last non-empty line of ``stdout``."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        pytest.fail("the engine run printed nothing", pytrace=False)
    return json.loads(lines[-1])


def _tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])
