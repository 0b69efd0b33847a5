"""Side-by-side benchmark of the KV event stream and the routing query against their peers.

Three measurements, each next to its peer, medians of interleaved runs, and ratios:
- publish: a 64-block ``BlockStored`` batch drained from the store, encoded and sent on
  the PUB socket (to a subscriber in another process), in daemon time; against the bare
  msgspec encode and zmq send of the same batch built ahead (target: <= 50 us);
- throughput: reserve+commit of 16-block chains and lookups against daemons side by
  side, publishing events (to a subscriber, to nobody, a batch every loop turn) and
  not; the daemon's CPU time per request (its batches' included), each run's ratio to
  the runs of the daemons without events next to it (target: <= 1.05).  The client and the daemons run on one
  CPU, so that all daemons share the same conditions (the subscriber, a router
  elsewhere, on the others), and a second daemon without events shows what the
  machine's noise alone makes of the ratio; and each daemon's minor page faults (new
  memory touched, about 5 us each on a VM) per 100 requests;
- route: one routing query over 8 daemons, against one lookup's round trip to one
  daemon (target: <= 2x); and the machine's limit beside it: a bare pyzmq request sent
  to 8 echo processes at once and gathered, against one echo's round trip; and the same
  route answered from the daemons' event streams (``RouteView``: no round trip a route).

    python benchmarks/kv_events.py [--repeats N] [--only publish|throughput|route]
        [--round N] [--beside DIR] [--json]

``--beside DIR`` adds to the throughput measurement daemons that run another version of
kvstore, a source tree in DIR (``git archive <commit> | tar -x -C DIR``; its subpackages
``scheduler``, ``tiers``, ``kernels``, ``plugins`` are taken from DIR too, never from
this checkout), each driven by a client of that version (how a client sends token ids
is part of the version): two without events, to a subscriber and to nobody, in the
same rounds as this version's, each of its ratios over its own two daemons without
events.  Every daemon, of either version, is driven by a client in a process of its
own, so the two versions' arms are measured alike (run against a copy of itself, the
two read the same within the noise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import zmq

from kvstore import Client, Identity
from kvstore import protocol as p
from kvstore.bench.harness import ECHO_PEER
from kvstore.config import EventsConfig
from kvstore.events import EventPublisher, KVEventBatch
from kvstore.keys import chain_keys
from kvstore.route_view import RouteView
from kvstore.router import Router
from kvstore.store import BlockStore
try:
    from kvstore.token_ids import encode_chain
except ImportError:  # an older version's (run by --beside's clients): each block apart
    from kvstore.token_ids import encode_blocks as encode_chain  # type: ignore[assignment]

IDENT = Identity(model="bench", model_revision="r", tenant="bench", kv_dtype="float16",
                 num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16)

SUBSCRIBER = r"""
import sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
print("ready", flush=True)
n = 0
while True:
    frames = sub.recv_multipart()
    n += 1
"""


# A daemon's client: the workload in a process of its own that imports its version's
# kvstore (its working directory's, for --beside's daemons), so its requests are that
# version's (how it sends token ids is part of the version); each line read runs one
# round and answers its request count.
CLIENT = r"""
import sys
sys.path.append(sys.argv[1])  # this benchmark, after the version's code (the cwd)
from kv_events import workload
from kvstore import Client
client = Client(sys.argv[2], tenant="bench")
run = workload(client, [0], n=int(sys.argv[3]), data=sys.argv[4] == "1")
print("ready", flush=True)
for _ in sys.stdin:
    print(run(), flush=True)
