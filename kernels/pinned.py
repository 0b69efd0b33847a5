"""Page-lock (pin) host memory for CUDA, such as the DRAM tier's shared-memory arena.

Pinned memory moves at full PCIe speed, asynchronously, and the copy kernels can read and
write it directly.  Without CUDA, registering is a no-op whose handle says so.

Pinning a large arena takes a while (the driver walks and locks every page), so
:func:`register_in_background` does it chunk by chunk on a thread, off the start-up path,
while the arena is already in use.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import logging
import mmap
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvstore.errors import MalformedError

DEFAULT_CHUNK_BYTES = 1 << 30
_log = logging.getLogger(__name__)
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and
# addressable from kernels.
_REGISTER_FLAGS = 0x01 | 0x02

HostBuffer: TypeAlias = mmap.mmap | memoryview | bytearray | npt.NDArray[np.uint8] | torch.Tensor
"""A writable, contiguous buffer, or a contiguous CPU tensor."""


class _Unregistering:
    """A registration that a ``with`` block undoes on the way out."""

    def unregister(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.unregister()


class HostRegistration(_Unregistering):
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
    calls, reason = _cuda_calls()
    if calls is None:
        return HostRegistration(address, nbytes, pinned=False, reason=reason)
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


class BackgroundRegistration(_Unregistering):
    """Host memory being pinned for CUDA chunk by chunk on a daemon thread.

    Ask :attr:`done`, :meth:`wait` for it, read :attr:`pinned_bytes` as it grows, and call
    :meth:`unregister` (or :meth:`cancel`) at any time, even while the thread runs: it stops
    the thread and unpins what was pinned.  ``pinned`` is True once the whole buffer is
    pinned; ``reason`` says why it is not (no CUDA, the driver refused, unregistered).

    Chunks are pinned from the highest address down and unpinned from the lowest up, so
    the pinned part is always a suffix of the buffer: a slot that *starts* in pinned
    memory lies wholly in it.  The copy code checks only a slot's first byte
    (``Tensor.is_pinned``), so copies that run while registration is under way never
    hand the GPU a host pointer that is only partly registered.
    """

    def __init__(
        self,
        address: int,
        nbytes: int,
        *,
        reason: str = "",
        edges: list[int] | None = None,
        calls: RegisterCalls | None = None,
        keepalive: object = None,
        on_done: Callable[[BackgroundRegistration], object] | None = None,
    ) -> None:
        self.address = address
        self.nbytes = nbytes
        self._reason = reason
        self._calls = calls
        self._keepalive = keepalive
        self._on_done = on_done
        self._work = threading.Lock()  # held while the runtime (un)registers a chunk
        self._state = threading.Lock()  # guards the fields below; never held for long
        self._stop = threading.Event()
        self._ended = threading.Event()  # the outcome is settled
        self._finished = threading.Event()  # ...and on_done has run
        self._chunks: list[tuple[int, int]] = []  # (start, size), pinned, highest first
        self._complete = False
        self._thread: threading.Thread | None = None
        if calls is None or edges is None:
            self._end()
            return
        pieces = list(itertools.pairwise(edges))
        self._thread = threading.Thread(
            target=self._run,
            args=(pieces[::-1],),
            name=f"kvstore-pin-{address:#x}",
            daemon=True,
        )
        self._thread.start()

    @property
    def done(self) -> bool:
        """Whether pinning has ended: all pinned, refused, or stopped."""
        return self._ended.is_set()

    @property
    def pinned(self) -> bool:
        """Whether the whole buffer is pinned now."""
        with self._state:
            return self._complete and bool(self._chunks)

    @property
    def pinned_bytes(self) -> int:
        """How many bytes are pinned now."""
        with self._state:
            return sum(size for _, size in self._chunks)

    @property
    def reason(self) -> str:
        """Why the buffer is not (or no longer) pinned; '' while all is well."""
        return self._reason

    def wait(self, timeout: float | None = None) -> bool:
        """Block until pinning has ended and ``on_done`` has run (or ``timeout`` seconds
        have passed); True if it has."""
        return self._finished.wait(timeout)

    def unregister(self) -> None:
        """Stop pinning and unpin every chunk pinned so far (once; later calls do nothing).

        Safe to call while the thread runs: a chunk being pinned at that moment is waited
        for, then unpinned with the rest.  No copy may still be using the memory.
        """
        self._stop.set()
        with self._work:
            self._unregister_chunks()
            if not self._reason:
                self._reason = "unregistered"
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._keepalive = None

    def cancel(self) -> None:
        """Same as :meth:`unregister`: stop, and unpin what was pinned."""
        self.unregister()

    def _unregister_chunks(self) -> None:
        """Unpin every pinned chunk; the caller holds ``_work``."""
        with self._state:
            self._complete = False
            chunks = list(self._chunks)
        if self._calls is None:
            return
        for chunk in reversed(chunks):  # lowest address first: what stays is a suffix
            error = self._calls[1](chunk[0])
            if error:
                _log.warning("cudaHostUnregister(%#x): %s", chunk[0], error)
            with self._state:
                self._chunks.remove(chunk)

    def _run(self, pieces: list[tuple[int, int]]) -> None:
        assert self._calls is not None, "the thread runs only with CUDA calls"
        register = self._calls[0]
        try:
            for start, end in pieces:
                with self._work:
                    if self._stop.is_set():
                        return
                    error = register(start, end - start)
                    if error:
                        # As register_host_memory: a refusal leaves nothing pinned.
                        self._reason = f"cudaHostRegister: {error}"
                        self._unregister_chunks()
                        return
                    with self._state:
                        self._chunks.append((start, end - start))
            with self._work, self._state:
                self._complete = not self._stop.is_set()
        except BaseException as exc:  # noqa: BLE001  a dead thread must still say why
            with self._work:
                self._reason = f"pinning failed: {type(exc).__name__}: {exc}"
                self._unregister_chunks()
        finally:
            self._end()

    def _end(self) -> None:
        self._ended.set()
        try:
            if self._on_done is not None:
                self._on_done(self)
        except Exception:  # noqa: BLE001  a callback's bug must not kill the caller
            _log.exception("on_done callback of %r failed", self)
        finally:
            self._finished.set()


    def __repr__(self) -> str:
        if self.pinned:
            state = "pinned"
        elif self.done:
            state = f"not pinned: {self.reason}"
        else:
            state = "pinning"
        return (
            f"BackgroundRegistration({self.nbytes} bytes at {self.address:#x}, {state}, "
            f"{self.pinned_bytes} bytes pinned)"
        )


def register_in_background(
    buffer: HostBuffer,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_done: Callable[[BackgroundRegistration], object] | None = None,
) -> BackgroundRegistration:
    """Pin ``buffer`` for CUDA on a daemon thread, in pieces of about ``chunk_bytes``, and
    return at once with a handle to watch or undo it.

    ``on_done(handle)`` is called once when pinning ends, whatever the outcome, on the
    pinning thread (at once, on the caller's thread, where nothing is to be pinned): an
    asyncio caller should hop back with ``loop.call_soon_threadsafe``.  Where CUDA is
    missing the handle is done at once, not pinned, with the reason.  The handle keeps the
    buffer exported until unregistered, so an mmap cannot be closed under it.
    """
    if chunk_bytes <= 0:
        raise MalformedError(f"chunk_bytes must be positive, got {chunk_bytes}")
    address, nbytes, keepalive = _address_of(buffer)
    calls, reason = _cuda_calls()
    if calls is None:
        return BackgroundRegistration(address, nbytes, reason=reason, on_done=on_done)
    return BackgroundRegistration(
        address,
        nbytes,
        edges=chunk_edges(address, nbytes, chunk_bytes),
        calls=calls,
        keepalive=keepalive,
        on_done=on_done,
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


RegisterCalls: TypeAlias = tuple[Callable[[int, int], str], Callable[[int], str]]
"""cudaHostRegister(address, size) and cudaHostUnregister(address), each returning '' or
an error message."""


def _cuda_calls() -> tuple[RegisterCalls | None, str]:
    """The register/unregister calls, or None and the reason there are none."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    calls = _runtime_calls()
    if calls is None:
        return None, "no CUDA runtime binding found"
    return calls, ""


def _runtime_calls() -> RegisterCalls | None:
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
