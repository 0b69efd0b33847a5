"""``fs``: one file per block in a directory, for shared filesystems (NFS, Lustre, CephFS).

Layout: ``<path>/<namespace hex>/<first 2 key hex digits>/<key hex>``, each file a codec
header and the payload.  A put writes a temporary file in the same directory and renames
it over the final name, so readers on any host see a whole old value or a whole new one.
File I/O runs on the backend's own thread pool (its size bounds the parallel I/O).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import io
import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Self, TypeVar

import msgspec

from kvstore.errors import BackendError, UnavailableError

from . import codec
from .base import GENERATION_MOST, BackendHealth, BytesLike, StorageBackend, parse_options

T = TypeVar("T")

_HIT, _MISS, _CORRUPT, _STOPPED = range(4)
GENERATION_FILE = "generation"  # in the directory: the store's generation (``generation``)
# A full store is a per-key outcome (the put returns False), not a broken backend.
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# A shared filesystem whose server went away: retrying later may work.
_UNAVAILABLE_ERRNOS = {errno.ETIMEDOUT, errno.ENOTCONN, errno.EHOSTDOWN, errno.EHOSTUNREACH}


class FsOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: Annotated[str, msgspec.Meta(min_length=1)]
    threads: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8
    fsync: bool = False  # fsync each file before the rename: durable, but much slower


class FsBackend(StorageBackend):
    """Blocks as files under ``root``; see the module docstring for the layout."""

    keys_tags = True  # values go through the codec with ``tag_secret``

    def __init__(self, root: Path, *, threads: int = 8, fsync: bool = False) -> None:
        super().__init__()
        self.root = root
        self.fsync = fsync
        self.threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="kvstore-fs"
        )

    def __repr__(self) -> str:
        return (
            f"FsBackend(root={str(self.root)!r}, threads={self.threads}, fsync={self.fsync}, "
            f"corrupt_values={self.counters.corrupt_values})"
        )

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        parsed = parse_options("fs", options, FsOptions)
        # absolute now, so a later chdir of the daemon cannot move the store
        root = Path(parsed.path).expanduser().absolute()
        return cls(root, threads=parsed.threads, fsync=parsed.fsync)

    def path_for(self, namespace: bytes, key: bytes) -> Path:
        """The file that holds ``(namespace, key)``."""
        name = key.hex()
        return self.root / namespace.hex() / name[:2] / name

    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        def count_leading(stop: threading.Event) -> int:
            count = 0
            for key in keys:
                if not self.path_for(namespace, key).is_file():
                    break
                count += 1
            return count

        return (await self._run("exists", [count_leading]))[0]

    async def get_into(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[bool]:
        jobs = [
            _bind(self._read_one, namespace, key, buffer)
            for key, buffer in zip(keys, buffers, strict=True)
        ]
        statuses = await self._run("get_into", jobs)
        self.counters.corrupt_values += statuses.count(_CORRUPT)
        return [status == _HIT for status in statuses]

    async def put(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike]
    ) -> list[bool]:
        return await self.put_checksummed(namespace, keys, values, [None] * len(keys))

    async def put_checksummed(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike],
        checksums: Sequence[int | None],
    ) -> list[bool]:
        jobs = [
            _bind(self._write_one, namespace, key, value, digest)
            for key, value, digest in zip(keys, values, checksums, strict=True)
        ]
        return await self._run("put", jobs)

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        def remove_all(stop: threading.Event) -> int:
            removed = 0
            for key in keys:
                try:
                    self.path_for(namespace, key).unlink()
                except FileNotFoundError:
                    continue
                removed += 1
            return removed

        return (await self._run("delete", [remove_all]))[0]

    async def health(self) -> BackendHealth:
        def check(stop: threading.Event) -> BackendHealth:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                return BackendHealth(ok=False, detail=f"{self.root} is not writable")
            fs = os.statvfs(self.root)
            capacity = fs.f_blocks * fs.f_frsize
            return BackendHealth(
                ok=True,
                detail=f"directory {self.root} (capacity and use are the filesystem's)",
                capacity_bytes=capacity,
                used_bytes=capacity - fs.f_bfree * fs.f_frsize,
            )

        try:
            return (await self._run("health", [check]))[0]
        except (BackendError, UnavailableError) as exc:
            return BackendHealth(ok=False, detail=str(exc))

    async def generation(self) -> bytes | None:
        """A token in the directory (the file ``generation``: no namespace's name, those
        are 32 hex digits), made by the first daemon to ask: the same while the directory
        keeps what it holds, for every daemon that shares it; another once it was emptied
        or replaced (a wiped folder, another filesystem mounted there), so the daemons
        forget which blocks they believed it held."""
        return (await self._run("generation", [self._generation_token]))[0]

    def _generation_token(self, stop: threading.Event) -> bytes:
        path = self.root / GENERATION_FILE
        for _ in range(8):  # (each try finds it, or makes it, unless others race it away)
            try:
                with open(path, "rb") as file:
                    return file.read(GENERATION_MOST)
            except FileNotFoundError:
                pass
            # made whole beside it, then linked in: a reader never finds it half-written,
            # and of two daemons making one, the first link wins and the other reads it
            made = path.with_name(f".{GENERATION_FILE}.{secrets.token_hex(6)}.tmp")
            fd = _create(made)
            try:
                try:
                    _write_all(fd, secrets.token_hex(16).encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.link(made, path)
            except FileExistsError:
                pass
            finally:
                made.unlink(missing_ok=True)
        raise BackendError(f"fs backend at {self.root}: its generation token comes and goes "
                           f"(another process keeps removing {path})")

    async def close(self) -> None:
        # Only a call still running concurrently can have jobs here; let them finish
        # (cancelling them would surface as a bare CancelledError in that call).
        self._executor.shutdown(wait=False)

    def _read_one(
        self, stop: threading.Event, namespace: bytes, key: bytes, out: memoryview
    ) -> int:
        try:
            with open(self.path_for(namespace, key), "rb", buffering=0) as file:
                return _read_value(file, stop, namespace, key, out, self.tag_secret)
        except FileNotFoundError:
            return _MISS

    def _write_one(
        self, stop: threading.Event, namespace: bytes, key: bytes, value: BytesLike,
        digest: int | None = None,
    ) -> bool:
        if stop.is_set():
            return False
        path = self.path_for(namespace, key)
        header = codec.encode_header(namespace, key, value, digest, self.tag_secret)
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = _create(temporary)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                return False
            raise
        try:
            try:
                _write_all(fd, header)
                _write_all(fd, value)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, path)
        except BaseException as exc:
            temporary.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
                return False
            raise
        return True

    async def _run(self, op: str, jobs: list[Callable[[threading.Event], T]]) -> list[T]:
        """Run the jobs on the pool; results in order; OSError mapped into kvstore errors.

        On any failure or cancellation the remaining jobs are told to stop, and the call
        returns only after every started job has ended: a running read may be filling a
        caller's buffer, which the caller may reuse as soon as we return.
        """
        stop = threading.Event()
        try:
            futures = [self._executor.submit(job, stop) for job in jobs]
        except RuntimeError as exc:  # the pool is shut down
            raise UnavailableError(f"fs backend at {self.root} is closed: {exc}") from None
        try:
            return [await asyncio.wrap_future(future) for future in futures]
        except BaseException as exc:
            stop.set()
            for future in futures:
                future.cancel()
            await _settle(futures)
            if isinstance(exc, OSError):
                raise _map_os_error(exc, f"fs backend at {self.root}: {op}") from exc
            raise


def _create(path: Path) -> int:
    """Open a new file for writing, creating its directories if needed: the daemon's
    user's alone, for the files hold every tenant's blocks, which any user of the host
    could read otherwise, past the daemon's isolation of tenants."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the namespace's
        path.parent.mkdir(mode=0o700, exist_ok=True)
        return os.open(path, flags, 0o600)


