"""The DRAM tier's bytes: one shared-memory arena that colocated clients map.

The arena is a file on a tmpfs (``/dev/shm`` by default), mode 0600, mapped shared by
the daemon and by every client, so blocks are written and read in place with no copy
through the daemon.  Or it is an anonymous memory file with no path, whose descriptor
the daemon hands to authenticated clients (``kvstore.tiers.arena_fds``).  Pages are
populated when the arena is created: the first touch of fresh shm pages runs several
times slower than a warm write.  Clients map the file with ``mmap`` rather than
``multiprocessing.shared_memory``, whose resource tracker would unlink the arena when a
client process exits.

A tenant's own arena (``dram.per_tenant_arenas``) is made when the tenant first comes,
on a thread (``Arenas.make``), so that the daemon's loop serves the others meanwhile:
its allocation (``posix_fallocate``) lets other threads run, but a mapping made with
``MAP_POPULATE``, and ``mmap.madvise``, hold the interpreter's lock while the kernel
faults the pages in (0.41 and 0.25 s a GiB measured, every other client stalled that
long).  So the daemon's own mapping is populated by ``madvise(MADV_POPULATE_WRITE)``
called through ctypes, which lets go of the lock during the call (0.27 s a GiB, the
loop stalled 3 ms); where the kernel lacks it (before Linux 5.14) ``MAP_POPULATE`` as
before.

Per-tenant arenas are sparse: a page first touched when the file system has no memory
left (another program filled /dev/shm, a size-limited tmpfs) raised SIGBUS in whichever
process touched it, an engine or the daemon.  So a slab's memory is allocated
(``posix_fallocate`` of its range) before any slot of it is handed out, and given back
(``MADV_REMOVE``) when its slab goes back to the budget, both on one thread of the
arenas', in the order asked (``Arenas.back``, ``Arenas.release``): 16 ms and 45-60 ms a
64 MiB slab that no longer hold the loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvstore.arena_budget import ArenaBudget
from kvstore.errors import ConfigError, LimitExceededError, UnavailableError
from kvstore.tiers.arena_fds import MEMFD_PREFIX, allocated, create_memfd, size_limit_note

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # (Linux 5.14; not in the mmap module's constants)
_MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)
_ARENA_NAME = re.compile(r"kvstore-(\d+)-(\d+)-[0-9a-f]+\.(arena|gpupool)")

log = logging.getLogger("kvstore.dram")

# The longest a request waits for a slab's memory before it looks again.
_WAIT_MOST = 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def sweep_stale_arenas(directory: str) -> list[str]:
    """Unlink this user's arenas (and host-backed device pools) whose daemon is gone
    (killed before it could unlink them), so shared memory does not fill up with dead
    ones; returns the paths removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        match = _ARENA_NAME.fullmatch(name)
        if match is None or int(match[1]) != uid or _alive(int(match[2])):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    if removed:
        log.warning("removed %d arenas left by daemons that were killed: %s",
                    len(removed), ", ".join(removed))
    return removed


