"""The SSD tier through the daemon against raw O_DIRECT pwrite/pread on the same
filesystem.

Per block size (256 KiB, 2 MiB), a daemon of its own with a small DRAM tier and a
write-back SSD tier under the bench's directory:

- write-back: DRAM is filled first (not timed); then each sample puts more chains of
  16 blocks through the arena, so that every put demotes as many cold blocks to SSD.
  Demotion bandwidth = bytes the SSD engine wrote (``stats()["ssd_io"]``) / the wall
  time of the puts.  Peer: ``os.pwrite`` with O_DIRECT of as many bytes in the same
  block size, ``fdatasync`` per chain (the daemon syncs once per demoted batch).
- promotion: the daemon restarts on its directory (a warm restart: DRAM is empty) and
  each sample acquires chains that are only on SSD.  Promotion bandwidth = bytes
  promoted / time.  Peer: ``os.preadv`` with O_DIRECT of as many bytes.

Where the filesystem refuses O_DIRECT (tmpfs), the peer is buffered and the row's peer
says so.
"""

from __future__ import annotations

import errno
import mmap
import os
import statistics
import time
from pathlib import Path
from typing import Any

from kvstore.bench.harness import Daemon, Progress, Results, Row
from kvstore.bench.planes import BLOCKS_PER_CALL, SIZES, sized_identity
from kvstore.client import Client, Namespace

MiB = 1 << 20
BLOCK_TOKENS = 8


def open_raw(path: Path, flags: int, direct: bool) -> tuple[int, bool]:
    """Open the raw peer's file, with O_DIRECT when asked and the filesystem allows it;
    the descriptor and whether it is direct."""
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # tmpfs and some FUSE filesystems refuse it
                raise
    return os.open(path, flags, 0o600), False


