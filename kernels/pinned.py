"""Page-lock (pin) host memory for CUDA, such as the DRAM tier's shared-memory arena.

Pinned memory moves at full PCIe speed, asynchronously, and the copy kernels can read and
write it directly.  Without CUDA, registering is a no-op whose handle says so.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import mmap
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvstore.errors import MalformedError

DEFAULT_CHUNK_BYTES = 1 << 30
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and
# addressable from kernels.
_REGISTER_FLAGS = 0x01 | 0x02

HostBuffer: TypeAlias = mmap.mmap | memoryview | bytearray | npt.NDArray[np.uint8] | torch.Tensor
"""A writable, contiguous buffer, or a contiguous CPU tensor."""


class HostRegistration:
    """A handle on host memory registered with CUDA; :meth:`unregister` undoes it.

    ``pinned`` is False where nothing was registered, and ``reason`` then says why.  While
    registered, the handle keeps the buffer exported, so an mmap cannot be closed under it.
    """

    def __init__(
        self,
        address: int,
        nbytes: int,
        *,
        pinned: bool,
        reason: str = "",
        chunks: tuple[int, ...] = (),
        unregister_chunk: Callable[[int], object] | None = None,
        keepalive: object = None,
    ) -> None:
        self.address = address
        self.nbytes = nbytes
        self.pinned = pinned
        self.reason = reason
        self._chunks = chunks
        self._unregister_chunk = unregister_chunk
        self._keepalive = keepalive

    def unregister(self) -> None:
        """Unpin the memory (once; later calls do nothing)."""
        chunks, self._chunks = self._chunks, ()
        if self._unregister_chunk is not None:
            for chunk in chunks:
                self._unregister_chunk(chunk)
        self.pinned = False
        self._keepalive = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.unregister()

    def __repr__(self) -> str:
        state = (
            f"pinned, {len(self._chunks)} chunks" if self.pinned else f"not pinned: {self.reason}"
        )
        return f"HostRegistration({self.nbytes} bytes at {self.address:#x}, {state})"


def register_host_memory(
    buffer: HostBuffer, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> HostRegistration:
    """Pin ``buffer`` for CUDA in pieces of about ``chunk_bytes`` (whole pages) and return
    a handle to undo it.

    Where CUDA is missing, or the driver refuses (a memlock limit, say), nothing stays
    registered and the handle has ``pinned=False`` with the reason.
    """
    if chunk_bytes <= 0:
        raise MalformedError(f"chunk_bytes must be positive, got {chunk_bytes}")
    address, nbytes, keepalive = _address_of(buffer)
    if not torch.cuda.is_available():
        return HostRegistration(address, nbytes, pinned=False, reason="CUDA is not available")
    calls = _runtime_calls()
    if calls is None:
        return HostRegistration(
            address, nbytes, pinned=False, reason="no CUDA runtime binding found"
        )
    register, unregister = calls
    done: list[int] = []
    for start, end in itertools.pairwise(chunk_edges(address, nbytes, chunk_bytes)):
        error = register(start, end - start)
        if error:
            for chunk in done:
                unregister(chunk)
            return HostRegistration(
                address, nbytes, pinned=False, reason=f"cudaHostRegister: {error}"
            )
        done.append(start)
    return HostRegistration(
        address,
        nbytes,
        pinned=True,
        chunks=tuple(done),
        unregister_chunk=unregister,
        keepalive=keepalive,
    )


def chunk_edges(address: int, nbytes: int, chunk_bytes: int) -> list[int]:
    """Where the registered pieces of ``[address, address + nbytes)`` start and end.

    Inner edges fall on page boundaries, since two registrations may not share a page.
    """
    page_start = address - address % mmap.PAGESIZE
    step = -(-chunk_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    return [address, *range(page_start + step, address + nbytes, step), address + nbytes]


def _address_of(buffer: HostBuffer) -> tuple[int, int, object]:
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise MalformedError("only a contiguous CPU tensor can be pinned")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer
    try:
        view = buffer.data if isinstance(buffer, np.ndarray) else memoryview(buffer)
    except TypeError:
        raise MalformedError(f"{type(buffer).__name__} is not a buffer") from None
    if view.readonly or not view.c_contiguous or view.nbytes == 0:
        raise MalformedError("host memory to pin must be a writable, contiguous, non-empty buffer")
    array = (ctypes.c_char * view.nbytes).from_buffer(view)
    return ctypes.addressof(array), view.nbytes, array


def _runtime_calls() -> tuple[Callable[[int, int], str], Callable[[int], str]] | None:
    """cudaHostRegister/Unregister as calls that return '' or an error message."""
    try:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
    except (AttributeError, RuntimeError):  # trimmed torch builds lack the binding
        cudart = None
    if cudart is not None and hasattr(cudart, "cudaHostRegister"):
        return (
            lambda address, size: _error_text(
                cudart.cudaHostRegister(address, size, _REGISTER_FLAGS)
            ),
            lambda address: _error_text(cudart.cudaHostUnregister(address)),
        )
    try:
        runtime: Any = importlib.import_module("cupy.cuda.runtime")
    except ImportError:
        return None
    return (
        lambda address, size: _call_cupy(runtime.hostRegister, address, size, _REGISTER_FLAGS),
        lambda address: _call_cupy(runtime.hostUnregister, address),
    )


def _error_text(code: Any) -> str:
    return "" if int(code) == 0 else f"CUDA error {int(code)}"


def _call_cupy(function: Callable[..., object], *args: int) -> str:
    try:
        function(*args)
    except RuntimeError as exc:  # cupy's CUDARuntimeError
        return str(exc)
    return ""
