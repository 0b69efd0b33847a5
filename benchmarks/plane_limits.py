"""The floors under ``kvstore bench``'s control, arena and frame rows, measured side by side.

    python benchmarks/plane_limits.py [--repeat 15] [--inner 200]

``kvstore bench`` sets each plane beside a bare limit: a blocking pyzmq echo, memcpy into
an anonymous numpy region, raw pyzmq frames.  Part of each gap is no work of kvstore's
but what any daemon built as kvstore is must pay; this program measures those parts:

- round trips: the blocking echo, beside an echo that reads its socket from a uvloop
  loop as the daemon's transport does (descriptor, EVENTS, non-blocking receives; a
  daemon serving many clients and tasks cannot block in a receive), beside kvstore's
  ping (a verb with no work) and lookup of a 64-key chain; and the same requests' CPU
  time in the serving process (steadier than wall time where cores are shared);
- copies: memcpy of 16 blocks into the bench's peer region, beside the same copy into
  a shared mapping of a /dev/shm file (the arena's kind of memory: 4 KiB pages unless
  the kernel gives shared memory huge pages), with the kernel's huge page settings;
- frames: 16 blocks sent to a ROUTER that drops them on receipt (the bench's raw
  peer), beside one that first copies them into a shared mapping (what an acknowledged
  put must have done before it says so: the blocks are visible to readers).

Each pair's samples are interleaved (``kvstore.bench.harness.paired``); medians.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import protocol as p
from kvstore.bench.harness import Daemon, EchoPeer, paired, short_dir
from kvstore.bench.planes import Echo, small_identity
from kvstore.client import Client

MiB = 1 << 20

# A ROUTER on uvloop that reads as kvstore.transport does; "store" copies each payload
# frame into a shared mapping before it answers, as a put does before its ack.
LOOP_PEER = r"""
import asyncio, mmap, os, sys, tempfile, zmq, uvloop
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.SNDHWM, 0); sock.setsockopt(zmq.RCVHWM, 0)
sock.bind(sys.argv[1])
size = int(sys.argv[2])
fd, path = tempfile.mkstemp(dir="/dev/shm")
os.unlink(path); os.ftruncate(fd, size)
region = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
cursor = 0

def answer(frames):
    global cursor
    head = frames[1].bytes
    if head == b"store":
        for f in frames[2:]:
            n = len(f)
            if cursor + n > size:
                cursor = 0
            region[cursor:cursor + n] = f.buffer
            cursor += n
        sock.send_multipart([frames[0], b"ok"])
    elif head == b"sink":
        sock.send_multipart([frames[0], b"ok"])
    elif len(frames) == 2:  # an echo, sent as the daemon's transport sends a reply
        sock.send(frames[0], zmq.SNDMORE)
        sock.send(frames[1])
    else:
        sock.send_multipart(frames, copy=False)

EVENTS, POLLIN, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

def drain():
    for _ in range(64):
        if not sock.getsockopt(EVENTS) & POLLIN:
            break
        try:
            frames = [sock.recv(NOBLOCK, copy=False)]
        except zmq.Again:
            break
        while frames[-1].more:
            frames.append(sock.recv(NOBLOCK, copy=False))
        answer(frames)
    if sock.getsockopt(EVENTS) & POLLIN:
        asyncio.get_running_loop().call_soon(drain)

async def main():
    loop = asyncio.get_running_loop()
    loop.add_reader(sock.getsockopt(zmq.FD), drain)
    loop.call_soon(drain)
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


