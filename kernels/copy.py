"""Batched block copy between paged KV caches and slot buffers: ``gather`` and ``scatter``.

One call moves a whole batch.  On a CUDA cache whose slots the GPU can reach (device
memory, or pinned host memory) the copy is one launch of the kernels in ``block_copy.cu``;
everywhere else it is a few vectorised torch ops per segment (a layer, or one op for an
all-layer page).  Both paths give the same bytes.

On CUDA the copy is queued on the current torch stream and the call returns before it
ends: synchronise (or record an event) before reading gathered host slots, and leave
host slots untouched until a scatter from them has run.  Page ids are checked on the
host, so ids given as a CUDA tensor are copied back first (a synchronisation).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvstore.errors import UnavailableError

from . import cuda
from .layout import (
    KVCaches,
    Layout,
    PagedCache,
    PageIds,
    SlotBuffers,
    Slots,
    page_id_array,
    paged_cache,
    slot_buffers,
)

Backend: TypeAlias = Literal["auto", "kernel", "torch"]
"""``auto`` picks the CUDA kernel where it can run; ``kernel`` insists on it (and raises
:class:`~kvstore.errors.UnavailableError` where it cannot); ``torch`` never uses it."""


def gather(
    kv_caches: KVCaches | PagedCache,
    page_ids: PageIds,
    slots: Slots,
    *,
    layout: Layout,
    backend: Backend = "auto",
) -> None:
    """Copy the block of each page in ``page_ids`` into the matching slot (offload).

    ``slots[i]`` receives page ``page_ids[i]`` as ``[layers, 2, T, H, D]`` bytes.  Ids may
    repeat; an empty batch does nothing.  Raises :class:`~kvstore.errors.MalformedError`
    before copying anything if the cache, ids or slots do not fit together.
    """
    cache = paged_cache(kv_caches, layout)
    ids = page_id_array(page_ids, cache.num_pages)
    buffers = slot_buffers(slots, len(ids), cache, writable=True)
    if len(ids) == 0:
        return
    with torch.no_grad():
        if _use_kernel(cache, buffers, backend):
            cuda.launch_copy(cache, ids, buffers.addresses(), gather=True)
        else:
            _torch_gather(cache, ids, buffers)


def scatter(
    slots: Slots,
    kv_caches: KVCaches | PagedCache,
    page_ids: PageIds,
    *,
    layout: Layout,
    backend: Backend = "auto",
) -> None:
    """Copy each slot into the page of the matching id in ``page_ids`` (reload).

    Where an id repeats, the last slot for it wins, as if the blocks were copied in order.
    An empty batch does nothing.  Raises :class:`~kvstore.errors.MalformedError` before
    copying anything if the cache, ids or slots do not fit together.
    """
    cache = paged_cache(kv_caches, layout)
    ids = page_id_array(page_ids, cache.num_pages)
    buffers = slot_buffers(slots, len(ids), cache, writable=False)
    if len(ids) == 0:
        return
    keep = _last_occurrences(ids)
    if keep is not None:
        ids = ids[keep]
    with torch.no_grad():
        if _use_kernel(cache, buffers, backend):
            addresses = buffers.addresses()
            if keep is not None:
                addresses = [addresses[int(position)] for position in keep]
            cuda.launch_copy(cache, ids, addresses, gather=False)
        else:
            _torch_scatter(cache, ids, buffers, keep)


def _use_kernel(cache: PagedCache, buffers: SlotBuffers, backend: Backend) -> bool:
    if backend == "torch":
        return False
    reason = cuda.kernel_unavailable(cache, buffers)
    if reason is None:
        return True
    if backend == "kernel":
        raise UnavailableError(f"the CUDA copy kernel cannot run here: {reason}")
    return False


def _last_occurrences(ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
    """Positions that keep only the last of each repeated id, or None if none repeats."""
    unique_ids, first_from_end = np.unique(ids[::-1], return_index=True)
    if len(unique_ids) == len(ids):
        return None
    return np.sort(len(ids) - 1 - first_from_end).astype(np.int64)


def _torch_gather(cache: PagedCache, ids: npt.NDArray[np.int64], buffers: SlotBuffers) -> None:
    n = len(ids)
    index = torch.from_numpy(ids).to(cache.device, non_blocking=True)
    table = buffers.table
    if table is not None and table.device == cache.device:
        staging = table
    else:
        staging = torch.empty((n, cache.info.block_bytes), dtype=torch.uint8, device=cache.device)
    by_segment = staging.view(n, len(cache.segments), cache.segment_bytes)
    for position, segment in enumerate(cache.segments):
        torch.index_select(segment, 0, index, out=by_segment[:, position])
    if staging is table:
        return
    if table is not None:
        table.copy_(staging, non_blocking=True)
        return
    # Separate buffers have no common base, so each row is its own copy.
    for row, block in zip(buffers.rows, staging):
        row.copy_(block, non_blocking=True)


def _torch_scatter(
    cache: PagedCache,
    ids: npt.NDArray[np.int64],
    buffers: SlotBuffers,
    keep: npt.NDArray[np.int64] | None,
) -> None:
    table = buffers.table
    if table is None:
        source = torch.stack(buffers.rows)
    else:
        source = table
    if keep is not None:
        source = source.index_select(0, torch.from_numpy(keep).to(source.device))
    source = source.to(cache.device, non_blocking=True)
    index = torch.from_numpy(ids).to(cache.device, non_blocking=True)
    by_segment = source.view(len(ids), len(cache.segments), cache.segment_bytes)
    for position, segment in enumerate(cache.segments):
        segment.index_copy_(0, index, by_segment[:, position])
