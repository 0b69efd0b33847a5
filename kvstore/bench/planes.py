"""The daemon's control, arena and frame planes against their limits: a bare pyzmq echo
(in its own process, as the daemon is), memcpy, and raw pyzmq frames (dropped, and copied
into shared memory before the ack: ``kvstore.bench.frame_peer``); and the curves behind
the plots (lookup latency against chain length, throughput against clients).

Every measurement takes fresh keys of namespaces of its own (model ``kvstore-bench-*``),
dropped when the section ends, so a running daemon keeps nothing of the run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from kvstore import protocol as p
from kvstore.aclient import AsyncClient
from kvstore.bench.frame_peer import FramePeer
from kvstore.bench.harness import Progress, Results, Row, Settings, paired
from kvstore.client import Client, Namespace
from kvstore.identity import Identity

KiB, MiB = 1 << 10, 1 << 20
BLOCKS_PER_CALL = 16  # the data planes move 16 blocks per call, as an engine's offload does
LOOKUP_KEYS = 64
PIPELINE_DEPTH = 32
# An engine's lookup comes once a request, after a forward pass: the daemon (and the
# client's own I/O thread) idle that long before it.  On a 2-core VM a bare pyzmq echo
# took 0.75-0.91 ms after 40 ms idle against 0.16-0.25 back to back (the threads' and
# CPUs' wake-ups, and memory left untouched that long: about a microsecond a page to
# touch again there), the daemon's lookup of 95 keys 1.06-1.24 against 0.22.
IDLE_GAP_S = 0.04
CHAIN_LENGTHS = (1, 4, 16, 64, 256, 1024, 4096)
CLIENT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# block bytes -> KV heads that give them (16 layers, head dim 128, 8 tokens, float16)
SIZES = {"256KiB": 4, "2MiB": 32}


def small_identity(name: str, tenant: str) -> Identity:
    """8 KiB blocks of 16 tokens: the control plane's keys."""
    return Identity(model=f"kvstore-bench-{name}", model_revision="r", tenant=tenant,
                    kv_dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                    block_tokens=16)


def sized_identity(label: str, tenant: str) -> Identity:
    return Identity(model=f"kvstore-bench-{label}", model_revision="r", tenant=tenant,
                    kv_dtype="float16", num_layers=16, num_kv_heads=SIZES[label],
                    head_dim=128, block_tokens=8)


class Echo:
    """A DEALER on the echo peer: one blocking round trip per call."""

    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def of(self, frames: list[Any]) -> Callable[[], object]:
        """A round trip of ``frames``, sent and read as the clients do (one frame in one
        send; each frame's more flag read, not RCVMORE asked of the socket)."""
        sock = self.sock

        def go() -> object:
            if len(frames) == 1:
                sock.send(frames[0])
            else:
                sock.send_multipart(frames, copy=False)
            parts = [sock.recv(copy=False)]
            while parts[-1].more:
                parts.append(sock.recv(copy=False))
            return [part.bytes for part in parts]  # into bytes, as the client's get returns
        return go

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _fresh(ns: Namespace, span: int, count: int) -> Iterator[list[bytes]]:
    """``count`` chains of ``span`` tokens never used before in this namespace, hashed
    ahead of the clock: the client's hashing is not the round trip."""
    at = 1 << 30
    return iter([ns.keys(range(at + i * span, at + (i + 1) * span)) for i in range(count)])


