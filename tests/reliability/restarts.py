"""A restart harness: tenants' client processes under a mixed load, two block sizes, a
small SSD tier that fills, and the daemon SIGKILLed or stopped cleanly (SIGTERM) at
random moments, restarted each time on the same workdir.

``Restarts(workdir, RestartConfig(...)).run()`` starts a daemon (``--debug-invariants``,
DRAM and SSD tiers a few tens of MiB, write-back or write-through to SSD), and
``clients`` worker processes of ``tenants`` tenants, each on two identities of different
block sizes, doing lookup, put, reserve (the client sends ``skip_held``) with commit or
abort, reserve_batch, acquire/release, get, prefetch, evict and drop on chains of keys
the workers of a tenant share.  Every block's bytes follow from its key, so a worker
checks every block it reads.

Each round ends with a fault.  A SIGKILL lands under load.  A clean stop first ends the
workers and waits for their leases, then takes a census (every chain's lookup: which
blocks DRAM alone holds, which SSD holds), stops the daemon with SIGTERM and restarts it.
After every restart the harness checks: each present block reads back bit-exact, no
block is found whose parent is missing, the daemon's arenas of the stopped process are
gone from /dev/shm, no invariant violated (stats and log), nothing held once the
sessions end; and after a clean stop whose census fits the SSD tier (in bytes, a slab of
each size to spare) every block present before it is back.

Run as a script, this module is a worker.  ``benchmarks/restart_soak.py`` runs it by
seeds and minutes.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]  # the tests folder: daemon_proc, kvtest

from daemon_proc import DaemonProcess, error_records  # noqa: E402
from kvtest import make_identity  # noqa: E402

from kvstore import Client, PlanItem  # noqa: E402
from kvstore.errors import (  # noqa: E402
    CapacityError,
    ForbiddenError,
    KVStoreError,
    LeaseExpiredError,
    LimitExceededError,
    NotFoundError,
    UnavailableError,
)
from kvstore.identity import Identity  # noqa: E402

TOKENS = 16


def identities(tenant: str) -> list[Identity]:
    """A tenant's two identities: 16 KiB and 32 KiB blocks."""
    return [make_identity(tenant=tenant, num_layers=4, num_kv_heads=4, head_dim=16),
            make_identity(tenant=tenant, num_layers=4, num_kv_heads=4, head_dim=32)]


def content(key: bytes, size: int) -> bytes:
    """Bytes that follow from the key, so any reader can check any block."""
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def chain_tokens(chain: int, blocks: int) -> list[int]:
    start = chain * 1_000_003
    return list(range(start, start + blocks * TOKENS))


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(text[:-len(unit)]) * scale
    return int(text)


@dataclass
class RestartConfig:
    seed: int = 0
    clients: int = 4
    tenants: int = 3
    rounds: int = 4                  # each ends with a SIGKILL or a clean stop
    round_seconds: tuple[float, float] = (2.0, 6.0)
    clean_share: float = 0.5         # of the faults, the share that are clean stops
    faults: str = ""                 # or the faults in order: "k" SIGKILL, "c" clean stop
    dram: str = "32MiB"
    ssd: str = "24MiB"
    slab: str = "1MiB"
    ssd_slab: str = ""               # "" picks 1 or 2 MiB by seed (the default, 64 MiB,
                                     # shrunk to a small tier, is one slab: one block size)
    ssd_policy: str = ""             # "" picks by seed
    chains: int = 64                 # 64 x 8 x (16 + 32) KiB x 3 tenants: 72 MiB
    chain_blocks: int = 8
    lease: float = 2.0
    drop_weight: int = 1
    weighted: bool | None = None     # tenant weights and a DRAM quota; None: by seed
    tenant_quota: str = "16MiB"
    redis: str = ""                  # a Redis remote tier's write policy; "" none
    redis_memory: str = "16mb"       # its maxmemory (noeviction: a full store refuses)
    extra: list[str] = field(default_factory=list)


