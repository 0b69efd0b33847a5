"""The GPU tier's bytes: one device pool owned by the daemon, shared by CUDA IPC.

The daemon makes one allocation of ``capacity_bytes`` on a device (a plain ``cudaMalloc``
through CuPy, so its IPC handle covers it from offset 0) and carves it into fixed-size
slots.  It sends colocated clients a :class:`PoolHandle`; a client opens it as a
:class:`PoolMapping` and copies between its paged KV cache and the slots with the kernels
in ``kvstore.kernels`` (``gather``/``scatter`` take :meth:`PoolMapping.slots` as they are).
A block one engine commits is thus reloaded by another on the same GPU device to device.

Where no GPU exists the tier is off: :func:`gpu_unavailable` says why.  A host-backed pool
(``DevicePool.create("cpu", ...)``: a shared-memory file under ``/dev/shm``, the handle
naming the file) has the same API, for tests and CPU-only machines.

Ordering: copies queue on the current torch stream and return before they run.  A writer
waits on a :class:`CopyFence` before it commits; a reader waits on one before it releases
its pin.  Nothing here synchronises a whole device.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeAlias

import msgspec
import numpy as np
import torch
import torch.utils.dlpack

from kvstore.errors import ConfigError, MalformedError, UnavailableError
from kvstore.kernels.cuda import _cupy
from kvstore.pool import SlabClass, SlabPool
from kvstore.tiers.dram import create_shared_file, map_arena

PoolKind: TypeAlias = Literal["cuda", "host"]
DEFAULT_SLAB_BYTES = 64 << 20
DEFAULT_ALIGNMENT = 256  # cudaMalloc's own alignment; every vector width of the kernels
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_IPC_LAZY_ENABLE_PEER_ACCESS = 0x01  # cudaIpcMemLazyEnablePeerAccess


class PoolHandle(msgspec.Struct, frozen=True, array_like=True):
    """What a client needs to map the daemon's pool; small enough for any reply.

    ``handle`` is a ``cudaIpcMemHandle_t`` (kind ``cuda``) or the pool file's path (kind
    ``host``).  ``device`` is the daemon's device ordinal (-1 for host); a client whose
    ``CUDA_VISIBLE_DEVICES`` differs finds the device by ``pci_bus_id`` instead.
    """

    kind: PoolKind
    device: Annotated[int, msgspec.Meta(ge=-1)]
    nbytes: Annotated[int, msgspec.Meta(gt=0)]
    handle: Annotated[bytes, msgspec.Meta(min_length=1, max_length=4096)]
    owner_pid: Annotated[int, msgspec.Meta(ge=0)]
    pci_bus_id: str = ""


def gpu_unavailable(device: int) -> str | None:
    """None if a CUDA device pool can be made on ``device``, else the reason it cannot."""
    if device < 0:
        return f"device index {device} is negative"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
        return f"CUDA is not available to torch {torch.__version__} (built with {build})"
    count = torch.cuda.device_count()
    if device >= count:
        return f"device {device} does not exist: {count} CUDA device(s) are visible"
    if _cupy() is None:
        return "cupy is not installed (install kvstore[cuda]); the pool needs its CUDA IPC calls"
    return None


class CopyFence:
    """The work queued so far on a device's current stream; :meth:`wait` blocks until it
    has run, by a CUDA event, never a device-wide sync.  On the CPU it is done at once.

    Record one after ``gather`` into pool slots and wait on it before committing them;
    record one after ``scatter`` out of pool slots and wait on it before releasing them.
    """

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self._event = event

    @classmethod
    def record(cls, device: torch.device | str | int) -> CopyFence:
        """Mark the work queued so far on ``device``'s current stream (a CUDA index, or a
        torch device)."""
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            return cls(None)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record(torch.cuda.current_stream(device))
        return cls(event)

    def done(self) -> bool:
        """Whether the work has run (without blocking)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        """Block this thread until the work has run."""
        if self._event is not None:
            self._event.synchronize()

    def __repr__(self) -> str:
        return f"CopyFence({'cpu' if self._event is None else 'cuda'}, done={self.done()})"