class LoopPeer:
    def __init__(self, region_bytes: int) -> None:
        self.sockets = short_dir()
        self.endpoint = f"ipc://{self.sockets / 'loop.sock'}"
        self.proc = subprocess.Popen([sys.executable, "-c", LOOP_PEER, self.endpoint,
                                      str(region_bytes)], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            raise SystemExit("the uvloop peer did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _row(name: str, ours: float, peer: float, unit: str, peer_name: str) -> None:
    print(f"  {name:<44} {ours:9.2f} {unit:<5} {peer_name:<28} {peer:9.2f}   "
          f"ratio {ours / peer:5.2f}")


def round_trips(repeat: int, inner: int, echo: Echo, loop: Echo, endpoint: str) -> None:
    print("round trips (us per call):")
    with Client(endpoint, tenant="limits", map_arena=False) as client:
        ns = client.namespace(small_identity("limits", "limits"))
        try:
            chain = ns.keys(range(16 * 64))
            ns.put(chain, [bytes(ns.block_bytes)] * 64)
            look = [p.encoder.encode(p.Lookup(1, ns.id, chain))]
            pairs: list[tuple[str, Callable[[], object], Callable[[], object], str]] = [
                ("uvloop echo (the daemon's way of reading)", loop.of(look), echo.of(look),
                 "blocking echo"),
                ("kvstore ping (a verb with no work)", client.ping, echo.of(look),
                 "blocking echo"),
                ("kvstore lookup of 64 keys", lambda: ns.lookup(chain), echo.of(look),
                 "blocking echo"),
                ("kvstore lookup of 64 keys", lambda: ns.lookup(chain), loop.of(look),
                 "uvloop echo"),
            ]
            for name, ours, peer, peer_name in pairs:
                a, b = paired(ours, peer, repeat, inner)
                _row(name, a * 1e6, b * 1e6, "us", peer_name)
        finally:
            ns.drop()


def _cpu_us(pid: int, fn: Callable[[], object], calls: int) -> float:
    """CPU time (user and system, all its threads: ZeroMQ's I/O thread too) that process
    ``pid`` spends per call of ``fn``, in us: on a busy machine a steadier figure than
    the wall time, which waits for a core as often as for the server."""
    from kv_events import cpu_ns  # a sibling script: ns per thread (/proc stat has ticks)

    def used() -> float:
        return cpu_ns(pid) / 1e9
    fn()
    before = used()
    for _ in range(calls):
        fn()
    return (used() - before) / calls * 1e6


def server_cpu(repeat: int, inner: int, echo: Echo, loop: Echo, pids: dict[str, int],
               endpoint: str) -> None:
    """The serving process's CPU per request: what each round trip costs the daemon
    beside what an echo costs its peer (medians of interleaved runs)."""
    print("server CPU per request (us; median of runs interleaved with the echo's):")
    calls = max(inner * 20, 2000)  # the clock ticks in 10 ms: enough calls to read it
    with Client(endpoint, tenant="limits") as client:
        ns = client.namespace(small_identity("limits-cpu", "limits"))
        try:
            chain = ns.keys(range(16 * 64))
            ns.put(chain, [bytes(ns.block_bytes)] * 64)
            look = [p.encoder.encode(p.Lookup(1, ns.id, chain))]
            fresh = iter(ns.keys(range(1 << 30, (1 << 30) + 16 * calls * (repeat + 1))))

            def reserve_commit() -> None:  # per request: two of them
                ns.reserve([next(fresh)]).commit()
            rows: list[tuple[str, Callable[[], object], int, int]] = [
                ("uvloop echo (the daemon's way of reading)", loop.of(look), pids["loop"], 1),
                ("kvstore ping (a verb with no work)", client.ping, pids["daemon"], 1),
                ("kvstore lookup of 64 keys", lambda: ns.lookup(chain), pids["daemon"], 1),
                ("kvstore reserve+commit of 1, per request", reserve_commit,
                 pids["daemon"], 2),
            ]
            for name, fn, pid, requests in rows:
                ours, peer = [], []
                for _ in range(max(3, repeat // 5)):
                    ours.append(_cpu_us(pid, fn, calls // requests) / requests)
                    peer.append(_cpu_us(pids["echo"], echo.of(look), calls))
                _row(name, statistics.median(ours), statistics.median(peer), "us",
                     "blocking echo")
        finally:
            ns.drop()


def _shared_region(size: int) -> np.ndarray[Any, Any]:
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    try:
        os.unlink(path)
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype=np.uint8)


class Copier:
    """16 blocks copied into a rotating region, as the bench's memcpy peer does."""

    def __init__(self, region: np.ndarray[Any, Any], src: list[np.ndarray[Any, Any]]) -> None:
        self.region, self.src, self.at = region, src, 0

    def __call__(self) -> None:
        at, size = self.at, len(self.src[0])
        for s in self.src:
            if at + size > len(self.region):
                at = 0
            np.copyto(self.region[at:at + size], s)
            at += size
        self.at = at


def _setting(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def copies(repeat: int, region_bytes: int) -> None:
    print("copies of 16 blocks (GB/s; ratio to memcpy into the bench's numpy region):")
    thp = "/sys/kernel/mm/transparent_hugepage"
    print(f"  transparent huge pages: anonymous {_setting(thp + '/enabled')!r}; shared memory "
          f"{_setting(thp + '/shmem_enabled')!r}; reserved huge pages "
          f"{_setting('/proc/sys/vm/nr_hugepages')}")
    numpy_region = np.ones(region_bytes, dtype=np.uint8)
    shared = _shared_region(region_bytes)
    rng = np.random.default_rng(0)
    for size in (256 << 10, 2 * MiB):
        src = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(16)]
        ours, peer = paired(Copier(shared, src), Copier(numpy_region, src), repeat, 4)
        total = 16 * size / 1e9
        _row(f"memcpy {size >> 10} KiB x16 into a /dev/shm mapping", total / ours,
             total / peer, "GB/s", "into the numpy region")


def frames(repeat: int, echo: Echo, loop: Echo) -> None:
    print("frames of 16 blocks sent and acknowledged (GB/s; ratio to the bench's raw peer):")
    rng = np.random.default_rng(1)
    for size in (256 << 10, 2 * MiB):
        payload = [rng.integers(0, 255, size, dtype=np.uint8).tobytes() for _ in range(16)]
        total = 16 * size / 1e9
        ours, peer = paired(loop.of([b"store", *payload]), echo.of([b"sink", *payload]),
                            repeat)
        _row(f"{size >> 10} KiB x16, copied into shm before the ack", total / ours,
             total / peer, "GB/s", "dropped (raw pyzmq sink)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=15, help="samples per measurement")
    parser.add_argument("--inner", type=int, default=200, help="round trips per sample")
    parser.add_argument("--region", type=int, default=512, help="MiB each copy rotates over")
    args = parser.parse_args(argv)
    region = args.region * MiB
    echo_peer = EchoPeer().start()
    loop_peer = LoopPeer(region)
    work = Path(tempfile.mkdtemp(prefix="kvlimits-"))
    try:
        with Daemon(work / "daemon", dram="256MiB") as daemon:
            echo, loop = Echo(echo_peer.endpoint), Echo(loop_peer.endpoint)
            try:
                round_trips(args.repeat, args.inner, echo, loop, daemon.endpoint)
                assert echo_peer.proc is not None
                server_cpu(args.repeat, args.inner, echo, loop,
                           {"echo": echo_peer.proc.pid, "loop": loop_peer.proc.pid,
                            "daemon": daemon.pid}, daemon.endpoint)
                copies(args.repeat, region)
                frames(args.repeat, echo, loop)
            finally:
                echo.close()
                loop.close()
    finally:
        loop_peer.stop()
        echo_peer.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
