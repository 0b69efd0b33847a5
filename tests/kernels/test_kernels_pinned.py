"""register_host_memory and register_in_background: a no-op handle without CUDA, real
pinning with it; the background thread's bookkeeping against a fake CUDA runtime."""

from __future__ import annotations

import itertools
import mmap
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvstore.errors import MalformedError
from kvstore.kernels import HostRegistration, pinned, register_host_memory
from kvstore.kernels.pinned import BackgroundRegistration, chunk_edges, register_in_background

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


# --- register_in_background ----------------------------------------------------------------


class FakeRuntime:
    """cudaHostRegister/Unregister stand-ins that record calls; ``gate`` can hold one."""

    def __init__(self, fail_at: int = -1, hold_at: int = -1) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at, self.hold_at = fail_at, hold_at
        self.holding = threading.Event()
        self.gate = threading.Event()

    def register(self, address: int, size: int) -> str:
        call = len(self.registered)
        if call == self.fail_at:
            return "CUDA error 2"
        if call == self.hold_at:
            self.holding.set()
            assert self.gate.wait(10), "the test never opened the gate"
        self.registered.append((address, size))
        return ""

    def unregister(self, address: int) -> str:
        self.unregistered.append(address)
        return ""

    def calls(self) -> tuple[pinned.RegisterCalls, str]:
        return (self.register, self.unregister), ""


@pytest.fixture
def fake_runtime(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeRuntime]:
    def install(**kwargs: int) -> FakeRuntime:
        runtime = FakeRuntime(**kwargs)
        monkeypatch.setattr(pinned, "_cuda_calls", runtime.calls)
        return runtime

    return install


@needs_no_gpu
def test_background_without_cuda_is_done_at_once() -> None:
    finished: list[BackgroundRegistration] = []
    began = time.perf_counter()
    registration = register_in_background(
        bytearray(1 << 20), chunk_bytes=4096, on_done=finished.append
    )
    assert time.perf_counter() - began < 0.5
    assert registration.done and registration.wait(0)
    assert not registration.pinned and registration.pinned_bytes == 0
    assert "CUDA" in registration.reason and "not pinned" in repr(registration)
    assert finished == [registration]
    registration.unregister()
    registration.cancel()
    assert "CUDA" in registration.reason


def test_background_pins_every_chunk_highest_first(
    fake_runtime: Callable[..., FakeRuntime],
) -> None:
    runtime = fake_runtime()
    region = mmap.mmap(-1, 10 * mmap.PAGESIZE)
    finished: list[BackgroundRegistration] = []
    registration = register_in_background(
        region, chunk_bytes=3 * mmap.PAGESIZE, on_done=finished.append
    )
    assert registration.wait(10)
    assert registration.pinned and registration.pinned_bytes == len(region)
    assert finished == [registration] and "pinned" in repr(registration)
    starts = [start for start, _ in runtime.registered]
    assert starts == sorted(starts, reverse=True) and len(starts) == 4
    # Pinned from the top down: what is pinned at any moment is a suffix of the buffer.
    ends = [start + size for start, size in runtime.registered]
    assert ends[0] == registration.address + len(region)
    assert all(end == previous for end, previous in zip(ends[1:], starts))
    with pytest.raises(BufferError):
        region.close()  # the registration keeps the mapping exported
    registration.unregister()
    assert runtime.unregistered == sorted(starts)  # from the bottom up: still a suffix
    assert not registration.pinned and registration.pinned_bytes == 0
    assert registration.reason == "unregistered"
    region.close()


def test_background_unregister_while_pinning_stops_and_unpins(
    fake_runtime: Callable[..., FakeRuntime],
) -> None:
    runtime = fake_runtime(hold_at=2)
    buffer = bytearray(16 * mmap.PAGESIZE)
    registration = register_in_background(buffer, chunk_bytes=mmap.PAGESIZE)
    assert runtime.holding.wait(10)
    assert not registration.done and len(runtime.registered) == 2
    assert registration.pinned_bytes == sum(size for _, size in runtime.registered)
    canceller = threading.Thread(target=registration.cancel)
    canceller.start()
    time.sleep(0.05)
    assert canceller.is_alive(), "cancel waits for the chunk being pinned"
    runtime.gate.set()
    canceller.join(10)
    assert not canceller.is_alive()
    assert registration.done and not registration.pinned
    assert len(runtime.registered) == 3, "no chunk is pinned after cancel"
    assert sorted(runtime.unregistered) == sorted(start for start, _ in runtime.registered)
    assert registration.pinned_bytes == 0


def test_background_refusal_leaves_nothing_pinned(
    fake_runtime: Callable[..., FakeRuntime],
) -> None:
    runtime = fake_runtime(fail_at=3)
    finished: list[BackgroundRegistration] = []
    registration = register_in_background(
        bytearray(8 * mmap.PAGESIZE), chunk_bytes=mmap.PAGESIZE, on_done=finished.append
    )
    assert registration.wait(10) and finished == [registration]
    assert not registration.pinned and registration.pinned_bytes == 0
    assert registration.reason == "cudaHostRegister: CUDA error 2"
    assert sorted(runtime.unregistered) == sorted(start for start, _ in runtime.registered)
    assert len(runtime.registered) == 3


def test_background_callback_errors_are_logged(
    fake_runtime: Callable[..., FakeRuntime], caplog: pytest.LogCaptureFixture
) -> None:
    fake_runtime()

    def broken(registration: BackgroundRegistration) -> None:
        raise RuntimeError("callback bug")

    with register_in_background(bytearray(4096), on_done=broken) as registration:
        assert registration.wait(10) and registration.pinned
    assert "callback bug" in caplog.text
    assert not registration.pinned


def test_background_malformed_buffers() -> None:
    with pytest.raises(MalformedError, match="chunk_bytes must be positive"):
        register_in_background(bytearray(16), chunk_bytes=0)
    with pytest.raises(MalformedError, match="writable"):
        register_in_background(b"read only")


@pytest.mark.cuda
@needs_gpu
def test_background_registration_pins_and_unregisters() -> None:
    arena = bytearray(5 << 20)
    registration = register_in_background(arena, chunk_bytes=2 << 20)
    assert registration.wait(60), registration
    assert registration.pinned, registration.reason
    assert registration.pinned_bytes == len(arena)
    host = torch.frombuffer(arena, dtype=torch.uint8)
    assert host.is_pinned() and host[-1:].is_pinned()
    source = torch.arange(256, dtype=torch.uint8).repeat(4096).cuda()
    host[: source.numel()].copy_(source, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    done.synchronize()
    assert bytes(arena[:256]) == bytes(range(256))
    registration.unregister()
    assert not registration.pinned and registration.pinned_bytes == 0
    assert not torch.frombuffer(arena, dtype=torch.uint8).is_pinned()
