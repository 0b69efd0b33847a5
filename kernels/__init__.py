"""Batched block copy between engines' paged KV caches and kvstore's slot buffers.

``gather`` (pages -> slots, to offload) and ``scatter`` (slots -> pages, to reload) move
a whole batch per call: with the CUDA kernels in ``block_copy.cu`` (compiled at run time
through CuPy) on a GPU, with vectorised torch ops elsewhere; both give the same bytes.
``paged_cache`` validates an engine's cache once, for reuse across calls;
``register_host_memory`` pins host memory (the DRAM arena) so the GPU can reach it;
``register_in_background`` does it chunk by chunk off the caller's thread.
"""

from .copy import Backend, gather, scatter
from .cuda import cuda_kernel_unavailable
from .layout import (
    LAYOUTS,
    KVCaches,
    Layout,
    LayoutInfo,
    PagedCache,
    PageIds,
    Slots,
    describe_layout,
    paged_cache,
)
from .pinned import (
    BackgroundRegistration,
    HostRegistration,
    register_host_memory,
    register_in_background,
)

__all__ = [
    "LAYOUTS",
    "BackgroundRegistration",
    "Backend",
    "HostRegistration",
    "KVCaches",
    "Layout",
    "LayoutInfo",
    "PageIds",
    "PagedCache",
    "Slots",
    "cuda_kernel_unavailable",
    "describe_layout",
    "gather",
    "paged_cache",
    "register_host_memory",
    "register_in_background",
    "scatter",
]
