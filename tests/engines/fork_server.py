"""A fork server per engine test environment: the engines' imports paid once a session.

Why: most of an engine run's wall time is third-party imports, not the run (``from vllm
import LLM`` alone is torch and its compiler packages: 43 s wall, 12 s CPU on a loaded
two-core CI machine), and every one of the dozens of engine runs paid them again.  So
``run_in_env`` (engine_envs.py) hands a run to a long-lived process of the environment's
own Python, started at the first run and ended with the test session, which imported
the heavy modules once (``PRELOAD``) and forks a child per run.  The child does what a
fresh ``python ARGS`` would: the request's environment, working directory, ``sys.argv``
and ``sys.path[0]``, stdin from /dev/null, stdout and stderr to files the caller reads,
then the script (``runpy``, or ``-c CODE``, ``-m MODULE``); its exit status is the
script's (``SystemExit`` honoured, an uncaught exception 1 with its traceback, a signal
``-N``), and it ends as an interpreter does: non-daemon threads joined, ``atexit`` run.

Fork safety: after the imports the server runs one Python thread; the only other threads
are OpenBLAS's idle thread servers (numpy's, and opencv's which vLLM's kv_transfer
imports), which OpenBLAS stops before a fork and starts again in the child
(``pthread_atfork``); torch's OpenMP pool starts at the first parallel operation, in
the child.  The server imports no kvstore module (it refuses to start if a preload
did), so every ``KVSTORE_*`` variable is read in the child as before.  Any other
variable may be read at import: ``OMP_NUM_THREADS`` is (by torch: a child given 1 still
runs torch on the server's count), and so are vLLM's logging ones.  So a run whose
environment differs from the server's elsewhere than in ``READ_AT_USE_PREFIXES`` runs
as a plain subprocess, as do arguments other than ``SCRIPT``, ``-c CODE`` and ``-m
MODULE``; the session's end says how many did, and why.  ``KVSTORE_TEST_FORK_SERVER=0``
runs every engine run as a plain subprocess.

Protocol, over a unix socket, one connection per run (runs go side by side): the client
sends one JSON line (args, env, cwd, stdout and stderr paths); the server forks a
manager for the connection, which forks the run, answers ``{"pid": N}`` and, once the
run ended, ``{"returncode": N}``.  The client kills the run's process group (the run
leads one) when it runs out of time.  The server ends when its stdin closes (the test
session ended or died).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

# What each environment's runs import at top level, and the slow part of engine start.
PRELOAD = {
    "vllm": ["torch", "numpy", "msgspec", "safetensors.torch", "vllm", "vllm.config",
             "vllm.entrypoints.llm", "vllm.sampling_params", "vllm.lora.request",
             "vllm.distributed.kv_transfer", "vllm.distributed.kv_events",
             "vllm.v1.kv_cache_interface", "vllm.v1.engine.llm_engine",
             "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
             "vllm.v1.sample.ops.penalties", "vllm.model_executor.models.llama"],
    "sglang": ["torch", "numpy", "sglang.srt.mem_cache.hicache_storage",
               "sglang.srt.mem_cache.storage.backend_factory", "sglang.srt.mem_cache.utils"],
    "lmcache": ["torch", "numpy", "lmcache.cli.commands.bench.l2_adapter_bench.data",
                "lmcache.v1.memory_management"],
    # the daemon's (``daemon_proc.py``): its third-party and standard-library imports,
    # two thirds of a start (0.25 of 0.36 s), none of kvstore's own
    "kvstore-daemon": ["numpy", "zmq", "zmq.asyncio", "msgspec", "msgspec.msgpack",
                       "msgspec.json", "uvloop", "lmdb", "xxhash", "prometheus_client",
                       "prometheus_client.exposition", "http.server", "asyncio",
                       "concurrent.futures", "ssl", "argparse", "tomllib", "uuid", "json",
                       "csv", "gzip", "ctypes", "decimal", "tempfile", "subprocess",
                       "hmac", "secrets", "typing_extensions", "socketserver",
                       "wsgiref.simple_server", "email.utils", "mmap", "resource"],
}
# Variables a run may set differently from the server: read when used, not at import
# (pytest names the running test in one).
READ_AT_USE_PREFIXES = ("KVSTORE_", "PYTEST_CURRENT_TEST")
START_TIMEOUT_S = 600.0
_GRACE_S = 5.0  # a run whose caller went: from SIGTERM to SIGKILL


def why_afresh(args: list[str], env: dict[str, str], server_env: dict[str, str]) -> str:
    """Why ``python ARGS`` under ``env`` must start afresh rather than be forked from a
    server started under ``server_env`` ('' when it may be forked)."""
    if not args or (args[0].startswith("-") and args[0] not in ("-c", "-m")):
        return f"python option {args[:1]}"
    differ = sorted(k for k in env.keys() | server_env.keys()
                    if env.get(k) != server_env.get(k) and not k.startswith(READ_AT_USE_PREFIXES))
    return f"environment differs in {', '.join(differ)}" if differ else ""


class ForkServer:
    """The client side: one server process of engine ``name``'s ``python``."""

    def __init__(self, name: str, python: Path, env: dict[str, str]) -> None:
        self.name, self.python, self.env = name, python, env
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvstore-fork-{name}-"))
        self.socket_path = self.dir / "server.sock"
        self.log = self.dir / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(python), __file__, str(self.socket_path), *PRELOAD.get(name, [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline() if _readable(self.proc.stdout.fileno(),
                                                        START_TIMEOUT_S) else b""
        if not line.startswith(b"{"):
            self.close()
            raise RuntimeError(f"the {name} fork server did not start: "
                               f"{self.log.read_text(errors='replace')[-3000:]}")
        self.threads: int = json.loads(line)["threads"]
        self.forked = 0
        self.afresh: dict[str, int] = {}  # why -> how many runs

    def run(self, args: list[str], env: dict[str, str], cwd: Path | None,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """``python ARGS`` forked from the server; raises ``subprocess.TimeoutExpired``
        (with the output so far) after ``timeout`` seconds, the run killed."""
        fd_out, out = tempfile.mkstemp(dir=self.dir, suffix=".out")
        fd_err, err = tempfile.mkstemp(dir=self.dir, suffix=".err")
        os.close(fd_out)
        os.close(fd_err)
        request = {"args": args, "env": env, "cwd": str(cwd or os.getcwd()),
                   "stdout": out, "stderr": err}
        command = [str(self.python), *args]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(60)
                conn.connect(str(self.socket_path))
                conn.sendall(json.dumps(request).encode() + b"\n")
                with conn.makefile("rb") as reader:
                    pid = self._answer(reader)["pid"]
                    conn.settimeout(timeout)
                    try:
                        returncode = self._answer(reader)["returncode"]
                    except TimeoutError:
                        timed_out = True
                    else:
                        timed_out = False
                if timed_out:
                    _kill_group(pid)
                    conn.settimeout(60)  # a reader that timed out reads no more: a new one
                    with conn.makefile("rb") as reader:
                        self._answer(reader)
                    raise subprocess.TimeoutExpired(command, timeout, _read(out),
                                                    _read(err))
            return subprocess.CompletedProcess(command, returncode, _read(out), _read(err))
        finally:
            os.unlink(out)
            os.unlink(err)

    def spawn(self, args: list[str], env: dict[str, str], cwd: Path | None,
              stdout: int, stderr: int) -> Forked:
        """``python ARGS`` forked from the server, not waited for: a handle that stands
        in for ``subprocess.Popen``'s (``Forked``), its output on the descriptors given
        (a pipe's write end, a log file: the run gets copies, as Popen's child does)."""
        request = {"args": args, "env": env, "cwd": str(cwd or os.getcwd()),
                   "stdout": None, "stderr": None}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(60)
            conn.connect(str(self.socket_path))
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [stdout, stderr])
            lines = _Lines(conn)
            answer = lines.read(60)
            if answer is None:
                raise RuntimeError(f"the {self.name} fork server went away: "
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
        except BaseException:
            conn.close()
            raise
        self.forked += 1
        return Forked([str(self.python), *args], int(answer["pid"]), lines)

    def _answer(self, reader: Any) -> dict[str, Any]:
        line = reader.readline()
        if not line:
            raise RuntimeError(f"the {self.name} fork server went away: "
                               f"{self.log.read_text(errors='replace')[-3000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def summary(self) -> str:
        afresh = "".join(f"; {n} afresh: {why}" for why, n in sorted(self.afresh.items()))
        return f"{self.name} fork server: {self.forked} runs forked{afresh}"

    def close(self) -> None:
        """End the server (runs in flight are their own process groups: left alone)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for path in self.dir.iterdir():
            path.unlink()
        self.dir.rmdir()


class _Lines:
    """JSON lines read off a connection, no further than asked (a buffered file would
    read ahead, and ``select`` on the socket then miss a line already taken in)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def read(self, timeout: float | None) -> dict[str, Any] | None:
        """The next line's object; None if the peer closed first; TimeoutError if none
        came within ``timeout`` (None: no limit, 0: only one already there)."""
        while b"\n" not in self.buffer:
            if not _readable(self.conn.fileno(), timeout):
                raise TimeoutError
            chunk = self.conn.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer


class Forked:
    """A run ``ForkServer.spawn`` started, as a ``subprocess.Popen`` is used: ``pid``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``, from
    any thread; its ``stdout`` and ``stdin`` are the caller's to set (the descriptors
    are its own).  Signals go through a pidfd: the run's manager reaps it at once (no
    zombie keeps its pid, which may be another process's by the time a signal goes),
    and a manager that died leaves its run killed, not running unseen."""

    def __init__(self, args: list[str], pid: int, lines: _Lines) -> None:
        self.args, self.pid, self._lines = args, pid, lines
        self.returncode: int | None = None
        self.stdout: Any = None
        self.stdin: Any = None
        self._reading = threading.Lock()  # one reader of the manager's answer at a time
        self._pidfd_lock = threading.Lock()  # signals beside the pidfd's close
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended already: its manager says how
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._take(0)
            except TimeoutError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self._take(timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def _take(self, timeout: float | None) -> None:
        with self._reading:
            if self.returncode is not None:
                return
            answer = self._lines.read(timeout)
            if answer is None:  # its manager died: the run goes too (status unknown)
                self._signal(signal.SIGKILL)
                if self._pidfd is not None:
                    _readable(self._pidfd, 10.0)
                returncode = -signal.SIGKILL
            else:
                returncode = int(answer["returncode"])
            self._lines.conn.close()
            with self._pidfd_lock:
                if self._pidfd is not None:
                    os.close(self._pidfd)
                    self._pidfd = None
            self.returncode = returncode

    def send_signal(self, sig: int) -> None:
        # (not behind a wait in another thread, as Popen's is not: that one may be
        # waiting for this very signal's effect)
        if self.returncode is None:
            self._signal(sig)

    def _signal(self, sig: int) -> None:
        with self._pidfd_lock:
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # ended; its manager has the status
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` is readable (or closed) within ``timeout`` seconds (None: no limit);
    ``poll``, not ``select``: a test session past 1023 descriptors has larger ones."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(timeout, 0.0) * 1000))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not yet its group's leader
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read(path: str) -> str:
    # As subprocess.run(text=True) reads: universal newlines.
    text = Path(path).read_bytes().decode(errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


# ---- the server, run by the environment's python: fork_server.py SOCKET MODULE...

def serve(socket_path: str, preload: list[str]) -> None:
    import importlib
    for module in preload:
        importlib.import_module(module)
    loaded = sorted(m for m in sys.modules if m == "kvstore" or m.startswith("kvstore."))
    if loaded:
        sys.exit(f"a preload imported kvstore ({loaded[:5]}): its variables would be "
                 f"read in the server, not the run")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # managers reaped by the kernel
    print(json.dumps({"threads": len(os.listdir("/proc/self/task"))}), flush=True)
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:
            return  # the session ended
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _manage(conn)
            finally:
                os._exit(0)
        conn.close()


def _manage(conn: socket.socket) -> None:
    # (a request with descriptors, ``spawn``'s: the run's stdout and stderr)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            return
        data += more
    request = json.loads(data)
    request["fds"] = fds
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _await_run(conn, pid)
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)})
                     .encode() + b"\n")
    except OSError:  # (its caller is gone)
        pass


def _await_run(conn: socket.socket, pid: int) -> None:
    """Until the run ends.  If its caller goes first (the connection closes: the test
    session died, or was killed), the run ends too: SIGTERM, then SIGKILL ``_GRACE_S``
    on, as a child in the session's process group would have been stopped with it."""
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(conn.fileno(), select.POLLIN)
    ended_at: float | None = None  # when its caller went
    try:
        while True:
            ready = {fd for fd, _ in poller.poll(1000)}
            if pidfd in ready:
                return
            if conn.fileno() in ready and conn.recv(4096) == b"":
                poller.unregister(conn.fileno())
                ended_at = time.monotonic()
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            if ended_at is not None and time.monotonic() - ended_at > _GRACE_S:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        return
    finally:
        os.close(pidfd)


def _run(request: dict[str, Any]) -> NoReturn:
    """In the forked child: become ``python ARGS`` and run it; never returns."""
    import atexit
    import runpy
    import threading
    import traceback
    import types

    args: list[str] = request["args"]
    code = 0
    try:
        os.setsid()
        given = request.get("fds") or []
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
            opened = given[fd - 1] if path is None else os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if "numpy" in sys.modules:  # seeded at import: reseed, as a fresh process is
            sys.modules["numpy"].random.seed()
        if args[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *args[2:]], ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        elif args[0] == "-m":
            sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.realpath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit: join non-daemon threads, then atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