def control(s: Settings, results: Results, progress: Progress) -> None:
    """Lookup of a 64-key chain (back to back, and each after ``IDLE_GAP_S`` idle),
    reserve+commit of 1 and 16 blocks, pipelined lookups."""
    echo = Echo(s.echo)
    try:
        with Client(s.endpoint, tenant=s.tenant, token=s.token, timeout=s.timeout) as client:
            ns = client.namespace(small_identity("control", s.tenant))
            try:
                progress.step("control: lookup of a 64-key chain")
                chain = ns.keys(range(16 * LOOKUP_KEYS))
                ns.put(chain, [bytes(ns.block_bytes)] * LOOKUP_KEYS)
                look = p.encoder.encode(p.Lookup(1, ns.id, chain))
                ours, peer = paired(lambda: ns.lookup(chain), echo.of([look]), s.repeat,
                                    s.inner)
                results.rows.append(Row("control", "lookup 64 keys", "us", ours * 1e6,
                                        peer * 1e6, "pyzmq echo", "lower", 1.25))
                progress.advance()
                progress.step(f"control: lookup after {IDLE_GAP_S * 1e3:.0f} ms idle")
                ours, peer = paired(lambda: ns.lookup(chain), echo.of([look]),
                                    max(3, s.inner // 20), gap=IDLE_GAP_S)
                results.rows.append(Row("control", f"lookup after {IDLE_GAP_S * 1e3:.0f} "
                                        "ms idle", "us", ours * 1e6, peer * 1e6,
                                        "pyzmq echo, idle alike", "lower", 1.25))
                progress.advance()
                for n in (1, 16):
                    progress.step(f"control: reserve+commit of {n}")
                    inner = max(1, s.inner // 4)
                    fresh = _fresh(ns, 16 * n, s.repeat * inner + 1)

                    def reserve_commit(fresh: Iterator[list[bytes]] = fresh) -> None:
                        ns.reserve(next(fresh)).commit()
                    req = p.encoder.encode(p.Reserve(1, ns.id, chain[:n]))
                    once = echo.of([req])

                    def two_echoes(once: Callable[[], object] = once) -> None:
                        once()
                        once()
                    ours, peer = paired(reserve_commit, two_echoes, s.repeat, inner)
                    results.rows.append(Row("control", f"reserve+commit {n}", "us",
                                            ours * 1e6, peer * 1e6, "2 pyzmq echoes",
                                            "lower", 1.25))
                    progress.advance()
                progress.step("control: pipelined lookups")
                rates: tuple[list[float], list[float]] = ([], [])
                for _ in range(s.repeat):  # interleaved, as paired() does
                    rates[0].append(_rate_blocking(echo.of([look]), s))
                    rates[1].append(asyncio.run(_pipelined(s, ns.identity, chain)))
                blocking, pipelined = map(statistics.median, rates)
                results.rows.append(Row("control", f"pipelined lookups ({PIPELINE_DEPTH} "
                                        "in flight)", "req/s", pipelined, blocking,
                                        "blocking echo", "higher", 0.8))
                progress.advance()
            finally:
                ns.drop()
    finally:
        echo.close()


def _rate_blocking(once: Callable[[], object], s: Settings) -> float:
    n = s.inner
    started = time.perf_counter()
    for _ in range(n):
        once()
    return n / (time.perf_counter() - started)


async def _pipelined(s: Settings, identity: Identity, chain: list[bytes]) -> float:
    """Lookups per second with ``PIPELINE_DEPTH`` of them in flight on one connection."""
    async with AsyncClient(s.endpoint, tenant=s.tenant, token=s.token, timeout=s.timeout) as client:
        ns = await client.namespace(identity)
        total = max(PIPELINE_DEPTH, s.inner * 4)
        done = 0

        async def worker() -> None:
            nonlocal done
            while done < total:
                done += 1
                await ns.lookup(chain)
        await asyncio.gather(*(worker() for _ in range(PIPELINE_DEPTH)))  # warm
        done = 0
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(PIPELINE_DEPTH)))
        return total / (time.perf_counter() - started)


class SizedBlocks:
    """One block size's namespace, source blocks and the memcpy peer's rotating region
    (as large as the arena's share, so neither side writes from cache to cache), and the
    destination blocks a read copies into."""

    def __init__(self, client: Client, label: str, s: Settings) -> None:
        self.label = label
        self.ns = client.namespace(sized_identity(label, s.tenant))
        self.size = self.ns.block_bytes
        self.total = BLOCKS_PER_CALL * self.size
        rng = np.random.default_rng(0)
        self.src = [rng.integers(0, 255, self.size, dtype=np.uint8)
                    for _ in range(BLOCKS_PER_CALL)]
        self.payload = [b.tobytes() for b in self.src]
        self.dst = [np.empty(self.size, dtype=np.uint8) for _ in range(BLOCKS_PER_CALL)]
        self.region = np.ones((64 if s.quick else 512) * MiB, dtype=np.uint8)
        self.cursor = 0
        self.counter = iter(range(1, 1 << 30))
        self.keys = self.fresh()
        self.ns.put(self.keys, self.payload)
        # the timed writes' chains, hashed ahead of the clock as the control section's
        # are: the client's hashing (46 us for 16 blocks here) is not the write
        self.ahead = [self.fresh() for _ in range(s.repeat + 2)]

    def fresh(self) -> list[bytes]:
        i = next(self.counter)
        span = BLOCKS_PER_CALL * 8
        return self.ns.keys(range(i * span, (i + 1) * span))

    def unused(self) -> list[bytes]:
        """A chain never written, hashed already when there is one left."""
        return self.ahead.pop() if self.ahead else self.fresh()

    def gbs(self, seconds: float) -> float:
        return self.total / seconds / 1e9

    def memcpy(self) -> None:
        at = self.cursor
        for s in self.src:
            if at + self.size > len(self.region):
                at = 0
            np.copyto(self.region[at:at + self.size], s)
            at += self.size
        self.cursor = at

    def memcpy_out(self) -> None:
        """The copy a read makes, without the daemon: into the same destination blocks
        ``arena_get`` fills, from blocks read over and over as its arena slots are (the
        rotating region's cold writes would make the peer slower than the copy the read
        itself makes)."""
        for s, d in zip(self.src, self.dst):
            np.copyto(d, s)

    def arena_put(self) -> None:
        with self.ns.reserve(self.unused()) as r:
            for buf, s in zip(r.buffers, self.src):
                np.copyto(np.frombuffer(buf, dtype=np.uint8), s)
            r.commit()

    def readable(self) -> None:
        """The read chain in DRAM again where the writes before pushed it out, untimed: on
        a running daemon of little DRAM the reads' acquire ended the run ("key 14 of 16
        ... is not cached").  Where it stayed, nothing is written."""
        hit = self.ns.lookup(self.keys)
        if hit.blocks < len(self.keys) or any(t != "dram" for t in hit.tiers):
            self.ns.put(self.keys, self.payload)

    def arena_get(self) -> None:
        with self.ns.acquire(self.keys) as held:
            for buf, d in zip(held.buffers, self.dst):
                np.copyto(d, np.frombuffer(buf, dtype=np.uint8))

    def frame_put(self) -> None:
        self.ns.put(self.unused(), self.payload)

    def frame_get(self) -> None:
        self.ns.get(self.keys)


def arena(s: Settings, results: Results, progress: Progress) -> None:
    """Reserve+write+commit and acquire+read+release of 16 blocks against memcpy."""
    with Client(s.endpoint, tenant=s.tenant, token=s.token, timeout=s.timeout) as client:
        for label in SIZES:
            progress.step(f"arena: {label} blocks x{BLOCKS_PER_CALL}")
            sized = SizedBlocks(client, label, s)
            try:
                put, mem = paired(sized.arena_put, sized.memcpy, s.repeat)
                sized.readable()
                get, mem2 = paired(sized.arena_get, sized.memcpy_out, s.repeat)
                results.rows.append(Row("arena", f"arena write {label} x16", "GB/s",
                                        sized.gbs(put), sized.gbs(mem), "memcpy",
                                        "higher", 0.8))
                results.rows.append(Row("arena", f"arena read {label} x16", "GB/s",
                                        sized.gbs(get), sized.gbs(mem2), "memcpy",
                                        "higher", 0.8))
            finally:
                sized.ns.drop()
            progress.advance()


def frames(s: Settings, results: Results, progress: Progress) -> None:
    """Put and get of 16 blocks in message frames against raw pyzmq frames; and each put
    beside the same frames copied into shared memory before the ack, what a put must have
    done before it answers (its blocks readable in the arena): the raw sink drops them."""
    with FramePeer((64 if s.quick else 512) * MiB) as peer:
        echo = Echo(peer.endpoint)
        try:
            with Client(s.endpoint, tenant=s.tenant, token=s.token, map_arena=False,
                        timeout=s.timeout) as client:
                for label in SIZES:
                    progress.step(f"frames: {label} blocks x{BLOCKS_PER_CALL}")
                    sized = SizedBlocks(client, label, s)
                    try:
                        _frame_rows(sized, echo, s, results)
                    finally:
                        sized.ns.drop()
                    progress.advance()
        finally:
            echo.close()


def _frame_rows(sized: SizedBlocks, echo: Echo, s: Settings, results: Results) -> None:
    label, n = sized.label, BLOCKS_PER_CALL
    sink = echo.of([b"sink", *sized.payload])
    store = echo.of([b"store", *sized.payload])
    source = echo.of([f"source {n} {sized.size}".encode()])
    put, raw_put, stored = _interleaved([sized.frame_put, sink, store], s.repeat)
    sized.readable()
    get, raw_get = paired(sized.frame_get, source, s.repeat)
    name = f"frame put {label} x{n}"
    results.rows.append(Row("frames", name, "GB/s", sized.gbs(put), sized.gbs(raw_put),
                            "raw pyzmq", "higher", 0.8))
    results.rows.append(Row("frames", name, "GB/s", sized.gbs(put), sized.gbs(stored),
                            "pyzmq + copy into shm", "higher", 0.8))
    results.rows.append(Row("frames", f"frame get {label} x{n}", "GB/s", sized.gbs(get),
                            sized.gbs(raw_get), "raw pyzmq", "higher", 0.8))


def _interleaved(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """``paired`` for several: median seconds per call of each, one call of each a round,
    who goes first turning round by round."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for i in range(repeats):
        for k in range(len(fns)):
            j = (i + k) % len(fns)
            start = time.perf_counter()
            fns[j]()
            samples[j].append(time.perf_counter() - start)
    return [statistics.median(each) for each in samples]


def sweeps(s: Settings, results: Results, progress: Progress) -> None:
    """Lookup latency against chain length, throughput against concurrent clients."""
    lengths = CHAIN_LENGTHS
    counts = (1, 4, 16, 64) if s.quick else CLIENT_COUNTS
    echo = Echo(s.echo)
    try:
        with Client(s.endpoint, tenant=s.tenant, token=s.token, timeout=s.timeout) as client:
            ns = client.namespace(small_identity("sweep", s.tenant))
            try:
                progress.step("sweep: lookup latency against chain length")
                chain = ns.keys(range(16 * lengths[-1]))
                for at in range(0, len(chain), 512):
                    part = chain[at:at + 512]
                    ns.put(part, [bytes(ns.block_bytes)] * len(part),
                           parent=chain[at - 1] if at else None)
                curve = []
                for n in lengths:
                    keys = chain[:n]
                    look = p.encoder.encode(p.Lookup(1, ns.id, keys))
                    def lookup(keys: list[bytes] = keys) -> object:
                        return ns.lookup(keys)
                    ours, peer = paired(lookup, echo.of([look]), s.repeat,
                                        max(1, s.inner // 4))
                    curve.append({"keys": n, "kvstore_us": ours * 1e6, "echo_us": peer * 1e6})
                results.sweeps["lookup_latency"] = curve
                progress.advance()
                progress.step("sweep: throughput against clients")
                look = p.encoder.encode(p.Lookup(1, ns.id, chain[:LOOKUP_KEYS]))
                seconds = 0.3 if s.quick else 1.0
                rates = []
                for k in counts:
                    ours = asyncio.run(_clients(s, ns.identity, chain[:LOOKUP_KEYS], k,
                                                seconds))
                    peer = asyncio.run(_echo_clients(s.echo, look, k, seconds))
                    rates.append({"clients": k, "kvstore_rps": ours, "echo_rps": peer})
                results.sweeps["throughput"] = rates
                progress.advance()
            finally:
                ns.drop()
    finally:
        echo.close()


async def _clients(s: Settings, identity: Identity, chain: list[bytes], k: int,
                   seconds: float) -> float:
    """Lookups per second of ``k`` connections, each with one request in flight."""
    clients = [await AsyncClient(s.endpoint, tenant=s.tenant, token=s.token,
                                 map_arena=False, timeout=s.timeout).connect() for _ in range(k)]
    try:
        spaces = [await c.namespace(identity) for c in clients]
        stop = time.perf_counter() + seconds
        counts = [0] * k

        async def one(i: int) -> None:
            while time.perf_counter() < stop:
                await spaces[i].lookup(chain)
                counts[i] += 1
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(k)))
        return sum(counts) / (time.perf_counter() - started)
    finally:
        for c in clients:
            await c.close()


async def _echo_clients(endpoint: str, request: bytes, k: int, seconds: float) -> float:
    """Echoes per second of ``k`` DEALER sockets, each with one request in flight."""
    ctx = zmq.asyncio.Context()
    socks = []
    for _ in range(k):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    try:
        stop = time.perf_counter() + seconds
        counts = [0] * k

        async def one(i: int) -> None:
            while time.perf_counter() < stop:
                await socks[i].send(request)
                await socks[i].recv_multipart()
                counts[i] += 1
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(k)))
        return sum(counts) / (time.perf_counter() - started)
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