"""


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def p10_us(samples: list[float]) -> float:
    """The tenth percentile: the cost with the least of the machine's interference."""
    return sorted(samples)[len(samples) // 10] * 1e6


def peer(script: str, endpoint: str) -> subprocess.Popen[bytes]:
    """``script`` in a process of its own at ``endpoint``, once it says it is ready."""
    proc = subprocess.Popen([sys.executable, "-c", script, endpoint], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    return proc


def subscriber(endpoint: str) -> subprocess.Popen[bytes]:
    return peer(SUBSCRIBER, endpoint)


def bench_publish(work: Path, repeats: int) -> tuple[float, float, float, float]:
    """Daemon time of one 64-block batch (drain, events, encode, send) vs encode+send:
    medians and tenth percentiles."""
    endpoint = f"ipc://{work}/pub.sock"
    slot = IDENT.block_bytes
    store = BlockStore(256 * slot, 64 * slot)
    pub = EventPublisher(EventsConfig(endpoint=endpoint, topic="kv@pod@bench"), store)
    loop = asyncio.new_event_loop()
    pub.open(loop)
    sub = subscriber(endpoint)
    time.sleep(0.5)  # the subscription reaches the publisher
    pub.read_subscriptions()
    ns = store.open_namespace(IDENT)
    ours: list[float] = []
    peer: list[float] = []
    raw = pub._pub
    assert raw is not None
    encoder = msgspec.msgpack.Encoder()
    try:
        for i in range(repeats * 20):
            tokens = list(range(i * 1024, (i + 1) * 1024))
            keys = chain_keys(ns.id, tokens, 16)
            r = store.reserve("bench", ns, keys, None, 0.0)
            store.commit("bench", r.id, 0.0,  # type: ignore[union-attr]
                         tokens=encode_chain(tokens, 64, 16))
            start = time.perf_counter()
            pub.flush()
            ours.append(time.perf_counter() - start)
            # the peer: the same batch, built ahead, only encoded and sent
            batch = msgspec.msgpack.decode(pub.ring[-1][1], type=KVEventBatch)
            start = time.perf_counter()
            payload = encoder.encode(batch)
            raw.send_multipart((b"kv@pod@bench", (10**9 + i).to_bytes(8, "big"), payload),
                               zmq.NOBLOCK)
            peer.append(time.perf_counter() - start)
            store.evict(ns, keys)
            pub.flush()
    finally:
        pub.close()
        loop.close()
        sub.kill()
        sub.wait()
    return median_us(ours), median_us(peer), p10_us(ours), p10_us(peer)


SUBPACKAGES = ("scheduler", "tiers", "kernels", "plugins")  # kvstore.* from the tree's top


def stage_tree(tree: Path, work: Path) -> str:
    """A directory whose ``kvstore`` package is ``tree``'s, with its subpackages laid in
    by links (as installed), so a daemon started there imports nothing of this checkout."""
    staged = work / "beside-code"
    package = staged / "kvstore"
    if not (tree / "kvstore" / "__init__.py").is_file():
        raise SystemExit(f"--beside {tree}: no kvstore package there (a source tree?)")
    package.mkdir(parents=True)
    for entry in (tree / "kvstore").iterdir():
        (package / entry.name).symlink_to(entry.resolve())
    for sub in SUBPACKAGES:
        if (tree / sub).is_dir() and not (package / sub).exists():
            (package / sub).symlink_to((tree / sub).resolve())
    return str(staged)


def start_daemon(work: Path, name: str, env: dict[str, str], code: str | None = None,
                 dram: str = "256MiB") -> tuple[subprocess.Popen[bytes], str, str]:
    """A daemon serving at an ipc endpoint (and a tcp one); ``code``: a directory whose
    ``kvstore`` package it runs (``python -m`` looks in its working directory first)."""
    endpoint = f"ipc://{work}/{name}.sock"
    tcp = f"tcp://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint, "--extra-endpoint",
         tcp, "--dram-capacity", dram, "--ssd-capacity", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, env={**os.environ, **env}, cwd=code)
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if b"serving on" in line:
            return proc, endpoint, tcp
        if not line:
            raise RuntimeError(f"daemon {name} exited ({proc.wait()}) before serving")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload(client: Client, counter: list[int], n: int = 40,
             data: bool = False) -> Callable[[], int]:
    """Stores of 16-block chains and lookups (``data``: the blocks' bytes written into
    the arena and read back under a pin, as an engine's offload and reload do).

    Against a daemon without events the client lays out the token ids all the same (and
    drops them): a client of one with events does, and on the daemons' CPU that work
    alone adds about 3% to the CPU time of the daemon it talks to (its caches
    refilled), which is the client's cost, not the events'."""
    ns = client.namespace(IDENT)
    mirror = not ns.events
    blob = np.ones(ns.block_bytes, dtype=np.uint8)
    sink = np.empty(ns.block_bytes, dtype=np.uint8)

    def run() -> int:
        for _ in range(n):
            i = counter[0]
            counter[0] += 1
            keys = ns.keys(range(i * 256, (i + 1) * 256))
            if mirror:
                encode_chain(np.arange(i * 256, (i + 1) * 256, dtype="<i8"), 16, 16)
            with ns.reserve(keys) as r:
                if data:
                    for buf in r.buffers:
                        np.copyto(np.frombuffer(buf, dtype=np.uint8), blob)
                r.commit()
            ns.lookup(keys)
            if data:
                with ns.acquire(keys) as held:
                    for buf in held.buffers:
                        np.copyto(sink, np.frombuffer(buf, dtype=np.uint8))
            if i % 64 == 63:
                ns.evict(keys)
        return (5 if data else 3) * n  # reserve, commit, lookup (acquire, release)
    return run


def cpu_ns(pid: int) -> int:
    """Nanoseconds a process ran on a CPU so far, all its threads (zmq's too)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended
    return total


def cpu_ns_by_thread(pid: int) -> tuple[int, int]:
    """Nanoseconds ``cpu_ns`` counts, as (the loop's thread, ZeroMQ's I/O threads: the
    transport's and, with events, the stream's, whose writes a batch wakes)."""
    loop = io = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ran = int((task / "schedstat").read_text().split()[0])
            if task.name == str(pid):
                loop += ran
            elif "ZMQbg/IO" in (task / "comm").read_text():
                io += ran
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended
    return loop, io


def minor_faults(pid: int) -> int:
    """Minor page faults a process took so far (new memory touched: its heap growing)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


# The daemons measured side by side: (name, events environment, a subscriber reads it).
ARMS: tuple[tuple[str, dict[str, str], bool], ...] = (
    ("off", {}, False),
    ("on", {"KVSTORE_EVENTS_ENDPOINT": "ipc://{work}/events-{tag}.sock"}, True),
    ("alone", {"KVSTORE_EVENTS_ENDPOINT": "ipc://{work}/nobody-{tag}.sock"}, False),
    ("turn", {"KVSTORE_EVENTS_ENDPOINT": "ipc://{work}/events-turn-{tag}.sock",
              "KVSTORE_EVENTS_INTERVAL_MS": "0"}, True),
    ("off2", {}, False),
)


def bench_throughput(work: Path, repeats: int, data: bool = False,
                     round_n: int = 3, beside: str | None = None,
                     dram: str = "256MiB") -> dict[str, float]:
    """Daemon CPU time per request, and requests a second, of daemons publishing events
    (to a subscriber; to nobody; a batch every loop turn) and of two that do not.  Every
    process here runs on one CPU: all daemons then run as the client's peer under the
    same conditions (the CPU time of a daemon woken on the other CPU, or beside another
    user's work there, varies by tens of percent).  Rounds of ``round_n`` iterations per
    daemon (a store, a lookup: 3 by default; more for a sustained load),
    in a shuffled order, ``20 * repeats`` of them; each round's CPU time per request
    over the mean of the two daemons without events in the same round, and the median
    of those.  A round's CPU time is read ``interval_ms`` and a millisecond after its
    last request (every daemon waits the same): a batch that goes out by then (every
    loop turn, or by a timer) is counted in its round, not in no round while the next
    daemon is measured.  A batch still waiting then goes out with the daemon's first
    commit of its next round, counted there; only a gap between two rounds longer than
    the quiet timer's wait (``quiet_ms``, 50 ms, or twice a busy batch's wait; they come
    30 to 45 ms apart) leaves one to a timer, uncounted in the rounds.  The median of
    rounds also leaves out the batches' cost where they are fewer than the rounds (the
    median round has none): the cross-check, all CPU time over all requests, counts
    both."""
    tag = "d" if data else "c"
    settle = EventsConfig().interval_ms / 1e3 + 0.001
    cpus = os.sched_getaffinity(0)
    cpu = max(cpus)
    os.sched_setaffinity(0, {cpu})  # the daemons started now inherit it
    procs: dict[str, subprocess.Popen[bytes]] = {}
    subs: list[subprocess.Popen[bytes]] = []
    workers: list[subprocess.Popen[bytes]] = []  # the daemons' clients
    arms = list(ARMS)
    if beside is not None:  # another version's daemons, in the same rounds, each started
        # next to its peer of this version, either first by turns: a daemon runs a few
        # percent faster or slower by where it comes in the start order (started after
        # all of this version's, the copy's read 3 to 4 points under them)
        arms = []
        for i, (name, env, subscribed) in enumerate(ARMS):
            pair = [(name, env, subscribed)]
            if name != "turn":
                pair.append((f"{name}_beside", {k: v.replace("{tag}", "beside-{tag}")
                                                for k, v in env.items()}, subscribed))
            arms += pair if i % 2 else pair[::-1]
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in arms}
    served = {name: 0 for name, _, _ in arms}
    total: dict[str, float] = {}
    endpoints: dict[str, str] = {}
    try:
        runs: dict[str, Callable[[], int]] = {}
        for name, env, subscribed in arms:
            env = {k: v.format(work=work, tag=tag) for k, v in env.items()}
            proc, endpoint, _ = start_daemon(work, f"{name}-{tag}",
                                             {**env, "PYTHONHASHSEED": "0"},
                                             beside if name.endswith("_beside") else None,
                                             dram)
            procs[name] = proc
            if subscribed:  # a router, elsewhere: on the other CPUs, where there are any
                subs.append(subscriber(env["KVSTORE_EVENTS_ENDPOINT"]))
                os.sched_setaffinity(subs[-1].pid, (cpus - {cpu}) or cpus)
            endpoints[name] = endpoint
            runs[name] = client_process(beside if name.endswith("_beside") else None,
                                        endpoint, round_n, data, workers)
        for run in runs.values():
            for _ in range(10):
                run()
        order = list(runs)
        rng = random.Random(7)
        first = {name: cpu_ns(proc.pid) for name, proc in procs.items()}
        threads_at = {name: cpu_ns_by_thread(proc.pid) for name, proc in procs.items()}
        faults_at = {name: minor_faults(proc.pid) for name, proc in procs.items()}
        for _ in range(20 * repeats):
            rng.shuffle(order)
            for name in order:
                pid = procs[name].pid
                before = cpu_ns(pid)
                start = time.perf_counter()
                n = runs[name]()
                wall = time.perf_counter() - start
                time.sleep(settle)  # a batch due by now goes out, counted in the round
                samples[name].append(((cpu_ns(pid) - before) / n / 1e3, n / wall))
                served[name] += n
        # the cross-check: all CPU time over all requests, the gaps between rounds too
        faults = {name: (minor_faults(proc.pid) - faults_at[name]) / served[name]
                  for name, proc in procs.items()}
        total = {name: (cpu_ns(proc.pid) - first[name]) / served[name] / 1e3
                 for name, proc in procs.items()}
        threads = {name: [(now - then) / served[name] / 1e3 for now, then in
                          zip(cpu_ns_by_thread(proc.pid), threads_at[name])]
                   for name, proc in procs.items()}
        for name in ("on", "turn", "on_beside"):
            if name in endpoints:
                with Client(endpoints[name], tenant="bench") as c:
                    events = c.stats()["events"]
                assert events["batches"] > 0 and events["dropped"] == 0, events
        if beside is not None:  # the daemons of the other version ran its own code
            check = ("import kvstore.scheduler as s, kvstore.tiers as t; "
                     "print(s.__path__[0]); print(t.__path__[0])")
            paths = subprocess.run([sys.executable, "-c", check], cwd=beside, check=True,
                                   capture_output=True, text=True).stdout.split()
            here = str(Path(__file__).resolve().parent.parent)
            assert not any(x.startswith(here) for x in paths), paths
    finally:
        for proc in (*procs.values(), *subs, *workers):
            proc.terminate()
            proc.wait()
        os.sched_setaffinity(0, cpus)
    # Each round's reference: the mean of the version's two daemons without events (a
    # process of its own runs a few percent faster or slower than another for as long
    # as it lives; --beside's arms over its own, as its other costs differ).
    out: dict[str, float] = {}
    for name, s in samples.items():
        suffix = "_beside" if name.endswith("_beside") else ""
        off, off2 = samples[f"off{suffix}"], samples[f"off2{suffix}"]
        own = [(a + b) / 2 for (a, _), (b, _) in zip(off, off2)]
        off_total = (total[f"off{suffix}"] + total[f"off2{suffix}"]) / 2
        out[f"{name}_cpu_us"] = statistics.median(c for c, _ in s)
        out[f"{name}_rate"] = statistics.median(r for _, r in s)
        out[f"{name}_cpu_ratio"] = statistics.median(c / b for (c, _), b in zip(s, own))
        out[f"{name}_cpu_total_ratio"] = total[name] / off_total
        # CPU outside the rounds (timers, a batch a timer sent), per request
        out[f"{name}_outside_us"] = total[name] - statistics.fmean(c for c, _ in s)
        out[f"{name}_faults"] = faults[name]  # minor page faults a request, all rounds
        # all CPU time a request, of the loop's thread and of ZeroMQ's I/O threads
        out[f"{name}_loop_us"], out[f"{name}_io_us"] = threads[name]
    # the noise: one daemon without events against the other
    for suffix in ("", "_beside") if beside is not None else ("",):
        out[f"off2{suffix}_cpu_ratio"] = statistics.median(
            b / a for (a, _), (b, _) in zip(samples[f"off{suffix}"],
                                            samples[f"off2{suffix}"]))
    return out


