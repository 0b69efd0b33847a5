"""The CUDA side of the block copy: compile ``block_copy.cu`` with CuPy and launch it.

CuPy is optional.  Without it (or without a GPU) :func:`kernel_unavailable` says why and
the callers use the torch path instead.  The kernels are compiled once per device, on
first use, and kept in a module-level cache.
"""

from __future__ import annotations

import functools
import importlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .layout import PagedCache, SlotBuffers

SOURCE = Path(__file__).with_name("block_copy.cu")
THREADS = 256  # KV_THREADS in block_copy.cu: the launch bound the kernels are built for
UNROLL = 4  # KV_UNROLL in block_copy.cu: vectors per thread per pass
VECTOR_WIDTHS = (16, 8, 4, 1)
KERNEL_NAMES = tuple(
    f"kv_{direction}_v{width}" for direction in ("gather", "scatter") for width in VECTOR_WIDTHS
)
# Enough CTAs to fill every multiprocessor (up to 32 resident each) a few times over;
# beyond that, each CTA loops over more blocks instead of the GPU scheduling tiny CTAs.
CTAS_PER_MULTIPROCESSOR = 32
_MAX_GRID_YZ = 65535
_MAX_GRID_X = 2**31 - 1
# cudaDevAttrCanUseHostPointerForRegisteredMem: the GPU reads cudaHostRegister'ed memory
# at its host address, so a slot's host pointer can go straight into the kernel's table.
_ATTR_HOST_POINTER_FOR_REGISTERED_MEM = 91


@dataclass
class _DeviceKernels:
    """What one device needs to launch: the functions, or why there are none."""

    functions: dict[str, Any] = field(default_factory=dict)
    host_pointers_ok: bool = False
    max_ctas: int = 0
    error: str | None = None


_COMPILED: dict[int, _DeviceKernels] = {}
_COMPILE_LOCK = threading.Lock()


@functools.cache
def _cupy() -> ModuleType | None:
    try:
        return importlib.import_module("cupy")
    except ImportError:
        return None


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _kernels(device_index: int) -> _DeviceKernels:
    kernels = _COMPILED.get(device_index)
    if kernels is not None:
        return kernels
    with _COMPILE_LOCK:
        kernels = _COMPILED.get(device_index)
        if kernels is None:
            kernels = _compile(device_index)
            _COMPILED[device_index] = kernels
    return kernels


def _compile(device_index: int) -> _DeviceKernels:
    cp = _cupy()
    if cp is None:
        return _DeviceKernels(error="cupy is not installed")
    try:
        with cp.cuda.Device(device_index):
            module = cp.RawModule(code=SOURCE.read_text())
            functions = {name: module.get_function(name) for name in KERNEL_NAMES}
            for function in functions.values():
                # CuPy compiles lazily; reading an attribute compiles now, so that a
                # failure shows here and not in the middle of a copy.
                getattr(function, "num_regs", None)
            host_pointers_ok = bool(
                cp.cuda.runtime.deviceGetAttribute(
                    _ATTR_HOST_POINTER_FOR_REGISTERED_MEM, device_index
                )
            )
    except Exception as exc:  # noqa: BLE001  NVRTC and driver errors come in several CuPy types
        return _DeviceKernels(error=f"compiling {SOURCE.name} failed: {exc}")
    multiprocessors = torch.cuda.get_device_properties(device_index).multi_processor_count
    return _DeviceKernels(functions, host_pointers_ok, CTAS_PER_MULTIPROCESSOR * multiprocessors)


def cuda_kernel_unavailable(device: torch.device) -> str | None:
    """None if the CUDA copy kernel can run on ``device``, else the reason it cannot."""
    if device.type != "cuda":
        return f"the cache is on {device}, not a CUDA device"
    return _kernels(_device_index(device)).error


