"""The CUDA side: the source builds with nvcc, and its kernels copy the same bytes as the
torch path.  Without a GPU the kernels run on the CPU through a host shim; on a GPU they
run for real (tests marked ``cuda``)."""

from __future__ import annotations

import ctypes
import importlib.resources
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore.kernels import (
    KVCaches,
    Layout,
    cuda_kernel_unavailable,
    gather,
    register_host_memory,
    scatter,
)
from kvstore.kernels import cuda as kernel_cuda
from kvstore.kernels.layout import PagedCache, paged_cache

SOURCE = kernel_cuda.SOURCE
SHIM = Path(__file__).with_name("block_copy_host_shim.cpp")
LAYOUTS: list[Layout] = ["per_layer", "per_layer_kv_split", "all_layer"]
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int8,
    torch.uint8,
    torch.float8_e4m3fn,
]
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def make_cache(
    layout: Layout,
    layers: int,
    page: tuple[int, ...],
    pages: int,
    dtype: torch.dtype,
    seed: int,
    variant: int = 0,
    device: str = "cpu",
) -> KVCaches:
    """Random bit patterns in ``layout``; ``variant`` 1 strides the pages or the layers."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        *outer, last = shape
        raw = torch.randint(0, 256, (*outer, last * dtype.itemsize), dtype=torch.uint8, generator=g)
        return raw.view(dtype).to(device)

    if layout == "per_layer":
        return [
            rand(pages, 3, *page)[:, :2] if variant else rand(pages, 2, *page)
            for _ in range(layers)
        ]
    if layout == "per_layer_kv_split":
        return [
            rand(2, pages, *page) if variant else (rand(pages, *page), rand(pages, *page))
            for _ in range(layers)
        ]
    return rand(pages, layers, 3, *page)[:, :, :2] if variant else rand(pages, layers, 2, *page)


def as_bytes(cache: KVCaches) -> list[bytes]:
    tensors = (
        [cache]
        if isinstance(cache, torch.Tensor)
        else [t for item in cache for t in ([item] if isinstance(item, torch.Tensor) else item)]
    )
    return [t.cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def zeros_like(cache: KVCaches) -> KVCaches:
    def fresh(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        out.view(torch.uint8).fill_(0xA5)
        return out

    if isinstance(cache, torch.Tensor):
        return fresh(cache)
    return [fresh(i) if isinstance(i, torch.Tensor) else tuple(fresh(t) for t in i) for i in cache]


# --- the source --------------------------------------------------------------------------


def test_source_ships_in_the_package() -> None:
    assert importlib.resources.files("kvstore.kernels").joinpath("block_copy.cu").is_file()


@needs_nvcc
def test_nvcc_emits_ptx_with_every_kernel(tmp_path: Path) -> None:
    out = tmp_path / "block_copy.ptx"
    result = subprocess.run(
        [str(NVCC), "-arch=sm_90", "--ptx", str(SOURCE), "-o", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    ptx = out.read_text()
    for name in kernel_cuda.KERNEL_NAMES:
        assert f".entry {name}(" in ptx
    assert "ld.global.nc.v2.u64" in ptx or "ld.v2.u64" in ptx, "16-byte loads expected"


@needs_nvcc
def test_nvcc_compiles_for_sm90_without_spills(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(NVCC),
            "-arch=sm_90",
            "-c",
            "-Xptxas",
            "-v",
            str(SOURCE),
            "-o",
            str(tmp_path / "block_copy.o"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert all(int(n) == 0 for n in re.findall(r"(\d+) bytes spill", result.stderr)), result.stderr


# --- the kernels, run on the CPU through the host shim -----------------------------------


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the host shim")
    library = tmp_path_factory.mktemp("shim") / "block_copy_host.so"
    result = subprocess.run(
        [
            compiler,
            "-O1",
            "-std=c++17",
            "-shared",
            "-fPIC",
            f'-DKV_SOURCE="{SOURCE}"',
            str(SHIM),
            "-o",
            str(library),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    dll = ctypes.CDLL(str(library))
    dll.run_kernel.argtypes = [
        ctypes.c_char_p,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_longlong,
        ctypes.c_int,
    ]
    dll.run_kernel.restype = ctypes.c_int
    return dll


@contextmanager
def kernels_on_cpu(dll: ctypes.CDLL, max_ctas: int = 0) -> Iterator[list[str]]:
    """Route backend="kernel" to the host shim; yields the names of the kernels launched."""
    launched: list[str] = []

    def launch(
        cache: PagedCache, page_ids: npt.NDArray[np.int64], addresses: list[int], *, gather: bool
    ) -> None:
        plan = kernel_cuda.plan_launch(cache, page_ids, addresses, gather=gather, max_ctas=max_ctas)
        meta = np.ascontiguousarray(plan.meta)
        status = dll.run_kernel(
            plan.kernel.encode(),
            *plan.grid,
            plan.threads,
            meta.ctypes.data,
            plan.n_segs,
            plan.seg_vecs,
            plan.n_blocks,
        )
        assert status == 0, plan.kernel
        launched.append(plan.kernel)

    with (
        mock.patch.object(kernel_cuda, "kernel_unavailable", lambda cache, buffers: None),
        mock.patch.object(kernel_cuda, "launch_copy", launch),
    ):
        yield launched


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    layers=st.integers(1, 3),
    page=st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 40)),
    pages=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    variant=st.integers(0, 1),
    max_ctas=st.sampled_from([0, 1, 5]),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_host_kernels_match_torch(
    host_kernels: ctypes.CDLL,
    layout: Layout,
    layers: int,
    page: tuple[int, int, int],
    pages: int,
    dtype: torch.dtype,
    variant: int,
    max_ctas: int,
    seed: int,
    data: st.DataObject,
) -> None:
    cache = make_cache(layout, layers, page, pages, dtype, seed, variant)
    ids = data.draw(st.lists(st.integers(0, pages - 1), max_size=10), label="ids")
    block_bytes = 2 * layers * int(np.prod(page)) * dtype.itemsize
    ours = torch.full((len(ids), block_bytes), 0x11, dtype=torch.uint8)
    theirs = torch.full((len(ids), block_bytes), 0x22, dtype=torch.uint8)
    with kernels_on_cpu(host_kernels, max_ctas):
        gather(cache, ids, ours, layout=layout, backend="kernel")
    gather(cache, ids, theirs, layout=layout, backend="torch")
    assert torch.equal(ours, theirs)

    noise = torch.randint(
        0, 256, theirs.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    target_kernel, target_torch = zeros_like(cache), zeros_like(cache)
    with kernels_on_cpu(host_kernels, max_ctas):
        scatter(noise, target_kernel, ids, layout=layout, backend="kernel")
    scatter(noise, target_torch, ids, layout=layout, backend="torch")
    assert as_bytes(target_kernel) == as_bytes(target_torch)


@pytest.mark.parametrize(
    ("dtype", "page", "slot_offset", "kernel"),
    [
        (torch.float16, (4, 2, 8), 0, "kv_gather_v16"),
        (torch.float16, (4, 2, 8), 8, "kv_gather_v8"),
        (torch.float16, (4, 2, 8), 4, "kv_gather_v4"),
        (torch.int8, (3, 1, 3), 0, "kv_gather_v1"),
        (torch.float16, (4, 2, 8), 1, "kv_gather_v1"),
    ],
)
def test_host_kernels_pick_the_widest_vector(
    host_kernels: ctypes.CDLL,
    dtype: torch.dtype,
    page: tuple[int, ...],
    slot_offset: int,
    kernel: str,
) -> None:
    cache = make_cache("per_layer", 2, page, 5, dtype, seed=3)
    block_bytes = 2 * 2 * int(np.prod(page)) * dtype.itemsize
    arena = np.zeros(3 * block_bytes + 64, dtype=np.uint8)
    start = (-arena.ctypes.data) % 16 + slot_offset
    slots = [arena[start + i * block_bytes : start + (i + 1) * block_bytes] for i in range(3)]
    expected = torch.empty((3, block_bytes), dtype=torch.uint8)
    with kernels_on_cpu(host_kernels) as launched:
        gather(cache, [4, 0, 4], slots, layout="per_layer", backend="kernel")
    gather(cache, [4, 0, 4], expected, layout="per_layer", backend="torch")
    assert launched == [kernel]
    assert [s.tobytes() for s in slots] == [row.numpy().tobytes() for row in expected]


def test_plan_keeps_the_grid_within_limits() -> None:
    cache = paged_cache(torch.zeros((70000, 1, 2, 1, 1, 8), dtype=torch.float16), "all_layer")
    ids = np.arange(70000, dtype=np.int64)
    addresses = [16 * i for i in range(70000)]
    plan = kernel_cuda.plan_launch(cache, ids, addresses, gather=True)
    assert plan.kernel == "kv_gather_v16"
    assert plan.grid == (1, 1, 65535) and plan.threads == 32
    assert plan.meta.shape == (2 + 2 * 70000,)
    capped = kernel_cuda.plan_launch(cache, ids, addresses, gather=False, max_ctas=4224)
    assert capped.kernel == "kv_scatter_v16" and capped.grid == (1, 1, 4224)


def test_plan_sizes_ctas_to_the_segment() -> None:
    layers = [torch.zeros((8, 2, 16, 8, 128), dtype=torch.bfloat16) for _ in range(32)]
    plan = kernel_cuda.plan_launch(
        paged_cache(layers, "per_layer"), np.arange(8), [1 << 24] * 8, gather=True, max_ctas=4224
    )
    # 64 KiB per layer and page: 4096 vectors, 4 CTAs of 256 threads x 4 vectors each
    assert (plan.kernel, plan.threads, plan.grid) == ("kv_gather_v16", 256, (4, 32, 8))
    assert plan.seg_vecs == 4096 and plan.n_segs == 32


# --- the kernels on a real GPU -----------------------------------------------------------


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_kernel_matches_torch(layout: Layout, dtype: torch.dtype) -> None:
    pytest.importorskip("cupy")
    assert cuda_kernel_unavailable(torch.device("cuda")) is None
    for variant in (0, 1):
        cache = make_cache(
            layout, 3, (16, 2, 64), 33, dtype, seed=7, variant=variant, device="cuda"
        )
        ids = [31, 0, 5, 5, 17, 2, 9]
        block_bytes = 2 * 3 * 16 * 2 * 64 * dtype.itemsize
        ours = torch.zeros((len(ids), block_bytes), dtype=torch.uint8, device="cuda")
        theirs = torch.ones_like(ours)
        gather(cache, ids, ours, layout=layout, backend="kernel")
        gather(cache, ids, theirs, layout=layout, backend="torch")
        torch.cuda.synchronize()
        assert torch.equal(ours, theirs)
        target_kernel, target_torch = zeros_like(cache), zeros_like(cache)
        noise = torch.randint(0, 256, ours.shape, dtype=torch.uint8, device="cuda")
        scatter(noise, target_kernel, ids, layout=layout, backend="kernel")
        scatter(noise, target_torch, ids, layout=layout, backend="torch")
        torch.cuda.synchronize()
        assert as_bytes(target_kernel) == as_bytes(target_torch)


@pytest.mark.cuda
@needs_gpu
def test_gpu_kernel_with_pinned_host_slots() -> None:
    pytest.importorskip("cupy")
    cache = make_cache("per_layer", 4, (16, 8, 128), 20, torch.bfloat16, seed=1, device="cuda")
    ids = [3, 19, 0, 7]
    block_bytes = 2 * 4 * 16 * 8 * 128 * 2
    expected = torch.empty((len(ids), block_bytes), dtype=torch.uint8, device="cuda")
    gather(cache, ids, expected, layout="per_layer", backend="torch")

    table = torch.zeros((len(ids), block_bytes), dtype=torch.uint8).pin_memory()
    gather(cache, ids, table, layout="per_layer", backend="kernel")
    torch.cuda.synchronize()
    assert torch.equal(table, expected.cpu())

    arena = bytearray(len(ids) * block_bytes)
    with register_host_memory(arena, chunk_bytes=1 << 20) as registration:
        assert registration.pinned, registration.reason
        views = [
            memoryview(arena)[i * block_bytes : (i + 1) * block_bytes] for i in range(len(ids))
        ]
        gather(cache, ids, views, layout="per_layer", backend="kernel")
        torch.cuda.synchronize()
        assert bytes(arena) == expected.cpu().numpy().tobytes()
        target = zeros_like(cache)
        scatter(views, target, ids, layout="per_layer", backend="kernel")
        torch.cuda.synchronize()
        for view in views:
            view.release()
    for written, original in zip(target, cache):
        assert isinstance(written, torch.Tensor) and isinstance(original, torch.Tensor)
        assert torch.equal(written[ids].view(torch.uint8), original[ids].view(torch.uint8))


@pytest.mark.cuda
@needs_gpu
def test_gpu_pageable_host_slots_use_the_torch_path() -> None:
    cache = make_cache("all_layer", 2, (16, 2, 64), 10, torch.float16, seed=2, device="cuda")
    slots = [bytearray(2 * 2 * 16 * 2 * 64 * 2) for _ in range(3)]
    gather(cache, [9, 1, 9], slots, layout="all_layer")
    torch.cuda.synchronize()
    assert isinstance(cache, torch.Tensor)
    expected = cache[[9, 1, 9]].cpu().contiguous().view(torch.uint8)
    assert [bytes(s) for s in slots] == [row.numpy().tobytes() for row in expected.view(3, -1)]
