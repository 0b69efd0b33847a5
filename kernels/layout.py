"""Paged KV-cache layouts, slot buffers and page ids: validation and byte views.

Everything here is checked before any byte moves, and every problem is a
:class:`~kvstore.errors.MalformedError` that names what is wrong.  The copy code then sees
only :class:`PagedCache` (uint8 views of the engine's pages) and :class:`SlotBuffers`.

A slot always holds one block as ``[layers, 2, block_tokens, kv_heads, head_dim]`` in the
cache dtype.  An engine cache is cut into *segments*: runs of bytes that are contiguous in
both the page and the slot (one layer's K and V, one layer's K or V, or a whole page), so
a copy is a few wide row copies per block whatever the layout.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeAlias, cast

import numpy as np
import numpy.typing as npt
import torch

from kvstore.errors import MalformedError

Layout: TypeAlias = Literal["per_layer", "per_layer_kv_split", "all_layer"]
LAYOUTS: tuple[Layout, ...] = ("per_layer", "per_layer_kv_split", "all_layer")

KVCaches: TypeAlias = torch.Tensor | Sequence[torch.Tensor | Sequence[torch.Tensor]]
"""``per_layer``: L tensors ``[pages, 2, T, H, D]``.  ``per_layer_kv_split``: L pairs
``(K, V)`` of ``[pages, T, H, D]`` (a ``[2, pages, T, H, D]`` tensor per layer also unpacks
as a pair).  ``all_layer``: one tensor ``[pages, L, 2, T, H, D]``."""

SlotBuffer: TypeAlias = torch.Tensor | memoryview | bytearray | bytes | np.ndarray
Slots: TypeAlias = torch.Tensor | Sequence[SlotBuffer]
"""One uint8 tensor ``[n_blocks, block_bytes]``, or one buffer of ``block_bytes`` per block."""

PageIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer] | torch.Tensor


class LayoutInfo(NamedTuple):
    """The shape of one block, as every layout agrees on it."""

    layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_bytes: int


@dataclass(frozen=True, eq=False)
class PagedCache:
    """An engine cache seen as bytes: one ``[num_pages, segment_bytes]`` uint8 view per
    segment, in slot order; the segments of a page, end to end, are its block.

    Build it once with :func:`paged_cache` and pass it to ``gather``/``scatter`` in place
    of the tensors to skip validating them on every call.
    """

    layout: Layout
    info: LayoutInfo
    num_pages: int
    device: torch.device
    segments: tuple[torch.Tensor, ...]
    segment_bytes: int

    def __repr__(self) -> str:
        return (
            f"PagedCache(pages={self.num_pages}, segments={len(self.segments)}x"
            f"{self.segment_bytes}B, block_bytes={self.info.block_bytes}, device={self.device})"
        )


@dataclass(frozen=True, eq=False)
class SlotBuffers:
    """Slot memory for a batch: ``table`` when given as one 2-D tensor ``[n, block_bytes]``,
    else ``rows``, one 1-D uint8 tensor per block."""

    table: torch.Tensor | None
    rows: tuple[torch.Tensor, ...]
    device: torch.device

    def __len__(self) -> int:
        return self.table.shape[0] if self.table is not None else len(self.rows)

    def addresses(self) -> list[int]:
        """The address of each block's slot, in batch order."""
        if self.table is None:
            return [row.data_ptr() for row in self.rows]
        base, stride = self.table.data_ptr(), self.table.stride(0)
        return [base + index * stride for index in range(self.table.shape[0])]

    def __repr__(self) -> str:
        kind = "table" if self.table is not None else "rows"
        return f"SlotBuffers({kind}, n={len(self)}, device={self.device})"


def describe_layout(kv_caches: KVCaches | PagedCache, layout: Layout) -> LayoutInfo:
    """Return ``(layers, block_tokens, kv_heads, head_dim, dtype, block_bytes)`` of a cache.

    Raises :class:`MalformedError` when the tensors disagree in shape, dtype or device, or
    when a page is not laid out as the layout says.
    """
    return paged_cache(kv_caches, layout).info


