"""Side-by-side benchmark of the daemon's remote tier against a raw redis-py client.

Starts its own redis-server and two daemons, A and B, both with ``--remote`` on that server
and no SSD tier, then for 256 KiB and 2 MiB blocks measures, samples interleaved:
- put through the daemon: a client puts ``--mib`` MiB into daemon A, in requests of
  ``--batch-mib`` MiB (arena plane: reserve, write the slots, commit; frames: put); the clock runs from the first put until A's
  ``stats()["remote"]["writes"]`` counts every block (the write-through has finished);
- get through the daemon: a client of daemon B asks for the same keys, which B does not
  hold, so B fetches them from Redis into its DRAM; the client then takes the bytes,
  through the shared arena (``--plane arena``, the default: acquire, copy into
  preallocated pages as an engine's reload does) or as message frames (``get``);
against redis-py (hiredis parser) on the same server: pipelined SET, then pipelined GET, of
the same values in batches of the same size.  Fresh keys every repeat; Redis is flushed and
the daemons' namespaces dropped between repeats, outside the clock.  The daemon's values
carry a 32-byte header with an xxh3 checksum (plugins/codec.py); that cost is part of
what is measured.  Throughput counts block payload bytes on both sides.  On Linux it also
reports the CPU time that each side's processes (client, daemon, redis-server) spent per GB,
which is steadier than wall time on a busy machine and says where a gap comes from.

    python benchmarks/remote_tier.py [--mib N] [--repeats N] [--batch-mib N]
        [--plane arena|frames]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import redis

from kvstore import Client, Identity

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_servers import RedisServer  # type: ignore[import-not-found]

TENANT = "bench"
DRAM = "2GiB"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads); NaN without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _TICKS


class Daemon:
    """``python -m kvstore serve`` with a remote tier and no SSD tier; stdout to a log."""

    def __init__(self, work: Path, name: str, remote_url: str) -> None:
        self.endpoint = f"ipc://{work / name}.sock"
        self.log_path = work / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        env = dict(os.environ)
        env.pop("KVSTORE_ENDPOINT", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--endpoint", self.endpoint,
             "--dram-capacity", DRAM, "--ssd-capacity", "0", "--ssd-path",
             str(work / f"{name}-ssd"), "--remote", remote_url, "--log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def wait_serving(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while b"serving on" not in self.log_path.read_bytes():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("daemon did not come up in time")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def remote_stats(client: Client) -> dict[str, Any]:
    r: dict[str, Any] = client.stats()["remote"]
    return r


def identity(label: str, heads: int) -> Identity:
    return Identity(model=f"bench-remote-{label}", model_revision="r", tenant=TENANT,
                    kv_dtype="float16", num_layers=16, num_kv_heads=heads, head_dim=128,
                    block_tokens=8)


Row = tuple[str, float, float, float, float]  # name, GB/s ours and peer, CPU s/GB ours, peer
Split = tuple[dict[str, float], dict[str, float]]  # CPU s/GB per process: ours, peer


def median_rate(samples: list[float], total: int) -> float:
    return total / statistics.median(samples) / 1e9


def bench_size(label: str, heads: int, args: argparse.Namespace, ca: Client, cb: Client,
               raw: redis.Redis, pids: dict[str, int], rows: list[Row],
               splits: list[Split]) -> None:
    ns_a = ca.namespace(identity(label, heads))
    ns_b = cb.namespace(identity(label, heads))
    size = ns_a.block_bytes
    per_batch = max(1, (args.batch_mib << 20) // size)
    batches = max(1, (args.mib << 20) // (size * per_batch))
    n = per_batch * batches
    total = n * size
    rng = np.random.default_rng(7)
    values = [rng.bytes(size) for _ in range(per_batch)]  # the same values on both sides
    pages = [memoryview(bytearray(size)) for _ in range(per_batch)]  # an engine's cache
    chains: Iterator[int] = iter(range(10**9))

    def fresh_daemon_keys() -> list[list[bytes]]:
        # every batch its own chain from the root, so batches never wait on each other
        return [ns_a.keys(range(i * per_batch * 8, (i + 1) * per_batch * 8))
                for i in (next(chains) for _ in range(batches))]

    def fresh_raw_keys() -> list[list[bytes]]:
        base = next(chains)
        return [[f"raw:{label}:{base}:{b}:{j}".encode() for j in range(per_batch)]
                for b in range(batches)]

    def daemon_put(keys: list[list[bytes]]) -> float:
        target = remote_stats(ca)["writes"] + n
        start = time.perf_counter()
        for batch in keys:
            if args.plane == "frames":
                ns_a.put(batch, values)
                continue
            r = ns_a.reserve(batch)
            for buffer, value in zip(r.buffers, values):
                buffer[:] = value
            r.commit()
        while (stats := remote_stats(ca))["writes"] < target:
            if stats["errors"]:
                raise RuntimeError(f"remote writes failed: {stats}")
            time.sleep(0.002)  # a stats call costs the daemon ~50 us: poll gently
        return time.perf_counter() - start

    def daemon_get(keys: list[list[bytes]]) -> float:
        if args.plane == "frames":
            start = time.perf_counter()
            got = [ns_b.get(batch) for batch in keys]
            elapsed = time.perf_counter() - start
        else:  # acquire, and copy the bytes into the engine's (preallocated) pages
            got, elapsed = [], 0.0
            for batch in keys:
                start = time.perf_counter()
                with ns_b.acquire(batch) as held:
                    for page, block in zip(pages, held.buffers):
                        page[:] = block
                elapsed += time.perf_counter() - start
                got.append([bytes(page) for page in pages])  # checked, off the clock
        assert all(g == values for g in got), "daemon B returned wrong bytes"
        return elapsed

    def raw_set(keys: list[list[bytes]]) -> float:
        start = time.perf_counter()
        for batch in keys:
            pipe = raw.pipeline(transaction=False)
            for key, value in zip(batch, values):
                pipe.set(key, value)
            pipe.execute()
        return time.perf_counter() - start

    def raw_get(keys: list[list[bytes]]) -> float:
        start = time.perf_counter()
        got = []
        for batch in keys:
            pipe = raw.pipeline(transaction=False)
            for key in batch:
                pipe.get(key)
            got.append(pipe.execute())
        elapsed = time.perf_counter() - start
        assert all(g == values for g in got), "redis returned wrong bytes"
        return elapsed

    def reset() -> None:
        ns_a.drop()
        ns_b.drop()
        raw.flushall()

    samples: dict[str, list[float]] = {"put": [], "set": [], "get": [], "rget": []}
    # whose CPU counts: the client (this process), redis-server, and the daemon at work
    involved = {"put": ("client", "redis", "a"), "set": ("client", "redis"),
                "get": ("client", "redis", "b"), "rget": ("client", "redis")}
    cpu: dict[str, list[float]] = {name: [] for name in samples}
    cpu_of: dict[tuple[str, str], list[float]] = {}  # (measure, process) -> CPU s/GB
    for repeat in range(args.repeats + 1):  # the first is a warm-up, not counted
        dk, rk = fresh_daemon_keys(), fresh_raw_keys()
        puts: list[tuple[str, Callable[[], float]]] = [
            ("put", partial(daemon_put, dk)), ("set", partial(raw_set, rk))]
        gets: list[tuple[str, Callable[[], float]]] = [
            ("get", partial(daemon_get, dk)), ("rget", partial(raw_get, rk))]
        if repeat % 2:  # alternate who goes first
            puts.reverse()
            gets.reverse()
        for name, fn in (*puts, *gets):
            before = {who: cpu_seconds(pids[who]) for who in involved[name]}
            t = fn()
            used = {who: cpu_seconds(pids[who]) - before[who] for who in involved[name]}
            if repeat:
                samples[name].append(t)
                cpu[name].append(sum(used.values()) / (total / 1e9))
                for who, seconds in used.items():
                    cpu_of.setdefault((name, who), []).append(seconds / (total / 1e9))
        reset()
    rb = remote_stats(cb)
    if rb["errors"] or rb["corrupt_values"]:
        raise RuntimeError(f"daemon B saw remote errors: {rb}")
    for ours, peer in (("put", "set"), ("get", "rget")):
        rows.append((f"{ours} {label} x{per_batch}/req", median_rate(samples[ours], total),
                     median_rate(samples[peer], total), statistics.median(cpu[ours]),
                     statistics.median(cpu[peer])))
        splits.append(({who: statistics.median(cpu_of[ours, who]) for who in involved[ours]},
                       {who: statistics.median(cpu_of[peer, who]) for who in involved[peer]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per sample")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--batch-mib", type=int, default=16,
                        help="MiB per put/get request and per redis-py pipeline")
    parser.add_argument("--plane", choices=("arena", "frames"), default="arena",
                        help="how the client moves bytes: through the shared arena "
                             "(reserve/commit, acquire: what an engine's offload and "
                             "reload do) or as message frames (put/get)")
    args = parser.parse_args()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    work = Path(tempfile.mkdtemp(prefix="kvremote-"))
    server: RedisServer | None = None
    daemons: list[Daemon] = []
    rows: list[Row] = []
    splits: list[Split] = []
    started = time.monotonic()
    try:
        server = RedisServer(work / "redis")
        server.start()
        daemons = [Daemon(work, name, server.url) for name in ("a", "b")]
        for d in daemons:
            d.wait_serving()
        raw = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
        assert server.process is not None
        pids = {"client": os.getpid(), "redis": server.process.pid,
                "a": daemons[0].proc.pid, "b": daemons[1].proc.pid}
        with Client(daemons[0].endpoint, tenant=TENANT, timeout=60) as ca, \
                Client(daemons[1].endpoint, tenant=TENANT, timeout=60) as cb:
            for label, heads in (("256KiB", 4), ("2MiB", 32)):
                bench_size(label, heads, args, ca, cb, raw, pids, rows, splits)
        raw.close()
    finally:
        for d in daemons:
            d.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    parser_name = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python"
    print(f"kvstore remote tier (daemon -> redis) vs redis-py {redis.__version__} "
          f"({parser_name} parser), same redis-server: medians of {args.repeats} runs, "
          f"{args.mib} MiB per sample, {args.plane} plane, {os.cpu_count()} CPUs, "
          f"{time.monotonic() - started:.0f} s")
    print(f"{'':20} {'--- throughput GB/s ---':>27}   {'--- CPU s per GB ---':>27}")
    print(f"{'measure':20} {'kvstore':>9} {'redis-py':>9} {'ratio':>7}   "
          f"{'kvstore':>9} {'redis-py':>9} {'ratio':>7}")
    for name, ours, peer, cpu_ours, cpu_peer in rows:
        print(f"{name:20} {ours:9.2f} {peer:9.2f} {ours / peer:7.2f}   "
              f"{cpu_ours:9.2f} {cpu_peer:9.2f} {cpu_peer / cpu_ours:7.2f}")
    print("CPU s per GB by process (daemon a: put, b: get):")
    for (name, *_), (ours_by, peer_by) in zip(rows, splits):
        print(f"  {name:18} kvstore {_by_process(ours_by)}   redis-py {_by_process(peer_by)}")
    print("put: client puts into daemon A (arena: reserve, write, commit; frames: put) "
          "until A's remote writes count every block; redis-py: pipelined SET")
    print("get: daemon B fetches from redis into DRAM; the client takes the bytes (arena: "
          "acquire, copy into preallocated pages; frames: get); redis-py: pipelined GET")
    print("CPU: client + redis-server (+ the daemon at work), all threads; "
          "ratio = redis-py CPU / kvstore CPU")
    print("throughput ratio = kvstore GB/s / redis-py GB/s (target >= 0.80)")


def _by_process(seconds: dict[str, float]) -> str:
    return " ".join(f"{who} {value:.2f}" for who, value in seconds.items())


if __name__ == "__main__":
    main()