def create_shared_file(directory: str, suffix: str, capacity_bytes: int, *,
                       directory_field: str, size_field: str, noun: str,
                       allocate: bool = True) -> str:
    """A new file of ``capacity_bytes``, mode 0600, named for this user and process (so a
    later start can tell a dead daemon's files), allocated now (unless not ``allocate``:
    its pages come as they are written); its path.  ConfigError,
    naming the field, if it cannot be made; nothing is left behind then."""
    path = str(Path(directory) / f"kvstore-{os.getuid()}-{os.getpid()}-"
                                 f"{secrets.token_hex(4)}.{suffix}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"{directory_field}: cannot create {noun} {path}: {exc}") from None
    try:
        try:
            if allocate:
                os.posix_fallocate(fd, 0, capacity_bytes)
            else:
                os.ftruncate(fd, capacity_bytes)
        except OSError as exc:
            raise ConfigError(f"{size_field}: cannot allocate {capacity_bytes} bytes in "
                              f"{directory}: {exc.strerror}{size_limit_note(exc, size_field)}") from None
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


class DramArena:
    """A shared-memory file of ``capacity_bytes``, mapped read-write.  ``sparse``: its
    memory is neither allocated nor populated up front, but taken as slabs are written
    and given back as they go back to the budget over all arenas (``release``)."""

    def __init__(self, capacity_bytes: int, directory: str = "/dev/shm",
                 *, populate: bool = True, memfd: bool = False, sparse: bool = False) -> None:
        check_memory(capacity_bytes)
        populate = populate and not sparse
        self.capacity_bytes = capacity_bytes
        self.fd: int | None = None  # a memfd arena's descriptor, to hand to clients
        self._read_fd: int | None = None  # the same memory opened read-only, for grantees
        if memfd:
            # no path: clients get the descriptor over the side socket (tiers.arena_fds)
            self.fd = create_memfd(capacity_bytes, allocate=not sparse)
            self.path = MEMFD_PREFIX + secrets.token_hex(8)
            try:
                self._mmap = _map_populated(self.fd, capacity_bytes, populate)
            except BaseException:
                os.close(self.fd)
                raise
        else:
            self.path = create_shared_file(directory, "arena", capacity_bytes,
                                           directory_field="dram.directory",
                                           size_field="dram.capacity", noun="the arena",
                                           allocate=not sparse)
            try:
                fd = os.open(self.path, os.O_RDWR)
                try:
                    self._mmap = _map_populated(fd, capacity_bytes, populate)
                finally:
                    os.close(fd)
            except BaseException:
                os.unlink(self.path)
                raise
        self.view = memoryview(self._mmap)

    @property
    def label(self) -> str:
        """A memfd arena's name in ``memfd:<label>`` ("" for a file arena)."""
        return self.path[len(MEMFD_PREFIX):] if self.fd is not None else ""

    def read_only_fd(self) -> int:
        """A descriptor of a memfd arena that maps only for reading: what a session
        granted a tenant's namespaces to read is handed (its writes would land in blocks
        the owner's clients load).  The memory opened again through ``/proc``, read-only:
        a new open file, whose mode the mapping cannot exceed."""
        assert self.fd is not None, "only a memfd arena is handed out"
        if self._read_fd is None:
            self._read_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return self._read_fd

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping itself (to page-lock it for CUDA, say)."""
        return self._mmap

    def slot(self, offset: int, length: int) -> memoryview:
        return self.view[offset:offset + length]

    def move(self, source: int, target: int, length: int) -> None:
        """Copy ``length`` bytes at ``source`` to ``target`` (a block given another slot)."""
        self._mmap.move(target, source, length)

    def release(self, offset: int, length: int) -> None:
        """Give the memory of ``length`` bytes at ``offset`` (a slab no block uses) back
        to the system: punched out of the memory file (``MADV_REMOVE``), not merely
        unmapped, so that no client's mapping keeps it either; read again, it is zeros."""
        page = mmap.PAGESIZE
        start, end = -(-offset // page) * page, (offset + length) // page * page
        if end <= start:
            return
        try:
            # through ctypes, which lets go of the interpreter's lock while the kernel
            # frees the pages (about 50 ms a 64 MiB slab measured on a loaded host)
            address = ctypes.c_char.from_buffer(self._mmap)
            try:
                done = _madvise(ctypes.addressof(address) + start, end - start,
                                _MADV_REMOVE) == 0
            finally:
                del address
            if not done:
                self._mmap.madvise(_MADV_REMOVE, start, end - start)
        except (OSError, ValueError, TypeError) as exc:  # (a file system that cannot
            # punch holes; or the arena closed meanwhile)
            log.warning("cannot give back %d bytes of arena %s: %s", end - start, self.path,
                        exc)

    def back(self, offset: int, length: int) -> bool:
        """Allocate the memory of ``length`` bytes at ``offset`` of a sparse arena (a slab
        about to be handed out), so that no process's first write to it can fault with
        the file system full (SIGBUS); False where there is no memory for it."""
        try:
            fd = self.fd if self.fd is not None else os.open(self.path, os.O_RDWR)
        except OSError:
            return False  # (the arena unlinked: closing)
        try:
            os.posix_fallocate(fd, offset, length)  # (without the interpreter's lock)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT):
                log.warning("no memory for %d bytes of arena %s: %s", length, self.path,
                            exc.strerror)
                return False
            # a file system that cannot allocate ahead: its pages come as written
            log.warning("cannot allocate %d bytes of arena %s ahead: %s", length,
                        self.path, exc.strerror)
        finally:
            if fd != self.fd:
                os.close(fd)
        return True

    def allocated_bytes(self) -> int:
        """The memory the arena's file holds now (its pages written and not given back)."""
        if self.fd is not None:
            return os.fstat(self.fd).st_blocks * 512
        try:
            return os.stat(self.path).st_blocks * 512
        except OSError:
            return 0

    def close(self) -> None:
        """Unmap and unlink; clients that still map it keep their pages until they go."""
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still exported (a send in flight); the GC unmaps it later
        if self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd = None
        if self.fd is not None:
            os.close(self.fd)  # the memory goes with its last holder
            self.fd = None
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"DramArena({self.path}, {self.capacity_bytes} bytes)"


def check_memory(capacity_bytes: int, meminfo: str = "/proc/meminfo") -> None:
    """ConfigError if the host has less memory available than an arena of
    ``capacity_bytes`` takes: its allocation went on until the kernel killed processes
    for memory (a memory file knows no limit of its own, and a tmpfs may be sized past
    the memory), the daemon or another.  Where the figure cannot be read, nothing."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return
    if capacity_bytes > available:
        raise ConfigError(f"dram.capacity: an arena of {capacity_bytes} bytes is more than "
                          f"the {available} bytes of memory available on this host")


def map_arena(path: str, size: int, *, populate: bool = True) -> mmap.mmap:
    """A client's mapping of the daemon's arena."""
    fd = os.open(path, os.O_RDWR)
    try:
        return map_fd(fd, size, populate=populate)
    finally:
        os.close(fd)


def map_fd(fd: int, size: int, *, populate: bool = True) -> mmap.mmap:
    """A shared mapping of an open arena file (the descriptor stays open)."""
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate and allocated(fd, size) else 0)
    return mmap.mmap(fd, size, flags=flags)


def _map_populated(fd: int, size: int, populate: bool) -> mmap.mmap:
    """The daemon's mapping of an arena, its pages faulted in (``populate``) without
    holding the interpreter's lock where the kernel can (see the module doc)."""
    mapped = map_fd(fd, size, populate=False)
    if populate and size:
        address = ctypes.c_char.from_buffer(mapped)
        try:
            done = _madvise(ctypes.addressof(address), size, _MADV_POPULATE_WRITE) == 0
        finally:
            del address  # (the mapping closes only once no buffer of it is held)
        if not done:
            mapped.close()
            mapped = map_fd(fd, size, populate=True)
    return mapped


def _libc_madvise() -> Callable[[int, int, int], int]:
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return lambda address, size, advice: -1
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_madvise = _libc_madvise()


class Arenas:
    """The daemon's arenas: one for all tenants, or one per tenant (``name_of`` decides which
    a tenant's blocks live in), created on first use (``make``: on a thread, where the
    first use can wait), at most ``max_arenas``."""

    def __init__(self, capacity_bytes: int, directory: str, *, populate: bool,
                 max_arenas: int = 64, memfd: bool = False,
                 budget: ArenaBudget | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        # one budget over every tenant's arena (``kvstore.arena_budget``): the arenas are
        # sparse, and a slab that goes back to the budget gives its memory back
        self.sparse = budget is not None
        self.budget = budget
        # giving slabs' memory back and allocating it, one at a time, in order, off the
        # daemon's loop (45-60 ms and 16 ms a 64 MiB slab); created at the first
        self._worker: ThreadPoolExecutor | None = None
        self._answers = 0  # backings answered (``waiter``)
        self._answered: asyncio.Future[None] | None = None
        if budget is not None:
            budget.on_release = self.release
            budget.backer = self.back
            budget.waiter = self.waiter
        self.directory = directory
        self.populate = populate
        self.max_arenas = max_arenas
        self.memfd = memfd
        self.by_name: dict[str, DramArena] = {}
        self.by_label: dict[str, tuple[str, DramArena]] = {}  # memfd label -> (name, arena)
        self._making: dict[str, asyncio.Task[None]] = {}  # (``make``)
        self._closed = False  # (an arena made after ``close`` is closed at once)

    def get(self, name: str) -> DramArena:
        """``name``'s arena, made now (on the caller's thread) if it has none yet."""
        arena = self.by_name.get(name)
        if arena is None:
            self._check_room()
            arena = self._new()
            self._add(name, arena)
        return arena

    async def make(self, name: str) -> None:
        """Make ``name``'s arena, unless it has one, on a thread (the caller's loop goes
        on); the callers for one name meanwhile wait for the same making.
        LimitExceededError past ``max_arenas``; ConfigError if the memory is not there."""
        if name in self.by_name:
            return
        making = self._making.get(name)
        if making is None:
            if self._closed:
                raise UnavailableError("the daemon is stopping")
            self._check_room(len(self._making))
            making = self._making[name] = asyncio.get_running_loop().create_task(
                self._make(name))
        await asyncio.shield(making)

    async def _make(self, name: str) -> None:
        try:
            arena = await asyncio.to_thread(self._new, unless_closed=True)
        finally:
            del self._making[name]
        if name in self.by_name or self._closed:  # made meanwhile (by a request that
            await asyncio.to_thread(arena.close)  # could not wait), or the daemon stops
            if self._closed:
                raise UnavailableError("the daemon is stopping")
        else:
            self._add(name, arena)

    def _new(self, unless_closed: bool = False) -> DramArena:
        arena = DramArena(self.capacity_bytes, self.directory, populate=self.populate,
                          memfd=self.memfd, sparse=self.sparse)
        if unless_closed and self._closed:  # (on a thread: the loop may be gone)
            arena.close()
            raise UnavailableError("the daemon is stopping")
        return arena

    def _check_room(self, making: int = 0) -> None:
        if len(self.by_name) + making >= self.max_arenas:
            raise LimitExceededError(
                f"{len(self.by_name)} arenas exist (limit dram.max_arenas); no room for "
                f"another tenant's arena")

    def _add(self, name: str, arena: DramArena) -> None:
        self.by_name[name] = arena
        if arena.label:
            self.by_label[arena.label] = (name, arena)

    def release(self, name: str, offset: int, length: int) -> None:
        """The arena ``name``'s memory at ``offset`` goes back to the system (a slab
        back to the budget), on the arenas' thread where the daemon's loop runs."""
        arena = self.by_name.get(name)
        if arena is not None:
            self._off_loop(lambda: arena.release(offset, length))

    def back(self, name: str, index: int, offset: int, length: int) -> None:
        """Allocate the memory of the arena ``name``'s slab ``index`` (at ``offset``), on
        the arenas' thread, after the releases asked before it; the budget is told
        (``ArenaBudget.backed``) on the loop."""
        budget = self.budget
        assert budget is not None
        arena = self.by_name.get(name)
        if arena is None:
            budget.backed(name, index, None)
            return

        def done(ok: bool | None) -> None:
            budget.backed(name, index, None if self._closed else ok)
            self._answers += 1
            if self._answered is not None and not self._answered.done():
                self._answered.set_result(None)

        self._off_loop(lambda: arena.back(offset, length), done)

    def waiter(self) -> Callable[[], Awaitable[None]]:
        """A wait for the next answer to a backing after now (at most ``_WAIT_MOST``
        seconds): what a request whose slab's memory is being allocated waits for,
        rather than a turn of the loop at a time (a 64 MiB slab's memory given back and
        allocated took thousands of turns)."""
        seen = self._answers

        async def wait() -> None:
            if self._answers != seen:
                return
            if self._answered is None or self._answered.done():
                self._answered = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._answered), _WAIT_MOST)
            except TimeoutError:
                pass
        return wait

    def _off_loop(self, work: Callable[[], bool | None],
                  then: Callable[[bool | None], None] | None = None) -> None:
        """Run ``work`` on the arenas' one thread (in order), ``then`` its answer on the
        loop; with no loop running (tests, start-up), both now."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self._closed:
            result = work()
            if then is not None:
                then(result)
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvstore-arenas")
        future = self._worker.submit(work)

        def answer(f: Future[bool | None]) -> None:
            failed = f.exception()
            if failed is not None:  # (a bug: the file system's answers are values)
                log.error("the arenas' thread failed: %s", failed, exc_info=failed)
            if then is not None:
                ok = False if failed is not None else f.result()
                try:
                    loop.call_soon_threadsafe(then, ok)
                except RuntimeError:
                    pass  # (the loop closed meanwhile)
        future.add_done_callback(answer)

    def allocated_bytes(self) -> dict[str, int]:
        """The memory each arena holds now, by name."""
        return {name: arena.allocated_bytes() for name, arena in self.by_name.items()}

    def close(self) -> None:
        self._closed = True
        if self._worker is not None:  # (its work done before the arenas are unmapped)
            self._worker.shutdown(wait=True)
            self._worker = None
        for arena in self.by_name.values():
            arena.close()
        self.by_name.clear()
        self.by_label.clear()

    def __repr__(self) -> str:
        return f"Arenas({len(self.by_name)} of {self.capacity_bytes} bytes)"
