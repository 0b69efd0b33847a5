"""The GPU tier in the real daemon.  No GPU here: the daemon's pool is host-backed
(``--gpu-device cpu``), which runs the same protocol, accounting and client path (the
pool mapped through its handle, reloads taken from pool slots) as a CUDA pool does."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

import pytest
import torch
from daemon_proc import DaemonProcess
from kvtest import make_identity, removed_after, wait_for_file

from kvstore import AsyncClient, Client

LAYERS, TOKENS, HEADS, DIM = 2, 16, 2, 8
IDENT = make_identity(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_tokens=TOKENS)


BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=TOKENS)  # 64 KiB


def cache(pages: int, seed: int, ident: Any = IDENT) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(pages, 2, TOKENS, ident.num_kv_heads, ident.head_dim,
                        generator=g).to(torch.float16)
            for _ in range(ident.num_layers)]


def page(c: list[torch.Tensor], i: int) -> bytes:
    return b"".join(t[i].contiguous().view(torch.uint8).numpy().tobytes() for t in c)


def wait_for_copies(client: Client, count: int) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        stats = client.stats()
        gpu: dict[str, Any] = stats["tiers"]["gpu"]
        if gpu["blocks"] >= count:
            return stats
        assert time.monotonic() < deadline, f"gpu copies never came: {gpu}"
        time.sleep(0.02)


def _offload_in_another_process(endpoint: str, seed: int, pages: list[int]) -> None:
    with Client(endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(TOKENS * len(pages)))
        assert ns.offload(cache(8, seed), pages, keys) == len(pages)


def test_a_block_one_engine_commits_another_reloads_from_the_pool(
        daemon_factory: Any) -> None:
    d = daemon_factory(extra=["--gpu-device", "cpu", "--gpu-capacity", "4MiB"])
    pages_a = [5, 1, 6, 2]
    writer = multiprocessing.get_context("spawn").Process(
        target=_offload_in_another_process, args=(d.endpoint, 11, pages_a))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    engine_a = cache(8, 11)
    with Client(d.endpoint, tenant="acme") as b:
        stats = wait_for_copies(b, 4)
        assert stats["tiers"]["gpu"]["copies"] == 4 and stats["invariant_violations"] == 0
        pool = b.gpu_pool()
        assert pool is not None and pool.device.type == "cpu"
        ns = b.namespace(IDENT)
        keys = ns.keys(range(TOKENS * 4))
        with ns.acquire(keys) as held:
            assert all(off >= 0 for off in held.gpu_offsets)
            for i, off in enumerate(held.gpu_offsets):  # the pool holds the same bytes
                assert pool.slot_tensor(off, ns.block_bytes).numpy().tobytes() == \
                    page(engine_a, pages_a[i])
            # Spoil the DRAM copies under the pin: a reload that still comes back exact
            # can only have read the pool.
            for view in b._slots(held.offsets, ns.block_bytes, readonly=False, arena=ns.arena):
                view[:] = bytes(len(view))
        engine_b = cache(6, 3)
        pages_b = [4, 0, 3, 1]
        assert ns.reload(keys, engine_b, pages_b) == 4
        for pa, pb in zip(pages_a, pages_b):
            assert page(engine_b, pb) == page(engine_a, pa)
        assert b.stats()["invariant_violations"] == 0


def test_blocks_without_a_pool_copy_come_from_the_arena(daemon_factory: Any) -> None:
    """A pool of one slab fits few blocks: a reload takes what the pool holds from it
    and the rest from the arena, and the async client does the same."""
    block = BIG.block_bytes
    d = daemon_factory(extra=["--gpu-device", "cpu", "--gpu-capacity", "1MiB"])
    engine_a = cache(40, 5, BIG)
    with Client(d.endpoint, tenant="acme") as a:
        ns = a.namespace(BIG)
        keys = ns.keys(range(TOKENS * 40))
        assert ns.offload(engine_a, list(range(40)), keys) == 40
        stats = wait_for_copies(a, (1 << 20) // block)
        assert stats["tiers"]["gpu"]["blocks"] == (1 << 20) // block < 40

    async def reload() -> list[torch.Tensor]:
        async with AsyncClient(d.endpoint, tenant="acme") as c:
            assert await c.gpu_pool() is not None
            ns_b = await c.namespace(BIG)
            engine_b = cache(40, 9, BIG)
            assert await ns_b.reload(keys, engine_b, list(reversed(range(40)))) == 40
            return engine_b

    engine_b = asyncio.run(reload())
    for i in range(40):
        assert page(engine_b, 39 - i) == page(engine_a, i)
    with Client(d.endpoint, tenant="acme") as c:
        stats = c.stats()
        # copies into the pool (after commits, and those the reload asked for) are
        # background work (write-back class), never queued ahead of engines' reloads
        assert set(stats["transfers"]["waits"]) == {"writeback"}
        assert stats["invariant_violations"] == 0


def test_without_a_gpu_the_tier_is_off_and_everything_else_works(
        daemon_factory: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the tier would be on")
    d: DaemonProcess = daemon_factory(extra=["--gpu-device", "0"])
    assert "gpu tier off" in d.log()
    with Client(d.endpoint, tenant="acme") as c:
        assert c.gpu_pool() is None
        assert "CUDA" in c.gpu_reason or "cupy" in c.gpu_reason
        assert "off" in c.stats()["gpu"]
        ns = c.namespace(IDENT)
        engine_a = cache(4, 1)
        keys = ns.keys(range(TOKENS * 4))
        assert ns.offload(engine_a, [0, 1, 2, 3], keys) == 4
        with ns.acquire(keys) as held:
            assert held.gpu_offsets == []
        engine_b = cache(4, 2)
        ns.reload(keys, engine_b, [3, 2, 1, 0])
        assert page(engine_b, 0) == page(engine_a, 3)


def test_a_put_waits_for_the_gpu_copies_that_pin_dram_then_goes_in(tmp_path: Any) -> None:
    """Every DRAM block pinned by a copy into the GPU tier under way: a put waits for the
    copies to end, then takes their room (it was refused as if the pins were an engine's,
    "0 free and 0 evictable": seen under load, where the copies took a while)."""
    from pathlib import Path

    flag, reached = tmp_path / "hold", tmp_path / "reached"
    flag.touch()
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB", ssd_capacity="8MiB",
                      extra=["--slab-size", "1MiB", "--gpu-device", "cpu",
                             "--gpu-capacity", "4MiB"],
                      env={"GPU_HOLD_FLAG": str(flag), "GPU_HOLD_REACHED": str(reached)})
    d.run_through(Path(__file__).resolve().parents[1] / "slow_gpu_copies.py")
    d.start()
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(BIG)
            first = ns.keys(range(TOKENS * 16))  # 16 blocks of 64 KiB: all of DRAM
            ns.put(first, [bytes([i]) * BIG.block_bytes for i in range(16)])
            wait_for_file(reached, "the gpu copy was never held")
            dram = c.stats()["tiers"]["dram"]
            assert dram["pinned_blocks"] == 16, dram  # every block read by the held copy
            with removed_after(flag):
                start = time.monotonic()
                more = ns.keys(range(100_000, 100_000 + TOKENS * 6))
                ns.put(more, [bytes([50 + i]) * BIG.block_bytes for i in range(6)])
                waited = time.monotonic() - start
            assert waited >= 0.5, waited  # it went in once the copies let go, not before
            assert ns.lookup(more).blocks == 6
            deadline = time.monotonic() + 10  # the new blocks' own copies end too
            while c.stats()["tiers"]["dram"]["pinned_blocks"]:
                assert time.monotonic() < deadline, c.stats()["tiers"]["dram"]
                time.sleep(0.02)
    finally:
        d.stop()


def test_a_put_short_of_more_than_the_gpu_copies_will_free_is_refused_at_once(
        tmp_path: Any) -> None:
    """12 of 16 DRAM blocks pinned by an engine, the other 4 by their copies into the GPU
    tier: a put of 6 can never fit when those copies end, so it is refused at once.
    Before, any copy under way counted as room coming: the put waited for room that was
    not enough, 30 s, past its client's timeout (with copies or sends under way after
    every commit, any such request did)."""
    from pathlib import Path

    from kvstore.errors import CapacityError

    flag, reached = tmp_path / "hold", tmp_path / "reached"
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB", ssd_capacity="8MiB",
                      extra=["--slab-size", "1MiB", "--gpu-device", "cpu",
                             "--gpu-capacity", "4MiB"],
                      env={"GPU_HOLD_FLAG": str(flag), "GPU_HOLD_REACHED": str(reached),
                           "KVSTORE_DRAM_PRESSURE": "evict,demote,reject"})
    d.run_through(Path(__file__).resolve().parents[1] / "slow_gpu_copies.py").start()
    try:
        with Client(d.endpoint, tenant="acme", timeout=10) as c, \
                Client(d.endpoint, tenant="acme") as engine:
            ns = c.namespace(BIG)
            pinned = ns.keys(range(TOKENS * 12))
            ns.put(pinned, [bytes([i]) * BIG.block_bytes for i in range(12)])
            wait_for_copies(c, 12)
            held = engine.namespace(BIG).acquire(pinned)
            flag.touch()
            ns.put(ns.keys(range(50_000, 50_000 + TOKENS * 4)),
                   [bytes([20 + i]) * BIG.block_bytes for i in range(4)])
            wait_for_file(reached, "the gpu copy was never held")
            assert c.stats()["tiers"]["dram"]["pinned_blocks"] == 16
            start = time.monotonic()
            with pytest.raises(CapacityError):
                ns.put(ns.keys(range(100_000, 100_000 + TOKENS * 6)),
                       [bytes([50 + i]) * BIG.block_bytes for i in range(6)])
            assert time.monotonic() - start < 5  # at once, not after 30 s of waiting
            flag.unlink()
            held.release()
    finally:
        flag.unlink(missing_ok=True)
        d.stop()