@dataclass
class RestartReport:
    rounds: int = 0
    kills: int = 0
    clean_stops: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    verified: int = 0
    orphans_after_clean: int = 0     # blocks a restart after a clean stop dropped
    census_fit: int = 0              # clean stops whose census fit the SSD tier
    # per clean stop: blocks present before it, back after it, and in DRAM before it
    back_after_clean: list[tuple[int, int, int]] = field(default_factory=list)
    back_bytes_after_clean: list[int] = field(default_factory=list)  # their bytes back
    bytes_before_clean: list[int] = field(default_factory=list)  # present before it
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # first errors of each kind, workers'

    def lines(self) -> list[str]:
        return [f"restarts: {self.rounds} rounds, {self.kills} SIGKILLs, {self.clean_stops} "
                f"clean stops ({self.census_fit} whose census fit the ssd tier)",
                f"restarts: ops {dict(self.ops)}", f"restarts: outcomes {dict(self.outcomes)}",
                f"restarts: blocks verified bit-exact {self.verified}",
                f"restarts: clean stops, blocks present before/after (in dram before): "
                f"{self.back_after_clean}; dropped as orphans at their restarts "
                f"{self.orphans_after_clean}"]


class Restarts:
    """Runs the rounds once; ``run()`` returns the report (it asserts nothing itself)."""

    def __init__(self, workdir: Path, config: RestartConfig,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.cfg = config
        self.say = say
        self.rng = random.Random(config.seed)
        policy = config.ssd_policy or self.rng.choice(["write-back", "write-through"])
        self.policy = policy
        self.ssd_slab = config.ssd_slab or self.rng.choice(["1MiB", "2MiB"])
        workdir.mkdir(parents=True, exist_ok=True)
        conf = workdir / "kvstore.toml"
        text = f'[ssd]\nslab_size = "{self.ssd_slab}"\n'
        self.weighted = (config.weighted if config.weighted is not None
                         else self.rng.random() < 0.5)
        if self.weighted:   # tenants' shares: of the work under way, the tiers, the remote
            weights = ", ".join(f"t{i} = {i + 1}.0" for i in range(config.tenants))
            text += (f"[server]\ntenant_weights = {{ {weights} }}\n"
                     f'[dram]\ntenant_quota = "{config.tenant_quota}"\n')
        conf.write_text(text)
        remote: list[str] = []
        self.redis: Any = None
        if config.redis:
            from redis_servers import RedisServer
            self.redis = RedisServer(workdir / "redis", extra_args=(
                "--maxmemory", config.redis_memory, "--maxmemory-policy", "noeviction"))
            remote = ["--remote-write-policy", config.redis]
        self.daemon = DaemonProcess(
            workdir / "daemon", dram_capacity=config.dram, lease=config.lease,
            ssd_capacity=config.ssd, debug_invariants=True,
            extra=["--slab-size", config.slab, "--ssd-write-policy", policy,
                   "--config", str(conf), *remote, *config.extra])
        self.client_dir = workdir / "clients"
        self.client_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[int, tuple[subprocess.Popen[bytes], Any]] = {}
        self._next_worker = 0
        self.report = RestartReport()
        self.tenants = [f"t{i}" for i in range(config.tenants)]

    # -- processes --------------------------------------------------------------------------
    def _start_worker(self) -> None:
        wid = self._next_worker
        self._next_worker += 1
        tenant = self.tenants[wid % len(self.tenants)]
        cfg = self.cfg
        args = [sys.executable, str(Path(__file__).resolve()), self.daemon.endpoint, tenant,
                str(self.rng.randrange(1 << 32)), str(self.client_dir / f"{wid}.log"),
                str(cfg.chains), str(cfg.chain_blocks), str(cfg.lease), str(cfg.drop_weight)]
        err = open(self.client_dir / f"{wid}.err", "wb")
        self.workers[wid] = (subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err), err)

    def _end_workers(self) -> None:
        for wid in list(self.workers):
            proc, err = self.workers.pop(wid)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            err.close()

    def _problem(self, text: str) -> None:
        self.report.problems.append(f"round {self.report.rounds}: {text}")
        self.say(f"restarts: PROBLEM {text}")

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> RestartReport:
        cfg = self.cfg
        if self.redis is not None:
            self.redis.start()
            self.daemon.args += ["--remote", self.redis.url]
        self.daemon.start()
        try:
            faults = cfg.faults or "".join(
                "c" if self.rng.random() < cfg.clean_share else "k" for _ in range(cfg.rounds))
            for fault in faults:
                self.report.rounds += 1
                for _ in range(cfg.clients):
                    self._start_worker()
                time.sleep(self.rng.uniform(*cfg.round_seconds))
                if fault == "c":
                    self._clean_stop()
                else:
                    self._kill()
            self._end_workers()
            self._settle_and_check("end")
        finally:
            self._end_workers()
            pid = self.daemon.proc.pid if self.daemon.proc else 0
            if self.daemon.alive():
                code = self.daemon.stop()
                if code != 0:
                    self._problem(f"the daemon exited {code} on SIGTERM at the end")
            self._check_shm(pid, "after the last stop")
            if self.redis is not None:
                self.redis.kill()
            self._read_worker_logs()
            for record in error_records(self.daemon.log()):
                self._problem(f"daemon log: {record.strip()[:1500]}")
        return self.report

    def _kill(self) -> None:
        pid = self.daemon.proc.pid if self.daemon.proc else 0
        self.daemon.stop(signal.SIGKILL)
        self.report.kills += 1
        self._end_workers()
        self.daemon.start()
        self._check_shm(pid, "after the restart that followed a SIGKILL")
        self._settle_and_check("after a SIGKILL")

    def _clean_stop(self) -> None:
        self._end_workers()
        before = self._settle_and_check("before a clean stop")
        pid = self.daemon.proc.pid if self.daemon.proc else 0
        code = self.daemon.stop()
        self.report.clean_stops += 1
        if code != 0:
            self._problem(f"a clean stop exited {code}")
        self._check_shm(pid, "after a clean stop")
        seen = len(self.daemon.log())
        self.daemon.start()
        # (the flush writes whole prefixes, and the parents of copies on SSD first: an
        # orphan after it is a parent it found no room for, which the README allows)
        for line in self.daemon.log()[seen:].splitlines():
            if "dropped at restore" in line:
                self.report.orphans_after_clean += int(line.split("ssd tier: ")[1].split()[0])
        after = self._settle_and_check("after a clean stop")
        present = {k for k, tier in before.items() if tier}
        dram_only = {k for k, tier in before.items() if tier == "dram"}
        back = {k for k, tier in after.items() if tier}
        self.report.back_after_clean.append((len(present), len(present & back), len(dram_only)))
        need = sum(size for (_, _, _, size) in present)
        self.report.back_bytes_after_clean.append(sum(k[3] for k in present & back))
        self.report.bytes_before_clean.append(need)
        room = parse_size(self.cfg.ssd) - 2 * parse_size(self.ssd_slab)
        self.say(f"restarts: clean stop: {len(present)} blocks ({need >> 10} KiB; "
                 f"{len(dram_only)} in dram) before, {len(present & back)} "
                 f"({sum(k[3] for k in present & back) >> 10} KiB) back, room {room >> 10} KiB")
        if self.policy == "write-back" and need <= room:
            self.report.census_fit += 1
            lost = sorted(present - back)
            if lost:
                self._problem(f"a clean stop lost {len(lost)} of {len(present)} blocks "
                              f"({len(dram_only - back)} of {len(dram_only)} dram-only), "
                              f"{need} bytes in all on a {self.cfg.ssd} ssd tier: "
                              f"e.g. {lost[:5]}")

    def _check_shm(self, pid: int, when: str) -> None:
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"kvstore-{os.getuid()}-{pid}-")]
        if pid and left:
            self._problem(f"/dev/shm still holds {left} of daemon {pid} {when}")

    def _settle_and_check(self, when: str) -> dict[tuple[str, int, int, int], str]:
        """With no worker left: wait for the leases to let go, then read every chain; the
        census: (tenant, identity, chain, block bytes) and block index -> tier ('' absent)."""
        census: dict[tuple[str, int, int, int], str] = {}
        deadline = time.monotonic() + self.cfg.lease + 5
        with Client(self.daemon.endpoint, tenant=self.tenants[0], timeout=30) as c:
            while True:
                held = _held(c.stats())
                if not held or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if held:
                self._problem(f"{when}: still held after the leases ended: {held}")
        for tenant in self.tenants:
            with Client(self.daemon.endpoint, tenant=tenant, timeout=30) as c:
                for which, ident in enumerate(identities(tenant)):
                    ns = c.namespace(ident)
                    size = ident.block_bytes
                    for chain in range(self.cfg.chains):
                        keys = ns.keys(chain_tokens(chain, self.cfg.chain_blocks))
                        hit = ns.lookup(keys)
                        for i in range(len(keys)):
                            tier = hit.tiers[i] if i < hit.blocks else ""
                            census[(tenant, which, chain * 100 + i, size)] = tier
                        for i in range(hit.blocks + 1, len(keys)):
                            # (the remote store is flat: a value there without its
                            # parent's is no chain of this daemon's, never served as one)
                            alone = ns.lookup([keys[i]])
                            if alone.blocks and alone.tiers[0] != "remote":
                                self._problem(f"{when}: {tenant} identity {which} chain "
                                              f"{chain}: block {i} found ({alone.tiers[0]}), "
                                              f"its prefix ends at {hit.blocks}")
                                break
                        if hit.blocks:
                            try:
                                got = ns.get(keys[:hit.blocks])
                            except NotFoundError:
                                continue   # (a promotion found a damaged copy: a miss)
                            for i, (key, data) in enumerate(zip(keys, got)):
                                if data != content(key, size):
                                    self._problem(f"{when}: {tenant} identity {which} chain "
                                                  f"{chain} block {i} read back wrong")
                            self.report.verified += len(got)
                stats = c.stats()
                if stats["invariant_violations"]:
                    self._problem(f"{when}: {stats['invariant_violations']} invariant "
                                  f"violations")
        return census

    def _read_worker_logs(self) -> None:
        r = self.report
        for path in sorted(self.client_dir.glob("*.log"), key=lambda p: int(p.stem)):
            text = path.read_text(errors="replace")
            for line in text[:text.rfind("\n") + 1].splitlines():
                kind, _, rest = line.partition(" ")
                if kind == "O":
                    name, count = rest.split()
                    r.outcomes[name] += int(count)
                elif kind == "N":
                    name, count = rest.split()
                    r.ops[name] += int(count)
                elif kind == "V":
                    r.verified += int(rest)
                elif kind == "W":
                    r.notes.append(f"worker {path.stem}: {rest}")
                elif kind in ("X", "E"):
                    r.problems.append(f"worker {path.stem}: {rest}")