def paged_cache(kv_caches: KVCaches | PagedCache, layout: Layout) -> PagedCache:
    """Validate ``kv_caches`` against ``layout`` and return its byte views.

    The views alias the engine's tensors, so one ``PagedCache`` stays valid for as long as
    those tensors live.
    """
    if isinstance(kv_caches, PagedCache):
        if kv_caches.layout != layout:
            raise MalformedError(f"the prepared cache is {kv_caches.layout}, not {layout}")
        return kv_caches
    if layout == "per_layer":
        return _per_layer(kv_caches)
    if layout == "per_layer_kv_split":
        return _per_layer_kv_split(kv_caches)
    if layout == "all_layer":
        return _all_layer(kv_caches)
    raise MalformedError(f"unknown KV layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def _per_layer(kv_caches: KVCaches) -> PagedCache:
    tensors = _tensor_list(kv_caches, "per_layer")
    _check_uniform(tensors, ndim=5, what="per_layer cache")
    pages, two, tokens, heads, dim = tensors[0].shape
    if two != 2:
        raise MalformedError(f"per_layer tensors must be [pages, 2, T, H, D]; got dim 1 = {two}")
    info = _info(len(tensors), tokens, heads, dim, tensors[0].dtype)
    segments = tuple(_page_bytes(t, "per_layer cache") for t in tensors)
    return PagedCache(
        "per_layer", info, pages, tensors[0].device, segments, info.block_bytes // len(tensors)
    )


def _per_layer_kv_split(kv_caches: KVCaches) -> PagedCache:
    if isinstance(kv_caches, torch.Tensor) or len(kv_caches) == 0:
        raise MalformedError("per_layer_kv_split needs a non-empty sequence of (K, V) pairs")
    tensors: list[torch.Tensor] = []
    for layer, pair in enumerate(kv_caches):
        if not isinstance(pair, (torch.Tensor, Sequence)) or len(pair) != 2:
            raise MalformedError(
                f"per_layer_kv_split layer {layer}: expected (K, V), got {pair!r:.60}"
            )
        for part in pair:
            if not isinstance(part, torch.Tensor):
                raise MalformedError(f"per_layer_kv_split layer {layer}: K and V must be tensors")
            tensors.append(part)
    _check_uniform(tensors, ndim=4, what="per_layer_kv_split K/V")
    pages, tokens, heads, dim = tensors[0].shape
    info = _info(len(tensors) // 2, tokens, heads, dim, tensors[0].dtype)
    segments = tuple(_page_bytes(t, "per_layer_kv_split K/V") for t in tensors)
    return PagedCache(
        "per_layer_kv_split",
        info,
        pages,
        tensors[0].device,
        segments,
        info.block_bytes // len(tensors),
    )


def _all_layer(kv_caches: KVCaches) -> PagedCache:
    if not isinstance(kv_caches, torch.Tensor):
        tensors = _tensor_list(kv_caches, "all_layer")
        if len(tensors) != 1:
            raise MalformedError(f"all_layer takes one tensor, got {len(tensors)}")
        kv_caches = tensors[0]
    _check_uniform([kv_caches], ndim=6, what="all_layer cache")
    pages, layers, two, tokens, heads, dim = kv_caches.shape
    if two != 2:
        raise MalformedError(f"all_layer tensor must be [pages, L, 2, T, H, D]; got dim 2 = {two}")
    info = _info(layers, tokens, heads, dim, kv_caches.dtype)
    if _dims_contiguous(kv_caches, 1):
        # The usual case: a page is one contiguous block, so one segment covers it.
        return PagedCache(
            "all_layer",
            info,
            pages,
            kv_caches.device,
            (_page_bytes(kv_caches, "all_layer cache"),),
            info.block_bytes,
        )
    segments = tuple(_page_bytes(kv_caches[:, layer], "all_layer cache") for layer in range(layers))
    return PagedCache(
        "all_layer", info, pages, kv_caches.device, segments, info.block_bytes // layers
    )


def _tensor_list(kv_caches: KVCaches, layout: str) -> list[torch.Tensor]:
    if isinstance(kv_caches, torch.Tensor):
        raise MalformedError(f"{layout} takes a sequence of per-layer tensors, not one tensor")
    if len(kv_caches) == 0:
        raise MalformedError(f"{layout} needs at least one layer tensor")
    tensors = list(kv_caches)
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise MalformedError(
                f"{layout} item {index} is a {type(tensor).__name__}, not a tensor"
            )
    return cast(list[torch.Tensor], tensors)


def _check_uniform(tensors: Sequence[torch.Tensor], ndim: int, what: str) -> None:
    first = tensors[0]
    if first.dim() != ndim:
        raise MalformedError(f"{what} must have {ndim} dims, got shape {tuple(first.shape)}")
    if any(size == 0 for size in first.shape[1:]):
        raise MalformedError(f"{what} has an empty dimension: shape {tuple(first.shape)}")
    for index, tensor in enumerate(tensors[1:], start=1):
        if tensor.shape != first.shape:
            raise MalformedError(
                f"{what} {index} has shape {tuple(tensor.shape)}, tensor 0 has {tuple(first.shape)}"
            )
        if tensor.dtype != first.dtype:
            raise MalformedError(
                f"{what} {index} has dtype {tensor.dtype}, tensor 0 has {first.dtype}"
            )
        if tensor.device != first.device:
            raise MalformedError(
                f"{what} {index} is on {tensor.device}, tensor 0 on {first.device}"
            )


def _info(layers: int, tokens: int, heads: int, dim: int, dtype: torch.dtype) -> LayoutInfo:
    block_bytes = 2 * layers * tokens * heads * dim * dtype.itemsize
    return LayoutInfo(layers, tokens, heads, dim, dtype, block_bytes)


def _dims_contiguous(tensor: torch.Tensor, start: int) -> bool:
    """Whether dims ``start:`` of ``tensor`` are laid out row-major with no gaps."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[start:]), reversed(tensor.stride()[start:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _page_bytes(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``[pages, ...]`` tensor -> ``[pages, bytes per page]`` uint8 view of the same memory."""
    if not _dims_contiguous(tensor, 1):
        raise MalformedError(
            f"{what}: each page must be contiguous (strides {tensor.stride()} for shape "
            f"{tuple(tensor.shape)}); only the page dimension may be strided"
        )
    itemsize = tensor.element_size()
    raw = tensor.detach()
    if raw.stride(-1) != 1:
        # A last dim of size 1 may carry any stride; view(uint8) wants 1, and it is free.
        raw = raw.as_strided(raw.shape, (*raw.stride()[:-1], 1))
    width = math.prod(tensor.shape[1:]) * itemsize
    return raw.view(torch.uint8).as_strided(
        (tensor.shape[0], width), (tensor.stride(0) * itemsize, 1)
    )


def page_id_array(page_ids: PageIds, num_pages: int) -> npt.NDArray[np.int64]:
    """Page ids as a 1-D int64 host array, every one checked to lie in ``[0, num_pages)``."""
    if isinstance(page_ids, torch.Tensor):
        if page_ids.dim() != 1 or page_ids.dtype == torch.bool or not _is_integer(page_ids.dtype):
            raise MalformedError(
                f"page ids must be a 1-D integer tensor, got {page_ids.dtype} shape {tuple(page_ids.shape)}"
            )
        ids = page_ids.detach().to("cpu", torch.int64).numpy()
    elif isinstance(page_ids, np.ndarray):
        if page_ids.ndim != 1 or page_ids.dtype.kind not in "iu":
            raise MalformedError(
                f"page ids must be a 1-D integer array, got {page_ids.dtype} {page_ids.shape}"
            )
        ids = page_ids.astype(np.int64, copy=False)
    else:
        try:
            ids = np.fromiter(map(operator.index, page_ids), dtype=np.int64, count=len(page_ids))
        except (TypeError, OverflowError) as exc:
            raise MalformedError(f"page ids must be integers: {exc}") from None
    if ids.size:
        bad = np.flatnonzero((ids < 0) | (ids >= num_pages))
        if bad.size:
            raise MalformedError(
                f"page id {int(ids[bad[0]])} (position {int(bad[0])}) is out of range: "
                f"the cache has {num_pages} pages"
            )
    return ids


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def slot_buffers(slots: Slots, n_blocks: int, cache: PagedCache, *, writable: bool) -> SlotBuffers:
    """Validate the slot memory for ``n_blocks`` blocks of ``cache`` and view it as uint8.

    Slots live in host memory or on the cache's own device.  ``writable`` slots (gather's
    destination) may not be read-only buffers.
    """
    block_bytes = cache.info.block_bytes
    if isinstance(slots, torch.Tensor):
        if slots.dtype != torch.uint8 or slots.dim() != 2:
            raise MalformedError(
                f"a slot table must be a 2-D uint8 tensor, got {slots.dtype} shape {tuple(slots.shape)}"
            )
        if tuple(slots.shape) != (n_blocks, block_bytes):
            raise MalformedError(
                f"slot table has shape {tuple(slots.shape)}; {n_blocks} blocks of "
                f"{block_bytes} bytes need ({n_blocks}, {block_bytes})"
            )
        if slots.stride(1) != 1 and block_bytes > 1:
            raise MalformedError("each row of the slot table must be contiguous")
        _check_slot_device(slots.device, cache.device)
        return SlotBuffers(slots.detach(), (), slots.device)
    if isinstance(slots, (str, bytes, bytearray, memoryview)) or not isinstance(slots, Sequence):
        raise MalformedError(
            f"slots must be a 2-D uint8 tensor or a sequence of buffers, got {type(slots).__name__}"
        )
    if len(slots) != n_blocks:
        raise MalformedError(f"{len(slots)} slot buffers given for {n_blocks} page ids")
    rows = tuple(_slot_row(slot, index, block_bytes, writable) for index, slot in enumerate(slots))
    device = rows[0].device if rows else cache.device
    for index, row in enumerate(rows):
        if row.device != device:
            raise MalformedError(f"slot {index} is on {row.device}, slot 0 on {device}")
    _check_slot_device(device, cache.device)
    return SlotBuffers(None, rows, device)


def _slot_row(slot: SlotBuffer, index: int, block_bytes: int, writable: bool) -> torch.Tensor:
    if isinstance(slot, torch.Tensor):
        if slot.dtype != torch.uint8 or slot.dim() != 1 or not slot.is_contiguous():
            raise MalformedError(
                f"slot {index} must be a contiguous 1-D uint8 tensor, got {slot.dtype} "
                f"shape {tuple(slot.shape)}"
            )
        row = slot.detach()
    else:
        try:
            view = slot.data if isinstance(slot, np.ndarray) else memoryview(slot)
        except TypeError:
            raise MalformedError(f"slot {index} ({type(slot).__name__}) is not a buffer") from None
        if not view.c_contiguous:
            raise MalformedError(f"slot {index} is not a contiguous buffer")
        if writable and view.readonly:
            raise MalformedError(f"slot {index} is read-only; gather writes into its slots")
        if view.nbytes != block_bytes:
            raise MalformedError(
                f"slot {index} holds {view.nbytes} bytes; a block needs {block_bytes}"
            )
        if view.readonly:
            # torch refuses to alias read-only memory without a warning, and a scatter source
            # may well be read-only (a received frame): a copy is the safe way in.
            return torch.frombuffer(bytearray(view), dtype=torch.uint8)
        return torch.frombuffer(view.cast("B"), dtype=torch.uint8)
    if row.numel() != block_bytes:
        raise MalformedError(f"slot {index} holds {row.numel()} bytes; a block needs {block_bytes}")
    return row


def _check_slot_device(slot_device: torch.device, cache_device: torch.device) -> None:
    if slot_device.type == "cpu" or slot_device == cache_device:
        return
    raise MalformedError(
        f"slots are on {slot_device} but the cache is on {cache_device}; slots must be in host "
        f"memory or on the cache's device"
    )
