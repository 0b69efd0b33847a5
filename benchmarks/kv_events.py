"""Side-by-side benchmark of the KV event stream and the routing query against their peers.

Three measurements, each next to its peer, medians of interleaved runs, and ratios:
- publish: a 64-block ``BlockStored`` batch drained from the store, encoded and sent on
  the PUB socket (to a subscriber in another process), in daemon time; against the bare
  msgspec encode and zmq send of the same batch built ahead (target: <= 50 us);
- throughput: reserve+commit of 16-block chains and lookups against two daemons side by
  side, one publishing events (a subscriber reading them) and one not (target: the
  publishing one keeps >= 95% of the other's request rate);
- route: one routing query over 8 daemons, against one lookup's round trip to one
  daemon (target: <= 2x).

    python benchmarks/kv_events.py [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
from kvstore.config import EventsConfig
from kvstore.events import EventPublisher, KVEventBatch
from kvstore.keys import chain_keys
from kvstore.router import Router
from kvstore.store import BlockStore
from kvstore.token_ids import encode_blocks

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


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def subscriber(endpoint: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    return proc


def bench_publish(work: Path, repeats: int) -> tuple[float, float]:
    """Daemon time of one 64-block batch (drain, events, encode, send) vs encode+send."""
    endpoint = f"ipc://{work}/pub.sock"
    slot = IDENT.block_bytes
    store = BlockStore(256 * slot, 64 * slot)
    pub = EventPublisher(EventsConfig(endpoint=endpoint, topic="kv@pod@bench"), store)
    loop = asyncio.new_event_loop()
    pub.open(loop)
    sub = subscriber(endpoint)
    time.sleep(0.5)  # the subscription reaches the publisher
    pub._drain_subscriptions()
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
                         tokens=encode_blocks(tokens, 64, 16))
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
    return median_us(ours), median_us(peer)


def start_daemon(work: Path, name: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes],
                                                                      str, str]:
    endpoint = f"ipc://{work}/{name}.sock"
    tcp = f"tcp://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint, "--extra-endpoint",
         tcp, "--dram-capacity", "256MiB", "--ssd-capacity", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, env={**os.environ, **env})
    assert proc.stdout is not None
    while b"serving on" not in proc.stdout.readline():
        pass
    return proc, endpoint, tcp


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload(client: Client, counter: list[int], n: int = 40,
             data: bool = False) -> Callable[[], int]:
    """Stores of 16-block chains and lookups (``data``: the blocks' bytes written into
    the arena and read back under a pin, as an engine's offload and reload do)."""
    ns = client.namespace(IDENT)
    blob = np.ones(ns.block_bytes, dtype=np.uint8)
    sink = np.empty(ns.block_bytes, dtype=np.uint8)

    def run() -> int:
        for _ in range(n):
            i = counter[0]
            counter[0] += 1
            keys = ns.keys(range(i * 256, (i + 1) * 256))
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


def bench_throughput(work: Path, repeats: int, data: bool = False) -> dict[str, float]:
    """Requests a second, and daemon CPU time per request, of a daemon publishing events
    to a subscriber, of one publishing to nobody, and of one that does not publish.  On
    a busy machine the CPU time per request is the steadier figure: the rate a daemon
    sustains is the inverse of it."""
    tag = "d" if data else "c"
    pub = f"ipc://{work}/events-{tag}.sock"
    on, on_ep, _ = start_daemon(work, f"on-{tag}", {"KVSTORE_EVENTS_ENDPOINT": pub})
    alone, alone_ep, _ = start_daemon(work, f"alone-{tag}", {
        "KVSTORE_EVENTS_ENDPOINT": f"ipc://{work}/nobody-{tag}.sock"})
    off, off_ep, _ = start_daemon(work, f"off-{tag}", {})
    sub = subscriber(pub)
    rates: tuple[list[float], list[float], list[float]] = ([], [], [])
    cpu = [0, 0, 0]
    served = [0, 0, 0]
    procs = (on, alone, off)
    try:
        with Client(on_ep, tenant="bench") as c_on, \
                Client(alone_ep, tenant="bench") as c_alone, \
                Client(off_ep, tenant="bench") as c_off:
            runs = (workload(c_on, [0], data=data), workload(c_alone, [0], data=data),
                    workload(c_off, [0], data=data))
            for run in runs:
                run()
            for _ in range(repeats):
                for i, (run, out) in enumerate(zip(runs, rates)):
                    before = cpu_ns(procs[i].pid)
                    start = time.perf_counter()
                    n = run()
                    out.append(n / (time.perf_counter() - start))
                    cpu[i] += cpu_ns(procs[i].pid) - before
                    served[i] += n
            events = c_on.stats()["events"]
            assert events["batches"] > 0 and events["dropped"] == 0, events
    finally:
        for proc in (on, alone, off, sub):
            proc.terminate()
            proc.wait()
    names = ("on", "alone", "off")
    out = {name: statistics.median(r) for name, r in zip(names, rates)}
    out.update({f"{name}_cpu_us": c / n / 1e3 for name, c, n in zip(names, cpu, served)})
    return out


def bench_route(work: Path, repeats: int, daemons: int) -> dict[str, float]:
    """One route over ``daemons`` daemons vs one lookup round trip to one daemon; and,
    to tell the router's cost from the machine's, a route over one daemon, and raw
    lookups sent to every daemon at once and gathered (pyzmq, no ranking)."""
    procs = [start_daemon(work, f"r{i}", {}) for i in range(daemons)]
    tokens = range(16 * 64)
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
        socks = [c._sock for c in clients]

        def fan_out() -> None:
            for s in socks:
                s.send(lookup)
            for s in socks:
                s.recv_multipart()

        with Router([tcp for _, _, tcp in procs], tenant="bench") as router, \
                Router([procs[0][2]], tenant="bench") as one:
            results = router.route(keys, deadline=5.0)
            assert all(r.answered for r in results), results
            one.route(keys, deadline=5.0)
            samples: dict[str, list[float]] = {"route": [], "lookup": [], "route1": [],
                                               "fanout": []}
            calls: dict[str, Callable[[], object]] = {
                "route": lambda: router.route(keys, deadline=5.0),
                "lookup": lambda: namespaces[0].lookup(keys),
                "route1": lambda: one.route(keys, deadline=5.0),
                "fanout": fan_out}
            for _ in range(repeats):
                for name, fn in calls.items():
                    start = time.perf_counter()
                    for _ in range(50):
                        fn()
                    samples[name].append((time.perf_counter() - start) / 50)
        for c in clients:
            c.close()
    finally:
        for proc, _, _ in procs:
            proc.terminate()
            proc.wait()
    return {name: median_us(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--daemons", type=int, default=8)
    parser.add_argument("--only", choices=["publish", "throughput", "route"],
                        help="run one of the three")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvevents-"))
    rows: list[tuple[str, float, float, str, str]] = []
    if args.only in (None, "publish"):
        t_pub, t_raw = bench_publish(work, args.repeats)
        rows.append(("64-block batch, daemon time (us)", t_pub, t_raw, "encode+send", ".2f"))
    if args.only in (None, "throughput"):
        for data, what in ((False, "control"), (True, "with bytes")):
            t = bench_throughput(work, args.repeats, data)
            rows.append((f"{what}: requests/s, to a subscriber", t["on"], t["off"],
                         "events off", ".3f"))
            rows.append((f"{what}: requests/s, to nobody", t["alone"], t["off"],
                         "events off", ".3f"))
            rows.append((f"{what}: daemon cpu us/request, to a sub", t["on_cpu_us"],
                         t["off_cpu_us"], "events off", ".3f"))
            rows.append((f"{what}: daemon cpu us/request, nobody", t["alone_cpu_us"],
                         t["off_cpu_us"], "events off", ".3f"))
    if args.only in (None, "route"):
        route = bench_route(work, args.repeats, args.daemons)
        n = args.daemons
        rows.append((f"route over {n} daemons (us)", route["route"], route["lookup"],
                     "one lookup", ".2f"))
        rows.append(("route over 1 daemon (us)", route["route1"], route["lookup"],
                     "one lookup", ".2f"))
        rows.append((f"route over {n} daemons (us)", route["route"], route["fanout"],
                     f"raw {n} lookups", ".2f"))
    print(f"kv events and routing: medians of {args.repeats} interleaved runs "
          f"({os.cpu_count()} cpus here)")
    print(f"{'measure':40} {'kvstore':>10} {'peer':>10} {'peer is':>16} {'ratio':>7}")
    for name, ours, peer, peer_name, fmt in rows:
        print(f"{name:40} {ours:10.1f} {peer:10.1f} {peer_name:>16} "
              f"{format(ours / peer, fmt):>7}")
    print("targets: batch <= 50 us; requests/s ratio >= 0.95; route over 8 <= 2x one lookup")


if __name__ == "__main__":
    main()
