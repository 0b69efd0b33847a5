"""How long the daemon's event loop is held, and what the index costs, as blocks grow.

Three parts, each run at several index sizes (every size in a fresh process, so that
its memory is its own), printing medians, tails and ratios:

- ``store``: the pure store alone (no arena, no sockets): index memory per committed
  block (RSS delta, keys included), ingest (reserve+commit of 1024-key chains,
  blocks/s), lookup of 64 keys (p50, p99), evict of one leaf, stats, the invariant
  check (whole, and the fork that takes it off the daemon's loop), the garbage
  collector's longest pause while the index was built, and the SSD slots' claims of a
  warm restart (per block);
- ``daemon``: a real daemon (an unpopulated arena, so untouched slots cost nothing):
  ingest through a client, then each verb's round trip while a second client pings
  the daemon every half millisecond; the probe's longest ping is the longest stall of
  the loop any client saw (last, a snapshot of all the blocks in pages and in one
  reply, an evict of the key that heads half the blocks, and the namespace's drop;
  with ``--debug-invariants``, the invariant check after each request as well; after
  the idle phase, a change of the eviction policy from ``slru`` to ``auto`` by SIGHUP,
  ``sighup``, its window from the signal to the new order in charge).  On a
  loaded machine that wall-clock stall (``stall_``) is mostly other processes: each
  ping also reads the daemon's CPU time and the time it and the probe waited for a
  CPU, and ``loop_`` is the most of one ping the daemon's loop can have held;
- ``sessions``: many client sessions at once, each pinging about once a second, and
  one more client's ping p50/p99 beside that load and without it;
- ``slabs``: a daemon whose arena is full of small blocks (``--small``, 16 KiB) asked
  for blocks of another size (``--large``, 1 MiB) needing ``--request-slabs`` slabs at
  once (15 of 16 by default), each handed over by the small blocks' class (their
  coldest evicted, a slab's survivors copied into the freed slots); the probe's
  longest ping and the loop's longest hold during that one reserve, against the
  longest of the same number of single-slab reserves, and the turns the daemon let
  others have (``slab_turns``).

    python benchmarks/loop_stalls.py store --sizes 10k,100k,400k,1M
    python benchmarks/loop_stalls.py daemon --sizes 10k,100k,400k
    python benchmarks/loop_stalls.py sessions --sessions 1000
    python benchmarks/loop_stalls.py slabs [--request-slabs 15] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from kvstore.config import parse_size

CHAIN = 1024
KEY = 16
SLOT = 4096  # the smallest DRAM slot: the arena's alignment


def parse_count(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def chains(n: int, seed: int = 1) -> Iterator[list[bytes]]:
    """``n`` blocks' keys in chains of ``CHAIN`` random keys, as clients send them."""
    rng = __import__("random").Random(seed)
    left = n
    while left > 0:
        size = min(CHAIN, left)
        blob = rng.randbytes(size * KEY)
        yield [blob[i * KEY:(i + 1) * KEY] for i in range(size)]
        left -= size


