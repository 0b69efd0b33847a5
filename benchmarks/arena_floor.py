"""Where an arena write or read spends its time beyond the copy, and the floor under it.

    python benchmarks/arena_floor.py [--repeat 21] [--sizes 256KiB,2MiB]

``kvstore bench arena`` sets reserve+write+commit (and acquire+read+release) of 16 blocks
beside memcpy of the same bytes.  Beyond the copy, a write makes two round trips and a
read one round trip and one posted release.  This program measures, for each block size,
samples interleaved (``kvstore.bench.harness.paired``'s order), medians:

- the bench's two rows, kvstore and memcpy, as the bench defines them;
- the floor: the same memcpy with as many bare pyzmq echo round trips (a write: two; a
  read: one, and one message posted as the release is) to a peer that does no work.  A
  design of reserve, write in place and commit over ZeroMQ cannot beat it, whatever the
  daemon does: its ratio to memcpy is the best such a row can show on this machine;
- each phase's wall time and this thread's CPU time (reserve, copy, commit; acquire,
  copy, release), with the minor page faults taken during the copies (a fresh slot's
  first touch would show here);
- CPU a call: this thread's, its other threads' (ZeroMQ's I/O thread), the daemon's
  loop thread's and its other threads' (its ZeroMQ I/O thread), beside memcpy's;
- a round trip after a copy of 4 MiB, as the bench's come (with the caches the copy
  left): the pyzmq echo, the same echo over a plain Unix socket (what a data plane
  without ZeroMQ's I/O threads would pay), and kvstore's ping (a verb with no work).

On a machine whose other cores are busy, the client, the daemon and both ZeroMQ I/O
threads take turns on one core: a round trip then costs its CPU, not its latency.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from kvstore.bench.harness import Daemon, EchoPeer, Settings
from kvstore.bench.planes import Echo, SizedBlocks
from kvstore.client import Client

MiB = 1 << 20
MAX_REPEAT = 26  # 2 MiB blocks: (26 + 4 warm-ups and spares + 1) writes of 32 MiB < 1 GiB
T = TypeVar("T")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu(pid: int) -> tuple[float, float]:
    """Seconds a process's main thread and its other threads have run (the scheduler's
    nanoseconds; 0 where there is no /proc)."""
    main = others = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ran = int(f.read().split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
        if int(tid) == pid:
            main += ran
        else:
            others += ran
    return main / 1e9, others / 1e9


CPU_COLUMNS = ("this thread", "its ZeroMQ thread", "daemon loop", "daemon others")


def cpu_per_call(fn: Callable[[], object], daemon_pid: int, repeat: int) -> list[float]:
    """Median CPU seconds a call costs, by ``CPU_COLUMNS``: this thread, this process's
    other threads (ZeroMQ's I/O thread), the daemon's loop (its main thread) and its
    other threads (ZeroMQ's I/O thread among them)."""
    me = os.getpid()
    samples: list[list[float]] = [[] for _ in CPU_COLUMNS]
    for _ in range(repeat):
        t, (_, p), (dl, do) = time.thread_time(), _cpu(me), _cpu(daemon_pid)
        fn()
        t2 = time.thread_time()
        time.sleep(0.005)  # what the call left to the others (a posted release) is done
        (_, p2), (dl2, do2) = _cpu(me), _cpu(daemon_pid)
        for out, value in zip(samples, (t2 - t, p2 - p, dl2 - dl, do2 - do)):
            out.append(value)
    return [statistics.median(s) for s in samples]


class Phases:
    """Each phase's wall and CPU samples (microseconds) and the copies' page faults."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.faults: dict[str, list[int]] = {}

    def add(self, name: str, wall: float, cpu: float) -> None:
        self.wall.setdefault(name, []).append(wall * 1e6)
        self.cpu.setdefault(name, []).append(cpu * 1e6)

    def timed(self, name: str, fn: Callable[[], T]) -> T:
        w, c = time.perf_counter(), time.thread_time()
        out = fn()
        self.add(name, time.perf_counter() - w, time.thread_time() - c)
        return out

    def print(self, label: str) -> None:
        for name in self.wall:
            faults = self.faults.get(name)
            extra = f"  minor faults {statistics.median(faults):.0f}" if faults else ""
            print(f"  {label:>7} {name:<16} wall {statistics.median(self.wall[name]):8.1f} us"
                  f"  client CPU {statistics.median(self.cpu[name]):8.1f} us{extra}")


def phased_put(sized: SizedBlocks, phases: Phases) -> None:
    """The bench's write, each phase timed."""
    r = phases.timed("reserve", lambda: sized.ns.reserve(sized.unused()))
    before = _faults()

    def copy() -> None:
        for buf, s in zip(r.buffers, sized.src):
            np.copyto(np.frombuffer(buf, dtype=np.uint8), s)
    phases.timed("write copy", copy)
    phases.faults.setdefault("write copy", []).append(_faults() - before)
    phases.timed("commit", r.commit)


def phased_get(sized: SizedBlocks, phases: Phases) -> None:
    """The bench's read, each phase timed."""
    held = phases.timed("acquire", lambda: sized.ns.acquire(sized.keys))
    before = _faults()

    def copy() -> None:
        for buf, d in zip(held.buffers, sized.dst):
            np.copyto(d, np.frombuffer(buf, dtype=np.uint8))
    phases.timed("read copy", copy)
    phases.faults.setdefault("read copy", []).append(_faults() - before)
    phases.timed("release", held.release)


def interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds of each, in an order that turns around every sample."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for i in range(repeat):
        for name, fn in order if i % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


class Floors:
    """The floor's peers: memcpy with a write's two bare round trips, and with a read's
    round trip and posted message (its answer read before the next is posted, as the
    client reads a release's), each on a DEALER of its own so that no answer waits for
    the other's."""

    def __init__(self, endpoint: str, sized: SizedBlocks) -> None:
        self.writes, self.reads = Echo(endpoint), Echo(endpoint)
        self.write_trip = self.writes.of([b"x" * 64])
        self.read_trip = self.reads.of([b"x" * 64])
        self.sized = sized
        self.posted = False

    def write(self) -> None:
        self.write_trip()
        self.sized.memcpy()
        self.write_trip()

    def read(self) -> None:
        if self.posted:
            self.reads.sock.recv()
        self.read_trip()
        self.sized.memcpy_out()
        self.reads.sock.send(b"release")
        self.posted = True

    def close(self) -> None:
        self.writes.close()
        self.reads.close()


def _sized(client: Client, label: str, repeat: int) -> SizedBlocks:
    """A fresh namespace of ``label`` blocks whose chains are hashed ahead for
    ``repeat`` writes and their warm-ups."""
    return SizedBlocks(client, label, Settings(endpoint="", echo="", workdir=Path(),
                                               repeat=repeat + 4, quick=False))


def one_size(client: Client, echo_endpoint: str, label: str, repeat: int,
             daemon_pid: int) -> None:
    """The three measures of one block size, each on a namespace of its own dropped
    after it, so that no write has to evict."""
    sized = _sized(client, label, repeat)
    floors = Floors(echo_endpoint, sized)
    try:
        got = interleaved({"arena write": sized.arena_put, "memcpy": sized.memcpy,
                           "floor write": floors.write,
                           "arena read": sized.arena_get, "memcpy out": sized.memcpy_out,
                           "floor read": floors.read}, repeat)
    finally:
        floors.close()
        sized.ns.drop()
    print(f"{label} x16 ({sized.total // MiB} MiB a call), medians of {repeat}:")
    for op, peer in (("write", "memcpy"), ("read", "memcpy out")):
        ours, mem, floor = got[f"arena {op}"], got[peer], got[f"floor {op}"]
        print(f"  {op:>5}: kvstore {ours * 1e6:8.1f} us  memcpy {mem * 1e6:8.1f}  "
              f"floor {floor * 1e6:8.1f}  | kvstore/memcpy {mem / ours:.2f}  "
              f"floor/memcpy {mem / floor:.2f}  kvstore/floor {floor / ours:.2f}")

    sized = _sized(client, label, repeat)
    try:
        phases = Phases()
        for _ in range(repeat):
            phased_put(sized, phases)
            sized.memcpy()
            phased_get(sized, phases)
            sized.memcpy_out()
        phases.print(label)
    finally:
        sized.ns.drop()

    sized = _sized(client, label, repeat)
    try:
        print(f"  {label:>7} CPU a call, us (medians): {' / '.join(CPU_COLUMNS)}")
        for name, fn in (("arena write", sized.arena_put), ("memcpy", sized.memcpy),
                         ("arena read", sized.arena_get), ("memcpy out", sized.memcpy_out)):
            figures = " / ".join(f"{v * 1e6:7.1f}" for v in cpu_per_call(fn, daemon_pid, repeat))
            print(f"  {label:>7} {name:<16} {figures}")
    finally:
        sized.ns.drop()


UNIX_ECHO = r"""
import socket, sys
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(1)
print("ready", flush=True)
conn, _ = server.accept()
while data := conn.recv(4096):
    conn.sendall(data)
"""


class UnixEcho:
    """A blocking echo over a plain Unix socket, in its own process."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, "echo.unix")
        self.proc = subprocess.Popen([sys.executable, "-c", UNIX_ECHO, path],
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)

    def trip(self) -> None:
        self.sock.sendall(b"x" * 64)
        self.sock.recv(4096)

    def close(self) -> None:
        self.sock.close()  # the peer's receive ends, and so does it
        self.proc.wait(10)


def after_copy(client: Client, echo: Echo, unix: UnixEcho, repeat: int) -> None:
    """A round trip's wall and client CPU just after a 4 MiB copy, as the bench's come."""
    src, dst = np.ones(4 * MiB, np.uint8), np.empty(4 * MiB, np.uint8)
    phases = Phases()
    trips = (("pyzmq echo", echo.of([b"x" * 64])), ("unix socket echo", unix.trip),
             ("kvstore ping", client.ping))
    for i in range(repeat):
        for name, fn in trips if i % 2 == 0 else trips[::-1]:
            np.copyto(dst, src)
            phases.timed(name, fn)
    print("a round trip after a 4 MiB copy:")
    phases.print("")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--sizes", default="256KiB,2MiB")
    args = parser.parse_args(argv)
    if not 1 <= args.repeat <= MAX_REPEAT:
        parser.error(f"--repeat must be 1 to {MAX_REPEAT} (a measure's writes fit the "
                     "1 GiB arena without evictions)")
    with tempfile.TemporaryDirectory(prefix="kvstore-arena-floor-") as work:
        peer = EchoPeer().start()
        try:
            echo, unix = Echo(peer.endpoint), UnixEcho(work)
            try:
                with Daemon(Path(work) / "daemon", dram="1GiB") as daemon, \
                        Client(daemon.endpoint, tenant="bench") as client:
                    for label in args.sizes.split(","):
                        one_size(client, peer.endpoint, label, args.repeat, daemon.pid)
                    after_copy(client, echo, unix, args.repeat)
            finally:
                echo.close()
                unix.close()
        finally:
            peer.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