class SlotAllocator:
    """The pool's fixed-size slots, in slabs per size class (a :class:`SlabPool`), and the
    set of slots handed out, so that a double or foreign free is refused before anything
    changes.  Offsets are bytes from the start of the pool."""

    def __init__(self, capacity_bytes: int, slab_bytes: int, alignment: int) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise MalformedError(f"alignment must be a power of two, got {alignment}")
        slab = min(slab_bytes, capacity_bytes) // alignment * alignment
        if capacity_bytes <= 0 or slab <= 0:
            raise MalformedError(
                f"a pool of {capacity_bytes} bytes in slabs of {slab_bytes} bytes has no "
                f"{alignment}-byte aligned slab"
            )
        self.capacity_bytes = capacity_bytes
        self.pool = SlabPool(capacity_bytes, slab, alignment)
        self._taken: dict[int, set[int]] = {}  # slot_bytes -> offsets handed out

    def slot_bytes_for(self, block_bytes: int) -> int:
        """The slot size a block of ``block_bytes`` gets (raises TooLargeError if none)."""
        if block_bytes <= 0:
            raise MalformedError(f"block_bytes must be positive, got {block_bytes}")
        return self.pool.slot_bytes_for(block_bytes)

    def _class(self, block_bytes: int) -> SlabClass:
        self.slot_bytes_for(block_bytes)
        return self.pool.class_for(block_bytes)

    def available(self, block_bytes: int) -> int:
        """Slots of this size that :meth:`allocate` could hand out now."""
        return self.pool.available(self._class(block_bytes))

    def allocate(self, block_bytes: int, count: int) -> list[int] | None:
        """``count`` slot offsets for blocks of ``block_bytes``, or None (and nothing
        taken) if there are not that many free."""
        if count < 0:
            raise MalformedError(f"cannot allocate {count} slots")
        cls = self._class(block_bytes)
        offsets = self.pool.allocate(cls, count)
        if offsets is not None:
            self._taken.setdefault(cls.slot_bytes, set()).update(offsets)
        return offsets

    def free(self, block_bytes: int, offsets: Sequence[int]) -> None:
        """Give slots back.  Raises MalformedError, freeing none, if any offset is not a
        slot of this size handed out (or appears twice)."""
        slot_bytes = self.slot_bytes_for(block_bytes)
        taken = self._taken.get(slot_bytes, set())
        unique = set(offsets)
        if len(unique) != len(offsets) or not unique <= taken:
            stray = sorted(unique - taken) or sorted(o for o in unique if offsets.count(o) > 1)
            raise MalformedError(
                f"slot offsets {stray[:4]} are not allocated {slot_bytes}-byte slots "
                f"(or are freed twice); nothing was freed"
            )
        if unique:
            taken -= unique
            self.pool.free(self.pool.classes[slot_bytes], list(offsets))

    @property
    def allocated_slots(self) -> int:
        return sum(len(offsets) for offsets in self._taken.values())

    @property
    def allocated_bytes(self) -> int:
        return sum(size * len(offsets) for size, offsets in self._taken.items())

    def check(self) -> None:
        """Slabs and free counts agree; handed-out slots and free slots never meet."""
        self.pool.check()
        for slot_bytes, taken in self._taken.items():
            cls = self.pool.classes[slot_bytes]
            free = set(self.pool.free_offsets(cls))
            assert not taken & free, f"class {slot_bytes}: a slot is both free and taken"
            assert len(taken) + cls.free_slots == cls.capacity_slots, (
                f"class {slot_bytes}: {len(taken)} taken + {cls.free_slots} free != "
                f"{cls.capacity_slots} slots in its slabs"
            )

    def __repr__(self) -> str:
        return (
            f"SlotAllocator({self.allocated_slots} slots taken, {self.allocated_bytes} of "
            f"{self.capacity_bytes} bytes; {self.pool!r})"
        )