class GcPauses:
    """The collector's pauses, by generation, while registered."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.total = 0.0  # seconds paused so far, all generations
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            paused = time.perf_counter() - self._start
            self.pauses[info["generation"]].append(paused)
            self.total += paused

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


# -- the pure store --------------------------------------------------------------------------
def store_figures(n: int, policy: str, check: bool, settle_every: int) -> dict[str, float]:
    from kvstore.identity import Identity
    from kvstore.store import BlockStore, Reservation

    gc.collect()
    base = rss_bytes()
    store = BlockStore((n + CHAIN) * SLOT, 64 << 20, eviction_policy=policy)
    ident = Identity(model="loop", model_revision="r", tenant="t", kv_dtype="float16",
                     num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16)
    ns = store.open_namespace(ident)
    heads: list[list[bytes]] = []
    tails: list[bytes] = []
    ingest = 0.0
    try:  # the daemon's heap settling, where this version of it has one
        from kvstore.heap import settle
    except ImportError:
        settle_every = 0
    with GcPauses() as pauses:
        for i, keys in enumerate(chains(n)):
            if settle_every and i % settle_every == 0:
                settle()  # as the daemon does each second
            start = time.perf_counter()
            r = store.reserve("w", ns, keys, None, 0.0)
            assert isinstance(r, Reservation), r
            store.commit("w", r.id, 0.0)
            ingest += time.perf_counter() - start
            heads.append(keys[:64])
            tails.append(keys[-1])
    gc.collect()
    per_block = (rss_bytes() - base) / n
    if settle_every:
        settle()
    rng = __import__("random").Random(2)
    looks = timed(lambda: store.lookup(ns, rng.choice(heads)), 2000)
    stats = timed(store.tier_stats, 5)
    full_gc = timed(gc.collect, 3)

    # one leaf each time: the last block of a chain not evicted from before
    leaves = iter(tails[::max(1, len(tails) // 20)])
    evicts = timed(lambda: store.evict(ns, [next(leaves)]), min(20, len(tails)))
    out = {
        "blocks": n,
        "bytes_per_block": per_block,
        "ingest_blocks_per_s": n / ingest,
        "lookup64_p50_us": pct(looks, 0.5) * 1e6,
        "lookup64_p99_us": pct(looks, 0.99) * 1e6,
        "stats_ms": statistics.median(stats) * 1e3,
        "evict_one_ms": statistics.median(evicts) * 1e3,
        "full_gc_ms": statistics.median(full_gc) * 1e3,
        "gc2_runs_in_ingest": len(pauses.pauses[2]),
        "gc_longest_pause_ms": max((max(v) for v in pauses.pauses.values() if v),
                                   default=0.0) * 1e3,
    }
    out.update(forget_marks(store))
    if check:
        out["check_ms"] = statistics.median(timed(store.check_invariants, 1)) * 1e3
    # what the periodic invariant check (``InvariantWatch``, past its inline size) holds
    # the loop for: the fork of the daemon's heap, parent side (the check runs in the child)
    out["invariant_fork_ms"] = statistics.median(fork_parent() for _ in range(5)) * 1e3
    out["restore_claim_us"] = restore_claims(min(n, 1 << 20)) * 1e6
    return out


def forget_marks(store: object) -> dict[str, float]:
    """The slices that take back every block's remote mark once the remote store lost
    what it held (``remote_copies.ForgetMarks``, a slice a loop turn): the longest and
    the median slice, with every block marked."""
    try:
        from kvstore.remote_copies import ForgetMarks
        from kvstore.remote_watch import FORGET_SLICE, FORGET_SLICE_SECONDS
    except ImportError:
        return {}
    for ns in store.namespaces.values():  # type: ignore[attr-defined]
        for b in ns.blocks.values():
            b.remote = True
    walk = ForgetMarks(store)  # type: ignore[arg-type]
    slices: list[float] = []
    cpu: list[float] = []  # (the slice's own CPU time: on a loaded machine, the wall
    done = False           # clock's longest is mostly other processes)
    while not done:
        start, start_cpu = time.perf_counter(), time.thread_time()
        done, _ = walk.step(FORGET_SLICE, FORGET_SLICE_SECONDS)
        slices.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return {"forget_marks_slice_max_ms": max(slices) * 1e3,
            "forget_marks_slice_p50_ms": statistics.median(slices) * 1e3,
            "forget_marks_slice_cpu_max_ms": max(cpu) * 1e3}


def fork_parent() -> float:
    """Seconds ``os.fork`` takes in the parent (the child leaves at once)."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    took = time.perf_counter() - start
    os.waitpid(pid, 0)
    return took


