"""LMCache's multiprocess server measured through LMCache's own client classes, with the
definitions ``kvstore bench`` uses for kvstore.  Run as a script by the Python of an
environment where LMCache is installed; it imports nothing of kvstore, starts the
server itself and prints one JSON object:

    python -I lmcache_driver.py --port P --http-port H --repeat N [--quick] [--log FILE]

- lookup of a 64-chunk prefix that is cached (LOOKUP, then QUERY_PREFETCH_STATUS until
  it answers: LMCache's lookup), in microseconds;
- store of 16 chunks of 256 KiB and of 2 MiB from a worker's KV cache in shared memory,
  ack-to-visible: from the STORE until a lookup sees all 16 chunks, in GB/s;
- load of the same 16 chunks (RETRIEVE into the worker's KV cache, after a lookup that
  takes its read locks, as an engine's does), in GB/s.

A chunk is 256 tokens of ``(2, blocks, 16, 1, 128)`` float16 KV per layer: 2 layers make
256 KiB, 16 layers 2 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

CHUNK_TOKENS = 256
LAYERS = {"256KiB": 2, "2MiB": 16}
CHUNKS = 16
LOOKUP_CHUNKS = 64


def start_server(port: int, http_port: int, log: Any) -> subprocess.Popen[bytes]:
    """``lmcache server`` on loopback, a 2 GB DRAM L1, no observability exporters; its
    log into the file ``log``."""
    env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
         "--port", str(port), "--http-host", "127.0.0.1", "--http-port", str(http_port),
         "--l1-size-gb", "2", "--eviction-policy", "LRU", "--chunk-size",
         str(CHUNK_TOKENS), "--disable-observability"],
        stdout=subprocess.DEVNULL, stderr=log, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", http_port), timeout=0.5):
                return proc  # the HTTP frontend listens once the cache server runs
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("lmcache server did not come up in 120 s")


class Worker:
    """One simulated engine worker: LMCache's bench client, its KV cache registered with
    the server over shared memory, and its request client."""

    def __init__(self, port: int, http_port: int, layers: int, tokens: int) -> None:
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        blocks = max(1024, 4 * tokens // 16)
        self.config = BenchConfig(
            rpc_url=f"tcp://127.0.0.1:{port}", http_url=f"http://127.0.0.1:{http_port}",
            mode="cpu", transfer_mode="lmcache_driven", tp_size=1, use_mla=False,
            num_tokens=tokens, kvcache_shape_spec=f"(2,{blocks},16,1,128):float16:{layers}",
            num_blocks=blocks, block_size=16)
        self.client = ServerBenchClient(self.config, log=lambda _: None)
        self.client.start()
        # token ids follow the sequence number: each layout its own, or a 2 MiB store
        # would find the 256 KiB chunks of the same tokens already there
        self.sequence = layers * 1_000_000 + tokens

    def request(self) -> Any:
        self.sequence += 1
        return self.client.create_request(self.sequence, f"kvb-{self.sequence}", "bench")

    def lookup(self, request: Any) -> int:
        """LMCache's lookup of a whole request: LOOKUP, then poll its prefetch status
        (without sleeping between polls) until it answers; the hit chunks."""
        from lmcache.cli.commands.bench.server_bench.helpers import (
            _TIMEOUT,
            _make_key,
            _wait_for_result,
        )

        rc = self.client._req_client
        key = _make_key(request.token_ids, request.request_id, start=0,
                        end=request.num_full_tokens, world_size=1)
        if _wait_for_result(rc.lookup(key, 1)) is _TIMEOUT:
            raise RuntimeError("LMCache LOOKUP timed out")
        while True:
            hits = _wait_for_result(rc.query_prefetch_status(request.request_id))
            if hits is _TIMEOUT:
                raise RuntimeError("LMCache QUERY_PREFETCH_STATUS timed out")
            if hits is not None:
                return int(hits)

    def end(self, request: Any) -> None:
        self.client.end_session(request)

    def close(self) -> None:
        self.client.close()


def measure_lookup(port: int, http_port: int, repeat: int, inner: int) -> float:
    """Median microseconds of a 64-chunk lookup that hits every chunk."""
    worker = Worker(port, http_port, LAYERS["256KiB"], LOOKUP_CHUNKS * CHUNK_TOKENS)
    try:
        request = worker.request()
        result = worker.client.store(request, 0, request.num_full_tokens)
        if result is None or not result.succeeded:
            raise RuntimeError("LMCache STORE of the lookup's chunks failed")
        deadline = time.monotonic() + 30
        while worker.lookup(request) != LOOKUP_CHUNKS:  # acknowledged, not yet visible
            if time.monotonic() > deadline:
                raise RuntimeError("LMCache's stored chunks did not become visible")
        worker.end(request)
        samples = []
        for _ in range(repeat + 1):
            started = time.perf_counter()
            for _ in range(inner):
                hits = worker.lookup(request)
                if hits != LOOKUP_CHUNKS:
                    raise RuntimeError(f"LMCache lookup hit {hits} of {LOOKUP_CHUNKS}")
            samples.append((time.perf_counter() - started) / inner)
            worker.end(request)  # the lookups' read locks go with the session
        return statistics.median(samples[1:]) * 1e6
    finally:
        worker.close()


def measure_store_load(port: int, http_port: int, label: str,
                       repeat: int) -> tuple[float, float]:
    """Median GB/s of storing 16 chunks (ack-to-visible) and of loading them back."""
    worker = Worker(port, http_port, LAYERS[label], CHUNKS * CHUNK_TOKENS)
    chunk_bytes = 2 * LAYERS[label] * CHUNK_TOKENS * 128 * 2
    total = CHUNKS * chunk_bytes
    stores, loads = [], []
    try:
        for i in range(repeat + 1):  # the first is a warm-up
            request = worker.request()
            started = time.perf_counter()
            result = worker.client.store(request, 0, request.num_full_tokens)
            if result is None or not result.succeeded:
                raise RuntimeError(f"LMCache STORE of {label} chunks failed")
            while worker.lookup(request) != CHUNKS:
                pass
            stored = time.perf_counter() - started
            worker.end(request)
            reader = worker.client.create_request(request.sequence_id,
                                                  f"{request.request_id}-r", "bench")
            if worker.lookup(reader) != CHUNKS:  # takes the read locks, off the clock
                raise RuntimeError("LMCache lost the chunks it stored")
            started = time.perf_counter()
            result = worker.client.retrieve(reader, 0, reader.num_full_tokens)
            loaded = time.perf_counter() - started
            if result is None or not result.succeeded:
                raise RuntimeError(f"LMCache RETRIEVE of {label} chunks failed")
            worker.end(reader)
            if i:
                stores.append(total / stored / 1e9)
                loads.append(total / loaded / 1e9)
    finally:
        worker.close()
    return statistics.median(stores), statistics.median(loads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--log", default=os.devnull, help="the server's log")
    args = parser.parse_args()
    from importlib.metadata import version

    out: dict[str, Any] = {"version": version("lmcache")}
    log = open(args.log, "ab")  # noqa: SIM115 - closed below, after the server
    server = start_server(args.port, args.http_port, log)
    try:
        out["lookup_64_us"] = measure_lookup(args.port, args.http_port, args.repeat,
                                             5 if args.quick else 50)
        for label in LAYERS:
            store, load = measure_store_load(args.port, args.http_port, label, args.repeat)
            out[f"store_{label}_gbs"] = store
            out[f"load_{label}_gbs"] = load
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