def kernel_unavailable(cache: PagedCache, buffers: SlotBuffers) -> str | None:
    """None if the kernel can copy between ``cache`` and ``buffers``, else why not."""
    reason = cuda_kernel_unavailable(cache.device)
    if reason is not None or buffers.device.type == "cuda":
        return reason
    slot_memory = [buffers.table] if buffers.table is not None else buffers.rows
    if not all(tensor.is_pinned() for tensor in slot_memory):
        return "the host slots are not pinned (page-locked) memory"
    if not _kernels(_device_index(cache.device)).host_pointers_ok:
        return "this GPU cannot use host pointers of registered memory"
    return None


def vector_width(segment_bytes: int, addresses: list[int]) -> int:
    """The widest vector that ``segment_bytes`` and every address and stride divide."""
    combined = segment_bytes
    for address in addresses:
        combined |= address
    return next(width for width in VECTOR_WIDTHS if combined % width == 0)


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of a ``block_copy.cu`` kernel: which one, its grid, and its arguments."""

    kernel: str
    grid: tuple[int, int, int]
    threads: int
    meta: npt.NDArray[np.int64]
    n_segs: int
    seg_vecs: int
    n_blocks: int


def plan_launch(
    cache: PagedCache,
    page_ids: npt.NDArray[np.int64],
    slot_addresses: list[int],
    *,
    gather: bool,
    max_ctas: int = 0,
) -> LaunchPlan:
    """Decide the kernel, grid and tables that copy the batch; nothing runs yet.

    ``max_ctas`` (0: no limit) bounds the grid by looping CTAs over the blocks.
    """
    seg_base = [segment.data_ptr() for segment in cache.segments]
    seg_stride = [segment.stride(0) for segment in cache.segments]
    width = vector_width(cache.segment_bytes, [*seg_base, *seg_stride, *slot_addresses])
    meta = np.concatenate(
        [
            np.asarray(seg_base, dtype=np.int64),
            np.asarray(seg_stride, dtype=np.int64),
            page_ids.astype(np.int64, copy=False),
            np.asarray(slot_addresses, dtype=np.int64),
        ]
    )
    seg_vecs = cache.segment_bytes // width
    # Small segments get fewer threads rather than idle ones.
    threads = min(THREADS, max(32, -(-seg_vecs // (UNROLL * 32)) * 32))
    chunks = -(-seg_vecs // (threads * UNROLL))
    n_segs, n_blocks = len(cache.segments), len(page_ids)
    grid_x, grid_y = min(chunks, _MAX_GRID_X), min(n_segs, _MAX_GRID_YZ)
    grid_z = min(n_blocks, _MAX_GRID_YZ)
    if max_ctas:
        grid_z = max(1, min(grid_z, max_ctas // (grid_x * grid_y)))
    grid = (grid_x, grid_y, grid_z)
    kernel = f"kv_{'gather' if gather else 'scatter'}_v{width}"
    return LaunchPlan(kernel, grid, threads, meta, n_segs, seg_vecs, n_blocks)


def launch_copy(
    cache: PagedCache,
    page_ids: npt.NDArray[np.int64],
    slot_addresses: list[int],
    *,
    gather: bool,
) -> None:
    """Queue one kernel launch that copies every block of the batch, on torch's stream."""
    cp = _cupy()
    assert cp is not None, "launch_copy called where kernel_unavailable() gave a reason"
    device_index = _device_index(cache.device)
    kernels = _kernels(device_index)
    plan = plan_launch(cache, page_ids, slot_addresses, gather=gather, max_ctas=kernels.max_ctas)
    function = kernels.functions[plan.kernel]
    # Freed when this returns; the caching allocator only reuses it for work queued on this
    # stream after the launch, so the kernel still reads valid tables.
    meta = torch.from_numpy(plan.meta).to(cache.device, non_blocking=True)
    stream_pointer = torch.cuda.current_stream(cache.device).cuda_stream
    stream = cp.cuda.Stream.null if stream_pointer == 0 else cp.cuda.ExternalStream(stream_pointer)
    with cp.cuda.Device(device_index), stream:
        function(
            plan.grid,
            (plan.threads, 1, 1),
            (
                np.uint64(meta.data_ptr()),
                np.int32(plan.n_segs),
                np.int64(plan.seg_vecs),
                np.int32(plan.n_blocks),
            ),
        )