def restore_claims(n: int, slot: int = 64 << 10, slab: int = 256 << 20) -> float:
    """Seconds per block to claim the SSD slots of ``n`` blocks found in the durable
    index in no order of offset (a warm restart): 64 KiB blocks in 256 MiB slabs."""
    from kvstore.pool import SlabPool

    pool = SlabPool(-(-n * slot // slab) * slab, slab, 4096)
    cls = pool.class_for(slot)
    offsets = [i * slot for i in range(n)]
    __import__("random").Random(4).shuffle(offsets)
    start = time.perf_counter()
    for offset in offsets:
        pool.claim(cls, offset)
    return (time.perf_counter() - start) / n


# -- a real daemon ---------------------------------------------------------------------------
PROBE = r"""
import select, sys, time
from kvstore import Client
out, every, pid = sys.argv[2], float(sys.argv[3]), sys.argv[4]
samples = []
# the daemon's CPU time (all its threads), the time its loop thread spent runnable but
# waiting for a CPU, and this probe's own such time: the machine's other work, which a
# ping's round trip includes, not the daemon's loop
clock = None
if pid != "0":
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    clk = ctypes.c_int()
    if libc.clock_getcpuclockid(int(pid), ctypes.byref(clk)) == 0:
        clock = clk.value
    stat = open(f"/proc/{pid}/task/{pid}/schedstat", "rb", buffering=0)
    mine = open("/proc/thread-self/schedstat", "rb", buffering=0)

def sched():
    if clock is None:
        return 0, 0, 0
    stat.seek(0)
    mine.seek(0)
    return (time.clock_gettime_ns(clock), int(stat.read().split()[1]),
            int(mine.read().split()[1]))

with Client(sys.argv[1], tenant="probe", timeout=600.0) as c:
    c.ping()
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # until told to stop
        run, wait, own = sched()
        start = time.monotonic()
        c.ping()
        took = time.monotonic() - start
        run2, wait2, own2 = sched()
        samples.append((start, took, (run2 - run) / 1e9, (wait2 - wait) / 1e9,
                        (own2 - own) / 1e9))
        if every:
            time.sleep(every)
with open(out, "w") as f:
    f.write("\n".join(" ".join(map(str, s)) for s in samples))
"""

# The daemon, watched from inside: a thread asks the loop for a turn about every
# millisecond (``call_soon_threadsafe``) and the callback notes how much CPU the loop's
# thread spent before it ran (what any new work waits for: the rest of the callback under
# way and those queued before it); its own CPU clock, so other processes do not count.
WATCHED = r"""
import asyncio, sys, threading, time
out, argv = sys.argv[1], sys.argv[2:]
loops = []

def watched(run):
    def watched_run(main, **kw):
        async def outer():
            loops.append(asyncio.get_running_loop())
            return await main
        return run(outer(), **kw)
    return watched_run

asyncio.run = watched(asyncio.run)  # (where there is no uvloop)
try:
    import uvloop
    uvloop.run = watched(uvloop.run)
except ImportError:
    pass
main_thread = threading.get_ident()

def watch():
    while not loops:
        time.sleep(0.01)
    loop, clock = loops[0], time.pthread_getcpuclockid(main_thread)
    with open(out, "w") as f:
        while True:
            asked = time.clock_gettime(clock)
            def turn(at=time.monotonic(), asked=asked):
                held = time.thread_time() - asked
                if held > 2e-4:
                    f.write(f"{at} {held}\n")
            try:
                loop.call_soon_threadsafe(turn)
            except RuntimeError:  # the loop is closed
                return
            f.flush()
            time.sleep(0.001)

threading.Thread(target=watch, daemon=True).start()
sys.argv = ["kvstore", *argv]
from kvstore.cli import main
sys.exit(main())
"""


class Daemon:
    """``python -m kvstore serve`` over an unpopulated arena of ``capacity`` bytes."""

    def __init__(self, work: Path, capacity: int, *, metrics_port: int = 0,
                 debug_invariants: bool = False, lease: float = 600.0,
                 watched: bool = False) -> None:
        self.endpoint = f"ipc://{work}/kvstore.sock"
        # with ``watched``: the loop's turns that kept new work waiting (``WATCHED``)
        self.turns = work / "turns.txt" if watched else None
        config = self.config = work / "kvstore.toml"
        config.write_text(
            f"[server]\nmetrics_port = {metrics_port}\n"
            f"debug_invariants = {str(debug_invariants).lower()}\n"
            f"max_keys_per_request = {CHAIN}\nlease_seconds = {lease}\n"
            f"[dram]\ncapacity = {capacity}\npopulate = false\neviction_policy = \"slru\"\n"
            f"[ssd]\ncapacity = 0\n")
        start = ([sys.executable, "-c", WATCHED, str(self.turns)] if self.turns is not None
                 else [sys.executable, "-m", "kvstore"])
        self.proc = subprocess.Popen(
            [*start, "serve", "--config", str(config), "--endpoint", self.endpoint,
             "--log-level", "warning"], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        while b"serving on" not in self.proc.stdout.readline():
            if self.proc.poll() is not None:
                raise RuntimeError("the daemon did not start")

    def cpu(self) -> float:
        """The daemon's CPU seconds so far, all its threads (0 where it cannot be read)."""
        import ctypes

        clock = ctypes.c_int()
        if ctypes.CDLL(None).clock_getcpuclockid(self.proc.pid, ctypes.byref(clock)):
            return 0.0
        return time.clock_gettime(clock.value)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def switch_policy(self, client: object, policy: str) -> float:
        """Change the DRAM eviction policy by SIGHUP; the seconds until the new order is
        in charge (the daemon's stats say so)."""
        import signal

        done = client.stats()["eviction_switch"]["done"]  # type: ignore[attr-defined]
        text = self.config.read_text()
        self.config.write_text(text.replace('eviction_policy = "slru"',
                                            f'eviction_policy = "{policy}"'))
        start = time.monotonic()
        self.proc.send_signal(signal.SIGHUP)
        while client.stats()["eviction_switch"]["done"] == done:  # type: ignore[attr-defined]
            if time.monotonic() - start > 600:
                raise RuntimeError("the change of policy did not end")
            time.sleep(0.05)
        return time.monotonic() - start

    def held(self) -> list[tuple[float, float]]:
        """(when, CPU seconds) of each turn the loop was asked for that waited (watched)."""
        if self.turns is None or not self.turns.exists():
            return []
        rows = [line.split() for line in self.turns.read_text().splitlines()]
        return [(float(row[0]), float(row[1])) for row in rows if len(row) == 2]


class Probe:
    """A second client pinging the daemon; its samples, by the clock all processes share,
    each with what the daemon's loop thread did meanwhile (given its ``pid``)."""

    def __init__(self, endpoint: str, work: Path, every: float = 0.0005, pid: int = 0) -> None:
        self.out = work / f"probe-{time.monotonic_ns()}.txt"
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, endpoint, str(self.out),
                                      str(every), str(pid)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()

    def samples(self) -> list[Ping]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stop\n")
        self.proc.stdin.flush()
        self.proc.wait(600)
        rows = [line.split() for line in self.out.read_text().splitlines() if line]
        return [Ping(*map(float, row)) for row in rows]


class Ping(NamedTuple):
    """One ping: when it left and how long its round trip took (wall), what the daemon
    spent meanwhile (CPU seconds, all its threads), and the seconds the daemon's loop
    thread and the probe itself were runnable but kept off a CPU by other processes
    (all 0 without the daemon's pid)."""

    start: float
    took: float
    cpu: float = 0.0
    queued: float = 0.0
    probe_queued: float = 0.0


def in_window(samples: list[Ping], window: tuple[float, float]) -> list[Ping]:
    """The pings that overlapped ``window``."""
    return [s for s in samples if s.start <= window[1] and s.start + s.took >= window[0]]


def longest(samples: list[Ping], window: tuple[float, float]) -> float:
    """The longest ping that overlapped ``window`` (seconds)."""
    return max((s.took for s in in_window(samples, window)), default=0.0)


def stall_figures(name: str, samples: list[Ping], window: tuple[float, float],
                  held: list[tuple[float, float]]) -> dict[str, float]:
    """A phase's longest stall by the wall clock (``stall_``: what the probe saw), the
    most CPU the daemon's loop thread spent before a turn it was asked for came
    (``loop_``: the loop's own part, which other processes do not lengthen), and, of
    the longest ping, the daemon's CPU and the time it and the probe waited for a CPU
    (``_cpu``, ``_queued``, ``_probe_queued``): a long ping with little CPU was the
    machine, not the loop."""
    pings = in_window(samples, window)
    worst = max(pings, key=lambda s: s.took, default=Ping(0.0, 0.0))
    return {f"stall_{name}_ms": worst.took * 1e3,
            f"loop_{name}_ms": max((cpu for at, cpu in held
                                    if window[0] <= at <= window[1]), default=0.0) * 1e3,
            f"stall_{name}_cpu_ms": worst.cpu * 1e3,
            f"stall_{name}_queued_ms": worst.queued * 1e3,
            f"stall_{name}_probe_queued_ms": worst.probe_queued * 1e3,
            # the probe's pings in the phase: they are in its ``cpu_`` too, and more of
            # them are answered the less the loop holds them
            f"pings_{name}": float(len(pings))}


def whole_snapshot(client: object) -> int:
    """A snapshot in one reply (``limit`` 0), as older clients ask it: its entries."""
    from kvstore import protocol as p
    from kvstore.client_wire import check_reply

    call, rid = getattr(client, "_call"), getattr(client, "_next_rid")
    reply = check_reply(call(p.Snapshot(rid(), 0, 0))[0], p.SnapshotReply)
    return len(reply.blocks)


def daemon_figures(n: int, debug_invariants: bool) -> dict[str, float]:
    from kvstore import Client, Identity

    work = Path(tempfile.mkdtemp(prefix="kvloop-"))
    port = __import__("socket").create_server(("127.0.0.1", 0))
    metrics_port = port.getsockname()[1]
    port.close()
    daemon = Daemon(work, (n + 4 * CHAIN) * SLOT, metrics_port=metrics_port,
                    debug_invariants=debug_invariants, watched=True)
    windows: dict[str, tuple[float, float]] = {}
    out: dict[str, float] = {"blocks": n}
    try:
        base = daemon.rss()
        probe = Probe(daemon.endpoint, work, pid=daemon.proc.pid)
        with Client(daemon.endpoint, tenant="t", timeout=120.0) as client:
            ns = client.namespace(Identity(
                model="loop", model_revision="r", tenant="t", kv_dtype="float16",
                num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16))
            heads: list[list[bytes]] = []
            tails: list[bytes] = []
            spent = 0.0
            start, cpu = time.monotonic(), daemon.cpu()
            roots: list[bytes] = []  # two subtrees of half the blocks each (below)
            for i, keys in enumerate(chains(n)):
                # the first two chains are roots; every other one hangs off a block of
                # one of them, so that each of their first keys heads half the blocks
                parent = roots[i % 2] if i >= 2 else None
                t0 = time.perf_counter()
                ns.reserve(keys, parent=parent).commit()
                spent += time.perf_counter() - t0
                if i < 2:
                    roots.append(keys[0])
                heads.append(keys[:64])
                tails.append(keys[-1])
            windows["ingest"] = (start, time.monotonic())
            out["cpu_ingest_ms"] = (daemon.cpu() - cpu) * 1e3
            out["ingest_blocks_per_s"] = n / spent
            out["bytes_per_block_rss"] = (daemon.rss() - base) / n
            rng = __import__("random").Random(3)

            def phase(name: str, fn: Callable[[], object], repeats: int) -> list[float]:
                """Run ``fn``; its window, and the daemon's CPU in it (``cpu_``: what the
                phase cost the daemon, the probe's pings included, whatever the load)."""
                t, cpu = time.monotonic(), daemon.cpu()
                got = timed(fn, repeats)
                windows[name] = (t, time.monotonic())
                out[f"cpu_{name}_ms"] = (daemon.cpu() - cpu) * 1e3
                return got

            looks = phase("lookup", lambda: ns.lookup(rng.choice(heads)), 500)
            out["lookup64_p50_us"] = pct(looks, 0.5) * 1e6
            out["lookup64_p99_us"] = pct(looks, 0.99) * 1e6
            out["stats_ms"] = statistics.median(phase("stats", client.stats, 10)) * 1e3
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            out["metrics_scrape_ms"] = statistics.median(phase(
                "metrics", lambda: urllib.request.urlopen(url, timeout=60).read(), 10)) * 1e3
            leaves = iter(tails[::max(1, len(tails) // 10)])
            out["evict_one_ms"] = statistics.median(phase(
                "evict", lambda: ns.evict([next(leaves)]), min(10, len(tails)))) * 1e3
            out["ping_ms"] = statistics.median(phase("ping", client.ping, 200)) * 1e3
            # the machine's own noise: the longest ping of 3 s with nothing else to do
            phase("idle", lambda: time.sleep(3.0), 1)
            # a change of the eviction policy, slru to auto, every block passed on in
            # loop turns while the probe pings (its stats polled every 50 ms)
            out["sighup_s"] = phase("sighup", lambda: daemon.switch_policy(client, "auto"),
                                    1)[0]
            # the whole namespace: listed (paged where the daemon pages), then listed in
            # one reply (limit 0, as older clients ask); half of it evicted by the one key
            # that heads it, then the rest dropped
            out["snapshot_ms"] = statistics.median(phase("snapshot", client.snapshot, 3)) * 1e3
            whole = phase("snapshot_whole", lambda: whole_snapshot(client), 3)
            out["snapshot_whole_ms"] = statistics.median(whole) * 1e3
            half = [0]

            def evict_half() -> None:
                half[0] = ns.evict(roots[:1])
            out["evict_subtree_ms"] = statistics.median(phase("evict_subtree", evict_half,
                                                              1)) * 1e3
            out["evict_subtree_blocks"] = half[0]
            out["drop_ms"] = statistics.median(phase("drop", ns.drop, 1)) * 1e3
        samples = probe.samples()
        held = daemon.held()
        for name, window in windows.items():
            out.update(stall_figures(name, samples, window, held))
        verbs = [s.took for s in samples if s.start >= windows["lookup"][0]]
        out["probe_p99_ms"] = pct(verbs, 0.99) * 1e3 if verbs else 0.0
    finally:
        daemon.stop()
    return out


# -- many sessions ---------------------------------------------------------------------------
CROWD = r"""
import random, sys, time, zmq
from kvstore import protocol as p
endpoint, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ctx = zmq.Context()
socks = []
for i in range(count):  # a session each: its own connection, hello, then pings
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, f"crowd{i % 8}")))
    p.reply_decoder.decode(s.recv())
    socks.append(s)
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + seconds
rng, rid = random.Random(), 2
while time.monotonic() < end:  # each session pings about once a second, spread out
    start = time.monotonic()
    batch = rng.sample(socks, max(1, count // 50))
    for s in batch:
        s.send(p.encoder.encode(p.Ping(rid)))
        rid += 1
    for s in batch:
        reply = p.reply_decoder.decode(s.recv())
        assert isinstance(reply, p.OkReply), reply
    time.sleep(max(0.0, 0.02 - (time.monotonic() - start)))
"""


def sessions_figures(count: int, seconds: float) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="kvcrowd-"))
    daemon = Daemon(work, 64 << 20)
    out: dict[str, float] = {"sessions": count}
    try:
        probe = Probe(daemon.endpoint, work, every=0.001)
        time.sleep(seconds)
        alone = [s.took for s in probe.samples()]
        crowds = [subprocess.Popen([sys.executable, "-c", CROWD, daemon.endpoint,
                                    str(count // 2), str(seconds)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                  for _ in range(2)]
        for c in crowds:
            assert c.stdout is not None
            c.stdout.readline()
        probe = Probe(daemon.endpoint, work, every=0.001)
        for c in crowds:
            assert c.stdin is not None
            c.stdin.write(b"go\n")
            c.stdin.flush()
        for c in crowds:
            c.wait(seconds + 120)
        crowded = [s.took for s in probe.samples()]
        out.update({"alone_p50_ms": pct(alone, 0.5) * 1e3, "alone_p99_ms": pct(alone, 0.99) * 1e3,
                    "crowd_p50_ms": pct(crowded, 0.5) * 1e3,
                    "crowd_p99_ms": pct(crowded, 0.99) * 1e3,
                    "crowd_max_ms": max(crowded) * 1e3,
                    "p99_ratio": pct(crowded, 0.99) / pct(alone, 0.99)})
    finally:
        daemon.stop()
    return out


# -- a request of many slabs ----------------------------------------------------------------
def slab_figures(slabs: int, small: int, large: int, capacity: int) -> dict[str, float]:
    """One reserve of ``slabs`` slabs' worth of ``large`` blocks into an arena full of
    ``small`` ones, then as many reserves of one slab's worth each (a fresh daemon
    each): the probe's longest ping and the loop's longest hold in each."""
    from kvstore import Client, Identity

    def ident(name: str, block: int) -> Identity:
        return Identity(model=name, model_revision="r", tenant="t", kv_dtype="float16",
                        num_layers=1, num_kv_heads=1, head_dim=block // 64, block_tokens=16)

    out: dict[str, float] = {"blocks": slabs}
    slab = 64 << 20
    for name, per_request in (("many", slabs), ("one", 1)):
        work = Path(tempfile.mkdtemp(prefix="kvslabs-"))
        daemon = Daemon(work, capacity, watched=True)
        try:
            probe = Probe(daemon.endpoint, work, pid=daemon.proc.pid)
            with Client(daemon.endpoint, tenant="t", timeout=600.0) as client:
                little = client.namespace(ident("small", small))
                for i in range(capacity // small // CHAIN):  # every slab: small blocks
                    keys = little.keys(range(i * CHAIN * 16, (i + 1) * CHAIN * 16))
                    little.reserve(keys).commit()
                big = client.namespace(ident("large", large))
                count = slab // large * per_request
                start, cpu = time.monotonic(), daemon.cpu()
                for r in range(slabs // per_request):
                    keys = big.keys(range(10**9 + r * count * 16, 10**9 + (r + 1) * count * 16))
                    big.reserve(keys).commit()
                window = (start, time.monotonic())
                out[f"{name}_wall_ms"] = (window[1] - window[0]) * 1e3
                out[f"{name}_cpu_ms"] = (daemon.cpu() - cpu) * 1e3
                dram = client.stats()["tiers"]["dram"]
                out[f"{name}_slab_moves"] = dram["slab_moves"]
                out[f"{name}_slab_turns"] = dram.get("slab_turns", 0)
            figures = stall_figures(name, probe.samples(), window, daemon.held())
            out[f"{name}_stall_ms"] = figures[f"stall_{name}_ms"]
            out[f"{name}_loop_ms"] = figures[f"loop_{name}_ms"]
            out[f"{name}_pings"] = figures[f"pings_{name}"]
        finally:
            daemon.stop()
    return out


# -- driver ----------------------------------------------------------------------------------
def one(args: argparse.Namespace) -> dict[str, float]:
    if args.part == "store":
        return store_figures(args.one, args.policy, args.check, args.settle_every)
    if args.part == "daemon":
        return daemon_figures(args.one, args.debug_invariants)
    if args.part == "slabs":
        return slab_figures(args.one, parse_size(args.small), parse_size(args.large),
                            parse_size(args.capacity))
    return sessions_figures(args.sessions, args.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["store", "daemon", "sessions", "slabs"])
    parser.add_argument("--sizes", default="10k,100k,400k", help="index sizes, e.g. 10k,1M")
    parser.add_argument("--policy", default="slru", help="the DRAM eviction policy (store)")
    parser.add_argument("--check", action="store_true",
                        help="also time the full invariant check (store)")
    parser.add_argument("--settle-every", type=int, default=64, metavar="CHAINS",
                        help="settle the heap as the daemon does, every so many chains "
                             "(store; 0: never)")
    parser.add_argument("--debug-invariants", action="store_true",
                        help="run the daemon with --debug-invariants (daemon)")
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--request-slabs", type=int, default=15,
                        help="slabs one request needs (slabs)")
    parser.add_argument("--small", default="16KiB", help="the blocks filling the arena (slabs)")
    parser.add_argument("--large", default="1MiB", help="the blocks asked for (slabs)")
    parser.add_argument("--capacity", default="1GiB", help="the arena (slabs)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size (medians)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None or args.part == "sessions" and args.repeats == 1:
        print(json.dumps(one(args)))
        return
    sizes = ([0] if args.part == "sessions" else [args.request_slabs] if args.part == "slabs"
             else [parse_count(s) for s in args.sizes.split(",")])
    rows: list[dict[str, float]] = []
    for n in sizes:
        runs = []
        for _ in range(args.repeats):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", str(n), "--repeats", "1"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"size {n} failed:\n{done.stderr[-4000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        rows.append({k: statistics.median(r[k] for r in runs) for k in runs[0]})
    if args.json:
        print(json.dumps(rows))
        return
    keys = list(rows[0])
    print(f"{'figure':28}" + "".join(f"{int(r.get('blocks', 0)):>12,}" for r in rows))
    for k in keys[1:]:
        print(f"{k:28}" + "".join(f"{r[k]:>12.3f}" for r in rows))
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print("\nratio of the largest to the smallest size: " + ", ".join(
            f"{k} {last[k] / first[k]:.2f}" for k in keys[1:] if first[k]))


if __name__ == "__main__":
    main()
