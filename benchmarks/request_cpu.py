"""The daemon's Python CPU per request, verb by verb, without sockets' waits.

    python benchmarks/request_cpu.py [--policy auto lru ...] [--requests 4000] [--profile VERB]
    python benchmarks/request_cpu.py --wire [--against OTHER_CHECKOUT] [--policy lru ...]

A round trip's wall time on a shared machine is mostly waiting: for a core, for ZeroMQ's
I/O threads.  This program hands requests straight to a started daemon's dispatch
(``Server._on_message``, replies encoded and sent to a peer that is not there, which
ZeroMQ drops) and reads the loop thread's CPU clock around them: what each verb costs
the daemon itself, steady enough to compare eviction policies or two versions of the
code.  Ping (no work), lookup of a 64-key chain, reserve+commit of 1 and of 16 blocks.
``--profile VERB`` prints cProfile's top functions for that verb.

``--wire`` measures over real sockets instead: a daemon process (``kvstore serve``), a
client's blocking round trips, and per request the wall time and the CPU of the daemon's
loop thread (its scheduler's nanoseconds from /proc: transport, dispatch and all, with the
cold caches of a round trip that a loop of direct calls does not have).  ``--against``
starts a second daemon from another checkout of kvstore (its root directory) and
alternates the two in short slices, restarted each epoch, so that a noisy machine's load
and placement fall on both alike: before and after, side by side, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import uvloop
import zmq

from kvstore import protocol as p
from kvstore.bench.planes import small_identity
from kvstore.client import Client
from kvstore.config import Config, DramConfig, ServerConfig, SsdConfig
from kvstore.metrics import Metrics, stats_on_loop
from kvstore.server import Server

PEER = b"\x00gone"  # socket 0, a routing id no peer has


class Requests:
    """A started daemon, a session and a namespace, and requests handed to it."""

    def __init__(self, policy: str) -> None:
        workdir = tempfile.mkdtemp(prefix="kvcpu-")
        config = Config(server=ServerConfig(endpoint=f"ipc://{workdir}/kvstore.sock",
                                            log_level="warning"),
                        dram=DramConfig(capacity="2GiB", eviction_policy=policy),
                        ssd=SsdConfig(capacity="0"))
        self.server = Server(config)
        # counted as the daemon counts them (run_server injects the same collector)
        self.server.metrics = Metrics(stats_on_loop(asyncio.get_running_loop(),
                                                    self.server.stats))
        self.server.start()
        self.replies: list[p.Message] = []
        send = self.server.transport.send

        def keep(peer: bytes, reply: p.Message, payload: list[Any]) -> None:
            self.replies.append(reply)
            send(peer, reply, payload)
        self.server.transport.send = keep  # type: ignore[method-assign]
        self.rid = 0
        self.answer(p.Hello(self.next(), p.PROTOCOL_VERSION, "cpu", ""), p.HelloReply)
        identity = small_identity("cpu", "cpu")
        self.ns = self.answer(p.OpenNamespace(self.next(), identity), p.NamespaceReply).ns
        self.chain = self.fresh(64)
        reserved = self.answer(p.Reserve(self.next(), self.ns, self.chain), p.ReserveReply)
        self.answer(p.Commit(self.next(), reserved.reservation), p.CommitReply)

    def next(self) -> int:
        self.rid += 1
        return self.rid

    @staticmethod
    def fresh(count: int) -> list[bytes]:
        return [os.urandom(16) for _ in range(count)]

    def handle(self, request: p.Message) -> None:
        frames = [zmq.Frame(PEER[1:]), zmq.Frame(p.encoder.encode(request))]
        self.server._on_message(PEER, frames, False)

    def answer(self, request: p.Message, expected: type[Any]) -> Any:
        self.handle(request)
        reply = self.replies[-1]
        if not isinstance(reply, expected):
            raise SystemExit(f"{type(request).__name__}: {reply!r}")
        return reply

    def ping(self) -> None:
        self.handle(p.Ping(self.next()))

    def lookup(self) -> None:
        self.handle(p.Lookup(self.next(), self.ns, self.chain))

    def reserve_commit(self, keys: list[bytes]) -> None:
        reserved = self.answer(p.Reserve(self.next(), self.ns, keys), p.ReserveReply)
        self.answer(p.Commit(self.next(), reserved.reservation), p.CommitReply)

    def verbs(self, requests: int) -> dict[str, tuple[Callable[[], None], int, int]]:
        """name -> (one call, calls, requests a call makes)"""
        ones = iter([self.fresh(1) for _ in range(requests + 1)])
        sixteens = iter([self.fresh(16) for _ in range(requests // 4 + 1)])
        return {"ping": (self.ping, requests, 1),
                "lookup": (self.lookup, requests, 1),
                "reserve+commit-1": (lambda: self.reserve_commit(next(ones)), requests // 2, 2),
                "reserve+commit-16": (lambda: self.reserve_commit(next(sixteens)),
                                      requests // 8, 2)}

    def close(self) -> None:
        self.server.close()


def cpu_per_request(fn: Callable[[], None], calls: int, requests: int) -> float:
    fn()
    started = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - started) / calls / requests * 1e6


async def measure(policies: Sequence[str], requests: int, repeat: int,
                  profile: str | None) -> None:
    print(f"daemon CPU per request (us; median of {repeat} runs of {requests} requests a "
          "verb; the loop thread's clock):")
    print(f"  {'verb':<20}" + "".join(f"{policy:>10}" for policy in policies))
    figures: dict[str, list[float]] = {}
    for policy in policies:
        daemon = Requests(policy)
        try:
            runs: dict[str, list[float]] = {}
            for _ in range(repeat):
                for name, (fn, calls, each) in daemon.verbs(requests).items():
                    runs.setdefault(name, []).append(cpu_per_request(fn, calls, each))
            for name, values in runs.items():
                figures.setdefault(name, []).append(statistics.median(values))
            if profile is not None:
                fn, calls, _ = daemon.verbs(requests)[profile]
                profiler = cProfile.Profile()
                profiler.runcall(lambda: [fn() for _ in range(calls)])
                print(f"-- {profile} under {policy}:")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        finally:
            daemon.close()
    for name, row in figures.items():
        print(f"  {name:<20}" + "".join(f"{value:10.1f}" for value in row))


def _thread_cpu(pid: int) -> float:
    """Seconds a process's main thread, its event loop, ran on a CPU (the scheduler's
    count in nanoseconds: a slice's few milliseconds are below /proc's stat ticks)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


