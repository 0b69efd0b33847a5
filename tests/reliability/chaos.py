"""A chaos harness: client processes under load while clients and the daemon are SIGKILLed.

``Chaos(workdir, ChaosConfig(...)).run()`` starts a daemon with a small DRAM tier over an
SSD tier in write-through mode (so blocks are evicted from DRAM and promoted back all the
time), starts ``clients`` worker processes doing mixed lookup / put / reserve+commit /
reserve+abort / acquire+release / get on chains of keys they share, and while they run
SIGKILLs a random worker now and then (starting a replacement) and SIGKILLs the daemon a
few times (restarting it on the same workdir).  Workers survive a daemon restart: on a
timeout, a "no session" or an expired lease they open a new ``Client`` and carry on.

Every block's bytes follow from its key (``content``), so any reader verifies any block.
Workers verify what they read (get, and acquire while their pin is fresh) and report
mismatches, unexpected errors, latencies, and which blocks they saw on the ssd tier.

At the end the harness SIGKILLs every worker and checks, from the daemon's stats, that
their reservations and pins are rolled back within the lease (plus the reaper's period
and a little slack); then reads every chain: every block lookup reports present reads
back bit-exact, and every *durable* block is present.  A block is durable when a lookup
reported it on the ssd tier, as it did every block of its prefix: with the SSD tier
never full and no evict/drop in the mix, nothing may remove it, restarts included.

Used by tests/reliability/test_reliability_chaos.py (bounded, in CI) and by
benchmarks/soak.py (``--minutes``).  Run as a script, this module is a worker.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import zmq

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]  # the tests folder: daemon_proc, kvtest

from daemon_proc import DaemonProcess, error_records  # noqa: E402
from kvtest import make_identity  # noqa: E402

from kvstore import Client  # noqa: E402
from kvstore import protocol as p  # noqa: E402
from kvstore.errors import (  # noqa: E402
    CapacityError,
    ForbiddenError,
    KVStoreError,
    LeaseExpiredError,
    LimitExceededError,
    NotFoundError,
    UnavailableError,
)

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=16)  # 16 KiB blocks
SCRATCH = make_identity(num_layers=4, num_kv_heads=4, head_dim=16, salt="scratch")
BLOCK = IDENT.block_bytes
TOKENS = IDENT.block_tokens
VERBS = ("lookup", "put", "reserve", "commit", "abort", "acquire", "release", "get", "evict")
T = TypeVar("T")


def content(key: bytes, size: int = BLOCK) -> bytes:
    """Bytes that follow from the key, so any reader can check any block."""
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def chain_tokens(chain: int, blocks: int) -> list[int]:
    """The token ids of chain ``chain``: ``blocks`` full blocks, disjoint across chains."""
    start = chain * 1_000_003
    return list(range(start, start + blocks * TOKENS))


def percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@dataclass
class ChaosConfig:
    clients: int = 8
    seconds: float = 40.0              # the chaos phase (then the checks)
    daemon_kills: int = 3              # spread evenly over the chaos phase
    client_kill_every: tuple[float, float] = (1.0, 3.0)   # seconds between client kills
    lease: float = 2.0
    dram: str = "1MiB"                 # 64 slots of 16 KiB: eviction and promotion
    slab: str = "256KiB"
    ssd: str = "64MiB"                 # never full: a durable block is never evicted
    chains: int = 200                  # (--debug-invariants walks every slot per request,
    chain_blocks: int = 8              # so the tiers stay small) 200 x 8 x 16 KiB = 25 MiB
    scratch_chains: int = 50           # a second namespace, evicted and rewritten all along
    client_timeout: float = 5.0
    lease_slack: float = 1.5           # beyond lease + the reaper's period, for a busy host
    seed: int | None = None


@dataclass
class ChaosReport:
    seconds: float = 0.0
    ops: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    client_kills: int = 0
    daemon_kills: int = 0
    reconnects: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)   # misses, capacity, ...
    verified_by_clients: int = 0
    verified_at_end: int = 0
    durable_blocks: int = 0
    present_at_end: int = 0
    mismatches: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    lost_durable: list[str] = field(default_factory=list)
    held_at_client_kill: tuple[int, int] = (0, 0)             # reserved slots, pinned blocks
    released_after: float = 0.0       # seconds from killing the clients to nothing held
    lease_bound: float = 0.0
    final_stats: dict[str, Any] = field(default_factory=dict)
    log_errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """What went wrong, in words; empty when the run kept every promise."""
        out = [f"read back wrong: {m}" for m in self.mismatches[:20]]
        out += [f"durable block lost: {m}" for m in self.lost_durable[:20]]
        out += [f"unexpected: {u}" for u in self.unexpected[:20]]
        out += [f"daemon log: {e}" for e in self.log_errors[:5]]
        if self.released_after > self.lease_bound:
            out.append(f"holdings of killed clients outlived their lease: released after "
                       f"{self.released_after:.2f}s, bound {self.lease_bound:.2f}s")
        final = self.final_stats
        if not final:
            out.append("no final stats (the run did not finish)")
        elif final["invariant_violations"] or _held(final):
            out.append(f"final stats: {final['invariant_violations']} invariant violations, "
                       f"held {_held(final)}")
        return out

    def lines(self) -> list[str]:
        all_lat = [x for v in self.latencies.values() for x in v]
        found = (f"chaos: blocks verified bit-exact: {self.verified_by_clients} by clients "
                 f"while running, {self.verified_at_end} at the end ({self.present_at_end} "
                 f"present, {self.durable_blocks} durable before the last kill, all found)")
        if self.lost_durable:
            found = f"chaos: LOST {len(self.lost_durable)} durable blocks of {self.durable_blocks}"
        out = [
            (f"chaos: {sum(self.ops.values())} operations in {self.seconds:.1f}s "
             f"({', '.join(f'{v} {self.ops[v]}' for v in VERBS if self.ops[v])})"),
            (f"chaos: faults injected: {self.client_kills} client SIGKILLs, "
             f"{self.daemon_kills} daemon SIGKILLs; {self.reconnects} client reconnects"),
            found,
            f"chaos: outcomes {dict(self.outcomes)}",
            (f"chaos: held when the clients were killed: {self.held_at_client_kill[0]} "
             f"reserved slots, {self.held_at_client_kill[1]} pinned blocks; all released "
             f"after {self.released_after:.2f}s (bound {self.lease_bound:.2f}s)"),
            (f"chaos: latency p50 {percentile(all_lat, 50) * 1e3:.2f} ms, "
             f"p99 {percentile(all_lat, 99) * 1e3:.2f} ms over all operations"),
        ]
        for verb in VERBS:
            lat = self.latencies.get(verb)
            if lat:
                p50, p99 = percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3
                out.append(f"chaos:   {verb:8s} n={len(lat):7d}  p50 {p50:8.2f} ms"
                           f"  p99 {p99:8.2f} ms")
        return out


class Chaos:
    """Runs the chaos once; ``run()`` returns the report (it asserts nothing itself)."""

    def __init__(self, workdir: Path, config: ChaosConfig,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.cfg = config
        self.say = say
        self.workdir = workdir
        self.rng = random.Random(config.seed)
        self.daemon = DaemonProcess(
            workdir / "daemon", dram_capacity=config.dram, lease=config.lease,
            ssd_capacity=config.ssd, debug_invariants=True,
            extra=["--slab-size", config.slab, "--ssd-write-policy", "write-through"])
        self.client_dir = workdir / "clients"
        self.client_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[int, tuple[subprocess.Popen[bytes], Any]] = {}
        self._next_worker = 0
        self.report = ChaosReport()
        self.arena_path = ""
        self.stats_before_kills: list[dict[str, Any]] = []
        self._seen_on_ssd: list[tuple[int, int, float]] = []   # chain, block, wall time
        self.kill_times: list[float] = []

    # -- processes --------------------------------------------------------------------------
    def _start_daemon(self) -> None:
        self.daemon.start()
        with Client(self.daemon.endpoint, tenant="acme", timeout=30, map_arena=False) as c:
            assert c.hello is not None
            self.arena_path = c.hello.arena_path

    def _kill_daemon(self) -> None:
        """SIGKILL the daemon, remove the arena it could not, start it on the same workdir."""
        self.stats_before_kills.append(self.stats())
        self.kill_times.append(time.time())
        self.daemon.stop(signal.SIGKILL)
        try:
            os.unlink(self.arena_path)   # a killed daemon leaves its shm arena behind
        except FileNotFoundError:
            pass
        self._start_daemon()
        self.report.daemon_kills += 1
        self.say(f"chaos: daemon SIGKILLed and restarted ({self.report.daemon_kills})")

    def _start_worker(self) -> None:
        wid = self._next_worker
        self._next_worker += 1
        cfg = self.cfg
        args = [sys.executable, str(Path(__file__).resolve()), self.daemon.endpoint, str(wid),
                str(self.rng.randrange(1 << 32)), str(self.client_dir / f"{wid}.log"),
                str(cfg.chains), str(cfg.scratch_chains), str(cfg.chain_blocks), str(cfg.lease),
                str(cfg.client_timeout), str(cfg.seconds + 120)]
        err = open(self.client_dir / f"{wid}.err", "wb")
        self.workers[wid] = (subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err), err)

    def _kill_worker(self, wid: int) -> int:
        proc, err = self.workers.pop(wid)
        proc.send_signal(signal.SIGKILL)
        code = proc.wait()
        err.close()
        return code

    def stats(self) -> dict[str, Any]:
        """The daemon's stats, through a session of its own (raw, so that a request left
        unanswered can be told apart: stuck, or woken by another peer's traffic)."""
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.daemon.endpoint)
        try:
            self._ask(ctx, sock, p.Hello(1, p.PROTOCOL_VERSION, "acme"))
            reply = self._ask(ctx, sock, p.Stats(2))
        finally:
            sock.close()
            ctx.term()
        assert isinstance(reply, p.StatsReply), reply
        return dict(reply.stats)

    def _ask(self, ctx: zmq.Context[Any], sock: Any, msg: p.Message) -> p.Message:
        sock.send(p.encoder.encode(msg))
        if not sock.poll(30_000):
            kick = ctx.socket(zmq.DEALER)
            kick.setsockopt(zmq.LINGER, 0)
            kick.connect(self.daemon.endpoint)
            kick.send(p.encoder.encode(p.Ping(1)))
            woken = sock.poll(2_000)
            kick.close()
            if woken:
                raise AssertionError(
                    f"{type(msg).__name__} sat unanswered for 30 s, the daemon idle, and was "
                    f"answered as soon as another socket sent a ping: a lost wakeup (see "
                    f"test_reliability_regressions.py)")
            raise AssertionError(f"the daemon stopped answering: {self.diagnose()}")
        reply: p.Message = p.reply_decoder.decode(sock.recv_multipart()[0])
        return reply

    def diagnose(self) -> str:
        """Whether the daemon is alive, and busy or blocked (for a daemon that is stuck)."""
        proc = self.daemon.proc
        if proc is None or proc.poll() is not None:
            return f"the daemon exited ({None if proc is None else proc.returncode})"

        def cpu() -> int:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])     # utime + stime, in clock ticks

        before = cpu()
        time.sleep(1.0)
        busy = cpu() - before
        threads = sorted(Path(f"/proc/{proc.pid}/task").iterdir())
        wchan = [(t.name, (t / "wchan").read_text(), (t / "stat").read_text().split()[2])
                 for t in threads]
        return (f"pid {proc.pid} alive, {busy} cpu ticks in the last second, threads "
                f"(tid, wchan, state): {wchan}; log tail:\n{self.daemon.log()[-3000:]}")

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> ChaosReport:
        cfg = self.cfg
        self._start_daemon()
        try:
            for _ in range(cfg.clients):
                self._start_worker()
            self._chaos()
            self._end_clients()
            self._verify()
        except UnavailableError as exc:
            raise AssertionError(f"the daemon stopped answering: {self.diagnose()}") from exc
        finally:
            for wid in list(self.workers):
                self._kill_worker(wid)
            if self.daemon.alive():
                code = self.daemon.stop()        # graceful: drain, flush, sync
                if code != 0:
                    self.report.log_errors.append(f"daemon exited {code} on SIGTERM")
            else:
                self.daemon.stop()
            self._read_worker_logs()
            self.report.log_errors += _log_errors(self.daemon.log())
        return self.report

    def _chaos(self) -> None:
        cfg = self.cfg
        self.started = time.time()
        start = time.monotonic()
        end = start + cfg.seconds
        kills = [start + cfg.seconds * (i + 1) / (cfg.daemon_kills + 1)
                 for i in range(cfg.daemon_kills)]
        next_client_kill = start + self.rng.uniform(*cfg.client_kill_every)
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if kills and now >= kills[0]:
                kills.pop(0)
                self._kill_daemon()
            elif now >= next_client_kill:
                wid = self.rng.choice(sorted(self.workers))
                self._kill_worker(wid)
                self._start_worker()
                self.report.client_kills += 1
                next_client_kill = now + self.rng.uniform(*cfg.client_kill_every)
            for wid, (proc, _) in list(self.workers.items()):   # died by itself?
                if proc.poll() is not None:
                    code = self._kill_worker(wid)
                    self.report.unexpected.append(
                        f"client process {wid} exited {code} by itself: "
                        f"{(self.client_dir / f'{wid}.err').read_text()[-2000:]}")
                    self._start_worker()
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        self.report.seconds = time.monotonic() - start

    def _end_clients(self) -> None:
        """SIGKILL every worker (some hold reservations and pins), then time how long the
        daemon takes to roll their holdings back: no longer than the lease allows."""
        cfg = self.cfg
        stats = self.stats()
        dram = stats["tiers"]["dram"]
        self.report.held_at_client_kill = (dram["reserved_slots"], dram["pinned_blocks"])
        for wid in list(self.workers):
            self._kill_worker(wid)
        killed = time.monotonic()
        reaper = min(1.0, cfg.lease / 4)
        self.report.lease_bound = cfg.lease + reaper + cfg.lease_slack
        while True:
            stats = self.stats()
            held = _held(stats)
            waited = time.monotonic() - killed
            if not held or waited > self.report.lease_bound + 5:
                break
            time.sleep(0.05)
        self.report.released_after = waited
        if held:
            self.report.unexpected.append(f"still held {waited:.1f}s after the clients died: "
                                          f"{held}")

    def _verify(self) -> None:
        """Every present block reads back bit-exact; every durable block is present."""
        self._read_worker_logs()
        cfg = self.cfg
        durable = self._durable_prefixes()
        self.report.durable_blocks = sum(durable.values())
        with Client(self.daemon.endpoint, tenant="acme", timeout=30) as c:
            main, scratch = c.namespace(IDENT), c.namespace(SCRATCH)
            every = [(main, chain, chain) for chain in range(cfg.chains)] + [
                (scratch, -1 - chain, chain) for chain in range(cfg.scratch_chains)]
            for ns, chain, tokens_of in every:       # scratch chains are labelled negative
                keys = ns.keys(chain_tokens(tokens_of, cfg.chain_blocks))
                hit = ns.lookup(keys).blocks
                self.report.present_at_end += hit
                if hit < durable.get(chain, 0):
                    self.report.lost_durable.append(
                        f"chain {chain}: {durable[chain]} durable blocks, {hit} present; "
                        f"blocks seen on ssd {self._sightings(chain)}")
                if not hit:
                    continue
                got = ns.get(keys[:hit])
                for i, (key, data) in enumerate(zip(keys, got)):
                    if data != content(key):
                        self.report.mismatches.append(f"end: chain {chain} block {i} (get)")
                with ns.acquire(keys[:hit]) as held:
                    for i, (key, buf) in enumerate(zip(keys, held.buffers)):
                        if bytes(buf) != content(key):
                            self.report.mismatches.append(
                                f"end: chain {chain} block {i} (acquire)")
                self.report.verified_at_end += 2 * hit
            stats = c.stats()
        self.report.final_stats = stats
        if _held(stats):
            self.report.unexpected.append(f"held after the checks: {_held(stats)}")
        for s in [*self.stats_before_kills, stats]:
            if s["invariant_violations"]:
                self.report.unexpected.append(f"invariant violations: {s['invariant_violations']}")
            if s["tiers"].get("ssd", {}).get("evictions"):
                self.report.unexpected.append("the ssd tier evicted: durable blocks may go")

    def _durable_prefixes(self) -> dict[int, int]:
        """Per chain, the longest prefix that was on the ssd tier at some daemon kill (or
        at the end): every block of it seen there by a lookup asked between the same two
        kills.  (An SSD copy of the main namespace is never removed while the daemon
        runs; across a restart only a block whose whole prefix was on SSD comes back.)"""
        by_epoch: dict[tuple[int, int], set[int]] = defaultdict(set)
        for chain, index, when in self._seen_on_ssd:
            by_epoch[(chain, bisect.bisect(self.kill_times, when))].add(index)
        out: dict[int, int] = {}
        for (chain, _), indices in by_epoch.items():
            n = 0
            while n in indices:
                n += 1
            out[chain] = max(out.get(chain, 0), n)
        return out

    def _sightings(self, chain: int) -> str:
        """When the blocks of a chain were seen on the ssd tier, by epoch (for a report)."""
        by_epoch: dict[int, set[int]] = defaultdict(set)
        for c, index, when in self._seen_on_ssd:
            if c == chain:
                by_epoch[bisect.bisect(self.kill_times, when)].add(index)
        return ", ".join(f"before kill {e + 1}: {sorted(ix)}" if e < len(self.kill_times)
                         else f"after the last kill: {sorted(ix)}"
                         for e, ix in sorted(by_epoch.items()))

    def _read_worker_logs(self) -> None:
        """Fold the workers' records into the report (a line cut by SIGKILL is skipped)."""
        r = self.report
        r.ops.clear()
        r.latencies.clear()
        r.outcomes.clear()
        r.reconnects = r.verified_by_clients = 0
        r.mismatches = [m for m in r.mismatches if not m.startswith("worker ")]
        r.unexpected = [u for u in r.unexpected if not u.startswith("worker ")]
        self._seen_on_ssd = []
        for path in sorted(self.client_dir.glob("*.log"), key=lambda p: int(p.stem)):
            text = path.read_text(errors="replace")
            text = text[:text.rfind("\n") + 1]
            for line in text.splitlines():
                kind, _, rest = line.partition(" ")
                if kind == "L":
                    verb, *values = rest.split()
                    r.latencies[verb].extend(float(v) / 1e6 for v in values)
                    r.ops[verb] += len(values)
                elif kind == "S":
                    chain, index, when = rest.split()
                    self._seen_on_ssd.append((int(chain), int(index), float(when)))
                elif kind == "V":
                    r.verified_by_clients += int(rest)
                elif kind == "C":
                    r.reconnects += 1
                elif kind == "O":
                    name, count = rest.split()
                    r.outcomes[name] += int(count)
                elif kind == "X":
                    r.mismatches.append(f"worker {path.stem}: {rest}")
                elif kind == "E":
                    r.unexpected.append(f"worker {path.stem}: {rest}")