class _PoolMemory:
    """Views into a pool's bytes: one uint8 tensor over all of it, sliced per slot."""

    kind: PoolKind
    nbytes: int
    _whole: torch.Tensor | None

    @property
    def device(self) -> torch.device:
        return self.tensor().device

    def tensor(self) -> torch.Tensor:
        """The whole pool as one 1-D uint8 tensor (on its GPU, or in host memory)."""
        if self._whole is None:
            raise UnavailableError(f"{self!r} is closed")
        return self._whole

    def slot_tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` at ``offset`` as a 1-D uint8 tensor that aliases the pool."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise MalformedError(
                f"bytes [{offset}, {offset + nbytes}) are outside the pool of {self.nbytes}"
            )
        return self.tensor()[offset : offset + nbytes]

    def slots(self, offsets: Sequence[int], block_bytes: int) -> torch.Tensor | list[torch.Tensor]:
        """The slots at ``offsets`` as ``gather``/``scatter`` take them: one
        ``[n, block_bytes]`` table where the offsets are evenly spaced (one wide copy on
        the torch path), else one row per slot."""
        if block_bytes <= 0:
            raise MalformedError(f"block_bytes must be positive, got {block_bytes}")
        stride = offsets[1] - offsets[0] if len(offsets) >= 2 else 0
        if stride >= block_bytes and all(
            later - earlier == stride for earlier, later in itertools.pairwise(offsets)
        ):
            # increasing: the first and the last slot bound all the others
            self.slot_tensor(offsets[0], block_bytes)
            self.slot_tensor(offsets[-1], block_bytes)
            whole = self.tensor()
            return whole.as_strided(
                (len(offsets), block_bytes),
                (stride, 1),
                storage_offset=whole.storage_offset() + offsets[0],
            )
        return [self.slot_tensor(offset, block_bytes) for offset in offsets]


class DevicePool(_PoolMemory):
    """The daemon's pool: one allocation, its slot allocator and the handle to share it.

    Build it with :meth:`create`.  ``slots`` hands out offsets; any allocator over
    ``[0, capacity_bytes)`` with ``alignment``-aligned slots may be used instead (the
    block store's own slab pools, say).  :meth:`close` frees the memory once the last
    tensor that views it is gone.
    """

    def __init__(
        self,
        kind: PoolKind,
        device: int,
        capacity_bytes: int,
        whole: torch.Tensor,
        handle: PoolHandle,
        allocator: SlotAllocator,
        release: Callable[[], None],
    ) -> None:
        self.kind = kind
        self.device_index = device
        self.capacity_bytes = self.nbytes = capacity_bytes
        self._whole = whole
        self._handle = handle
        self.allocator = allocator
        self._release = release

    @classmethod
    def create(
        cls,
        device: int | Literal["cpu"],
        capacity_bytes: int,
        *,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        alignment: int = DEFAULT_ALIGNMENT,
        directory: str = "/dev/shm",
        populate: bool = True,
    ) -> DevicePool:
        """A pool of ``capacity_bytes`` on CUDA device ``device``, or, for ``"cpu"``, in a
        new shared-memory file in ``directory`` (touched up front unless ``populate`` is
        off).

        Raises :class:`~kvstore.errors.UnavailableError` when the device cannot hold a
        pool (:func:`gpu_unavailable` says why), :class:`~kvstore.errors.ConfigError`
        when the memory cannot be had, :class:`~kvstore.errors.MalformedError` for sizes
        that make no pool.
        """
        allocator = SlotAllocator(capacity_bytes, slab_bytes, alignment)
        if device == "cpu":
            return cls._create_host(capacity_bytes, allocator, directory, populate)
        if isinstance(device, bool) or not isinstance(device, int):
            raise MalformedError(f"device must be a CUDA device index or 'cpu', got {device!r}")
        reason = gpu_unavailable(device)
        if reason is not None:
            raise UnavailableError(f"cannot make a GPU pool on cuda:{device}: {reason}")
        return cls._create_cuda(device, capacity_bytes, allocator)

    @classmethod
    def _create_host(
        cls, capacity_bytes: int, allocator: SlotAllocator, directory: str, populate: bool
    ) -> DevicePool:
        path = create_shared_file(directory, "gpupool", capacity_bytes,
                                  directory_field="gpu pool directory",
                                  size_field="gpu pool capacity", noun="the pool file")
        try:
            mapping = map_arena(path, capacity_bytes, populate=populate)
        except BaseException:
            os.unlink(path)
            raise
        handle = PoolHandle("host", -1, capacity_bytes, os.fsencode(path), os.getpid())

        def release() -> None:
            _close_mmap(mapping)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

        whole = _host_tensor(mapping)
        return cls("host", -1, capacity_bytes, whole, handle, allocator, release)

    @classmethod
    def _create_cuda(cls, device: int, capacity_bytes: int, allocator: SlotAllocator) -> DevicePool:
        cp = _cupy()
        assert cp is not None, "gpu_unavailable() checked for cupy"
        runtime = cp.cuda.runtime
        try:
            with cp.cuda.Device(device):
                # A raw cudaMalloc, not a pool's sub-allocation: the IPC handle then
                # names exactly this memory, from offset 0.
                address = int(runtime.malloc(capacity_bytes))
        except runtime.CUDARuntimeError as exc:
            raise ConfigError(
                f"gpu pool capacity: cannot allocate {capacity_bytes} bytes on cuda:{device}: "
                f"{exc}"
            ) from None
        owner = _Allocation()
        finalizer = weakref.finalize(owner, _cuda_free, cp, device, address)
        finalizer.atexit = False  # at exit the driver reclaims it; CUDA may be gone by then
        try:
            with cp.cuda.Device(device):
                ipc = bytes(runtime.ipcGetMemHandle(address))
                pci_bus_id = str(runtime.deviceGetPCIBusId(device))
            whole = _device_tensor(cp, address, capacity_bytes, device, owner)
        except BaseException:
            finalizer()
            raise
        handle = PoolHandle("cuda", device, capacity_bytes, ipc, os.getpid(), pci_bus_id)
        _OWN_POOLS[ipc] = whole
        del owner  # the tensors hold it now; the memory goes with the last of them
        return cls("cuda", device, capacity_bytes, whole, handle, allocator, _nothing)

    # -- the slots ----------------------------------------------------------------------
    def allocate(self, block_bytes: int, count: int) -> list[int] | None:
        """``count`` free slot offsets for blocks of ``block_bytes``, or None (none taken)."""
        return self.allocator.allocate(block_bytes, count)

    def free(self, block_bytes: int, offsets: Sequence[int]) -> None:
        """Give slots back (all or, if any is not allocated, none)."""
        self.allocator.free(block_bytes, offsets)

    def export(self) -> PoolHandle:
        """The handle clients open with :meth:`PoolMapping.open`."""
        if self._whole is None:
            raise UnavailableError(f"{self!r} is closed")
        return self._handle

    def close(self) -> None:
        """Drop the pool: its memory is freed (or the file unmapped and unlinked) once no
        tensor views it.  Clients' mappings of a CUDA pool must be closed first."""
        if self._whole is None:
            return
        self._whole = None
        _OWN_POOLS.pop(self._handle.handle, None)
        release, self._release = self._release, _nothing
        release()

    def __repr__(self) -> str:
        where = f"cuda:{self.device_index}" if self.kind == "cuda" else self._handle.handle.decode(
            errors="replace"
        )
        state = "closed" if self._whole is None else "open"
        return (
            f"DevicePool({self.kind} {where}, {self.capacity_bytes} bytes, {state}, "
            f"{self.allocator.allocated_slots} slots taken)"
        )


class PoolMapping(_PoolMemory):
    """A client's view of the daemon's pool, from its :class:`PoolHandle`."""

    def __init__(self, handle: PoolHandle, whole: torch.Tensor, release: Callable[[], None]) -> None:
        self.handle = handle
        self.kind = handle.kind
        self.nbytes = handle.nbytes
        self._whole = whole
        self._release = release

    @classmethod
    def open(cls, handle: PoolHandle, *, populate: bool = True) -> PoolMapping:
        """Map the pool ``handle`` names: its CUDA memory through IPC (on the same GPU,
        found by PCI bus id), or its file.  A handle exported by this very process is
        used directly, since CUDA refuses to open one's own IPC handle.

        Raises :class:`~kvstore.errors.UnavailableError` if the pool cannot be reached
        from here, :class:`~kvstore.errors.MalformedError` if the handle makes no sense.
        """
        if handle.kind == "host":
            return cls._open_host(handle, populate)
        if handle.kind == "cuda":
            return cls._open_cuda(handle)
        raise MalformedError(f"unknown pool kind {handle.kind!r}")

    @classmethod
    def _open_host(cls, handle: PoolHandle, populate: bool) -> PoolMapping:
        path = os.fsdecode(handle.handle)
        try:
            size = os.stat(path).st_size
            if size < handle.nbytes:
                raise MalformedError(
                    f"the pool file {path} holds {size} bytes; the handle says {handle.nbytes}"
                )
            mapping = map_arena(path, handle.nbytes, populate=populate)
        except OSError as exc:
            raise UnavailableError(
                f"cannot map the pool file {path}: {exc.strerror}; is the daemon running?"
            ) from None
        whole = _host_tensor(mapping)
        return cls(handle, whole, functools.partial(_close_mmap, mapping))

    @classmethod
    def _open_cuda(cls, handle: PoolHandle) -> PoolMapping:
        if len(handle.handle) != IPC_HANDLE_BYTES:
            raise MalformedError(
                f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle.handle)}"
            )
        if handle.owner_pid == os.getpid():
            own = _OWN_POOLS.get(handle.handle)
            if own is not None:
                return cls(handle, own, _nothing)
        cp = _cupy()
        if cp is None or not torch.cuda.is_available():
            reason = "cupy is not installed" if cp is None else "CUDA is not available"
            raise UnavailableError(f"cannot open a CUDA pool here: {reason}")
        runtime = cp.cuda.runtime
        device = _local_device(cp, handle)
        unavailable = gpu_unavailable(device)
        if unavailable is not None:
            raise UnavailableError(f"cannot open a CUDA pool on cuda:{device}: {unavailable}")
        try:
            with cp.cuda.Device(device):
                address = int(
                    runtime.ipcOpenMemHandle(handle.handle, _IPC_LAZY_ENABLE_PEER_ACCESS)
                )
        except runtime.CUDARuntimeError as exc:
            raise UnavailableError(
                f"cannot open the pool's CUDA IPC handle on cuda:{device}: {exc}; the daemon "
                f"must be alive and share this GPU (and, in containers, the IPC namespace)"
            ) from None
        owner = _Allocation()
        finalizer = weakref.finalize(owner, _cuda_ipc_close, cp, device, address)
        finalizer.atexit = False
        try:
            whole = _device_tensor(cp, address, handle.nbytes, device, owner)
        except BaseException:
            finalizer()
            raise
        return cls(handle, whole, _nothing)

    def close(self) -> None:
        """Let go of the pool: the mapping is undone once no tensor views it."""
        if self._whole is None:
            return
        self._whole = None
        release, self._release = self._release, _nothing
        release()

    def __repr__(self) -> str:
        state = "closed" if self._whole is None else "open"
        return f"PoolMapping({self.kind}, {self.nbytes} bytes, owner pid {self.handle.owner_pid}, {state})"


# -- CUDA plumbing ---------------------------------------------------------------------


class _Allocation:
    """Stands for a device allocation or IPC mapping: a weakref finalizer releases the
    memory when the last tensor over it (which holds this object) is gone."""

    __slots__ = ("__weakref__",)


# The CUDA pools this process owns, by IPC handle, so that opening one of them here (which
# CUDA refuses) uses the memory directly.  Weak: a closed pool drops out by itself.
_OWN_POOLS: weakref.WeakValueDictionary[bytes, torch.Tensor] = weakref.WeakValueDictionary()


def _local_device(cp: Any, handle: PoolHandle) -> int:
    """This process's ordinal of the device the pool lives on."""
    if not handle.pci_bus_id:
        return handle.device
    try:
        return int(cp.cuda.runtime.deviceGetByPCIBusId(handle.pci_bus_id))
    except cp.cuda.runtime.CUDARuntimeError:
        raise UnavailableError(
            f"the pool's GPU (PCI {handle.pci_bus_id}) is not visible to this process; "
            f"check CUDA_VISIBLE_DEVICES"
        ) from None


def _device_tensor(cp: Any, address: int, nbytes: int, device: int, owner: object) -> torch.Tensor:
    """A uint8 tensor over raw device memory that keeps ``owner`` alive while it lives."""
    with cp.cuda.Device(device):
        memory = cp.cuda.UnownedMemory(address, nbytes, owner, device)
        array = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
        tensor = torch.utils.dlpack.from_dlpack(array)
    if tensor.data_ptr() != address or tensor.device != torch.device("cuda", device):
        raise UnavailableError(
            f"DLPack gave a tensor at {tensor.data_ptr():#x} on {tensor.device}, not the pool's "
            f"memory at {address:#x} on cuda:{device}"
        )
    return tensor


def _cuda_free(cp: Any, device: int, address: int) -> None:
    with cp.cuda.Device(device):
        cp.cuda.runtime.free(address)


def _cuda_ipc_close(cp: Any, device: int, address: int) -> None:
    with cp.cuda.Device(device):
        cp.cuda.runtime.ipcCloseMemHandle(address)


def _host_tensor(mapping: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over a mapping that keeps it mapped while any view of it lives.

    Through numpy, whose array holds a buffer export: ``torch.frombuffer`` releases its
    export at once, so the mapping could be closed under the tensor.
    """
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))


def _nothing() -> None:
    pass


def _close_mmap(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # slot tensors still view it; it is unmapped when the last one goes
