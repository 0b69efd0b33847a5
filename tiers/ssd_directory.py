"""An SSD tier's directory, held open: claimed, its data file and index opened, its
records restored on a warm restart, and released again.

``SSDStore`` (``ssd.py``, which describes the files on disk) holds one for as long as it
is open and does its block I/O through the directory's data file and index.  Everything
here blocks.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.files import FILE_SIZE_LIMIT_FROM, check_own_directory, file_size_limit

from .ssd_index import SSDIndex, SyncPolicy
from .ssd_io import DataFile, Span
from .ssd_layout import BlockRecord, LoadPlan, SlabLayout, plan_load
from .ssd_rows import RowsBuilder, RowsPlan, plan_rows, rows_of

log = logging.getLogger("kvstore.ssd")

__all__ = ["DATA_FILE", "INDEX_DIR", "LOCK_FILE", "SSDDirectory"]

DATA_FILE = "blocks.dat"
INDEX_DIR = "index"
LOCK_FILE = "lock"
_PROGRESS_FROM = 100_000
# entries decoded in arrays at a time: each array op's overhead shared, and a chunk's
# temporary arrays small enough that the allocator keeps their pages from one chunk to
# the next (at 64k entries they were mapped and faulted in afresh each chunk: 380k page
# faults at 10M entries, 40k at 16k entries, about a second of system time)
_ROWS_CHUNK = 1 << 14


# what an open meets where another kind of file is than the tier made (a directory, a
# device): kept, it would fail again, so its error says how to start the tier cold
_MISPLACED = frozenset({errno.EISDIR, errno.ENOTDIR, errno.ENXIO, errno.ENODEV,
                        errno.ESPIPE, errno.EINVAL})


# what ``missing`` checks, the directory first: (as a log line names it, path inside it)
_WATCHED = (("the directory", "."), ("its lock file", LOCK_FILE),
            ("its data file", DATA_FILE), ("its index", f"{INDEX_DIR}/data.mdb"))


def _holder(fd: int) -> str:
    """The process holding a directory's lock, as its lock file names it (" (pid N)"),
    or "" where it names none (a daemon of an older version)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class SSDDirectory:
    """The lock, data file and index of one SSD tier directory, open together."""

    def __init__(
        self,
        path: Path,
        layout: SlabLayout,
        *,
        sync: SyncPolicy,
        direct_io: bool,
        map_size: int,
        preallocate: bool,
    ) -> None:
        """Claim directory ``path`` (create it, check it is writable, lock it, check free
        space), then open its index and data file and record the layout in the index.

        Raises ConfigError or CapacityError as ``SSDStore`` documents (ConfigError too for
        a data file or an index that cannot be opened: a directory where a file should
        be, a device); whatever was opened before the failure is released again.
        """
        self.path = path
        self.layout = layout
        self._lock_fd = -1
        self._index: SSDIndex | None = None
        self._data: DataFile | None = None
        self._opened: dict[str, tuple[int, int]] = {}
        try:
            self._check_file_size_limit()
            self._prepare_directory()
            self._check_free_space()
            self._index = SSDIndex(self.path / INDEX_DIR, self.layout, map_size=map_size, sync=sync)
            self._data = DataFile(
                self.path / DATA_FILE, self.layout, direct_io=direct_io, preallocate=preallocate
            )
            self._index.write_layout()
            self._opened = self._identities()
        except OSError as exc:  # a directory or a device where a file should be, say
            self.release()
            misplaced = exc.errno in _MISPLACED  # (not an I/O error, a permission, ...)
            raise ConfigError(
                f"SSD tier directory {self.path}: a file cannot be opened ({exc})"
                + ("; move it aside or delete the directory to start the tier cold"
                   if misplaced else "")
            ) from None
        except BaseException:
            self.release()
            raise

    # claiming

    def _prepare_directory(self) -> None:
        existing = self.path  # (what mkdir makes below it is the daemon's, 0700)
        while not os.path.lexists(existing) and existing != existing.parent:
            existing = existing.parent
        if existing.is_dir():  # (a file there: mkdir says it cannot be created)
            check_own_directory(existing, "where the SSD tier keeps its files",
                                "could replace its index or its data file with blocks of "
                                "its own; use a directory of the daemon's user (or make it "
                                "sticky, chmod +t)")
        try:
            # the daemon's user's alone: every tenant's blocks, and an index of their keys
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"SSD tier directory {self.path} cannot be created: {exc.strerror}"
            ) from exc
        probe = self.path / f".probe-{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"SSD tier directory {self.path} is not writable: {exc.strerror}"
            ) from exc
        try:
            self._lock_fd = os.open(
                self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"SSD tier directory {self.path} is in use by another kvstore process"
                f"{_holder(self._lock_fd)}"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"SSD tier directory {self.path} cannot hold a lock file: {exc.strerror}"
            ) from exc
        # who holds it, for a second daemon started on the directory to name: only that
        # (the lock is what keeps it out), so a disk too full to take the pid starts the
        # tier all the same; before, the tier refused to start ("cannot hold a lock file")
        try:
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            log.warning("SSD tier directory %s: its lock file cannot name this process "
                        "(%s); a second daemon started on it is refused naming none",
                        self.path, exc.strerror)

    def _check_file_size_limit(self) -> None:
        """Refuse a capacity past the process's file size limit (``ulimit -f``, a unit's
        ``LimitFSIZE=``): the data file could not be sized to it, and the error then
        was EFBIG on an open ("a file cannot be opened"), with no word of the limit."""
        limit = file_size_limit()
        if limit is not None and limit < self.layout.capacity_bytes:
            raise ConfigError(
                f"SSD tier directory {self.path}: capacity_bytes={self.layout.capacity_bytes} "
                f"is past the daemon's file size limit of {limit} bytes "
                f"({FILE_SIZE_LIMIT_FROM}); raise the limit or lower capacity_bytes"
            )

    def _check_free_space(self) -> None:
        held = DataFile.allocated_bytes(self.path / DATA_FILE)
        needed = max(0, self.layout.capacity_bytes - held)
        fs = os.statvfs(self.path)
        free = fs.f_bavail * fs.f_frsize
        if needed > free:
            raise ConfigError(
                f"SSD tier directory {self.path} has {free} bytes free, but capacity_bytes="
                f"{self.layout.capacity_bytes} needs {needed} more; lower capacity_bytes or "
                f"free up space"
            )

    # the open files

    def parts(self) -> tuple[DataFile, SSDIndex]:
        """The data file and the index."""
        assert self._data is not None and self._index is not None, "an opened directory has both"
        return self._data, self._index

    @property
    def direct_io(self) -> bool:
        """Whether the data file bypasses the page cache for aligned blocks."""
        return self._data is not None and self._data.direct_io

    # still there

    def _identities(self) -> dict[str, tuple[int, int]]:
        """(st_dev, st_ino) of the directory and of each file the tier keeps in it, by
        what each is called in a log line."""
        return {what: _identity(self.path / name) for what, name in _WATCHED}

    def missing(self) -> str | None:
        """What of the opened directory is no longer at its path (removed, or replaced by
        another directory or file), or None while all is: a stat of each, cheap enough
        for a timer.  Writes there would go to files nobody can find, and a restart
        would find none of the blocks."""
        for what, name in _WATCHED:
            try:
                now = _identity(self.path / name)
            except FileNotFoundError:
                return f"{what} was removed"
            except NotADirectoryError as exc:  # (the directory made a file)
                return f"{what} cannot be found: {exc.strerror}"
            # any other error (EIO, ESTALE, EACCES, ENOMEM: perhaps for a moment) is the
            # caller's, which looks again later: taken as the directory gone, one failed
            # stat turned the tier off and dropped every copy of intact files
            if now != self._opened.get(what):
                return f"{what} was replaced by another"
        return None

    # warm restart

    def restore(self) -> LoadPlan:
        """Scan the index, decide with ``plan_load`` which records survive, and delete the
        others from the index; returns the plan.  Shows progress on a terminal for a large
        index."""
        index = self.parts()[1]
        with self._progress(index.count()) as progress:
            records, bad = index.scan(progress)
        plan = plan_load(records, self.layout, self._verify_now, bad)
        if plan.dropped_keys:
            index.delete(plan.dropped_keys)
        return plan

    def restore_rows(self) -> tuple[RowsPlan, LoadPlan | None]:
        """``restore`` in columns (``ssd_rows``): the same survivors in the same order,
        and the same records deleted, with no object per record but its key.  Where the
        columns cannot decide (overlapping slots, a key twice) it is ``restore``, its
        survivors then made rows; the ``LoadPlan`` is returned too in that case."""
        index = self.parts()[1]
        total = index.count()
        builder = RowsBuilder(self.layout, total)
        with self._progress(total) as progress:
            found = index.scan_mapped(builder.add_mapped, progress, _ROWS_CHUNK)
            if found is None:  # the pages are not read in place: by cursors
                builder = RowsBuilder(self.layout, total)
                found = index.scan_into(builder.add, progress, _ROWS_CHUNK)
        bad = found
        plan = plan_rows(builder.rows())
        if plan is None:
            slow = self.restore()
            return rows_of(slow.survivors, self.layout), slow
        plan.invalid = bad + builder.invalid
        if plan.dropped_keys:
            index.delete(plan.dropped_keys)
        return plan, None

    @contextmanager
    def _progress(self, total: int) -> Iterator[Callable[[int], None] | None]:
        """A progress bar's update on a terminal for a large index, else None."""
        if total < _PROGRESS_FROM or not sys.stderr.isatty():
            yield None
            return
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

        bar: Any = tqdm(total=total, desc=f"SSD index {self.path}", unit="rec", file=sys.stderr)
        try:
            yield bar.update
        finally:
            bar.close()

    def _verify_now(self, record: BlockRecord) -> bool:
        buffer = bytearray(record.length)
        span = Span(record.offset, memoryview(buffer))
        ((n, digest),) = self.parts()[0].read_hashed([span])
        return n == record.length and digest == record.checksum

    # releasing

    def release(self) -> None:
        """Close the index and the data file and drop the lock (no sync of its own)."""
        try:
            if self._index is not None:
                self._index.close()
        finally:
            if self._data is not None:
                self._data.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # closing the descriptor drops the flock
                self._lock_fd = -1
