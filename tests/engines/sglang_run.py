"""kvstore's HiCache backend built by SGLang's own factory, exercised against a daemon.

Runs inside the SGLang test environment (.engine-envs/sglang), started by
test_engine_sglang.py: ``--role writer`` stores pages, ``--role reader`` (another
process, another daemon session) checks them.  The page keys are SGLang's own chained
page hashes.  Prints one JSON object of named checks on the last line of stdout.

What is real: SGLang's ``StorageBackendFactory`` (the ``dynamic`` backend),
``HiCacheStorageConfig``, page hashing, and the calls its cache controller makes
(``register_mem_pool_host``, ``batch_exists``, ``batch_set_v1``/``batch_get_v1``, the
tensor interface).  What is not: the host memory pool.  SGLang's
``MHATokenToKVPoolHost`` cannot be imported without its CUDA-built dependencies
(sgl-kernel, a torchvision matching the CPU torch), so ``HostPool`` below reproduces
the part of its ``layer_first`` layout the backend uses — the page accessors of
``sglang/srt/mem_cache/pool_host/mha.py`` in SGLang 0.5.23.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# This checkout's kvstore (a script's directory, not the working one, starts sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, PAGES = 2, 2, 32, 16, 16


class HostPool:
    """The page accessors of SGLang's MHATokenToKVPoolHost, ``layer_first`` layout."""

    layout = "layer_first"

    def __init__(self, seed: int) -> None:
        self.page_size, self.dtype = PAGE, torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD_DIM
        self.size = PAGE * PAGES
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(2, LAYERS, self.size, HEADS, HEAD_DIM,
                                     generator=g).to(self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index:index + self.page_size, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index:index + self.page_size, :, :] = data_page.reshape(
            2, self.layer_num, self.page_size, self.head_num, self.head_dim)


class DcpPool(HostPool):
    """A host pool under decode context parallelism (``dcp_size`` 2), as SGLang's MLA
    pool is: its cache controller passes one index per token of a logical page, twice
    the pool's ``page_size`` (its rows), and the page accessors take a logical page's
    start alone (``pool_host/mla.py``), its row index halved."""

    dcp_size = 2

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.logical_page_size = self.page_size * self.dcp_size

    def _row(self, index: int) -> int:
        if index < 0 or index % self.logical_page_size:
            raise ValueError("DCP L3 page start must be a nonnegative logical page boundary.")
        return index // self.dcp_size

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return super().get_data_page(self._row(index), flat)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        super().set_from_flat_data_page(self._row(index), data_page)


def backend(endpoint: str, tenant: str, pool: HostPool, tp_rank: int = 0, tp_size: int = 1,
            **extra: object):
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=False, model_name="tiny-llama",
        extra_config={"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
                      "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
                      "endpoint": endpoint, "tenant": tenant, **extra})
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)  # what SGLang's cache controller does next
    return storage


def pages(first: int, count: int) -> torch.Tensor:
    """host_indices of pages first..first+count-1, one index per token as SGLang passes."""
    return torch.arange(first * PAGE, (first + count) * PAGE, dtype=torch.int64)


def page_keys() -> list[str]:
    tokens = list(range(100, 100 + 6 * PAGE))
    return get_hash_str(tokens, None, page_size=PAGE)


