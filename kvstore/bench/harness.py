"""What every section of ``kvstore bench`` shares: paired timing, rows, progress, and the
processes it starts (a daemon, the bare pyzmq echo peer)."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

from kvstore.errors import KVStoreError


class BenchError(KVStoreError):
    """A benchmark could not run: a peer or daemon did not start, or bad arguments."""


@dataclass
class Row:
    """One measurement side by side with its peer.

    ``ratio`` is kvstore's figure over the peer's in the row's unit; ``share`` turns it
    so that 1.0 is the peer (the limit) and more is better, whatever the unit: the peer's
    time over ours for latencies, ours over the peer's for bandwidths.
    """

    section: str
    name: str
    unit: str
    kvstore: float
    peer: float
    peer_name: str
    better: str  # "lower" (a latency) or "higher" (a bandwidth or a rate)
    goal: float | None = None  # the ratio the issue aims at (<= for lower, >= for higher)

    @property
    def ratio(self) -> float:
        return self.kvstore / self.peer if self.peer else float("nan")

    @property
    def share(self) -> float:
        if self.better == "lower":
            return self.peer / self.kvstore if self.kvstore else float("nan")
        return self.ratio

    def to_json(self) -> dict[str, Any]:
        return {"section": self.section, "name": self.name, "unit": self.unit,
                "kvstore": self.kvstore, "peer": self.peer, "peer_name": self.peer_name,
                "ratio": self.ratio, "share_of_limit": self.share, "better": self.better,
                "goal": self.goal}


@dataclass
class Results:
    """Everything a run measured: rows, sweeps (curves for the plots), sections that did
    not run and why, and the figures of the LMCache comparison."""

    rows: list[Row] = field(default_factory=list)
    sweeps: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    against: dict[str, Any] = field(default_factory=dict)


def paired(ours: Callable[[], object], peer: Callable[[], object], repeats: int,
           inner: int = 1, gap: float = 0.0) -> tuple[float, float]:
    """Median seconds per call of each, samples interleaved so that noise hits both (and
    who goes first alternating, so that neither always runs on the other's heels);
    ``gap``: seconds of nothing before each sample, untimed (a call after idle)."""
    ours()
    peer()
    samples: tuple[list[float], list[float]] = ([], [])
    pairs = [(ours, samples[0]), (peer, samples[1])]
    for i in range(repeats):
        for fn, out in pairs if i % 2 == 0 else pairs[::-1]:
            if gap:
                time.sleep(gap)
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - start) / inner)
    return statistics.median(samples[0]), statistics.median(samples[1])


class Progress:
    """Progress on stderr: a bar redrawn in place on a terminal, plain lines elsewhere
    (a log, a pipe), and nothing at all when ``quiet``."""

    WIDTH = 28

    def __init__(self, total: int, stream: IO[str] | None = None, quiet: bool = False) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.tty = self.stream.isatty()

    def step(self, what: str) -> None:
        """Say that ``what`` starts now."""
        if self.quiet:
            return
        if self.tty:
            filled = self.WIDTH * self.done // self.total
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self.stream.write(f"\r\x1b[K[{bar}] {self.done}/{self.total} {what}")
        else:
            self.stream.write(f"kvstore bench: [{self.done + 1}/{self.total}] {what}\n")
        self.stream.flush()

    def advance(self) -> None:
        self.done = min(self.done + 1, self.total)

    def note(self, text: str) -> None:
        """A line that stays (a section skipped, a warning)."""
        if self.quiet:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(f"kvstore bench: {text}\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def short_dir() -> Path:
    """A fresh directory for ipc:// sockets in the system's temporary directory: a
    socket's path may not be longer than 107 bytes, which a deep ``--dir`` would pass."""
    return Path(tempfile.mkdtemp(prefix="kvb-"))


def _clean_env() -> dict[str, str]:
    """The environment for a started daemon: none of the user's KVSTORE_ settings, which
    would point it at their endpoint or configuration."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


class Daemon:
    """``python -m kvstore serve`` under ``root``, from its "serving on" line to SIGTERM."""

    def __init__(self, root: Path, *, dram: str, ssd: str = "0",
                 extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.sockets = short_dir()
        self.endpoint = f"ipc://{self.sockets / 'kvstore.sock'}"
        self.args = [sys.executable, "-m", "kvstore", "serve", "--endpoint", self.endpoint,
                     "--dram-capacity", dram, "--ssd-capacity", ssd,
                     "--ssd-path", str(root / "ssd"), "--log-level", "warning",
                     *(extra or [])]
        self.env = env or {}
        self.log_path = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._drain: threading.Thread | None = None

    def start(self, timeout: float = 60.0) -> Daemon:
        self.sockets.mkdir(exist_ok=True)  # again after a stop: a restart
        env = _clean_env()
        env.update(self.env)
        with open(self.log_path, "ab") as log:
            self.proc = proc = subprocess.Popen(self.args, stdout=subprocess.PIPE,
                                                stderr=log, env=env)
        assert proc.stdout is not None
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                if b"serving on" in line:
                    break
            else:
                raise BenchError("the daemon it started did not come up: "
                                 + self.log_path.read_text(errors="replace")[-1500:])
        except BaseException:
            self.stop()
            raise
        finally:
            watchdog.cancel()
        self._drain = threading.Thread(target=proc.stdout.read, daemon=True)  # the rest
        self._drain.start()
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def cpu_seconds(self) -> float:
        """CPU time the daemon has used (user and system; Linux's /proc, else 0): steadier
        than wall time on a busy machine."""
        if self.proc is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM: the daemon drains its writes and syncs its index on the way out."""
        proc, self.proc = self.proc, None
        try:
            if proc is not None:
                self._end(proc)
                if self._drain is not None:
                    self._drain.join(10)  # its read ends with the process's output
                    self._drain = None
                if proc.stdout is not None:
                    proc.stdout.close()
        finally:
            shutil.rmtree(self.sockets, ignore_errors=True)

    @staticmethod
    def _end(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


ECHO_PEER = r"""
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.SNDHWM, 0); sock.setsockopt(zmq.RCVHWM, 0)
sock.bind(sys.argv[1])
print("ready", flush=True)
blob = b""
while True:
    # read and answer as the daemon's transport does (each frame's more flag; a small
    # answer in two sends): a bare peer that spent more per message would flatter it
    frames = [sock.recv(copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    head = frames[1].bytes
    if head == b"sink":               # bulk put: take the frames, answer small
        sock.send_multipart([frames[0], b"ok"])
    elif head.startswith(b"source"):  # bulk get: answer with N frames of SIZE
        n, size = map(int, head.split()[1:])
        if len(blob) != size:
            blob = bytes(size)
        sock.send_multipart([frames[0], b"ok", *([blob] * n)], copy=False)
    elif len(frames) == 2:             # echo
        sock.send(frames[0], zmq.SNDMORE)
        sock.send(frames[1])
    else:
        sock.send_multipart(frames, copy=False)
"""


class PeerProcess:
    """A peer script (``python -c``) in its own process, listening on an ipc endpoint in
    a folder of its own; it prints "ready" once it serves."""

    def __init__(self, script: str, socket_name: str, what: str, *args: str) -> None:
        self.sockets = short_dir()
        self.endpoint = f"ipc://{self.sockets / socket_name}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._script, self._what, self._args = script, what, args

    def start(self) -> Self:
        self.proc = subprocess.Popen([sys.executable, "-c", self._script, self.endpoint,
                                      *self._args], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            self.stop()
            raise BenchError(f"the pyzmq {self._what} peer did not start")
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        shutil.rmtree(self.sockets, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EchoPeer(PeerProcess):
    """A bare pyzmq ROUTER in its own process (as the daemon is): echoes a request, takes
    bulk frames (``sink``) or sends them (``source N SIZE``).  The limit the control and
    frame planes are measured against."""

    def __init__(self) -> None:
        super().__init__(ECHO_PEER, "echo.sock", "echo")


@dataclass
class Settings:
    """What every section is told: how long to run, where the daemon and the echo peer
    listen, and where it may put files."""

    endpoint: str
    echo: str
    workdir: Path
    repeat: int
    quick: bool
    tenant: str = "bench"
    token: str | None = None
    timeout: float = 30.0

    @property
    def inner(self) -> int:
        """Round trips per latency sample."""
        return 20 if self.quick else 200