def client_process(code: str | None, endpoint: str, round_n: int, data: bool,
                   procs: list[subprocess.Popen[bytes]]) -> Callable[[], int]:
    """A round of ``workload`` run by a client of the version in ``code`` (None: this
    checkout's), in a process of its own (added to ``procs``, to end with them)."""
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, here, endpoint, str(round_n), str(int(data))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=code)
    procs.append(proc)
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    if stdout.readline() != b"ready\n":
        raise RuntimeError(f"a daemon's client exited ({proc.wait()}) before its rounds")

    def run() -> int:
        stdin.write(b"\n")
        stdin.flush()
        return int(stdout.readline())
    return run


def echo_peer(endpoint: str) -> subprocess.Popen[bytes]:
    """A bare pyzmq ROUTER in its own process that echoes each request."""
    return peer(ECHO_PEER, endpoint)


def bench_route(work: Path, repeats: int, daemons: int) -> dict[str, float]:
    """One route over ``daemons`` daemons vs one lookup round trip to one daemon; and,
    to tell the router's cost from the machine's, a route over one daemon, raw lookups
    sent to every daemon at once and gathered (pyzmq, no ranking), and the machine's
    limit: a request of the probe's size sent to as many bare pyzmq echo processes at
    once and gathered, against one echo's round trip.  Beside them, the same route
    answered by a ``RouteView`` that follows the daemons' event streams (no round trip
    a route: the daemons' events are on for it)."""
    streams = [(_free_port(), _free_port()) for _ in range(daemons)]
    procs = [start_daemon(work, f"r{i}", {
        "KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
        "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}"})
        for i, (pub, replay) in enumerate(streams)]
    echo_ports = [_free_port() for _ in range(daemons)]
    echoes = [echo_peer(f"tcp://127.0.0.1:{port}") for port in echo_ports]
    tokens = range(16 * 64)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for i, (_, endpoint, _) in enumerate(procs):
            with Client(endpoint, tenant="bench") as c:
                ns = c.namespace(IDENT)
                keys = ns.keys(tokens)[:8 * (i + 1)]
                ns.put(keys, [bytes(ns.block_bytes)] * len(keys))
        keys = chain_keys(IDENT.namespace_id, tokens, 16)
        clients = [Client(tcp, tenant="bench", map_arena=False) for _, _, tcp in procs]
        namespaces = [c.namespace(IDENT) for c in clients]
        lookup = p.encoder.encode(p.Lookup(1, namespaces[0].id, keys))
        probe = p.encoder.encode(p.Probe(1, keys))  # what an echo is sent: a probe's size
        socks = [c._sock for c in clients]
        dealers = []
        for port in echo_ports:
            d = ctx.socket(zmq.DEALER)
            d.connect(f"tcp://127.0.0.1:{port}")
            dealers.append(d)

        def fan_out() -> None:
            for s in socks:
                s.send(lookup)
            for s in socks:
                s.recv_multipart()

        def echo_all() -> None:
            for d in dealers:
                d.send(probe)
            for d in dealers:
                d.recv()

        def echo_one() -> None:
            dealers[0].send(probe)
            dealers[0].recv()

        for _ in range(100):
            echo_all()
        with Router([tcp for _, _, tcp in procs], tenant="bench") as router, \
                Router([procs[0][2]], tenant="bench") as one, \
                RouteView([tcp for _, _, tcp in procs],
                          [f"tcp://127.0.0.1:{pub}" for pub, _ in streams],
                          [f"tcp://127.0.0.1:{replay}" for _, replay in streams],
                          tenant="bench") as view:
            results = router.route(keys, deadline=5.0)
            assert all(r.answered for r in results), results
            one.route(keys, deadline=5.0)
            assert view.ready(30) == daemons
            deadline = time.monotonic() + 30  # (the figures thread's first probes)
            while not all(r.answered for r in view.route(keys)):
                assert time.monotonic() < deadline, view.route(keys)
                time.sleep(0.05)
            assert ([(r.endpoint, r.hits) for r in view.route(keys)]
                    == [(r.endpoint, r.hits) for r in router.route(keys, deadline=5.0)])
            calls: dict[str, Callable[[], object]] = {
                "route": lambda: router.route(keys, deadline=5.0),
                "view": lambda: view.route(keys),
                "lookup": lambda: namespaces[0].lookup(keys),
                "route1": lambda: one.route(keys, deadline=5.0),
                "fanout": fan_out,
                "echo_all": echo_all,
                "echo_one": echo_one}
            samples: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(repeats):
                for name, fn in calls.items():
                    start = time.perf_counter()
                    for _ in range(50):
                        fn()
                    samples[name].append((time.perf_counter() - start) / 50)
        for c in clients:
            c.close()
    finally:
        ctx.destroy(linger=0)
        for proc in [*(proc for proc, _, _ in procs), *echoes]:
            proc.terminate()
            proc.wait()
    return {name: median_us(s) for name, s in samples.items()}