def _held(stats: dict[str, Any]) -> dict[str, int]:
    dram = stats["tiers"]["dram"]
    held = {"dram reserved slots": dram["reserved_slots"], "dram reserved bytes": dram["reserved"],
            "pinned blocks": dram["pinned_blocks"]}
    ssd = stats["tiers"].get("ssd")
    if ssd is not None:
        held["ssd reserved bytes"] = ssd["reserved"]
    return {k: v for k, v in held.items() if v}


# ========================================================================================
# the worker (a separate process; the harness SIGKILLs it at will)
# ========================================================================================

class Worker:
    OPS = ("lookup", "put", "reserve", "abort", "batch", "acquire", "get", "prefetch",
           "evict", "drop")

    def __init__(self, endpoint: str, tenant: str, seed: int, out: Path, chains: int,
                 chain_blocks: int, lease: float, drop_weight: int) -> None:
        self.endpoint, self.tenant = endpoint, tenant
        self.rng = random.Random(seed)
        self.out = open(out, "a", buffering=1)
        self.chains, self.chain_blocks, self.lease = chains, chain_blocks, lease
        self.weights = (5, 20, 20, 5, 10, 15, 15, 5, 3, drop_weight)
        self.client: Client | None = None
        self.spaces: list[Any] = []
        self.ops: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.verified = 0
        self.flushed = time.monotonic()

    def flush(self) -> None:
        for name, count in self.ops.items():
            self.out.write(f"N {name} {count}\n")
        for name, count in self.outcomes.items():
            self.out.write(f"O {name} {count}\n")
        if self.verified:
            self.out.write(f"V {self.verified}\n")
        self.ops.clear()
        self.outcomes.clear()
        self.verified = 0
        self.flushed = time.monotonic()

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None

    def run(self) -> None:
        parent = os.getppid()
        while os.getppid() == parent:
            if time.monotonic() - self.flushed > 0.3:
                self.flush()
            try:
                if self.client is None:
                    self.client = Client(self.endpoint, tenant=self.tenant, timeout=5)
                    self.spaces = [self.client.namespace(i) for i in identities(self.tenant)]
                self.step()
            except (CapacityError, LimitExceededError, NotFoundError) as exc:
                self.outcomes[type(exc).__name__] += 1
            except (UnavailableError, ForbiddenError, LeaseExpiredError) as exc:
                self.outcomes[type(exc).__name__] += 1
                self.close()
                time.sleep(0.05)
            except KVStoreError as exc:
                self.out.write(f"E {type(exc).__name__} {exc.code} {str(exc)[:300]!r}\n")
                self.close()
            except Exception as exc:  # zmq or mapping errors while the daemon restarts
                if not self.outcomes[type(exc).__name__]:
                    self.out.write(f"W {type(exc).__name__} {str(exc)[:300]!r}\n")
                self.outcomes[type(exc).__name__] += 1
                self.close()
                time.sleep(0.05)

    def step(self) -> None:
        ns = self.rng.choice(self.spaces)
        size = ns.block_bytes
        op = self.rng.choices(self.OPS, self.weights)[0]
        chain = self.rng.randrange(self.chains)
        keys = ns.keys(chain_tokens(chain, self.chain_blocks))
        n = ns.lookup(keys).blocks
        self.ops[op] += 1
        if op == "drop":
            ns.drop()
            return
        if op == "evict":
            if n:
                ns.evict(keys[self.rng.randrange(n):n])
            return
        if op == "prefetch":
            ns.prefetch(keys, wait=self.rng.random() < 0.5, timeout=2.0)
            return
        if op in ("put", "reserve", "abort", "batch") and n == len(keys):
            op = "get"
        elif op in ("acquire", "get") and n == 0:
            op = "put"
        # a reservation may begin inside what is cached: skip_held gives those no slot
        first = self.rng.randint(max(0, n - 2), n) if op == "reserve" else n
        todo = (keys[first:first + self.rng.randint(1, len(keys) - first)]
                if op in ("put", "reserve", "abort", "batch") else [])
        parent = keys[first - 1] if first else None
        if op == "put":
            ns.put(todo, [content(k, size) for k in todo], parent=parent)
        elif op in ("reserve", "abort"):
            asked = time.monotonic()
            with ns.reserve(todo, parent=parent) as r:
                if op == "abort" or time.monotonic() - asked > self.lease / 2:
                    return
                for buf, key, off in zip(r.buffers, todo, r.offsets):
                    if off >= 0:
                        buf[:] = content(key, size)
                r.commit()
        elif op == "batch":
            split = self.rng.randint(1, len(todo))
            plan = [PlanItem(first * TOKENS, split * TOKENS, todo[:split], parent)]
            if split < len(todo):
                plan.append(PlanItem((first + split) * TOKENS, (len(todo) - split) * TOKENS,
                                     todo[split:], todo[split - 1]))
            asked = time.monotonic()
            res = ns.reserve_batch(plan)
            if not res.admitted:
                self.outcomes["batch refused"] += 1
                return
            late = time.monotonic() - asked > self.lease / 2
            for r in res.reservations:
                if late:
                    r.abort()
                    continue
                for buf, key, off in zip(r.buffers, r.keys, r.offsets):
                    if off >= 0:
                        buf[:] = content(key, size)
                r.commit()
        elif op == "acquire":
            lo = self.rng.randrange(n)
            want = keys[lo:self.rng.randint(lo + 1, n)]
            asked = time.monotonic()
            with ns.acquire(want) as held:
                data = [bytes(b) for b in held.buffers]
                if time.monotonic() - asked < self.lease / 2:
                    self.check(want, data, size, chain, "acquire")
        elif op == "get":
            want = keys[:self.rng.randint(1, n)]
            self.check(want, ns.get(want), size, chain, "get")
        elif op == "lookup":
            pass

    def check(self, keys: list[bytes], data: list[bytes], size: int, chain: int,
              verb: str) -> None:
        for key, block in zip(keys, data):
            if block != content(key, size):
                self.out.write(f"X {self.tenant} chain {chain} size {size} read wrong ({verb})\n")
            else:
                self.verified += 1


if __name__ == "__main__":
    endpoint, tenant, seed, out, chains, blocks, lease, drops = sys.argv[1:]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    Worker(endpoint, tenant, int(seed), Path(out), int(chains), int(blocks), float(lease),
           int(drops)).run()
