"""gather/scatter on the torch path, against a reference written block by block."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore.kernels import (
    KVCaches,
    Layout,
    LayoutInfo,
    describe_layout,
    gather,
    paged_cache,
    scatter,
)

from kvstore.errors import MalformedError, UnavailableError

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn]
LAYOUTS: list[Layout] = ["per_layer", "per_layer_kv_split", "all_layer"]


@dataclass
class Shape:
    pages: int
    layers: int
    tokens: int
    heads: int
    dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.tokens * self.heads * self.dim * self.dtype.itemsize


def random_bytes(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """Random bit patterns (NaNs included) of ``dtype``: the copy must not care."""
    *outer, last = shape
    raw = torch.randint(
        0, 256, (*outer, last * dtype.itemsize), dtype=torch.uint8, generator=generator
    )
    return raw.view(dtype)


def make_cache(layout: Layout, s: Shape, seed: int, variant: int = 0) -> KVCaches:
    """A cache in ``layout``; ``variant`` 1 lays pages out with gaps or K/V outermost."""
    g = torch.Generator().manual_seed(seed)
    page = (s.tokens, s.heads, s.dim)
    if layout == "per_layer":
        if variant:  # a gap after each page's K and V
            return [random_bytes((s.pages, 3, *page), s.dtype, g)[:, :2] for _ in range(s.layers)]
        return [random_bytes((s.pages, 2, *page), s.dtype, g) for _ in range(s.layers)]
    if layout == "per_layer_kv_split":
        if variant:  # vLLM's flash-attention layout: [2, pages, T, H, D] per layer
            return [random_bytes((2, s.pages, *page), s.dtype, g) for _ in range(s.layers)]
        return [
            (random_bytes((s.pages, *page), s.dtype, g), random_bytes((s.pages, *page), s.dtype, g))
            for _ in range(s.layers)
        ]
    if variant:  # layers not adjacent: one segment per layer
        return random_bytes((s.pages, s.layers, 3, *page), s.dtype, g)[:, :, :2]
    return random_bytes((s.pages, s.layers, 2, *page), s.dtype, g)


def reference_block(cache: Any, layout: Layout, s: Shape, page: int) -> bytes:
    """The slot bytes of ``page``, filled one layer and one of K/V at a time."""
    block = torch.empty((s.layers, 2, s.tokens, s.heads, s.dim), dtype=s.dtype)
    for layer in range(s.layers):
        for kv in range(2):
            if layout == "per_layer":
                block[layer, kv] = cache[layer][page, kv]
            elif layout == "per_layer_kv_split":
                block[layer, kv] = cache[layer][kv][page]
            else:
                block[layer, kv] = cache[page, layer, kv]
    return block.view(torch.uint8).numpy().tobytes()


def reference_scatter(
    slots: list[bytes], cache: Any, layout: Layout, s: Shape, ids: list[int]
) -> None:
    for slot, page in zip(slots, ids):
        block = torch.frombuffer(bytearray(slot), dtype=torch.uint8).view(s.dtype)
        block = block.view(s.layers, 2, s.tokens, s.heads, s.dim)
        for layer in range(s.layers):
            for kv in range(2):
                if layout == "per_layer":
                    cache[layer][page, kv] = block[layer, kv]
                elif layout == "per_layer_kv_split":
                    cache[layer][kv][page] = block[layer, kv]
                else:
                    cache[page, layer, kv] = block[layer, kv]


def cache_bytes(cache: KVCaches) -> list[bytes]:
    if isinstance(cache, torch.Tensor):
        tensors = [cache]
    else:
        tensors = [
            t for item in cache for t in ([item] if isinstance(item, torch.Tensor) else item)
        ]
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def fresh_like(cache: KVCaches, fill: int = 0xA5) -> KVCaches:
    """A poisoned copy with the same strides, so untouched pages show."""

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        out.view(torch.uint8).fill_(fill)
        return out

    if isinstance(cache, torch.Tensor):
        return poisoned(cache)
    return [
        poisoned(item) if isinstance(item, torch.Tensor) else tuple(poisoned(t) for t in item)
        for item in cache
    ]


shapes = st.builds(
    Shape,
    pages=st.integers(1, 9),
    layers=st.integers(1, 3),
    tokens=st.integers(1, 4),
    heads=st.integers(1, 3),
    dim=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
)


@settings(max_examples=80, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    shape=shapes,
    variant=st.integers(0, 1),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_gather_matches_reference(
    layout: Layout, shape: Shape, variant: int, seed: int, data: st.DataObject
) -> None:
    cache = make_cache(layout, shape, seed, variant)
    ids = data.draw(st.lists(st.integers(0, shape.pages - 1), max_size=12), label="ids")
    slots = torch.full((len(ids), shape.block_bytes), 0x5A, dtype=torch.uint8)
    gather(cache, ids, slots, layout=layout)
    for row, page in enumerate(ids):
        assert slots[row].numpy().tobytes() == reference_block(cache, layout, shape, page)


@settings(max_examples=80, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    shape=shapes,
    variant=st.integers(0, 1),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_scatter_matches_reference(
    layout: Layout, shape: Shape, variant: int, seed: int, data: st.DataObject
) -> None:
    source = make_cache(layout, shape, seed, variant)
    ids = data.draw(st.lists(st.integers(0, shape.pages - 1), max_size=12), label="ids")
    g = torch.Generator().manual_seed(seed + 1)
    slots = [
        bytes(torch.randint(0, 256, (shape.block_bytes,), dtype=torch.uint8, generator=g).numpy())
        for _ in ids
    ]
    ours, theirs = fresh_like(source), fresh_like(source)
    scatter([bytearray(slot) for slot in slots], ours, ids, layout=layout)
    reference_scatter(slots, theirs, layout, shape, ids)
    assert cache_bytes(ours) == cache_bytes(theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", [0, 1])
def test_round_trip_is_bit_exact(layout: Layout, dtype: torch.dtype, variant: int) -> None:
    shape = Shape(pages=7, layers=3, tokens=5, heads=2, dim=6, dtype=dtype)
    source = make_cache(layout, shape, seed=11, variant=variant)
    ids = [6, 0, 3, 5, 1]  # odd count, out of order
    slots = torch.empty((len(ids), shape.block_bytes), dtype=torch.uint8)
    gather(source, ids, slots, layout=layout)
    target = fresh_like(source)
    scatter(slots, target, ids, layout=layout)
    untouched = fresh_like(source)
    for page in range(shape.pages):
        want = reference_block(source if page in ids else untouched, layout, shape, page)
        assert reference_block(target, layout, shape, page) == want, page


def test_repeated_ids() -> None:
    shape = Shape(pages=4, layers=2, tokens=2, heads=1, dim=4, dtype=torch.float16)
    cache = make_cache("per_layer", shape, seed=3)
    slots = torch.zeros((3, shape.block_bytes), dtype=torch.uint8)
    gather(cache, [2, 2, 1], slots, layout="per_layer")
    assert torch.equal(slots[0], slots[1])
    # scatter: the last slot given for a page wins
    blocks = [bytes([value]) * shape.block_bytes for value in (1, 2, 3, 4)]
    target = fresh_like(cache)
    scatter(blocks, target, [0, 3, 0, 3], layout="per_layer", backend="torch")
    assert reference_block(target, "per_layer", shape, 0) == blocks[2]
    assert reference_block(target, "per_layer", shape, 3) == blocks[3]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_batch_is_a_no_op(layout: Layout) -> None:
    shape = Shape(pages=3, layers=2, tokens=2, heads=2, dim=4, dtype=torch.bfloat16)
    cache = make_cache(layout, shape, seed=5)
    before = cache_bytes(cache)
    gather(cache, [], torch.empty((0, shape.block_bytes), dtype=torch.uint8), layout=layout)
    gather(cache, np.array([], dtype=np.int64), [], layout=layout)
    scatter([], cache, torch.tensor([], dtype=torch.int64), layout=layout)
    assert cache_bytes(cache) == before


@pytest.mark.parametrize(
    "page_ids", [[4, 1, 4], np.array([4, 1, 4], dtype=np.int32), torch.tensor([4, 1, 4]), (4, 1, 4)]
)
def test_page_id_forms(page_ids: Any) -> None:
    shape = Shape(pages=5, layers=1, tokens=1, heads=1, dim=8, dtype=torch.float32)
    cache = make_cache("all_layer", shape, seed=9)
    slots = torch.empty((3, shape.block_bytes), dtype=torch.uint8)
    gather(cache, page_ids, slots, layout="all_layer")
    assert slots[0].numpy().tobytes() == reference_block(cache, "all_layer", shape, 4)


def test_slots_as_memoryviews_over_bytearray_and_mmap() -> None:
    shape = Shape(pages=6, layers=2, tokens=3, heads=2, dim=4, dtype=torch.float16)
    cache = make_cache("per_layer_kv_split", shape, seed=21)
    ids = [5, 0, 2]
    bb = shape.block_bytes
    arena = bytearray(len(ids) * bb + 3)
    views = [memoryview(arena)[3 + i * bb : 3 + (i + 1) * bb] for i in range(len(ids))]  # unaligned
    gather(cache, ids, views, layout="per_layer_kv_split")
    for i, page in enumerate(ids):
        assert bytes(views[i]) == reference_block(cache, "per_layer_kv_split", shape, page)

    region = mmap.mmap(-1, len(ids) * bb)
    try:
        whole = memoryview(region)
        mapped = [whole[i * bb : (i + 1) * bb] for i in range(len(ids))]
        gather(cache, ids, mapped, layout="per_layer_kv_split")
        assert [bytes(v) for v in mapped] == [bytes(v) for v in views]
        target = fresh_like(cache)
        scatter(mapped, target, ids, layout="per_layer_kv_split")
        for page in ids:
            assert reference_block(target, "per_layer_kv_split", shape, page) == reference_block(
                cache, "per_layer_kv_split", shape, page
            )
        for view in mapped:
            view.release()
        whole.release()
    finally:
        region.close()


def test_slots_as_tensor_list_and_numpy_arrays() -> None:
    shape = Shape(pages=4, layers=2, tokens=2, heads=1, dim=8, dtype=torch.int8)
    cache = make_cache("per_layer", shape, seed=4)
    rows = [torch.empty(shape.block_bytes, dtype=torch.uint8) for _ in range(2)]
    arrays = [np.empty(shape.block_bytes, dtype=np.uint8) for _ in range(2)]
    gather(cache, [3, 1], rows, layout="per_layer")
    gather(cache, [3, 1], arrays, layout="per_layer")
    assert [r.numpy().tobytes() for r in rows] == [a.tobytes() for a in arrays]
    assert arrays[1].tobytes() == reference_block(cache, "per_layer", shape, 1)


def test_slot_table_with_strided_rows() -> None:
    shape = Shape(pages=4, layers=2, tokens=2, heads=2, dim=4, dtype=torch.float32)
    cache = make_cache("per_layer", shape, seed=8)
    wide = torch.zeros((3, shape.block_bytes + 16), dtype=torch.uint8)
    table = wide[:, 8 : 8 + shape.block_bytes]
    gather(cache, [0, 3, 2], table, layout="per_layer")
    assert table[1].numpy().tobytes() == reference_block(cache, "per_layer", shape, 3)
    assert int(wide[:, :8].sum()) == 0 and int(wide[:, 8 + shape.block_bytes :].sum()) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_describe_layout(layout: Layout) -> None:
    shape = Shape(pages=3, layers=4, tokens=16, heads=2, dim=64, dtype=torch.bfloat16)
    info = describe_layout(make_cache(layout, shape, seed=1), layout)
    assert info == LayoutInfo(4, 16, 2, 64, torch.bfloat16, 2 * 4 * 16 * 2 * 64 * 2)
    layers, tokens, heads, dim, dtype, block_bytes = info
    assert (layers, tokens, heads, dim, dtype) == (4, 16, 2, 64, torch.bfloat16)
    assert block_bytes == shape.block_bytes


def test_prepared_cache_is_reused() -> None:
    shape = Shape(pages=5, layers=2, tokens=3, heads=2, dim=4, dtype=torch.float16)
    cache = make_cache("per_layer_kv_split", shape, seed=12, variant=1)
    prepared = paged_cache(cache, "per_layer_kv_split")
    assert "segments=4x" in repr(prepared)
    assert describe_layout(prepared, "per_layer_kv_split") == describe_layout(
        cache, "per_layer_kv_split"
    )
    ours = torch.empty((2, shape.block_bytes), dtype=torch.uint8)
    theirs = torch.empty_like(ours)
    gather(prepared, [4, 1], ours, layout="per_layer_kv_split")
    gather(cache, [4, 1], theirs, layout="per_layer_kv_split")
    assert torch.equal(ours, theirs)
    target = fresh_like(cache)
    scatter(ours, paged_cache(target, "per_layer_kv_split"), [4, 1], layout="per_layer_kv_split")
    assert reference_block(target, "per_layer_kv_split", shape, 4) == ours[0].numpy().tobytes()
    with pytest.raises(MalformedError, match="prepared cache is per_layer_kv_split, not per_layer"):
        gather(prepared, [0], ours[:1], layout="per_layer")


def test_kernel_backend_unavailable_on_cpu() -> None:
    shape = Shape(pages=2, layers=1, tokens=1, heads=1, dim=4, dtype=torch.float16)
    cache = make_cache("per_layer", shape, seed=0)
    with pytest.raises(UnavailableError, match="not a CUDA device"):
        gather(
            cache,
            [0],
            torch.empty((1, shape.block_bytes), dtype=torch.uint8),
            layout="per_layer",
            backend="kernel",
        )


# --- malformed input: a typed error, and nothing copied ---------------------------------

GOOD = Shape(pages=4, layers=2, tokens=2, heads=2, dim=4, dtype=torch.float16)
BB = GOOD.block_bytes


def per_layer() -> list[torch.Tensor]:
    return cast(list[torch.Tensor], make_cache("per_layer", GOOD, seed=2))


@pytest.mark.parametrize(
    ("caches", "layout", "message"),
    [
        (lambda: per_layer(), "paged", "unknown KV layout"),
        (list, "per_layer", "at least one"),
        (lambda: per_layer()[0], "per_layer", "not one tensor"),
        (lambda: [per_layer()[0], "x"], "per_layer", "not a tensor"),
        (lambda: [t[0] for t in per_layer()], "per_layer", "must have 5 dims"),
        (lambda: [torch.zeros(4, 3, 2, 2, 4)], "per_layer", "dim 1 = 3"),
        (lambda: [per_layer()[0], per_layer()[1][:3]], "per_layer", "has shape"),
        (lambda: [per_layer()[0], per_layer()[1].float()], "per_layer", "dtype"),
        (
            lambda: [
                per_layer()[0],
                torch.empty(4, 2, 2, 2, 4, dtype=torch.float16, device="meta"),
            ],
            "per_layer",
            "is on",
        ),
        (lambda: [t.transpose(3, 4) for t in per_layer()], "per_layer", "contiguous"),
        (lambda: [torch.zeros(4, 2, 0, 2, 4)], "per_layer", "empty dimension"),
        (lambda: [(torch.zeros(4, 2, 2, 4),)], "per_layer_kv_split", "expected \\(K, V\\)"),
        (
            lambda: [(torch.zeros(4, 2, 2, 4), torch.zeros(4, 2, 2, 5))],
            "per_layer_kv_split",
            "has shape",
        ),
        (lambda: [(torch.zeros(4, 2, 2, 4), "v")], "per_layer_kv_split", "must be tensors"),
        (lambda: torch.zeros(4, 2, 2, 2, 4), "per_layer_kv_split", "sequence of \\(K, V\\)"),
        (lambda: [torch.zeros(4, 1, 2, 2, 2, 4)] * 2, "all_layer", "one tensor"),
        (lambda: torch.zeros(4, 1, 2, 2, 4), "all_layer", "6 dims"),
    ],
)
def test_malformed_caches(caches: Callable[[], Any], layout: Any, message: str) -> None:
    with pytest.raises(MalformedError, match=message):
        describe_layout(caches(), layout)


@pytest.mark.parametrize(
    ("page_ids", "message"),
    [
        ([0, 4], "page id 4 \\(position 1\\) is out of range"),
        ([-1], "page id -1"),
        ([1.5], "integers"),
        (["1"], "integers"),
        (np.array([0.0]), "integer array"),
        (torch.tensor([[0]]), "1-D integer tensor"),
        (torch.tensor([0.5]), "1-D integer tensor"),
        (torch.tensor([True]), "1-D integer tensor"),
    ],
)
def test_malformed_page_ids(page_ids: Any, message: str) -> None:
    cache = per_layer()
    n = len(page_ids)
    with pytest.raises(MalformedError, match=message):
        gather(cache, page_ids, torch.empty((n, BB), dtype=torch.uint8), layout="per_layer")


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        (lambda: torch.empty((2, BB + 1), dtype=torch.uint8), f"need \\(2, {BB}\\)"),
        (lambda: torch.empty((3, BB), dtype=torch.uint8), f"need \\(2, {BB}\\)"),
        (lambda: torch.empty((2, BB // 2), dtype=torch.int16), "2-D uint8"),
        (lambda: torch.empty((BB, 2), dtype=torch.uint8).t(), "contiguous"),
        (lambda: torch.empty((2, BB), dtype=torch.uint8, device="meta"), "slots are on meta"),
        (lambda: [bytearray(BB)], "1 slot buffers given for 2"),
        (lambda: [bytearray(BB), bytearray(BB - 1)], f"slot 1 holds {BB - 1} bytes"),
        (lambda: [bytearray(BB), bytes(BB)], "slot 1 is read-only"),
        (lambda: [bytearray(BB), 7], "slot 1 \\(int\\) is not a buffer"),
        (lambda: [bytearray(BB), torch.empty(BB, dtype=torch.int8)], "1-D uint8"),
        (lambda: [torch.empty(BB * 2, dtype=torch.uint8)[::2]] * 2, "contiguous"),
        (lambda: bytearray(2 * BB), "sequence of buffers"),
        (lambda: [memoryview(bytearray(2 * BB))[::2]] * 2, "not a contiguous buffer"),
    ],
)
def test_malformed_slots(slots: Callable[[], Any], message: str) -> None:
    cache = per_layer()
    with pytest.raises(MalformedError, match=message):
        gather(cache, [0, 1], slots(), layout="per_layer")


def test_failed_scatter_changes_nothing() -> None:
    cache = per_layer()
    before = cache_bytes(cache)
    slots = [bytes([1]) * BB, bytes([2]) * (BB - 2)]
    with pytest.raises(MalformedError):
        scatter(slots, cache, [0, 1], layout="per_layer")
    with pytest.raises(MalformedError):
        scatter(slots[:1], cache, [4], layout="per_layer")
    assert cache_bytes(cache) == before


def test_scatter_accepts_read_only_sources() -> None:
    cache = per_layer()
    block = bytes(i % 251 for i in range(BB))
    scatter([block, memoryview(block)], cache, [1, 2], layout="per_layer")
    assert reference_block(cache, "per_layer", GOOD, 2) == block


def test_malformed_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        describe_layout([], "per_layer")