Row = tuple[str, float, float, str, float, str, str]  # measure, ours, peer, peer is,
#                                                      ratio, its format, target


def row(name: str, ours: float, peer: float, peer_name: str, fmt: str = ".2f",
        target: str = "", ratio: float | None = None) -> Row:
    return (name, ours, peer, peer_name, ours / peer if ratio is None else ratio, fmt,
            target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--daemons", type=int, default=8)
    parser.add_argument("--only", choices=["publish", "throughput", "route"],
                        help="run one of the three")
    parser.add_argument("--round", type=int, default=3, metavar="N",
                        help="throughput: iterations (a store and a lookup) per daemon in "
                             "a round (more: a sustained load)")
    parser.add_argument("--beside", metavar="DIR",
                        help="throughput: also daemons running the kvstore package in DIR "
                             "(another version), in the same rounds")
    parser.add_argument("--dram-capacity", default="256MiB", metavar="SIZE",
                        help="throughput: each daemon's DRAM tier (256MiB: the rounds "
                             "fill it, nothing is evicted; 4MiB: full after the warm-up, "
                             "each store evicts, as a daemon at capacity)")
    parser.add_argument("--json", action="store_true",
                        help="print every figure as JSON after the table")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvevents-"))
    beside = None if args.beside is None else stage_tree(Path(args.beside), work)
    figures: dict[str, float] = {}
    rows: list[Row] = []
    if args.only in (None, "publish"):
        t_pub, t_raw, p_pub, p_raw = bench_publish(work, args.repeats)
        figures.update(publish_us=t_pub, encode_send_us=t_raw, publish_p10_us=p_pub,
                       encode_send_p10_us=p_raw)
        rows.append(row("64-block batch, daemon time (us)", t_pub, t_raw, "encode+send",
                        target="ours <= 50 us"))
        rows.append(row("  the same, tenth percentile (us)", p_pub, p_raw, "encode+send"))
    if args.only in (None, "throughput"):
        for data, what in ((False, "control"), (True, "with bytes")):
            t = bench_throughput(work, args.repeats, data, args.round, beside,
                                 args.dram_capacity)
            figures.update({f"{what.replace(' ', '_')}_{k}": v for k, v in t.items()})
            arms = [("on", "events to a subscriber", "<= 1.05"),
                    ("alone", "events to nobody", "<= 1.05"),
                    ("turn", "a batch every loop turn", ""),
                    ("off2", "noise: 2nd daemon, no events", "")]
            if args.beside:
                arms[2:2] = [("on_beside", "to a subscriber, --beside's code", ""),
                             ("alone_beside", "to nobody, --beside's code", "")]
                arms.append(("off2_beside", "noise, --beside's code", ""))
            for arm, label, target in arms:
                off = "off_beside" if arm.endswith("_beside") else "off"
                rows.append(row(f"{what}: cpu us/request, {label}", t[f"{arm}_cpu_us"],
                                t[f"{off}_cpu_us"], "events off", ".3f", target,
                                ratio=t[f"{arm}_cpu_ratio"]))
            rows.append(row(f"{what}: the same, all CPU time / all requests", t["on_cpu_us"],
                            t["off_cpu_us"], "events off", ".3f",
                            ratio=t["on_cpu_total_ratio"]))
            rows.append(row(f"{what}: cpu us/request outside the rounds, to a subscriber",
                            t["on_outside_us"], t["off_outside_us"], "events off", ".3f"))
            for arm, label in (("on", "to a subscriber"), ("on_beside", "the same, --beside's")):
                suffix = "_beside" if arm.endswith("_beside") else ""
                for part, thread in (("loop", "loop thread"), ("io", "zmq I/O threads")):
                    # where a subscriber's stream costs: the loop, or ZeroMQ's I/O
                    # threads (the stream's writes, the token ids' reads); over the
                    # mean of the version's two daemons without events
                    if f"{arm}_{part}_us" in t:
                        off_us = (t[f"off{suffix}_{part}_us"] + t[f"off2{suffix}_{part}_us"]) / 2
                        rows.append(row(f"{what}: all cpu us/request, {thread}, {label}",
                                        t[f"{arm}_{part}_us"], off_us, "events off", ".3f"))
            for arm, label in (("on", "to a subscriber"), ("on_beside", "the same, --beside's")):
                if f"{arm}_faults" in t:  # new memory a request (a filling daemon's heap)
                    off = "off_beside" if arm.endswith("_beside") else "off"
                    rows.append(row(f"{what}: page faults/100 requests, {label}",
                                    100 * t[f"{arm}_faults"], 100 * t[f"{off}_faults"],
                                    "events off"))
            rows.append(row(f"{what}: requests/s, events to a subscriber", t["on_rate"],
                            t["off_rate"], "events off", ".3f"))
    if args.only in (None, "route"):
        route = bench_route(work, args.repeats, args.daemons)
        figures.update({f"route_{k}_us": v for k, v in route.items()})
        n = args.daemons
        rows += [row(f"route over {n} daemons (us)", route["route"], route["lookup"],
                     "one lookup", target="<= 2"),
                 row("route over 1 daemon (us)", route["route1"], route["lookup"],
                     "one lookup"),
                 row(f"route over {n} daemons (us)", route["route"], route["fanout"],
                     f"raw {n} lookups"),
                 row(f"limit: echo to {n} processes (us)", route["echo_all"],
                     route["echo_one"], "one echo"),
                 row(f"route over {n} daemons (us)", route["route"], route["echo_all"],
                     f"echo to {n}"),
                 row(f"route over {n} daemons by their streams (us)", route["view"],
                     route["lookup"], "one lookup", target="<= 2")]
    print(f"kv events and routing: medians of {args.repeats} interleaved runs "
          f"({os.cpu_count()} cpus here)")
    print(f"{'measure':56} {'kvstore':>10} {'peer':>10} {'peer is':>16} {'ratio':>7} "
          f"{'target':>14}")
    for name, ours, peer, peer_name, ratio, fmt, target in rows:
        print(f"{name:56} {ours:10.1f} {peer:10.1f} {peer_name:>16} "
              f"{format(ratio, fmt):>7} {target:>14}")
    if args.only in (None, "throughput"):
        print("cpu us/request ratios: the median of each round's ratio to the daemons "
              "without events run beside it (the noise row: one of them to the other)")
    if args.json:
        print(json.dumps(figures, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