def writer(endpoint: str, tenant: str) -> dict[str, object]:
    pool = HostPool(seed=1)
    store = backend(endpoint, tenant, pool)
    keys = page_keys()
    checks: dict[str, object] = {"backend": type(store).__name__}
    checks["exists_before"] = store.batch_exists(keys)
    # v1 (zero-copy) interface: host pages 0..3 under the first four keys.
    checks["set_v1"] = store.batch_set_v1(
        keys[:4], pages(0, 4), HiCacheStorageExtraInfo(prefix_keys=None))
    checks["exists_after"] = store.batch_exists(keys)
    checks["exists_one"] = [store.exists(keys[0]), store.exists(keys[5])]
    got = store.batch_get_v1(keys[:4] + keys[5:], pages(8, 5))
    checks["get_v1"] = got
    checks["get_v1_bytes_equal"] = bool(torch.equal(pool.kv_buffer[:, :, 8 * PAGE:12 * PAGE],
                                                    pool.kv_buffer[:, :, 0:4 * PAGE]))
    # Tensor interface: pages 4 and 5 through set/batch_set, read back through get.
    checks["set"] = store.set(keys[4], pool.get_data_page(4 * PAGE))
    checks["batch_set"] = store.batch_set([keys[4], keys[5]],
                                          [pool.get_data_page(4 * PAGE),
                                           pool.get_data_page(5 * PAGE)])
    target = pool.get_dummy_flat_data_page()
    out = store.get(keys[5], target)
    checks["get_bytes_equal"] = out is not None and bool(
        torch.equal(out, pool.get_data_page(5 * PAGE)))
    checks["get_missing"] = store.get("0" * 64, pool.get_dummy_flat_data_page()) is None
    checks["exists_all"] = store.batch_exists(keys)
    # Another tensor-parallel rank keeps its own head shard: no hit.
    checks["other_rank_exists"] = backend(endpoint, tenant, pool, 1, 2).batch_exists(keys)
    store.close()
    # Decode context parallelism: three logical pages from logical page 0, read back at
    # logical pages 4..6 (the backend stepped by the rows' page size: the second page's
    # index was mid logical page, and every set and get raised).
    dcp = DcpPool(seed=3)
    dstore = backend(endpoint, tenant + "-dcp", dcp)
    width = dcp.logical_page_size
    checks["dcp_set_v1"] = dstore.batch_set_v1(
        keys[:3], torch.arange(0, 3 * width), HiCacheStorageExtraInfo(prefix_keys=None))
    checks["dcp_get_v1"] = dstore.batch_get_v1(keys[:3], torch.arange(4 * width, 7 * width))
    checks["dcp_bytes_equal"] = bool(torch.equal(dcp.kv_buffer[:, :, 4 * PAGE:7 * PAGE],
                                                 dcp.kv_buffer[:, :, 0:3 * PAGE]))
    dstore.close()
    return checks


def reader(endpoint: str, tenant: str) -> dict[str, object]:
    source = HostPool(seed=1)       # what the writer stored
    pool = HostPool(seed=2)         # a different host pool, overwritten by the loads
    store = backend(endpoint, tenant, pool)
    keys = page_keys()
    checks: dict[str, object] = {"exists": store.batch_exists(keys)}
    checks["get_v1"] = store.batch_get_v1(keys, pages(0, 6))
    checks["bytes_equal"] = bool(torch.equal(pool.kv_buffer[:, :, :6 * PAGE],
                                             source.kv_buffer[:, :, :6 * PAGE]))
    got = store.batch_get(keys[:2], [pool.get_dummy_flat_data_page() for _ in range(2)])
    checks["batch_get_bytes_equal"] = all(
        g is not None and torch.equal(g, source.get_data_page(i * PAGE))
        for i, g in enumerate(got))
    checks["other_tenant_exists"] = backend(endpoint, tenant + "-other", pool).batch_exists(keys)
    store.close()
    return checks


def late(endpoint: str, tenant: str) -> dict[str, object]:
    """A daemon not up when SGLang starts: the backend is made (its connect failed
    SGLang's start before), and every call is a miss."""
    pool = HostPool(seed=1)
    started = time.monotonic()
    store = backend(endpoint, tenant, pool, timeout=1)
    keys = page_keys()
    checks: dict[str, object] = {"made": True, "exists": store.batch_exists(keys)}
    checks["set_v1"] = store.batch_set_v1(keys[:2], pages(0, 2),
                                          HiCacheStorageExtraInfo(prefix_keys=None))
    checks["get_v1"] = store.batch_get_v1(keys[:2], pages(4, 2))
    checks["seconds"] = time.monotonic() - started
    store.close()
    return checks


def split(endpoint: str, tenant: str) -> dict[str, object]:
    """A daemon whose requests name at most 4 keys: SGLang's batches of 6 pages are
    stored and read back all the same (refused whole before: nothing was stored)."""
    pool = HostPool(seed=1)
    store = backend(endpoint, tenant, pool)
    keys = page_keys()
    checks: dict[str, object] = {}
    checks["set_v1"] = store.batch_set_v1(keys, pages(0, 6),
                                          HiCacheStorageExtraInfo(prefix_keys=None))
    checks["exists"] = store.batch_exists(keys)
    checks["get_v1"] = store.batch_get_v1(keys, pages(8, 6))
    checks["bytes_equal"] = bool(torch.equal(pool.kv_buffer[:, :, 8 * PAGE:14 * PAGE],
                                             pool.kv_buffer[:, :, 0:6 * PAGE]))
    got = store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    checks["batch_get_bytes_equal"] = all(
        g is not None and torch.equal(g, pool.get_data_page(i * PAGE))
        for i, g in enumerate(got))
    store.close()
    return checks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["writer", "reader", "late", "split"], required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--tenant", required=True)
    args = parser.parse_args()
    run = {"writer": writer, "reader": reader, "late": late, "split": split}[args.role]
    print(json.dumps(run(args.endpoint, args.tenant)))


if __name__ == "__main__":
    main()