def _bind(
    method: Callable[..., T],
    namespace: bytes,
    key: bytes,
    *args: Any,
) -> Callable[[threading.Event], T]:
    def job(stop: threading.Event) -> T:
        return method(stop, namespace, key, *args)

    return job


def _read_value(
    file: io.FileIO, stop: threading.Event, namespace: bytes, key: bytes, out: memoryview,
    secret: bytes | None,
) -> int:
    """Read and check one stored value from ``file``, its payload straight into ``out``."""
    header_bytes = bytearray(codec.HEADER_BYTES)
    if not _fill(file, memoryview(header_bytes), stop):
        return _STOPPED if stop.is_set() else _CORRUPT
    header = codec.read_header(header_bytes)
    if header is None or header[0] != out.nbytes:
        return _CORRUPT
    if os.fstat(file.fileno()).st_size != codec.HEADER_BYTES + header[0]:
        return _CORRUPT  # truncated or extended
    if not _fill(file, out, stop):
        return _STOPPED if stop.is_set() else _CORRUPT
    return _HIT if codec.payload_matches(namespace, key, header, out, secret) else _CORRUPT


def _fill(file: io.FileIO, out: memoryview, stop: threading.Event) -> bool:
    """Read exactly ``out.nbytes`` bytes into ``out``; False at end of file or when stopped."""
    filled = 0
    while filled < out.nbytes:
        if stop.is_set():
            return False
        count = file.readinto(out[filled:])
        if not count:
            return False
        filled += count
    return True


def _write_all(fd: int, data: BytesLike) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view):]


async def _settle(futures: list[concurrent.futures.Future[Any]]) -> None:
    """Wait until none of ``futures`` is running, through any cancellation, then re-raise it."""
    cancelled = False
    while running := [future for future in futures if not future.done()]:
        try:
            await asyncio.wait([asyncio.wrap_future(future) for future in running])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def _map_os_error(exc: OSError, what: str) -> BackendError | UnavailableError:
    if exc.errno in _UNAVAILABLE_ERRNOS:
        return UnavailableError(f"{what}: {exc}")
    return BackendError(f"{what}: {exc}")