def _held(stats: dict[str, Any]) -> dict[str, int]:
    """What the daemon still holds for someone: reserved slots, pins, transfers."""
    dram = stats["tiers"]["dram"]
    held = {"dram reserved slots": dram["reserved_slots"], "dram reserved bytes": dram["reserved"],
            "pinned blocks": dram["pinned_blocks"]}
    ssd = stats["tiers"].get("ssd")
    if ssd is not None:
        held["ssd reserved bytes"] = ssd["reserved"]
    return {k: v for k, v in held.items() if v}


def _log_errors(log: str) -> list[str]:
    return [r.strip()[:2000] for r in error_records(log)]


# ========================================================================================
# the worker (a separate process; the harness SIGKILLs it at will)
# ========================================================================================

class Worker:
    """One client process: a loop of random operations on shared chains of keys.

    Most operations go to the main namespace, which is never evicted by hand (its blocks
    seen on the ssd tier are durable); the rest to a scratch namespace that clients also
    evict, so that writes go on all along."""

    OPS = ("put", "reserve", "abort", "acquire", "get", "lookup", "evict")
    MAIN_WEIGHTS = (3, 3, 1, 3, 3, 1, 0)
    SCRATCH_WEIGHTS = (3, 3, 1, 3, 3, 1, 3)

    def __init__(self, endpoint: str, wid: int, seed: int, out: Path, chains: int,
                 scratch_chains: int, chain_blocks: int, lease: float, timeout: float) -> None:
        self.endpoint = endpoint
        self.wid = wid
        self.rng = random.Random(seed)
        self.out = open(out, "a", buffering=1)
        self.chains = chains
        self.scratch_chains = scratch_chains
        self.chain_blocks = chain_blocks
        self.lease = lease
        self.timeout = timeout
        self.client: Client | None = None
        self.ns: Any = None
        self.scratch: Any = None
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.outcomes: Counter[str] = Counter()
        self.verified = 0
        self.seen_ssd: set[tuple[int, int]] = set()
        self.flushed = time.monotonic()

    def timed(self, verb: str, fn: Callable[[], T]) -> T:
        t = time.perf_counter()
        result = fn()
        self.lat[verb].append(time.perf_counter() - t)
        return result

    def flush(self) -> None:
        lines = [f"L {verb} {' '.join(str(int(x * 1e6)) for x in values)}\n"
                 for verb, values in self.lat.items() if values]
        lines += [f"O {name} {count}\n" for name, count in self.outcomes.items()]
        if self.verified:
            lines.append(f"V {self.verified}\n")
        self.out.write("".join(lines))
        self.lat.clear()
        self.outcomes.clear()
        self.verified = 0
        self.flushed = time.monotonic()

    def connect(self) -> None:
        self.close()
        self.client = Client(self.endpoint, tenant="acme", timeout=self.timeout)
        self.seen_ssd.clear()              # a new session may be a new daemon: report again
        self.ns = self.client.namespace(IDENT)
        self.scratch = self.client.namespace(SCRATCH)
        self.out.write("C\n")

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None

    def run(self, deadline: float) -> None:
        parent = os.getppid()
        while time.monotonic() < deadline and os.getppid() == parent:
            if time.monotonic() - self.flushed > 0.5:
                self.flush()
            try:
                if self.client is None:
                    self.connect()
                self.step()
            except (CapacityError, LimitExceededError) as exc:
                self.outcomes[type(exc).__name__] += 1
            except NotFoundError:
                self.outcomes["miss"] += 1           # evicted between lookup and use
            except (UnavailableError, ForbiddenError, LeaseExpiredError) as exc:
                self.outcomes[type(exc).__name__] += 1   # the daemon restarted, or we slept
                self.close()
                time.sleep(0.05)
            except KVStoreError as exc:
                self.out.write(f"E {type(exc).__name__} {exc.code} {str(exc)[:300]!r}\n")
                self.close()
            except Exception as exc:  # zmq or mapping errors while the daemon restarts
                self.outcomes[type(exc).__name__] += 1
                self.close()
                time.sleep(0.05)
        self.flush()

    def step(self) -> None:
        main = self.rng.random() < 0.7
        ns = self.ns if main else self.scratch
        weights = self.MAIN_WEIGHTS if main else self.SCRATCH_WEIGHTS
        op = self.rng.choices(self.OPS, weights)[0]
        chain = self.rng.randrange(self.chains if main else self.scratch_chains)
        keys = ns.keys(chain_tokens(chain, self.chain_blocks))
        asked = time.time()   # before the request: a reply from this daemon came before
        hit = self.timed("lookup", lambda: ns.lookup(keys))   # it was killed, if it was
        for i, tier in enumerate(hit.tiers):
            if main and tier == "ssd" and (chain, i) not in self.seen_ssd:
                self.seen_ssd.add((chain, i))
                self.out.write(f"S {chain} {i} {asked:.3f}\n")
        n = hit.blocks
        if not main:
            chain = -1 - chain                     # scratch chains show as negative
        if op == "evict":
            if n:
                victims = keys[self.rng.randrange(n):n]
                self.outcomes["evicted"] += self.timed("evict", lambda: ns.evict(victims))
            return
        if op in ("put", "reserve", "abort") and n == len(keys):
            op = "get"
        elif op in ("acquire", "get") and n == 0:
            op = "put"
        if op == "put":
            todo = keys[n:n + self.rng.randint(1, len(keys) - n)]
            self.timed("put", lambda: ns.put(todo, [content(k) for k in todo]))
        elif op in ("reserve", "abort"):
            todo = keys[n:n + self.rng.randint(1, len(keys) - n)]
            asked = time.monotonic()
            r = self.timed("reserve", lambda: ns.reserve(todo))
            if op == "abort" or time.monotonic() - asked > self.lease / 2:
                # a slow write could land after the lease gave the slots to someone else
                self.timed("abort", r.abort)
                return
            for buf, key in zip(r.buffers, todo):
                buf[:] = content(key)
            if self.rng.random() < 0.05:
                time.sleep(self.rng.uniform(0, 1.5 * self.lease))   # may outlive the lease
            self.timed("commit", r.commit)
        elif op == "acquire":
            first = self.rng.randrange(n)
            want = keys[first:self.rng.randint(first + 1, n)]
            asked = time.monotonic()
            held = self.timed("acquire", lambda: ns.acquire(want))
            data = [bytes(b) for b in held.buffers]
            if time.monotonic() - asked < self.lease / 2:   # the pin was surely still ours
                self.check(chain, first, want, data, "acquire")
            if self.rng.random() < 0.05:
                time.sleep(self.rng.uniform(0, 1.5 * self.lease))   # may outlive the lease
            self.timed("release", held.release)
        elif op == "get":
            want = keys[:self.rng.randint(1, n)]
            data = self.timed("get", lambda: ns.get(want))
            self.check(chain, 0, want, data, "get")

    def check(self, chain: int, first: int, keys: list[bytes], data: list[bytes],
              verb: str) -> None:
        for i, (key, block) in enumerate(zip(keys, data)):
            if block != content(key):
                self.out.write(f"X chain {chain} block {first + i} ({verb})\n")
            else:
                self.verified += 1


def worker_main(argv: list[str]) -> None:
    endpoint, wid, seed, out, chains, scratch, chain_blocks, lease, timeout, lifetime = argv
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    worker = Worker(endpoint, int(wid), int(seed), Path(out), int(chains), int(scratch),
                    int(chain_blocks), float(lease), float(timeout))
    worker.run(time.monotonic() + float(lifetime))


if __name__ == "__main__":
    worker_main(sys.argv[1:])
