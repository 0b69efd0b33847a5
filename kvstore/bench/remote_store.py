"""The remote tier through the daemon against redis-py SET/GET on the same server.

Two daemons, A and B, with ``--remote`` on one Redis server and no SSD tier.  Per block
size (256 KiB, 2 MiB) and sample:

- put: a client writes chains of 16 blocks into A through the arena; the clock runs
  until A's ``stats()["remote"]["writes"]`` counts them all (the write-through is done).
  Peer: redis-py pipelined SET of the same values, 16 per pipeline.
- get: a client of B acquires the same keys, which B does not hold, so B fetches them
  from Redis, and copies them out.  Peer: redis-py pipelined GET, 16 per pipeline.

The server is ``--redis URL`` (point it at a scratch database: the daemons' copies stay
there) or a redis-server it starts on a free loopback port, keeping nothing on disk.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from kvstore.bench.harness import BenchError, Daemon, Progress, Results, Row
from kvstore.bench.planes import BLOCKS_PER_CALL, SIZES, sized_identity
from kvstore.client import Client, Namespace


class RedisServer:
    """A redis-server on a free loopback port, nothing on disk; killed by ``stop``."""

    def __init__(self, binary: str, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise BenchError("the redis-server it started did not answer") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Size:
    """One block size on both daemons and on the raw client."""

    def __init__(self, label: str, a: Client, b: Client, raw: Any, batches: int) -> None:
        self.label = label
        self.a: Namespace = a.namespace(sized_identity(label, "bench"))
        self.b: Namespace = b.namespace(sized_identity(label, "bench"))
        self.stats = a.stats
        self.raw = raw
        self.size = self.a.block_bytes
        self.batches = batches
        self.total = batches * BLOCKS_PER_CALL * self.size
        self.values = [bytes([i]) * self.size for i in range(BLOCKS_PER_CALL)]
        self.pages = [memoryview(bytearray(self.size)) for _ in range(BLOCKS_PER_CALL)]
        self.chain = 0

    def fresh(self) -> tuple[list[list[bytes]], list[list[bytes]]]:
        """Keys never used before: the daemon's chains and the raw client's."""
        span = BLOCKS_PER_CALL * 8
        ours, raw = [], []
        for _ in range(self.batches):
            self.chain += 1
            ours.append(self.a.keys(range(self.chain * span, (self.chain + 1) * span)))
            raw.append([f"kvstore-bench:{self.label}:{self.chain}:{j}".encode()
                        for j in range(BLOCKS_PER_CALL)])
        return ours, raw

    def put(self, chains: list[list[bytes]]) -> float:
        target = self.stats()["remote"]["writes"] + len(chains) * BLOCKS_PER_CALL
        started = time.perf_counter()
        for keys in chains:
            r = self.a.reserve(keys)
            for buffer, value in zip(r.buffers, self.values):
                buffer[:] = value
            r.commit()
        while (stats := self.stats()["remote"])["writes"] < target:
            if stats["errors"]:
                raise BenchError(f"the daemon's remote writes failed: {stats}")
            time.sleep(0.002)  # a stats call costs the daemon some: poll gently
        return time.perf_counter() - started

    def get(self, chains: list[list[bytes]]) -> float:
        started = time.perf_counter()
        for keys in chains:
            with self.b.acquire(keys) as held:
                for page, block in zip(self.pages, held.buffers):
                    page[:] = block
        return time.perf_counter() - started

    def raw_set(self, keys: list[list[bytes]]) -> float:
        started = time.perf_counter()
        for batch in keys:
            pipe = self.raw.pipeline(transaction=False)
            for key, value in zip(batch, self.values):
                pipe.set(key, value)
            pipe.execute()
        return time.perf_counter() - started

    def raw_get(self, keys: list[list[bytes]]) -> float:
        started = time.perf_counter()
        for batch in keys:
            pipe = self.raw.pipeline(transaction=False)
            for key in batch:
                pipe.get(key)
            pipe.execute()
        return time.perf_counter() - started


def remote(work: Path, repeat: int, quick: bool, url: str | None, results: Results,
           progress: Progress) -> None:
    """Put and get through the daemons' remote tier against redis-py, both sizes."""
    server = None
    if url is None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            results.skipped["remote"] = "no redis-server installed and no --redis URL"
            progress.note("remote: skipped, no redis-server installed and no --redis URL")
            return
        server = RedisServer(binary, work / "redis")
        url = server.url
    a = Daemon(work / "remote-a", dram="512MiB", extra=["--remote", url])
    b = Daemon(work / "remote-b", dram="512MiB", extra=["--remote", url])
    raw = redis.Redis.from_url(url)
    try:
        raw.ping()
        a.start()
        b.start()
        with Client(a.endpoint, tenant="bench") as ca, Client(b.endpoint, tenant="bench") as cb:
            for label in SIZES:
                progress.step(f"remote: {label} blocks")
                size = _Size(label, ca, cb, raw, 1 if quick else 4)
                samples: dict[str, list[float]] = {"put": [], "set": [], "get": [],
                                                   "rget": []}
                for i in range(repeat + 1):  # the first is a warm-up
                    ours, theirs = size.fresh()
                    times = {"put": size.put(ours), "set": size.raw_set(theirs),
                             "get": size.get(ours), "rget": size.raw_get(theirs)}
                    raw.delete(*[k for batch in theirs for k in batch])
                    size.a.drop()
                    size.b.drop()
                    if i:
                        for name, t in times.items():
                            samples[name].append(size.total / t / 1e9)
                med = {name: statistics.median(v) for name, v in samples.items()}
                results.rows.append(Row("remote", f"remote put {label} x16", "GB/s",
                                        med["put"], med["set"], "redis-py SET", "higher",
                                        0.7))
                results.rows.append(Row("remote", f"remote get {label} x16", "GB/s",
                                        med["get"], med["rget"], "redis-py GET", "higher",
                                        0.7))
                progress.advance()
    except redis.RedisError as exc:
        raise BenchError(f"the Redis server at {url} failed: {exc}") from exc
    finally:
        raw.close()
        a.stop()
        b.stop()
        if server is not None:
            server.stop()
