"""register_host_memory: a no-op handle without CUDA, real pinning with it."""

from __future__ import annotations

import itertools
import mmap

import numpy as np
import pytest
import torch
from kvstore.kernels import HostRegistration, register_host_memory
from kvstore.kernels.pinned import chunk_edges

from kvstore.errors import MalformedError

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@needs_no_gpu
@pytest.mark.parametrize(
    "make",
    [
        lambda: bytearray(4096),
        lambda: torch.zeros(4096, dtype=torch.uint8),
        lambda: np.zeros(4096, np.uint8),
    ],
)
def test_without_cuda_the_handle_says_not_pinned(make: object) -> None:
    buffer = make()  # type: ignore[operator]
    registration = register_host_memory(buffer, chunk_bytes=1024)
    assert isinstance(registration, HostRegistration)
    assert not registration.pinned
    assert registration.nbytes == 4096
    assert "not pinned" in repr(registration) and registration.reason
    registration.unregister()
    registration.unregister()


def test_mmap_can_be_registered_and_closed_after() -> None:
    region = mmap.mmap(-1, 1 << 16)
    with register_host_memory(region, chunk_bytes=1 << 14) as registration:
        if registration.pinned:
            with pytest.raises(BufferError):
                region.close()  # the handle keeps the mapping alive while pinned
    region.close()


@pytest.mark.parametrize(
    ("address", "nbytes", "chunk_bytes"),
    [
        (0x1010, 5 << 20, 2 << 20),
        (0x1000, 4 << 20, 2 << 20),
        (0x1010, 100, 1 << 30),
        (0x1FF0, 64, 1),
    ],
)
def test_chunks_cover_the_buffer_and_share_no_page(
    address: int, nbytes: int, chunk_bytes: int
) -> None:
    edges = chunk_edges(address, nbytes, chunk_bytes)
    assert edges[0] == address and edges[-1] == address + nbytes
    assert all(a < b for a, b in itertools.pairwise(edges))
    assert all(edge % mmap.PAGESIZE == 0 for edge in edges[1:-1])


@pytest.mark.parametrize(
    ("buffer", "chunk_bytes", "message"),
    [
        (bytearray(16), 0, "chunk_bytes must be positive"),
        (b"read only", 1024, "writable, contiguous, non-empty"),
        (bytearray(), 1024, "writable, contiguous, non-empty"),
        (memoryview(bytearray(64))[::2], 1024, "writable, contiguous, non-empty"),
        (torch.zeros(8, 8).t(), 1024, "contiguous CPU tensor"),
        (3, 1024, "not a buffer"),
    ],
)
def test_malformed_buffers(buffer: object, chunk_bytes: int, message: str) -> None:
    with pytest.raises(MalformedError, match=message):
        register_host_memory(buffer, chunk_bytes)  # type: ignore[arg-type]


@pytest.mark.cuda
@needs_gpu
def test_registered_memory_is_pinned_in_chunks() -> None:
    arena = bytearray(5 << 20)
    registration = register_host_memory(arena, chunk_bytes=2 << 20)
    assert registration.pinned, registration.reason
    assert "3 chunks" in repr(registration)
    assert torch.frombuffer(arena, dtype=torch.uint8).is_pinned()
    source = torch.arange(256, dtype=torch.uint8).repeat(4096).cuda()
    torch.frombuffer(arena, dtype=torch.uint8)[: source.numel()].copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert bytes(arena[:256]) == bytes(range(256))
    registration.unregister()
    assert not registration.pinned
    assert not torch.frombuffer(arena, dtype=torch.uint8).is_pinned()
