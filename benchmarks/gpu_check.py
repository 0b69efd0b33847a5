"""GPU check for kvstore.kernels: correctness, bandwidth and CUDA IPC, in one run.

1. Correctness: for every layout, dtype and slot kind (device table, pinned table, pinned
   arena rows at an unaligned offset, pageable host memory), gather and scatter through
   the CUDA kernel and through the torch path must give the bytes the CPU path gives
   (itself tested against a per-block reference in tests/kernels).  Repeated ids included.
2. Bandwidth, device time with CUDA events (the host's set-up is hidden behind a sleep
   kernel and reported apart): gather and scatter against one ``copy_`` of a contiguous
   tensor of the same bytes (target >= 0.80x); GPU -> pinned DRAM and back with the
   kernels against one large non-blocking copy of a pinned tensor (target >= 0.80x).
3. CUDA IPC: process A gathers a block into a CUDA tensor and sends it to process B,
   which maps it, checks it bit-exact and writes an answer into it that A then checks.
4. The GPU tier's device pool (kvstore.tiers.gpu) over CUDA IPC: process A commits blocks
   from its paged cache into pool slots (gather); process B opens the pool's handle,
   reloads them into its own paged cache (scatter), gathers its pages back into other
   slots, and A checks those bit-exact.  B times the reload against a plain device-to-
   device copy_ of the same bytes out of the IPC-mapped pool (target >= 0.80x).
5. The DRAM arena pinned in the background (register_in_background, in chunks): time to
   pin, then GPU <-> the pinned arena's slots with the kernels against one large
   cudaMemcpyAsync (a non-blocking copy_ of the whole arena; target >= 0.80x), bit-exact.

Run from the repository root (no install needed):  python benchmarks/gpu_check.py
It takes about a minute and a half on an H200.  Without a GPU it prints "no GPU" and exits
0; with one it exits 1 if a correctness or IPC check failed (a ratio under target only
says so).  Without CuPy it still checks and times the torch-on-CUDA path (the device pool
needs CuPy and reports itself skipped).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import importlib.util
import mmap
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _make_kernels_importable() -> None:
    """Let ``import kvstore.kernels`` work from a bare checkout, as on a GPU machine where
    the project is not installed (and kvstore's own dependencies may be missing)."""
    try:
        importlib.import_module("kvstore.kernels")
        return
    except ImportError:
        pass
    package = types.ModuleType("kvstore")
    package.__path__ = [str(Path(__file__).resolve().parents[1] / "kvstore")]
    sys.modules["kvstore"] = package
    _map_subpackage("kernels")


def _map_subpackage(name: str) -> None:
    """``kvstore.<name>`` from the checkout's ``<name>/`` (beside ``kvstore/``)."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        f"kvstore.{name}", root / name / "__init__.py",
        submodule_search_locations=[str(root / name)])
    assert spec is not None and spec.loader is not None, f"{name}/__init__.py not found"
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"kvstore.{name}"] = module
    spec.loader.exec_module(module)


def _import_gpu_tier() -> Any:
    """``kvstore.tiers.gpu``, also from a bare checkout.  Where msgspec is missing (the GPU
    machine may lack kvstore's dependencies) a stand-in makes ``PoolHandle`` a dataclass:
    this check builds handles and reads their fields, it never encodes them."""
    try:
        return importlib.import_module("kvstore.tiers.gpu")
    except ImportError:
        pass
    # (the tier's imports reach the configuration, which reads the scheduler's bounds)
    for name in ("scheduler", "tiers"):
        if f"kvstore.{name}" not in sys.modules:
            _map_subpackage(name)
    try:
        importlib.import_module("msgspec")
    except ImportError:
        import dataclasses

        class Struct:
            def __init_subclass__(cls, **options: Any) -> None:
                dataclasses.dataclass(frozen=bool(options.get("frozen")))(cls)

        stand_in = types.ModuleType("msgspec")
        stand_in.Struct = Struct  # type: ignore[attr-defined]
        stand_in.Meta = lambda **constraints: None  # type: ignore[attr-defined]
        sys.modules["msgspec"] = stand_in
    return importlib.import_module("kvstore.tiers.gpu")


_make_kernels_importable()

from kvstore.kernels import (
    LAYOUTS,
    Backend,
    KVCaches,
    Layout,
    Slots,
    cuda_kernel_unavailable,
    gather,
    register_host_memory,
    scatter,
)
from kvstore.kernels.cuda import CTAS_PER_MULTIPROCESSOR, plan_launch
from kvstore.kernels.layout import paged_cache
from kvstore.kernels.pinned import chunk_edges, register_in_background

MiB = 1 << 20
ARENA_CHUNK_BYTES = 64 * MiB  # the pinned arena check registers in pieces of this
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: longer than any call's host-side set-up
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8] + [
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
]


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int
    heads: int
    dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.tokens * self.heads * self.dim * self.dtype.itemsize

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return f"L{self.layers} T{self.tokens} H{self.heads} D{self.dim} {name}"


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    *outer, last = shape
    raw = torch.randint(0, 256, (*outer, last * dtype.itemsize), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def make_cache(layout: Layout, s: Shape, pages: int, device: str, variant: int = 0) -> KVCaches:
    """Random bit patterns; ``variant`` 1 strides pages (per_layer), puts K/V outermost
    (kv_split, vLLM's flash-attention layout) or separates layers (all_layer)."""
    page = (s.tokens, s.heads, s.dim)
    if layout == "per_layer":
        if variant:
            return [
                random_tensor((pages, 3, *page), s.dtype, device)[:, :2] for _ in range(s.layers)
            ]
        return [random_tensor((pages, 2, *page), s.dtype, device) for _ in range(s.layers)]
    if layout == "per_layer_kv_split":
        if variant:
            return [random_tensor((2, pages, *page), s.dtype, device) for _ in range(s.layers)]
        return [
            (
                random_tensor((pages, *page), s.dtype, device),
                random_tensor((pages, *page), s.dtype, device),
            )
            for _ in range(s.layers)
        ]
    if variant:
        return random_tensor((pages, s.layers, 3, *page), s.dtype, device)[:, :, :2]
    return random_tensor((pages, s.layers, 2, *page), s.dtype, device)


def map_cache(cache: KVCaches, function: Callable[[torch.Tensor], torch.Tensor]) -> KVCaches:
    if isinstance(cache, torch.Tensor):
        return function(cache)
    return [
        function(i) if isinstance(i, torch.Tensor) else tuple(function(t) for t in i) for i in cache
    ]


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.view(torch.uint8).fill_(0xA5)
    return out


def cache_bytes(cache: KVCaches) -> list[bytes]:
    tensors = [cache] if isinstance(cache, torch.Tensor) else []
    if not isinstance(cache, torch.Tensor):
        for item in cache:
            tensors.extend([item] if isinstance(item, torch.Tensor) else item)
    return [t.cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def address_of(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class SlotSet:
    """Slots of one kind for ``n`` blocks, with ways to fill and read them."""

    def __init__(self, kind: str, n: int, block_bytes: int) -> None:
        self.kind, self.n, self.block_bytes = kind, n, block_bytes
        self._arena: bytearray | None = None
        self._registration: Any = None
        self.table: torch.Tensor | None = None
        self.rows: list[memoryview] = []
        if kind == "device table":
            self.table = torch.empty((n, block_bytes), dtype=torch.uint8, device="cuda")
        elif kind == "pinned table":
            self.table = torch.empty((n, block_bytes), dtype=torch.uint8).pin_memory()
        elif kind == "pageable table":
            self.table = torch.empty((n, block_bytes), dtype=torch.uint8)
        elif kind in ("pinned rows +4B", "pageable rows"):
            self._arena = bytearray(n * block_bytes + 64)
            offset = (-address_of(self._arena)) % 16 + 4  # 4 bytes past a 16-byte boundary
            if kind == "pinned rows +4B":
                self._registration = register_host_memory(self._arena, chunk_bytes=4 * MiB)
                assert self._registration.pinned, self._registration.reason
            whole = memoryview(self._arena)
            self.rows = [
                whole[offset + i * block_bytes : offset + (i + 1) * block_bytes] for i in range(n)
            ]
        else:
            raise ValueError(kind)

    @property
    def slots(self) -> Slots:
        return self.table if self.table is not None else self.rows

    def write(self, data: torch.Tensor) -> None:
        if self.table is not None:
            self.table.copy_(data)
        else:
            for row, block in zip(self.rows, data):
                row[:] = block.numpy().tobytes()

    def read(self) -> bytes:
        if self.table is not None:
            return self.table.cpu().numpy().tobytes()
        return b"".join(bytes(row) for row in self.rows)

    def close(self) -> None:
        for row in self.rows:
            row.release()
        self.rows = []
        if self._registration is not None:
            self._registration.unregister()


def release_arena(rows: list[memoryview], whole: memoryview, registration: Any,
                  arena: mmap.mmap) -> None:
    """Undo an mmap arena cut into rows and registered for CUDA."""
    for row in rows:
        row.release()
    whole.release()
    registration.unregister()
    try:
        arena.close()
    except BufferError:  # a view still alive; the mapping goes with the process
        pass


KERNEL_SLOTS = ["device table", "pinned table", "pinned rows +4B"]
TORCH_SLOTS = ["device table", "pinned table", "pageable table", "pageable rows"]


def check_correctness(have_kernel: bool) -> tuple[int, list[str]]:
    """Kernel and torch-on-CUDA against the CPU path; returns (checks, failures)."""
    shapes = [Shape(3, 16, 2, 64, dtype) for dtype in DTYPES]
    shapes += [
        Shape(2, 3, 1, 5, torch.int8),
        Shape(2, 5, 3, 7, torch.float16),
    ]  # byte, 2-byte widths
    combos: list[tuple[Backend, str]] = [("torch", kind) for kind in TORCH_SLOTS]
    if have_kernel:
        combos += [("kernel", kind) for kind in KERNEL_SLOTS] + [("auto", "pageable rows")]
    checks, failures = 0, []
    pages, n = 50, 37
    for layout in LAYOUTS:
        for shape in shapes:
            for variant in (0, 1):
                cache = make_cache(layout, shape, pages, "cuda", variant)
                host_cache = map_cache(cache, lambda t: t.cpu())
                ids = torch.randint(0, pages, (n,)).tolist()
                expected = torch.empty((n, shape.block_bytes), dtype=torch.uint8)
                gather(host_cache, ids, expected, layout=layout)
                noise = torch.randint(0, 256, (n, shape.block_bytes), dtype=torch.uint8)
                expected_pages = map_cache(host_cache, poisoned_like)
                scatter(noise, expected_pages, ids, layout=layout)
                want_gather, want_scatter = expected.numpy().tobytes(), cache_bytes(expected_pages)
                for backend, kind in combos:
                    label = f"{layout} v{variant} {shape} {backend} {kind}"
                    slots = SlotSet(kind, n, shape.block_bytes)
                    try:
                        gather(cache, ids, slots.slots, layout=layout, backend=backend)
                        torch.cuda.synchronize()
                        if slots.read() != want_gather:
                            failures.append(f"gather {label}")
                        slots.write(noise)
                        target = map_cache(cache, poisoned_like)
                        scatter(slots.slots, target, ids, layout=layout, backend=backend)
                        torch.cuda.synchronize()
                        if cache_bytes(target) != want_scatter:
                            failures.append(f"scatter {label}")
                    except Exception as exc:  # noqa: BLE001  a check reports, it does not stop the run
                        failures.append(f"{label}: {type(exc).__name__}: {exc}")
                    finally:
                        slots.close()
                    checks += 2
    return checks, failures


def device_time(call: Callable[[], object], repeats: int = 15) -> tuple[float, float]:
    """Median device milliseconds and median host microseconds per call."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    device_ms, host_us = [], []
    for _ in range(repeats):
        # The GPU waits here while the host queues the call, so the events time the copy alone.
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        start.record()
        began = time.perf_counter()
        call()
        host_us.append((time.perf_counter() - began) * 1e6)
        end.record()
        end.synchronize()
        device_ms.append(start.elapsed_time(end))
    return statistics.median(device_ms), statistics.median(host_us)


@dataclass
class Result:
    name: str
    nbytes: int
    ms: float
    host_us: float
    baseline_ms: float | None = None
    target: float | None = None
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / (self.ms * 1e-3) / 1e9

    @property
    def ratio(self) -> float | None:
        return None if self.baseline_ms is None else self.baseline_ms / self.ms

    def line(self) -> str:
        text = (
            f"{self.name:<52} {self.gbps:8.1f} GB/s  {self.ms:8.3f} ms  host {self.host_us:7.0f} us"
        )
        if self.ratio is not None:
            text += f"  {self.ratio:5.2f}x"
            if self.target is not None:
                text += "  ok" if self.ratio >= self.target else f"  BELOW {self.target:.2f}"
        return f"{text}  {self.note}" if self.note else text


def bench_device(
    have_kernel: bool, shape: Shape, n: int, pages: int, targets: bool
) -> list[Result]:
    """Gather and scatter between device pages and a device slot table, against copy_."""
    nbytes = n * shape.block_bytes
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    destination = torch.empty_like(source)
    base_ms, base_host = device_time(functools.partial(destination.copy_, source))
    results = [Result(f"D2D copy_ {nbytes // MiB} MiB ({shape})", nbytes, base_ms, base_host)]
    del source, destination
    backends: list[Backend] = ["kernel", "torch"] if have_kernel else ["torch"]
    for layout in LAYOUTS:
        # Prepared once, as a tier would at registration: the calls skip re-validating it.
        cache = paged_cache(make_cache(layout, shape, pages, "cuda"), layout)
        ids = torch.randperm(pages)[:n].tolist()
        slots = torch.empty((n, shape.block_bytes), dtype=torch.uint8, device="cuda")
        addresses = [slots.data_ptr() + i * slots.stride(0) for i in range(n)]
        max_ctas = (
            CTAS_PER_MULTIPROCESSOR * torch.cuda.get_device_properties(0).multi_processor_count
        )
        plan = plan_launch(
            paged_cache(cache, layout),
            np.asarray(ids, dtype=np.int64),
            addresses,
            gather=True,
            max_ctas=max_ctas,
        )
        for backend in backends:
            target = 0.8 if targets and backend == "kernel" else None
            for verb in ("gather", "scatter"):
                if verb == "gather":
                    call = functools.partial(
                        gather, cache, ids, slots, layout=layout, backend=backend
                    )
                else:
                    call = functools.partial(
                        scatter, slots, cache, ids, layout=layout, backend=backend
                    )
                ms, host = device_time(call)
                kernel_name = plan.kernel.replace("gather", verb)
                note = (
                    f"[{kernel_name} grid {plan.grid} x{plan.threads}]"
                    if backend == "kernel"
                    else ""
                )
                results.append(
                    Result(f"  {verb} {layout} {backend}", nbytes, ms, host, base_ms, target, note)
                )
        del cache, slots
    return results


def bench_host(have_kernel: bool, shape: Shape, n: int, pages: int) -> list[Result]:
    """GPU pages <-> pinned host slots, against one large non-blocking copy."""
    nbytes = n * shape.block_bytes
    device_flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    table = torch.empty((n, shape.block_bytes), dtype=torch.uint8).pin_memory()
    flat = table.view(-1)
    d2h_ms, d2h_host = device_time(functools.partial(flat.copy_, device_flat, non_blocking=True), 9)
    h2d_ms, h2d_host = device_time(functools.partial(device_flat.copy_, flat, non_blocking=True), 9)
    results = [
        Result(f"GPU->pinned one copy {nbytes // MiB} MiB", nbytes, d2h_ms, d2h_host),
        Result(f"pinned->GPU one copy {nbytes // MiB} MiB", nbytes, h2d_ms, h2d_host),
    ]
    del device_flat
    flags = (
        mmap.MAP_SHARED | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_POPULATE", 0)
    )
    arena = mmap.mmap(-1, nbytes, flags=flags)
    registration = register_host_memory(arena, chunk_bytes=256 * MiB)
    whole = memoryview(arena)
    rows = [whole[i * shape.block_bytes : (i + 1) * shape.block_bytes] for i in range(n)]
    slot_kinds: list[tuple[str, Slots]] = [("pinned table", table)]
    if registration.pinned:
        slot_kinds.append(("registered mmap rows", rows))
    else:
        print(f"  mmap arena not pinned: {registration.reason}")
    backends: list[Backend] = ["kernel", "torch"] if have_kernel else ["torch"]
    try:
        for layout in LAYOUTS:
            # Prepared once, as a tier would at registration: the calls skip re-validating it.
            cache = paged_cache(make_cache(layout, shape, pages, "cuda"), layout)
            ids = torch.randperm(pages)[:n].tolist()
            for kind, slots in slot_kinds:
                for backend in backends:
                    target = 0.8 if backend == "kernel" and kind == "pinned table" else None

                    offload = functools.partial(
                        gather, cache, ids, slots, layout=layout, backend=backend
                    )
                    reload = functools.partial(
                        scatter, slots, cache, ids, layout=layout, backend=backend
                    )

                    ms, host = device_time(offload, repeats=9)
                    name = f"  GPU->DRAM {layout} {backend} {kind}"
                    results.append(Result(name, nbytes, ms, host, d2h_ms, target))
                    ms, host = device_time(reload, repeats=9)
                    name = f"  DRAM->GPU {layout} {backend} {kind}"
                    results.append(Result(name, nbytes, ms, host, h2d_ms, target))
            del cache
    finally:
        release_arena(rows, whole, registration, arena)
    return results


def _ipc_child(inbox: Any, outbox: Any) -> None:
    """Process B: map A's CUDA block, check it bit-exact, answer in the same memory."""
    try:
        block, expected = inbox.get(timeout=120)
        same = torch.equal(block.cpu(), expected)
        block.fill_(0x3C)
        torch.cuda.synchronize()
        outbox.put(("ok" if same else "mismatch", block.device.index, block.data_ptr()))
    except Exception as exc:  # noqa: BLE001  the parent reports it
        outbox.put((f"{type(exc).__name__}: {exc}", -1, 0))


def check_ipc(have_kernel: bool) -> str:
    """Process A gathers a block into a CUDA tensor; B maps it over CUDA IPC."""
    from torch import multiprocessing

    shape = Shape(4, 16, 8, 128, torch.bfloat16)
    cache = make_cache("per_layer", shape, 8, "cuda")
    block = torch.empty((1, shape.block_bytes), dtype=torch.uint8, device="cuda")
    gather(cache, [5], block, layout="per_layer", backend="kernel" if have_kernel else "torch")
    torch.cuda.synchronize()
    expected = block.cpu()
    context = multiprocessing.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    child = context.Process(target=_ipc_child, args=(inbox, outbox))
    child.start()
    try:
        inbox.put((block, expected))
        status, _, _ = outbox.get(timeout=180)
        if status != "ok":
            return f"process B: {status}"
        torch.cuda.synchronize()
        if not bool((block == 0x3C).all()):
            return "process A does not see process B's write"
        return "ok"
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()


POOL_SHAPE = Shape(32, 16, 8, 128, torch.bfloat16)  # 2 MiB blocks, 64 KiB per layer
POOL_BLOCKS = 128  # 256 MiB reloaded per call


def _as_table(slots: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    return slots if isinstance(slots, torch.Tensor) else torch.stack(slots)


def _pool_peer(
    fields: tuple[Any, ...], offsets: list[int], back: list[int], backend: Backend, outbox: Any
) -> None:
    """Process B: open the daemon's pool, reload A's blocks into this engine's own paged
    cache, time that against a plain D2D copy of the same bytes, and commit the pages
    back into the ``back`` slots for A to check."""
    try:
        gpu = _import_gpu_tier()
        mapping = gpu.PoolMapping.open(gpu.PoolHandle(*fields))
        shape, n = POOL_SHAPE, len(offsets)
        block_bytes = shape.block_bytes
        cache = paged_cache(
            map_cache(make_cache("per_layer", shape, 2 * n, "cuda"), poisoned_like), "per_layer"
        )
        ids = torch.randperm(2 * n)[:n].tolist()
        slots = mapping.slots(offsets, block_bytes)
        reload = functools.partial(scatter, slots, cache, ids, layout="per_layer", backend=backend)
        reload_ms, reload_host = device_time(reload, repeats=9)
        start = min(offsets)
        ipc_bytes = mapping.tensor()[start : start + n * block_bytes]
        local = torch.empty_like(ipc_bytes)
        copy_ms, copy_host = device_time(functools.partial(local.copy_, ipc_bytes), repeats=9)
        returned = mapping.slots(back, block_bytes)
        gather(cache, ids, returned, layout="per_layer", backend=backend)
        gpu.CopyFence.record(0).wait()
        same = torch.equal(_as_table(returned), _as_table(slots))
        del slots, returned, ipc_bytes, reload
        mapping.close()
        status = "ok" if same else "B's reloaded pages differ from the pool's blocks"
        outbox.put((status, reload_ms, reload_host, copy_ms, copy_host))
    except Exception as exc:  # noqa: BLE001  the parent reports it
        outbox.put((f"{type(exc).__name__}: {exc}", 0.0, 0.0, 0.0, 0.0))


def check_pool_ipc(have_kernel: bool) -> tuple[str, list[Result]]:
    """The GPU tier's pool shared over CUDA IPC: A commits, B reloads, A checks."""
    import multiprocessing

    gpu = _import_gpu_tier()
    reason = gpu.gpu_unavailable(0)
    if reason is not None:
        return f"skipped: {reason}", []
    shape, n = POOL_SHAPE, POOL_BLOCKS
    block_bytes, nbytes = shape.block_bytes, POOL_BLOCKS * POOL_SHAPE.block_bytes
    backend: Backend = "kernel" if have_kernel else "torch"
    slab = 64 * MiB
    pool = gpu.DevicePool.create(0, 2 * nbytes + slab, slab_bytes=slab)
    try:
        cache = paged_cache(make_cache("per_layer", shape, 2 * n, "cuda"), "per_layer")
        ids = torch.randperm(2 * n)[:n].tolist()
        offsets, back = pool.allocate(block_bytes, n), pool.allocate(block_bytes, n)
        slots = pool.slots(offsets, block_bytes)
        commit = functools.partial(gather, cache, ids, slots, layout="per_layer", backend=backend)
        commit_ms, commit_host = device_time(commit, repeats=9)
        plain = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        start = min(offsets)
        copy_ms, copy_host = device_time(
            functools.partial(plain.copy_, pool.tensor()[start : start + nbytes]), repeats=9
        )
        reference = torch.empty((n, block_bytes), dtype=torch.uint8, device="cuda")
        gather(cache, ids, reference, layout="per_layer", backend="torch")
        gpu.CopyFence.record(0).wait()  # the blocks are in the pool before B is told of them
        if not torch.equal(_as_table(slots), reference):
            return "A's commit into the pool is not bit-exact", []
        handle = pool.export()
        fields = (handle.kind, handle.device, handle.nbytes, handle.handle, handle.owner_pid,
                  handle.pci_bus_id)
        context = multiprocessing.get_context("spawn")
        outbox = context.Queue()
        peer = context.Process(target=_pool_peer, args=(fields, offsets, back, backend, outbox))
        peer.start()
        try:
            status, reload_ms, reload_host, peer_copy_ms, peer_copy_host = outbox.get(timeout=180)
        finally:
            peer.join(timeout=60)
            if peer.is_alive():
                peer.kill()
        if status != "ok":
            return f"process B: {status}", []
        returned = pool.slots(back, block_bytes)
        if not torch.equal(_as_table(returned), reference):
            return "the blocks B committed back differ from A's pages", []
        target = 0.8 if have_kernel else None
        results = [
            Result(f"A: D2D copy_ {nbytes // MiB} MiB ({shape})", nbytes, copy_ms, copy_host),
            Result(f"  A: commit gather -> pool {backend}", nbytes, commit_ms, commit_host,
                   copy_ms, target),
            Result(f"B: D2D copy_ {nbytes // MiB} MiB out of the IPC pool", nbytes,
                   peer_copy_ms, peer_copy_host),
            Result(f"  B: reload scatter IPC pool -> cache {backend}", nbytes, reload_ms,
                   reload_host, peer_copy_ms, target),
        ]
        del slots, returned, commit
        return "ok", results
    finally:
        pool.close()


def check_pinned_arena(have_kernel: bool) -> tuple[str, list[Result]]:
    """An mmap arena pinned in the background, then GPU <-> its slots against one copy."""
    shape, n = POOL_SHAPE, 256
    block_bytes, nbytes = shape.block_bytes, 256 * POOL_SHAPE.block_bytes
    flags = (
        mmap.MAP_SHARED | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_POPULATE", 0)
    )
    arena = mmap.mmap(-1, nbytes, flags=flags)
    began = time.perf_counter()
    registration = register_in_background(arena, chunk_bytes=ARENA_CHUNK_BYTES)
    call_ms = (time.perf_counter() - began) * 1e3
    finished = registration.wait(120)
    pin_s = time.perf_counter() - began
    print(f"  register_in_background returned in {call_ms:.1f} ms; pinned "
          f"{registration.pinned_bytes // MiB} MiB in {pin_s:.2f} s ({registration!r})")
    whole = memoryview(arena)
    rows = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(n)]
    flat = torch.from_numpy(np.frombuffer(arena, dtype=np.uint8))
    try:
        if not (finished and registration.pinned):
            return f"not pinned: {registration.reason or 'still pinning after 120 s'}", []
        if not (flat.is_pinned() and flat[-1:].is_pinned()):
            return "the arena is registered but torch does not see it as pinned", []
        device_flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        # One cudaMemcpyAsync per registered piece: one may not span two ("invalid
        # argument", found on an H200): the limit of an arena pinned in pieces.
        base = flat.data_ptr()
        edges = [e - base for e in chunk_edges(base, nbytes, ARENA_CHUNK_BYTES)]

        def copy_pieces(dst: torch.Tensor, src: torch.Tensor) -> None:
            for a, b in itertools.pairwise(edges):
                dst[a:b].copy_(src[a:b], non_blocking=True)

        d2h_ms, d2h_host = device_time(functools.partial(copy_pieces, flat, device_flat), 9)
        h2d_ms, h2d_host = device_time(functools.partial(copy_pieces, device_flat, flat), 9)
        backend: Backend = "kernel" if have_kernel else "torch"
        cache = paged_cache(make_cache("per_layer", shape, 2 * n, "cuda"), "per_layer")
        ids = torch.randperm(2 * n)[:n].tolist()
        offload = functools.partial(gather, cache, ids, rows, layout="per_layer", backend=backend)
        offload_ms, offload_host = device_time(offload, 9)
        target_cache = paged_cache(
            map_cache(make_cache("per_layer", shape, 2 * n, "cuda"), poisoned_like), "per_layer"
        )
        reload = functools.partial(
            scatter, rows, target_cache, ids, layout="per_layer", backend=backend
        )
        reload_ms, reload_host = device_time(reload, 9)
        reference = torch.empty((n, block_bytes), dtype=torch.uint8, device="cuda")
        gather(cache, ids, reference, layout="per_layer", backend="torch")
        reloaded = torch.empty_like(reference)
        gather(target_cache, ids, reloaded, layout="per_layer", backend="torch")
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        done.synchronize()
        copy_pieces(device_flat, flat)  # (the arena's bytes back, to compare)
        if not torch.equal(device_flat.view(n, block_bytes), reference):
            return "GPU -> pinned arena is not bit-exact", []
        del device_flat
        if not torch.equal(reloaded, reference):
            return "pinned arena -> GPU is not bit-exact", []
        target = 0.8 if have_kernel else None
        return "ok", [
            Result(f"GPU->pinned arena by piece {nbytes // MiB} MiB", nbytes, d2h_ms, d2h_host),
            Result(f"pinned arena->GPU by piece {nbytes // MiB} MiB", nbytes, h2d_ms, h2d_host),
            Result(f"  GPU->arena rows gather {backend}", nbytes, offload_ms, offload_host,
                   d2h_ms, target),
            Result(f"  arena rows->GPU scatter {backend}", nbytes, reload_ms, reload_host,
                   h2d_ms, target),
        ]
    finally:
        del flat
        release_arena(rows, whole, registration, arena)


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU")
        return 0
    began = time.perf_counter()
    torch.manual_seed(0)
    properties = torch.cuda.get_device_properties(0)
    print(
        f"device: {properties.name}, {properties.multi_processor_count} SMs, torch {torch.__version__}"
    )
    reason = cuda_kernel_unavailable(torch.device("cuda"))
    have_kernel = reason is None
    try:
        cupy_version = importlib.import_module("cupy").__version__
    except ImportError:
        cupy_version = "missing"
    print(f"cupy {cupy_version}; CUDA kernel: {'available' if have_kernel else reason}")
    failed = False

    print("\n== correctness ==")
    checks, failures = check_correctness(have_kernel)
    for failure in failures[:40]:
        print(f"  FAIL {failure}")
    failed |= bool(failures)
    correctness = f"correctness: {checks} checks, {len(failures)} failures"
    print(correctness)

    results: list[Result] = []
    sections: list[tuple[str, Callable[[], list[Result]]]] = [
        (
            "device bandwidth, 2 MiB blocks",
            lambda: bench_device(
                have_kernel, Shape(32, 16, 8, 128, torch.bfloat16), 512, 1024, targets=True
            ),
        ),
        (
            "device bandwidth, small segments (256 KiB blocks, 4-8 KiB per layer)",
            lambda: bench_device(
                have_kernel, Shape(32, 16, 2, 64, torch.float16), 2048, 4096, targets=False
            ),
        ),
        (
            "GPU <-> pinned DRAM, 2 MiB blocks",
            lambda: bench_host(have_kernel, Shape(32, 16, 8, 128, torch.bfloat16), 256, 512),
        ),
    ]
    for title, run in sections:
        print(f"\n== {title} ==")
        try:
            section = run()
        except Exception:  # noqa: BLE001  report and go on to the next section
            traceback.print_exc()
            failed = True
            continue
        for result in section:
            print(result.line())
        results.extend(section)
        torch.cuda.empty_cache()

    print("\n== CUDA IPC ==")
    try:
        ipc = check_ipc(have_kernel)
    except Exception as exc:  # noqa: BLE001
        ipc = f"{type(exc).__name__}: {exc}"
    print(f"ipc: {ipc}")
    failed |= ipc != "ok"

    extra_checks: list[tuple[str, str, Callable[[bool], tuple[str, list[Result]]]]] = [
        ("GPU tier: device pool shared over CUDA IPC, 2 MiB blocks", "device pool", check_pool_ipc),
        ("DRAM arena pinned in the background, 2 MiB blocks", "pinned arena", check_pinned_arena),
    ]
    statuses: list[str] = []
    for title, label, check in extra_checks:
        print(f"\n== {title} ==")
        try:
            status, section = check(have_kernel)
        except Exception as exc:  # noqa: BLE001  report and go on
            traceback.print_exc()
            status, section = f"{type(exc).__name__}: {exc}", []
        for result in section:
            print(result.line())
        results.extend(section)
        statuses.append(f"{label}: {status}")
        print(statuses[-1])
        failed |= not (status == "ok" or status.startswith("skipped"))
        torch.cuda.empty_cache()

    print(f"\n== summary ({time.perf_counter() - began:.0f} s) ==")
    print(correctness)
    print(f"ipc: {ipc}")
    for status in statuses:
        print(status)
    for result in results:
        if result.target is not None:
            print(result.line().strip())
    below = [
        r for r in results if r.target is not None and r.ratio is not None and r.ratio < r.target
    ]
    print(
        f"targets: {len([r for r in results if r.target is not None]) - len(below)} met, {len(below)} below"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