class _Case:
    """One block size: a daemon with an SSD tier, and a raw file beside it."""

    def __init__(self, root: Path, label: str, quick: bool, samples: int) -> None:
        self.root = root
        self.label = label
        self.identity = sized_identity(label, "bench")
        self.block = self.identity.block_bytes
        self.chain_bytes = BLOCKS_PER_CALL * self.block
        self.dram = (64 if quick else 256) * MiB
        per_sample = (64 if quick else 256) * MiB
        self.chains_per_sample = max(1, per_sample // self.chain_bytes)
        ssd = self.dram + samples * self.chains_per_sample * self.chain_bytes + 256 * MiB
        self.daemon = Daemon(root / "daemon", dram=str(self.dram),
                             ssd=str(-(-ssd // (64 * MiB)) * 64 * MiB),
                             extra=["--slab-size", "16MiB", "--ssd-write-policy",
                                    "write-back"],
                             env={"KVSTORE_SSD_SLAB_SIZE": str(64 * MiB)})
        self.payload = [os.urandom(self.block) for _ in range(BLOCKS_PER_CALL)]
        # page-aligned buffers for the raw peer, like the daemon's arena slots
        self.buffer = mmap.mmap(-1, self.chain_bytes)
        self.buffer.write(b"".join(self.payload))
        self.views = [memoryview(self.buffer)[i * self.block:(i + 1) * self.block]
                      for i in range(BLOCKS_PER_CALL)]
        self.raw_path = root / "raw.dat"
        self.direct = True
        self.chains: list[list[bytes]] = []
        self.counter = 0

    def _put(self, ns: Namespace) -> None:
        keys = ns.keys(range(self.counter * BLOCKS_PER_CALL * BLOCK_TOKENS,
                             (self.counter + 1) * BLOCKS_PER_CALL * BLOCK_TOKENS))
        self.counter += 1
        self.chains.append(keys)
        r = ns.reserve(keys)
        for buffer, data in zip(r.buffers, self.payload):
            buffer[:] = data
        r.commit()

    def write_back(self, samples: int) -> tuple[list[float], list[float]]:
        """Demotion GB/s of the daemon and of the raw peer, sample by sample."""
        ours: list[float] = []
        raw: list[float] = []
        with Client(self.daemon.endpoint, tenant="bench") as client:
            ns = client.namespace(self.identity)
            for _ in range(self.dram // self.chain_bytes):
                self._put(ns)
            for _ in range(samples):
                before = client.stats()["ssd_io"]["bytes_written"]
                started = time.perf_counter()
                for _ in range(self.chains_per_sample):
                    self._put(ns)
                seconds = time.perf_counter() - started
                written = client.stats()["ssd_io"]["bytes_written"] - before
                ours.append(written / seconds / 1e9)
                raw.append(self.raw_write(max(written, self.chain_bytes)))
        return ours, raw

    def raw_write(self, nbytes: int) -> float:
        fd, self.direct = open_raw(self.raw_path, os.O_RDWR | os.O_CREAT, self.direct)
        try:
            chains = max(1, nbytes // self.chain_bytes)
            os.posix_fallocate(fd, 0, chains * self.chain_bytes)
            started = time.perf_counter()
            at = 0
            for _ in range(chains):
                for view in self.views:
                    os.pwrite(fd, view, at)
                    at += self.block
                os.fdatasync(fd)
            return at / (time.perf_counter() - started) / 1e9
        finally:
            os.close(fd)

    def promote(self, samples: int) -> tuple[list[float], list[float]]:
        """Promotion GB/s of the restarted daemon and of the raw peer, sample by sample."""
        ours: list[float] = []
        raw: list[float] = []
        with Client(self.daemon.endpoint, tenant="bench") as client:
            ns = client.namespace(self.identity)
            on_ssd = [keys for keys in self.chains
                      if ns.lookup(keys).tiers == ["ssd"] * len(keys)]
            # what fits in the empty DRAM tier, so that promotions evict nothing
            room = max(1, (self.dram * 3 // 4) // self.chain_bytes)
            on_ssd = on_ssd[:room]
            per = max(1, len(on_ssd) // samples)
            for i in range(0, len(on_ssd), per):
                group = on_ssd[i:i + per]
                started = time.perf_counter()
                for keys in group:
                    with ns.acquire(keys):
                        pass
                seconds = time.perf_counter() - started
                ours.append(len(group) * self.chain_bytes / seconds / 1e9)
                raw.append(self.raw_read(len(group) * self.chain_bytes))
        return ours, raw

    def raw_read(self, nbytes: int) -> float:
        fd, self.direct = open_raw(self.raw_path, os.O_RDONLY, self.direct)
        try:
            size = os.fstat(fd).st_size
            started = time.perf_counter()
            at = done = 0
            while done < nbytes:
                for view in self.views:
                    if at + self.block > size:
                        at = 0
                    if os.preadv(fd, [view], at) != self.block:
                        raise OSError("short read from the raw peer's file")
                    at += self.block
                    done += self.block
            return done / (time.perf_counter() - started) / 1e9
        finally:
            os.close(fd)

    def close(self) -> None:
        self.daemon.stop()
        for view in self.views:
            view.release()
        self.buffer.close()


def ssd(work: Path, repeat: int, quick: bool, results: Results, progress: Progress) -> None:
    """Write-back and promotion at 256 KiB and 2 MiB against raw O_DIRECT."""
    samples = min(repeat, 5)  # each sample adds to the SSD tier: keep it bounded
    for label in SIZES:
        progress.step(f"ssd: {label} blocks, write-back and promotion")
        case = _Case(work / f"ssd-{label}", label, quick, samples)
        try:
            case.daemon.start()
            wrote, raw_w = case.write_back(samples)
            case.daemon.stop()  # drains and syncs the index: a warm restart follows
            case.daemon.start()
            read, raw_r = case.promote(samples)
        finally:
            case.close()
        peer = "O_DIRECT" if case.direct else "buffered (no O_DIRECT)"
        results.rows.append(Row("ssd", f"write-back {label}", "GB/s", _median(wrote),
                                _median(raw_w), f"pwrite {peer}", "higher", 0.7))
        results.rows.append(Row("ssd", f"promotion {label}", "GB/s", _median(read),
                                _median(raw_r), f"pread {peer}", "higher", 0.7))
        progress.advance()


def _median(values: list[Any]) -> float:
    return float(statistics.median(values)) if values else float("nan")
