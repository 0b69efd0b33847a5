"""kvstore.tiers.gpu: the device pool, its handle, client mappings and the slot allocator.

The host-backed pool runs for real everywhere, across two processes; the CUDA pool is
tested (marked ``cuda``) where a GPU and CuPy are present, and refuses cleanly elsewhere.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import MalformedError, TooLargeError, UnavailableError
from kvstore.kernels import gather, scatter
from kvstore.tiers.gpu import (
    CopyFence,
    DevicePool,
    PoolHandle,
    PoolMapping,
    SlotAllocator,
    gpu_unavailable,
)

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")

LAYERS, PAGES, PAGE = 3, 12, (16, 2, 32)  # per_layer pages [2, T, H, D] in bfloat16
BLOCK_BYTES = 2 * LAYERS * 16 * 2 * 32 * 2
SOURCE_IDS = [7, 0, 11, 3, 3]
TARGET_IDS = [1, 2, 4, 8, 9]


def make_cache(seed: int | None, device: str) -> list[torch.Tensor]:
    """A per_layer bfloat16 cache of random bit patterns (zeros when ``seed`` is None)."""
    shape = (PAGES, 2, *PAGE[:-1], PAGE[-1] * 2)  # bytes: two per bfloat16
    if seed is None:
        return [
            torch.zeros(shape, dtype=torch.uint8).view(torch.bfloat16).to(device)
            for _ in range(LAYERS)
        ]
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        .view(torch.bfloat16)
        .to(device)
        for _ in range(LAYERS)
    ]


def page_bytes(cache: list[torch.Tensor], page: int) -> bytes:
    return b"".join(layer[page].cpu().view(torch.uint8).numpy().tobytes() for layer in cache)


@pytest.fixture
def host_pool(tmp_path: Path) -> Iterator[DevicePool]:
    pool = DevicePool.create("cpu", 1 << 20, slab_bytes=1 << 16, directory=str(tmp_path))
    yield pool
    pool.close()


# --- no GPU here --------------------------------------------------------------------------


@needs_no_gpu
def test_without_a_gpu_the_reason_is_given() -> None:
    reason = gpu_unavailable(0)
    assert reason is not None and "CUDA is not available" in reason


def test_impossible_devices_have_a_reason() -> None:
    assert "negative" in (gpu_unavailable(-1) or "")
    assert gpu_unavailable(10_000) is not None


@needs_no_gpu
def test_a_cuda_pool_without_a_gpu_is_a_typed_error() -> None:
    with pytest.raises(UnavailableError, match="cuda:0.*CUDA is not available"):
        DevicePool.create(0, 1 << 20)


@needs_no_gpu
def test_a_cuda_handle_cannot_be_opened_without_a_gpu() -> None:
    handle = PoolHandle("cuda", 0, 1 << 20, bytes(64), os.getpid() + 1)
    with pytest.raises(UnavailableError, match="cannot open a CUDA pool here"):
        PoolMapping.open(handle)


@pytest.mark.parametrize(
    ("device", "capacity", "options", "message"),
    [
        ("gpu", 1 << 20, {}, "CUDA device index or 'cpu'"),
        (True, 1 << 20, {}, "CUDA device index or 'cpu'"),
        ("cpu", 0, {}, "has no 256-byte aligned slab"),
        ("cpu", 1 << 20, {"slab_bytes": 100}, "has no 256-byte aligned slab"),
        ("cpu", 1 << 20, {"alignment": 96}, "power of two"),
    ],
)
def test_pools_that_make_no_sense_are_refused(
    device: object, capacity: int, options: dict[str, int], message: str, tmp_path: Path
) -> None:
    with pytest.raises(MalformedError, match=message):
        DevicePool.create(device, capacity, directory=str(tmp_path), **options)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# --- the handle ---------------------------------------------------------------------------


def test_the_handle_travels_as_msgpack(host_pool: DevicePool) -> None:
    handle = host_pool.export()
    assert handle.kind == "host" and handle.device == -1 and handle.owner_pid == os.getpid()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=PoolHandle)
    assert decoded == handle
    with pytest.raises(msgspec.ValidationError, match=r">= 1 - at `\$\[2\]`"):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode(["host", -1, 0, b"/x", 1, ""]), type=PoolHandle
        )


def test_handles_that_make_no_sense_are_refused(host_pool: DevicePool, tmp_path: Path) -> None:
    with pytest.raises(UnavailableError, match="is the daemon running"):
        PoolMapping.open(PoolHandle("host", -1, 4096, str(tmp_path / "gone").encode(), 1))
    short = tmp_path / "short"
    short.write_bytes(bytes(100))
    with pytest.raises(MalformedError, match="holds 100 bytes"):
        PoolMapping.open(PoolHandle("host", -1, 4096, str(short).encode(), 1))
    with pytest.raises(MalformedError, match="64 bytes"):
        PoolMapping.open(PoolHandle("cuda", 0, 4096, b"short", 1))


# --- the host-backed pool in one process ------------------------------------------------------


def test_a_mapping_aliases_the_pool(host_pool: DevicePool) -> None:
    mapping = PoolMapping.open(host_pool.export())
    offsets = host_pool.allocate(1000, 3)
    assert offsets is not None
    mapping.slot_tensor(offsets[1], 1000).fill_(0x5A)
    assert bool((host_pool.slot_tensor(offsets[1], 1000) == 0x5A).all())
    assert int(host_pool.slot_tensor(offsets[0], 1000).sum()) == 0
    assert mapping.device == torch.device("cpu") and "open" in repr(mapping)
    with pytest.raises(MalformedError, match="outside the pool"):
        mapping.slot_tensor((1 << 20) - 10, 11)
    mapping.close()
    mapping.close()
    with pytest.raises(UnavailableError, match="closed"):
        mapping.slot_tensor(0, 1)


def test_slots_are_a_table_when_evenly_spaced(host_pool: DevicePool) -> None:
    table = host_pool.slots([0, 1024, 2048], 1000)
    assert isinstance(table, torch.Tensor) and table.shape == (3, 1000)
    assert table.stride() == (1024, 1)
    rows = host_pool.slots([2048, 0, 1024], 1000)
    assert isinstance(rows, list) and [row.numel() for row in rows] == [1000] * 3
    assert host_pool.slots([], 1000) == []
    with pytest.raises(MalformedError, match="block_bytes"):
        host_pool.slots([0], 0)


@pytest.mark.parametrize("spacing", ["table", "rows"])
def test_gather_and_scatter_go_through_pool_slots(host_pool: DevicePool, spacing: str) -> None:
    source, target = make_cache(1, "cpu"), make_cache(None, "cpu")
    offsets = host_pool.allocate(BLOCK_BYTES, len(SOURCE_IDS))
    assert offsets is not None
    if spacing == "rows":
        offsets = offsets[::-1]
    slots = host_pool.slots(offsets, BLOCK_BYTES)
    assert isinstance(slots, torch.Tensor) == (spacing == "table")
    gather(source, SOURCE_IDS, slots, layout="per_layer")
    CopyFence.record("cpu").wait()
    scatter(host_pool.slots(offsets, BLOCK_BYTES), target, TARGET_IDS, layout="per_layer")
    for source_id, target_id in zip(SOURCE_IDS, TARGET_IDS):
        assert page_bytes(target, target_id) == page_bytes(source, source_id)


def test_closing_unlinks_the_file_and_slot_tensors_stay_valid(tmp_path: Path) -> None:
    pool = DevicePool.create("cpu", 1 << 16, slab_bytes=1 << 14, directory=str(tmp_path))
    path = Path(os.fsdecode(pool.export().handle))
    assert path.exists() and path.stat().st_mode & 0o777 == 0o600
    slot = pool.slot_tensor(0, 64)
    pool.close()
    assert not path.exists() and "closed" in repr(pool)
    slot.fill_(7)  # still mapped: the tensor holds the mapping
    assert int(slot.sum()) == 7 * 64
    with pytest.raises(UnavailableError, match="closed"):
        pool.export()
    pool.close()


def test_copy_fence_on_the_cpu_is_done() -> None:
    fence = CopyFence.record("cpu")
    assert fence.done() and "done=True" in repr(fence)
    fence.wait()


# --- the host-backed pool across processes ------------------------------------------------------


def _peer(encoded: bytes, offsets: list[int], back: list[int], device: str, out: object) -> None:
    """The other engine: reload A's blocks from the pool into its own cache, check them
    bit-exact, and commit its pages back into the ``back`` slots."""
    try:
        handle = msgspec.msgpack.decode(encoded, type=PoolHandle)
        mapping = PoolMapping.open(handle)
        cache = make_cache(None, device)
        scatter(mapping.slots(offsets, BLOCK_BYTES), cache, TARGET_IDS, layout="per_layer")
        CopyFence.record(device).wait()
        expected = make_cache(1, "cpu")
        for source_id, target_id in zip(SOURCE_IDS, TARGET_IDS):
            if page_bytes(cache, target_id) != page_bytes(expected, source_id):
                raise AssertionError(f"page {target_id} differs from the committed block")
        gather(cache, TARGET_IDS[::-1], mapping.slots(back, BLOCK_BYTES), layout="per_layer")
        CopyFence.record(device).wait()
        mapping.close()
        out.put("ok")  # type: ignore[attr-defined]
    except BaseException as exc:  # noqa: BLE001  the parent reports it
        out.put(f"{type(exc).__name__}: {exc}")  # type: ignore[attr-defined]


def share_between_processes(pool: DevicePool, device: str) -> None:
    """Engine A commits blocks into the pool; engine B, another process, reloads them."""
    source = make_cache(1, device)
    offsets = pool.allocate(BLOCK_BYTES, len(SOURCE_IDS))
    back = pool.allocate(BLOCK_BYTES, len(TARGET_IDS))
    assert offsets is not None and back is not None
    gather(source, SOURCE_IDS, pool.slots(offsets, BLOCK_BYTES), layout="per_layer")
    CopyFence.record(device).wait()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    encoded = msgspec.msgpack.encode(pool.export())
    peer = context.Process(target=_peer, args=(encoded, offsets, back, device, out))
    peer.start()
    try:
        try:
            status = out.get(timeout=120)
        except queue.Empty:
            status = f"no answer; exit code {peer.exitcode}"
        assert status == "ok", f"process B: {status}"
    finally:
        peer.join(timeout=60)
        if peer.is_alive():
            peer.kill()
    expected = torch.empty((len(TARGET_IDS), BLOCK_BYTES), dtype=torch.uint8)
    # B gathered its pages TARGET_IDS[::-1], which hold A's pages SOURCE_IDS[::-1].
    gather([t.cpu() for t in source], SOURCE_IDS[::-1], expected, layout="per_layer")
    written = pool.slots(back, BLOCK_BYTES)
    assert isinstance(written, torch.Tensor)
    assert torch.equal(written.cpu(), expected)
    pool.free(BLOCK_BYTES, offsets + back)
    pool.allocator.check()


def test_host_pool_is_shared_between_processes(host_pool: DevicePool) -> None:
    share_between_processes(host_pool, "cpu")


# --- the slot allocator ------------------------------------------------------------------------

CAPACITY, SLAB, ALIGN = 64 * 1024 + 300, 16 * 1024, 256
BLOCK_SIZES = [100, 200, 1000, 4000, 9000]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from(BLOCK_SIZES), st.integers(0, 20)), max_size=60
    )
)
def test_allocations_never_overlap_or_overflow(ops: list[tuple[bool, int, int]]) -> None:
    allocator = SlotAllocator(CAPACITY, SLAB, ALIGN)
    held: dict[int, list[int]] = {size: [] for size in BLOCK_SIZES}
    for is_allocation, block_bytes, count in ops:
        if is_allocation:
            available = allocator.available(block_bytes)
            before = repr(allocator)
            offsets = allocator.allocate(block_bytes, count)
            if offsets is None:  # all or nothing: a refusal changes nothing
                assert available < count
                assert repr(allocator) == before
                assert allocator.available(block_bytes) == available
            else:
                assert len(offsets) == count
                held[block_bytes].extend(offsets)
        else:
            mine = held[block_bytes]
            given_back, held[block_bytes] = mine[:count], mine[count:]
            allocator.free(block_bytes, given_back)
        spans = sorted(
            (offset, offset + allocator.slot_bytes_for(size))
            for size, offsets in held.items()
            for offset in offsets
        )
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
        assert all(0 <= start and end <= CAPACITY and start % ALIGN == 0 for start, end in spans)
        assert allocator.allocated_slots == len(spans)
        assert allocator.allocated_bytes == sum(end - start for start, end in spans)
        allocator.check()
    for size, offsets in held.items():
        allocator.free(size, offsets)
    assert allocator.allocated_bytes == 0 and allocator.pool.empty_slabs == CAPACITY // SLAB


def test_bad_frees_free_nothing() -> None:
    allocator = SlotAllocator(CAPACITY, SLAB, ALIGN)
    offsets = allocator.allocate(1000, 4)
    assert offsets is not None
    before = repr(allocator)
    with pytest.raises(MalformedError, match="nothing was freed"):
        allocator.free(1000, [offsets[0], offsets[0]])
    with pytest.raises(MalformedError, match="nothing was freed"):
        allocator.free(1000, [offsets[1], 12345])
    with pytest.raises(MalformedError, match="nothing was freed"):
        allocator.free(4000, [offsets[2]])  # a slot of another size class
    assert repr(allocator) == before
    allocator.check()
    with pytest.raises(MalformedError, match="cannot allocate -1"):
        allocator.allocate(1000, -1)
    with pytest.raises(MalformedError, match="block_bytes must be positive"):
        allocator.allocate(0, 1)
    with pytest.raises(TooLargeError):
        allocator.allocate(SLAB + 1, 1)


# --- the CUDA pool ---------------------------------------------------------------------------


@pytest.fixture
def cuda_pool() -> Iterator[DevicePool]:
    pytest.importorskip("cupy")
    pool = DevicePool.create(0, 8 << 20, slab_bytes=1 << 20)
    yield pool
    pool.close()


@pytest.mark.cuda
@needs_gpu
def test_cuda_pool_is_one_raw_allocation(cuda_pool: DevicePool) -> None:
    handle = cuda_pool.export()
    assert handle.kind == "cuda" and handle.device == 0 and len(handle.handle) == 64
    assert handle.pci_bus_id and handle.owner_pid == os.getpid()
    whole = cuda_pool.tensor()
    assert whole.device == torch.device("cuda", 0) and whole.numel() == 8 << 20
    # Opening one's own handle (which CUDA refuses) gives the same memory.
    mapping = PoolMapping.open(handle)
    assert mapping.tensor().data_ptr() == whole.data_ptr()
    mapping.slot_tensor(4096, 16).fill_(9)
    assert int(cuda_pool.slot_tensor(4096, 16).sum()) == 9 * 16
    mapping.close()


@pytest.mark.cuda
@needs_gpu
def test_cuda_pool_slots_take_the_kernel_path(cuda_pool: DevicePool) -> None:
    pytest.importorskip("cupy")
    source, target = make_cache(3, "cuda"), make_cache(None, "cuda")
    offsets = cuda_pool.allocate(BLOCK_BYTES, len(SOURCE_IDS))
    assert offsets is not None
    for order in (offsets, offsets[::-1]):  # a table, then rows
        gather(source, SOURCE_IDS, cuda_pool.slots(order, BLOCK_BYTES), layout="per_layer",
               backend="kernel")
        scatter(cuda_pool.slots(order, BLOCK_BYTES), target, TARGET_IDS, layout="per_layer",
                backend="kernel")
        CopyFence.record(0).wait()
        for source_id, target_id in zip(SOURCE_IDS, TARGET_IDS):
            assert page_bytes(target, target_id) == page_bytes(source, source_id)


@pytest.mark.cuda
@needs_gpu
def test_cuda_pool_is_shared_between_processes(cuda_pool: DevicePool) -> None:
    share_between_processes(cuda_pool, "cuda")
