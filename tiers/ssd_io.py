"""The SSD tier's data file: positional reads and writes of block bytes.

One file holds the whole flat offset space (offset ``o`` of the layout is byte ``o`` of the
file).  Runs of adjacent blocks, up to 1 MiB, go down in one ``pwritev``/``preadv``, and
the runs of one call go down several at a time (one thread keeps an SSD's queue short).
With direct I/O, blocks whose offset and length are 4 KiB aligned bypass the page cache;
a caller buffer that is not page aligned is staged through a per-thread aligned bounce
buffer on writes, and read through the page cache on reads.  Everything here blocks:
callers run it in a worker thread.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.errors import BackendError, CapacityError

from .ssd_layout import IO_ALIGN, SlabLayout

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
_MAX_RUN_BYTES = 1 << 20  # bounds one syscall and each thread's bounce buffer
QUEUE_DEPTH = 4  # runs in flight at once: one thread cannot keep an SSD's queue full


class Span(NamedTuple):
    """A block's bytes in memory and the file offset they belong at."""

    offset: int
    view: memoryview


def address_of(view: memoryview) -> int:
    """Memory address of the first byte of a contiguous buffer."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _aligned(value: int) -> bool:
    return value % IO_ALIGN == 0


def disk_error(path: Path, action: str, exc: OSError) -> CapacityError | BackendError:
    """The kvstore error for an OSError: disk full is a CapacityError, the rest BackendError."""
    if exc.errno in DISK_FULL_ERRNOS:
        return CapacityError(f"disk full under SSD data file {path} while {action}: {exc.strerror}")
    return BackendError(f"SSD data file {path} failed while {action}: {exc}")


class DataFile:
    """The data file of the SSD tier, open for buffered and (where allowed) direct I/O."""

    def __init__(
        self, path: Path, layout: SlabLayout, *, direct_io: bool, preallocate: bool,
        queue_depth: int = QUEUE_DEPTH,
    ) -> None:
        """Open or create the file, sized to the layout's capacity.

        ``preallocate`` reserves the whole capacity now; otherwise each slab is reserved
        the first time this process writes into it.  Raises CapacityError when the disk
        cannot hold the reservation, leaving the file as it was.  Up to ``queue_depth``
        runs of one call go down at once, each from its own thread.
        """
        self.path = path
        self.layout = layout
        self._queue: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(queue_depth - 1, thread_name_prefix="kvstore-ssd-io")
            if queue_depth > 1 else None)
        self._allocated: set[int] = set()
        self._local = threading.local()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._direct_fd: int | None = None
        self._use_direct = False
        try:
            old_size = os.fstat(self._fd).st_size
            if old_size != layout.capacity_bytes:
                os.ftruncate(self._fd, layout.capacity_bytes)
            if preallocate:
                try:
                    os.posix_fallocate(self._fd, 0, layout.capacity_bytes)
                except OSError as exc:
                    # give back whatever the failed reservation grabbed
                    os.ftruncate(self._fd, min(old_size, layout.capacity_bytes))
                    raise disk_error(path, f"reserving {layout.capacity_bytes} bytes", exc) from exc
                self._allocated.update(range(layout.slabs))
            if direct_io:
                self._direct_fd = self._open_direct()
                self._use_direct = self._direct_fd is not None
        except BaseException:
            self.close()
            raise

    def _open_direct(self) -> int | None:
        try:
            return os.open(self.path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # the filesystem (tmpfs, some FUSE) has no O_DIRECT
                return None
            raise

    @property
    def direct_io(self) -> bool:
        """Whether aligned blocks currently bypass the page cache."""
        return self._use_direct

    @staticmethod
    def allocated_bytes(path: Path) -> int:
        """Bytes the file already holds on disk (0 when it does not exist)."""
        try:
            return os.stat(path).st_blocks * 512
        except FileNotFoundError:
            return 0

    # writes

    def write(self, spans: Sequence[Span], *, sync: bool) -> list[int]:
        """Write every span at its offset, then fdatasync when ``sync``; returns each span's
        xxh3_64, hashed by the thread that wrote it while other runs are in flight.  All
        or nothing is not promised: on error some spans may be on disk (the index never
        points at them)."""
        digests: dict[int, int] = {}

        def write_run(run: tuple[list[Span], bool]) -> None:
            self._write_run(*run)
            for span in run[0]:
                digests[id(span)] = xxhash.xxh3_64_intdigest(span.view)

        try:
            self._reserve(spans)
            self._each(self._runs(spans), write_run)
            if sync:
                os.fdatasync(self._fd)
        except OSError as exc:
            raise disk_error(self.path, "writing blocks", exc) from exc
        return [digests[id(span)] for span in spans]

    def _reserve(self, spans: Sequence[Span]) -> None:
        slab_bytes = self.layout.slab_bytes
        for slab in sorted({span.offset // slab_bytes for span in spans} - self._allocated):
            os.posix_fallocate(self._fd, slab * slab_bytes, slab_bytes)
            self._allocated.add(slab)

    def _runs(self, spans: Sequence[Span]) -> list[tuple[list[Span], bool]]:
        """Group spans (sorted by offset) into runs of adjacent ones for one syscall each."""
        runs: list[tuple[list[Span], bool]] = []
        run: list[Span] = []
        run_direct = False
        run_end = run_bytes = -1
        for span in sorted(spans, key=lambda s: s.offset):
            direct = (
                self._use_direct
                and _aligned(span.offset)
                and _aligned(len(span.view))
            )
            if (
                run
                and span.offset == run_end
                and direct == run_direct
                and len(run) < _IOV_MAX
                and run_bytes + len(span.view) <= _MAX_RUN_BYTES
            ):
                run.append(span)
                run_bytes += len(span.view)
            else:
                run = [span]
                run_bytes = len(span.view)
                run_direct = direct
                runs.append((run, direct))
            run_end = span.offset + len(span.view)
        return runs

    def _each(self, runs: list[tuple[list[Span], bool]],
              action: Callable[[tuple[list[Span], bool]], None]) -> None:
        """``action`` on every run, several at a time; the first error is raised once all
        have finished (none is left writing into a buffer the caller takes back)."""
        if self._queue is None or len(runs) < 2:
            for run in runs:
                action(run)
            return
        futures = [self._queue.submit(action, run) for run in runs[1:]]
        error: BaseException | None = None
        try:
            action(runs[0])  # this thread takes a share too
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others
            error = exc
        for future in futures:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error

    def _bounce(self, size: int) -> memoryview:
        buffer: mmap.mmap | None = getattr(self._local, "bounce", None)
        if buffer is None or len(buffer) < size:
            # anonymous mmap memory is page aligned, as O_DIRECT needs
            buffer = mmap.mmap(-1, max(size, _MAX_RUN_BYTES))
            self._local.bounce = buffer
        return memoryview(buffer)[:size]

    def _write_run(self, run: list[Span], direct: bool) -> None:
        offset = run[0].offset
        if direct:
            views = [span.view for span in run]
            if not all(_aligned(address_of(v)) for v in views):
                total = sum(len(v) for v in views)
                bounce = self._bounce(total)
                at = 0
                for v in views:
                    bounce[at:at + len(v)] = v
                    at += len(v)
                views = [bounce]
            assert self._direct_fd is not None, "direct run without a direct descriptor"
            try:
                written = os.pwritev(self._direct_fd, views, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # the filesystem refused O_DIRECT after all: stay buffered from now on (the
                # descriptor stays open until close(), another thread may be using it)
                self._use_direct = False
                written = 0
            _pwritev_all(self._fd, views, offset, written)
        else:
            _pwritev_all(self._fd, [span.view for span in run], offset, 0)

    # reads

    def read(self, spans: Sequence[Span]) -> list[int]:
        """Read each span's bytes from its offset into its view.  Returns, per span, how
        many bytes arrived (fewer than asked past the end of the file, -1 on an I/O error)."""
        return [n for n, _ in self.read_hashed(spans, hash_them=False)]

    def read_hashed(self, spans: Sequence[Span], *,
                    hash_them: bool = True) -> list[tuple[int, int | None]]:
        """As :meth:`read`, with each whole span's xxh3_64 (None if it came short), hashed
        by the thread that read it while other runs are in flight."""
        got: dict[int, tuple[int, int | None]] = {}

        def read_run(run: tuple[list[Span], bool]) -> None:
            n = self._read_run(run)
            for span in run[0]:
                take = min(n, len(span.view)) if n >= 0 else -1
                whole = hash_them and take == len(span.view)
                got[id(span)] = (take, xxhash.xxh3_64_intdigest(span.view) if whole else None)
                n -= take if n >= 0 else 0

        self._each(self._runs_for_read(spans), read_run)
        return [got[id(span)] for span in spans]

    def _read_run(self, run: tuple[list[Span], bool]) -> int:
        spans, direct = run
        fd = self._direct_fd if direct and self._direct_fd is not None else self._fd
        try:
            return _preadv_run(fd, [span.view for span in spans], spans[0].offset)
        except OSError:
            return -1

    def _runs_for_read(self, spans: Sequence[Span]) -> list[tuple[list[Span], bool]]:
        runs: list[tuple[list[Span], bool]] = []
        for run, direct in self._runs(spans):
            if direct and not all(_aligned(address_of(span.view)) for span in run):
                # reading through the page cache beats a bounce copy for a read
                runs.append((run, False))
            else:
                runs.append((run, direct))
        return runs

    # lifecycle

    def datasync(self) -> None:
        """fdatasync the file."""
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise disk_error(self.path, "syncing", exc) from exc

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        if self._queue is not None:
            self._queue.shutdown(wait=True)
            self._queue = None
        for fd in (self._direct_fd, self._fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._direct_fd = None
        self._use_direct = False
        self._fd = -1


def _pwritev_all(fd: int, views: list[memoryview], offset: int, done: int) -> None:
    """pwritev until all of ``views`` (of which ``done`` bytes are already written) is down."""
    views = _skip(views, done)
    offset += done
    while views:
        n = os.pwritev(fd, views, offset)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        views = _skip(views, n)


def _preadv_run(fd: int, views: list[memoryview], offset: int) -> int:
    """preadv the views full, or up to the end of the file; returns the bytes read."""
    wanted = sum(len(v) for v in views)
    n = os.preadv(fd, views, offset)
    # a regular file reads short only at its end; asking again (unaligned, under O_DIRECT)
    # would only fail
    return min(n, wanted)


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    out: list[memoryview] = []
    for i, v in enumerate(views):
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        out.extend(views[i + 1:])
        break
    return out
