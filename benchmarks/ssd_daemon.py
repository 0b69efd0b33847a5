"""SSD tier through the daemon: write-back and promotion bandwidth against raw pwrite/pread.

For 256 KiB and 2 MiB blocks, each repeat runs a fresh daemon with a 256 MiB DRAM tier and
a 2 GiB SSD tier (write-back) next to its peer, on the same filesystem, in the same run:

- write-back: DRAM is first filled with committed blocks (not counted); then ``--mib`` more are
  put in chains of ``--chain`` blocks, so that every put demotes as many cold blocks to
  SSD.  Demotion bandwidth = bytes the SSD engine wrote / wall time of the puts; the
  client's put throughput = bytes put / the same time.  Peer: sequential ``os.pwrite`` of
  the same bytes in the same block size, ``fdatasync`` per batch of ``--chain`` blocks
  (the daemon's ``sync = "batch"`` policy syncs once per demoted batch), buffered and,
  as the daemon writes where the filesystem allows, with O_DIRECT.
- promotion: the daemon is restarted on the same directory (warm restart), the page cache
  dropped, then every chain that is only on SSD is acquired (and released), one chain per
  request.  Promotion bandwidth = bytes promoted / time.  Peer: sequential ``os.preadv``
  of as many bytes from a cold file, block by block, buffered and with O_DIRECT.

The page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``) before every timed run
where the process may do so; otherwise the output says "warm cache".  Also printed: the
share of the SSD engine's write time spent in LMDB index commits (``ssd_io``:
``index_seconds`` against ``io_seconds``), the engine's own write bandwidth and how much
of the wall time it was busy, and the bandwidth of the same puts into free DRAM (no
demotion), which together separate the engine from the rest of the daemon.  Ratios are
against the buffered peer ("ratio") and the O_DIRECT one ("vs direct").  Runs take about
a minute on defaults.

    python benchmarks/ssd_daemon.py [--dir DIR] [--mib 512] [--repeats 5] [--chain 32]
        [--plane arena|frames]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ssd_tier import drop_page_cache  # the engine benchmark beside this one

from kvstore import Client, Identity
from kvstore.bench.disk import open_raw

KiB = 1 << 10
MiB = 1 << 20
DRAM_CAPACITY = "256MiB"
DRAM_BYTES = 256 * MiB
SSD_CAPACITY = "2GiB"
BLOCK_TOKENS = 8
SIZES = ((256 * KiB, 4), (2 * MiB, 32))  # block bytes, KV heads that give them




class Daemon:
    """``python -m kvstore serve`` with a write-back SSD tier under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.endpoint = f"ipc://{root / 'kvstore.sock'}"
        self.log_path = root / "daemon.log"
        self.args = [
            sys.executable, "-m", "kvstore", "serve", "--endpoint", self.endpoint,
            "--dram-capacity", DRAM_CAPACITY, "--ssd-path", str(root / "ssd"),
            "--ssd-capacity", SSD_CAPACITY, "--log-level", "warning",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ)
        env.pop("KVSTORE_ENDPOINT", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log, env=env)
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"daemon exited early:\n{self.log_path.read_text()}")
            if b"serving on" in line:
                return

    def stop(self) -> None:
        """SIGTERM: the daemon drains its SSD writes and syncs its index on the way out."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


class Case:
    """One block size, one repeat: a fresh daemon directory and a raw file beside it."""

    def __init__(self, root: Path, block: int, heads: int, total: int, chain: int,
                 plane: str = "arena") -> None:
        self.root = root
        self.block, self.chain = block, chain
        self.plane = plane
        self.identity = Identity(
            model=f"ssd-bench-{block}", model_revision="r", tenant="bench",
            kv_dtype="float16", num_layers=16, num_kv_heads=heads, head_dim=128,
            block_tokens=BLOCK_TOKENS)
        assert self.identity.block_bytes == block
        self.fill_chains = DRAM_BYTES // (block * chain)
        self.put_chains = total // (block * chain)
        self.total = self.put_chains * chain * block
        # a chain's worth of distinct blocks, put (and pwritten) again for every chain
        self.payload = [os.urandom(block) for _ in range(chain)]
        self.daemon = Daemon(root)
        self.raw_path = root / "raw.dat"
        self.direct_refused = False
        self.keys: list[list[bytes]] = []
        # page-aligned source and sink for the raw peer, like the daemon's arena slots
        self.sink = mmap.mmap(-1, block * chain)
        self.sink.write(b"".join(self.payload))
        self.sink_views = [memoryview(self.sink)[i * block:(i + 1) * block]
                           for i in range(chain)]

    def _tokens(self, c: int) -> range:
        span = self.chain * BLOCK_TOKENS
        return range(c * span, (c + 1) * span)

    # -- write-back ------------------------------------------------------------------------
    def daemon_write(self) -> dict[str, float]:
        """Fill DRAM (timed apart), then put ``total`` more bytes; what the demotions took."""
        self.daemon.start()
        with Client(self.daemon.endpoint, tenant="bench") as client:
            ns = client.namespace(self.identity)
            self.keys = [ns.keys(self._tokens(c))
                         for c in range(self.fill_chains + self.put_chains)]
            fill = time.perf_counter()
            for keys in self.keys[:self.fill_chains]:
                self._put(ns, keys)
            fill = time.perf_counter() - fill
            before = client.stats()
            assert before["tiers"]["dram"]["free"] < self.chain * self.block, "DRAM not full"
            drop_page_cache()
            started = time.perf_counter()
            for keys in self.keys[self.fill_chains:]:
                self._put(ns, keys)
            seconds = time.perf_counter() - started
            after = client.stats()
        self.daemon.stop()
        io = {k: after["ssd_io"][k] - before["ssd_io"][k]
              for k in ("bytes_written", "io_seconds", "index_seconds", "write_batches")}
        assert after["invariant_violations"] == 0 and after["ssd_io"]["errors"] == 0
        return {"seconds": seconds, "put_bytes": self.total, **io,
                "fill_rate": self.fill_chains * self.chain * self.block / fill}

    def _put(self, ns: Any, keys: list[bytes]) -> None:
        """One chain into the daemon: through the shared arena (reserve, write the slots,
        commit: what an engine's offload does) or as message frames (put)."""
        if self.plane == "frames":
            ns.put(keys, self.payload)
            return
        r = ns.reserve(keys)
        for buffer, data in zip(r.buffers, self.payload):
            buffer[:] = data
        r.commit()

    def raw_write(self, direct: bool) -> float:
        fd, got = open_raw(self.raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, direct)
        self.direct_refused |= direct and not got
        try:
            os.posix_fallocate(fd, 0, self.total)
            drop_page_cache()
            started = time.perf_counter()
            at = 0
            for _ in range(self.put_chains):
                for data in self.sink_views:
                    os.pwrite(fd, data, at)
                    at += self.block
                os.fdatasync(fd)
            return time.perf_counter() - started
        finally:
            os.close(fd)

    # -- promotion -------------------------------------------------------------------------
    def daemon_read(self) -> tuple[float, int, bool]:
        """Warm restart, drop caches, acquire every SSD-only chain: seconds, bytes, cold."""
        self.daemon.start()
        with Client(self.daemon.endpoint, tenant="bench") as client:
            ns = client.namespace(self.identity)
            on_ssd = [keys for keys in self.keys
                      if ns.lookup(keys).tiers == ["ssd"] * len(keys)]
            assert on_ssd, "nothing came back from the SSD tier after the restart"
            before = client.stats()
            cold = drop_page_cache()
            started = time.perf_counter()
            for keys in on_ssd:
                with ns.acquire(keys):
                    pass
            seconds = time.perf_counter() - started
            after = client.stats()
        self.daemon.stop()
        promoted = after["tiers"]["dram"]["promotions"] - before["tiers"]["dram"]["promotions"]
        assert promoted == sum(len(k) for k in on_ssd), "not every block was promoted"
        assert after["ssd_io"]["checksum_failures"] == 0
        return seconds, promoted * self.block, cold

    def raw_read(self, nbytes: int, direct: bool) -> tuple[float, int, bool]:
        nbytes = min(nbytes, self.total)
        fd, got = open_raw(self.raw_path, os.O_RDONLY, direct)
        self.direct_refused |= direct and not got
        try:
            cold = drop_page_cache()
            started = time.perf_counter()
            at = 0
            while at < nbytes:
                for view in self.sink_views:
                    if at >= nbytes:
                        break
                    if os.preadv(fd, [view], at) != self.block:
                        raise RuntimeError("short read from the raw file")
                    at += self.block
            return time.perf_counter() - started, at, cold
        finally:
            os.close(fd)

    def close(self) -> None:
        self.daemon.stop()
        for view in self.sink_views:
            view.release()
        self.sink.close()
        shutil.rmtree(self.root, ignore_errors=True)


def run_size(base: Path, block: int, heads: int, args: argparse.Namespace) -> dict[str, Any]:
    """All repeats of one block size, the daemon and both raw peers interleaved, the order
    rotating from repeat to repeat."""
    out: dict[str, list[float]] = {k: [] for k in (
        "raw_w", "direct_w", "demote", "put", "raw_r", "direct_r", "promote", "index_share",
        "engine_w", "engine_busy", "fill")}
    cold, refused = True, False
    peers = ["raw", "direct", "daemon"]
    for repeat in range(args.repeats):
        case = Case(Path(tempfile.mkdtemp(prefix=f"r{repeat}-", dir=base)), block, heads,
                    args.mib * MiB, args.chain, args.plane)
        order = peers[repeat % 3:] + peers[:repeat % 3]
        try:
            for who in order:
                if who == "daemon":
                    w = case.daemon_write()
                    out["demote"].append(w["bytes_written"] / w["seconds"] / 1e9)
                    out["put"].append(w["put_bytes"] / w["seconds"] / 1e9)
                    engine = w["io_seconds"] + w["index_seconds"]
                    out["index_share"].append(w["index_seconds"] / engine)
                    out["engine_w"].append(w["bytes_written"] / engine / 1e9)
                    out["engine_busy"].append(engine / w["seconds"])
                    out["fill"].append(w["fill_rate"] / 1e9)
                else:
                    seconds = case.raw_write(direct=who == "direct")
                    out[f"{who}_w"].append(case.total / seconds / 1e9)
            # the raw file holds what the last raw peer wrote; both read the same bytes
            promoted = 0
            for who in order:
                if who == "daemon":
                    seconds, promoted, c = case.daemon_read()
                    out["promote"].append(promoted / seconds / 1e9)
                else:
                    # the daemon's read may not have run yet: read what it will promote,
                    # which is what its write-back demoted, about ``total`` bytes
                    seconds, nbytes, c = case.raw_read(promoted or case.total,
                                                       direct=who == "direct")
                    out[f"{who}_r"].append(nbytes / seconds / 1e9)
                cold &= c
            refused |= case.direct_refused
        finally:
            case.close()
    med: dict[str, Any] = {k: statistics.median(v) for k, v in out.items()}
    med["cold"] = cold
    med["refused"] = refused
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where to put the files (default: system temp)")
    parser.add_argument("--mib", type=int, default=512,
                        help="MiB put beyond a full DRAM tier, per block size and repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chain", type=int, default=32, help="blocks per put and per acquire")
    parser.add_argument("--plane", choices=("arena", "frames"), default="arena",
                        help="how the client puts: into the shared arena (reserve, write, "
                             "commit, as an engine's offload does) or as message frames")
    args = parser.parse_args()
    if args.mib + DRAM_BYTES // MiB > 2048 - 64:
        parser.error("--mib must leave the 2 GiB SSD tier room (at most 1728)")

    base = Path(tempfile.mkdtemp(prefix="kvstore-ssd-daemon-bench-", dir=args.dir))
    can_drop = drop_page_cache()
    print(f"SSD tier through the daemon vs raw pwrite/pread: DRAM {DRAM_CAPACITY} full, "
          f"then {args.mib} MiB put ({args.plane} plane) in chains of {args.chain}; medians of {args.repeats} "
          f"repeats; {'page cache dropped before each run' if can_drop else 'warm cache'}")
    header = (f"{'block':>8} {'measure':<24} {'raw GB/s':>9} {'O_DIRECT':>9} "
              f"{'daemon GB/s':>12} {'ratio':>6} {'vs direct':>9}  notes")
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    try:
        for block, heads in SIZES:
            m = run_size(base, block, heads, args)
            label = f"{block // KiB} KiB" if block < MiB else f"{block // MiB} MiB"
            rows = (
                ("write-back (demotion)", m["raw_w"], m["direct_w"], m["demote"],
                 (f"engine {m['engine_w']:.2f} GB/s alone, busy {m['engine_busy']:.0%} of "
                  f"the time; index commits {m['index_share']:.1%} of its time")),
                ("put seen by the client", m["raw_w"], m["direct_w"], m["put"],
                 f"puts into free DRAM (no demotion): {m['fill']:.2f} GB/s"),
                ("promotion (acquire)", m["raw_r"], m["direct_r"], m["promote"],
                 "cold cache" if m["cold"] else "warm cache"),
            )
            if m["refused"]:
                print(f"{label:>8} the filesystem refused O_DIRECT: that peer is buffered too")
            for name, raw, direct, ours, note in rows:
                print(f"{label:>8} {name:<24} {raw:9.2f} {direct:9.2f} {ours:12.2f} "
                      f"{ours / raw:6.0%} {ours / direct:9.0%}  {note}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"target: daemon >= 70% of raw; ran {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