class WireDaemon:
    """``kvstore serve`` from a checkout's root, a client of it, and its chains."""

    def __init__(self, root: str, policy: str, requests: int) -> None:
        self.workdir = tempfile.mkdtemp(prefix="kvwire-")
        endpoint = f"ipc://{self.workdir}/kvstore.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint,
             "--dram-capacity", "1GiB", "--ssd-capacity", "0", "--eviction-policy", policy,
             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": root}, cwd=root)
        assert self.proc.stdout is not None
        while b"serving on" not in self.proc.stdout.readline():
            if self.proc.poll() is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
                raise SystemExit(f"the daemon of {root} did not start")
        self.client = Client(endpoint, tenant="cpu")
        self.ns = self.client.namespace(small_identity("cpu", "cpu"))
        self.chain = self.ns.keys(range(16 * 64))
        self.ns.put(self.chain, [bytes(self.ns.block_bytes)] * 64)
        self.at = 1 << 30
        self.requests = requests

    def fresh(self, count: int) -> list[bytes]:
        self.at += 16 * count
        return self.ns.keys(range(self.at, self.at + 16 * count))

    def verbs(self) -> dict[str, tuple[Callable[[], object], int, int]]:
        """name -> (one call, calls a slice, requests a call makes)"""
        n = self.requests
        return {"ping": (self.client.ping, n, 1),
                "lookup": (lambda: self.ns.lookup(self.chain), max(1, n // 2), 1),
                "reserve+commit-1": (lambda: self.ns.reserve(self.fresh(1)).commit(),
                                     max(1, n // 4), 2),
                "reserve+commit-16": (lambda: self.ns.reserve(self.fresh(16)).commit(),
                                      max(1, n // 8), 2)}

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def measure_wire(roots: dict[str, str], policy: str, epochs: int, slices: int,
                 requests: int) -> None:
    walls: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}  # [seconds, requests]
    for epoch in range(epochs):
        order = list(roots) if epoch % 2 == 0 else list(roots)[::-1]
        daemons: dict[str, WireDaemon] = {}
        try:
            for name in order:
                daemons[name] = WireDaemon(roots[name], policy, requests)
            for turn in range(slices):
                for verb in daemons[order[0]].verbs():
                    for name in order if turn % 2 == 0 else order[::-1]:
                        fn, calls, each = daemons[name].verbs()[verb]
                        pid = daemons[name].proc.pid
                        used, started = _thread_cpu(pid), time.perf_counter()
                        for _ in range(calls):
                            fn()
                        walls.setdefault((verb, name), []).append(
                            (time.perf_counter() - started) / (calls * each) * 1e6)
                        spent = cpu.setdefault((verb, name), [0.0, 0])
                        spent[0] += _thread_cpu(pid) - used
                        spent[1] += calls * each
        finally:
            for daemon in daemons.values():
                daemon.close()
    print(f"over the wire under {policy}, us a request ({epochs} epochs of {slices} "
          "alternated slices): wall (median of slices), daemon loop thread CPU (total)"
          + (", and this version's over the other's" if len(roots) > 1 else ""))
    print(f"  {'verb':<20}" + "".join(f"{name + ' wall':>16}{name + ' cpu':>14}"
                                      for name in roots)
          + (f"{'wall ratio':>12}{'cpu ratio':>12}" if len(roots) > 1 else ""))
    for verb in dict.fromkeys(v for v, _ in walls):
        wall = {name: statistics.median(walls[(verb, name)]) for name in roots}
        used = {name: cpu[(verb, name)][0] / cpu[(verb, name)][1] * 1e6 for name in roots}
        row = "".join(f"{wall[name]:16.1f}{used[name]:14.1f}" for name in roots)
        if len(roots) > 1:
            row += f"{wall['this'] / wall['other']:12.3f}{used['this'] / used['other']:12.3f}"
        print(f"  {verb:<20}{row}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--policy", nargs="+", default=["auto", "lru"],
                        help="the DRAM eviction policies to run under")
    parser.add_argument("--requests", type=int,
                        help="requests a verb a run (4000); --wire: pings a slice (200), "
                        "the other verbs a half, a quarter, an eighth as many calls")
    parser.add_argument("--repeat", type=int, default=5, help="runs (medians are shown)")
    parser.add_argument("--profile", choices=["ping", "lookup", "reserve+commit-1",
                                              "reserve+commit-16"])
    parser.add_argument("--wire", action="store_true",
                        help="over real sockets: a daemon process and a client's round trips")
    parser.add_argument("--against", metavar="ROOT",
                        help="--wire: also a daemon from this checkout's root, alternated")
    parser.add_argument("--epochs", type=int, default=4,
                        help="--wire: daemons started afresh this many times")
    args = parser.parse_args()
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    if args.against and not args.wire:
        parser.error("--against compares daemons over the wire: add --wire")
    if args.wire:
        if args.profile:
            parser.error("--profile profiles the in-process run, not --wire")
        roots = {"this": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
        if args.against:
            roots["other"] = os.path.abspath(args.against)
        for policy in args.policy:
            measure_wire(roots, policy, args.epochs, args.repeat * 2, args.requests or 200)
        return 0
    uvloop.run(measure(args.policy, args.requests or 4000, args.repeat, args.profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
