"""An engine's paged cache offloaded to the daemon and reloaded into another, bit-exact."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore.errors import MalformedError, NotFoundError

LAYERS, TOKENS, HEADS, DIM = 3, 16, 2, 8


def make_cache(layout: str, pages: int, dtype: torch.dtype, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        return raw.view(dtype) if dtype.itemsize == 1 else \
            torch.randn(*shape, generator=g).to(dtype)

    if layout == "per_layer":
        return [rand(pages, 2, TOKENS, HEADS, DIM) for _ in range(LAYERS)]
    if layout == "per_layer_kv_split":
        return [(rand(pages, TOKENS, HEADS, DIM), rand(pages, TOKENS, HEADS, DIM))
                for _ in range(LAYERS)]
    return [rand(pages, LAYERS, 2, TOKENS, HEADS, DIM)]


def page_bytes(cache: list[Any], layout: str, page: int) -> bytes:
    if layout == "per_layer":
        parts = [t[page] for t in cache]
    elif layout == "per_layer_kv_split":
        parts = [torch.stack([k[page], v[page]]) for k, v in cache]
    else:
        parts = [cache[0][page]]
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


@pytest.mark.parametrize("layout", ["per_layer", "per_layer_kv_split", "all_layer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
def test_offload_then_reload_is_bit_exact(module_daemon: DaemonProcess, layout: str,
                                          dtype: torch.dtype) -> None:
    """(Each case's identity, its layout's and dtype's, is a namespace of its own.)"""
    daemon = module_daemon
    dtype_name = {torch.float16: "float16", torch.bfloat16: "bfloat16",
                  torch.float32: "float32", torch.int8: "int8"}[dtype]
    ident = make_identity(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                          block_tokens=TOKENS, kv_dtype=dtype_name, layout=layout)
    with Client(daemon.endpoint, tenant="acme") as a, Client(daemon.endpoint, tenant="acme") as b:
        ns_a, ns_b = a.namespace(ident), b.namespace(ident)
        engine_a = make_cache(layout, 9, dtype, seed=1)
        keys = ns_a.keys(range(TOKENS * 5))
        pages_a = [7, 2, 5, 0, 3]
        assert ns_a.offload(engine_a, pages_a, keys, layout=layout) == 5
        assert ns_a.offload(engine_a, pages_a, keys, layout=layout) == 0   # all cached
        engine_b = make_cache(layout, 6, dtype, seed=2)
        pages_b = [1, 4, 0, 5, 2]
        assert ns_b.reload(ns_b.keys(range(TOKENS * 5)), engine_b, pages_b,
                           layout=layout) == 5
        for pa, pb in zip(pages_a, pages_b):
            assert page_bytes(engine_b, layout, pb) == page_bytes(engine_a, layout, pa)
        assert ns_b.get(keys[:1])[0] == page_bytes(engine_a, layout, pages_a[0])


def test_reload_of_a_missing_key_writes_nothing(daemon: DaemonProcess) -> None:
    ident = make_identity(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        engine = make_cache("per_layer", 4, torch.float16, seed=3)
        keys = ns.keys(range(TOKENS * 3))
        ns.offload(engine, [0, 1], keys[:2])
        target = make_cache("per_layer", 4, torch.float16, seed=4)
        before = [t.clone() for t in target]
        with pytest.raises(NotFoundError):
            ns.reload(keys, target, [0, 1, 2])
        assert all(torch.equal(x, y) for x, y in zip(before, target))
        with pytest.raises(MalformedError):
            ns.offload(engine, [0], keys[:2])                     # ids and keys disagree
        wrong = make_cache("per_layer", 4, torch.float32, seed=5)  # wrong KV format
        with pytest.raises(MalformedError):
            ns.offload(wrong, [0], keys[2:3])
        assert client.stats()["tiers"]["dram"]["reserved_slots"] == 0


def test_async_offload_reload(daemon: DaemonProcess) -> None:
    ident = make_identity(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, tenant="acme") as client:
            ns = await client.namespace(ident)
            engine = make_cache("per_layer", 4, torch.float16, seed=6)
            keys = ns.keys(range(TOKENS * 4))
            assert await ns.offload(engine, [3, 2, 1, 0], keys) == 4
            target = make_cache("per_layer", 4, torch.float16, seed=7)
            assert await ns.reload(keys, target, [0, 1, 2, 3]) == 4
            for i in range(4):
                assert page_bytes(target, "per_layer", i) == page_bytes(engine, "per_layer",
                                                                       3 - i)

    asyncio.run(main())
