"""Engines whose pages differ must not share them: kvstore's HiCache backend, built by
SGLang's own factory with SGLang's ``HiCacheStorageConfig`` for each case, against a
daemon.  Runs inside the SGLang test environment, started by
test_engine_sglang_identity.py; prints one JSON object of named checks on its last line.

The cases: attention context-parallel ranks and decode-context-parallel shards (each
holds another slice of every page), fp8 engines of the two formats (SGLang's pools hold
fp8 as uint8), and a checkpoint's weights replaced in place where SGLang passes the
model's path with its host pool's format tag appended.  The host pool is
sglang_run.py's stand-in (SGLang's own needs CUDA), given each case's shape and dtype.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang_run import HEAD_DIM, LAYERS, PAGE, PAGES, HostPool, pages  # noqa: E402


class ShapedPool(HostPool):
    """The stand-in pool with another head count, dtype or format tag."""

    def __init__(self, seed: int, heads: int = 2, dtype: torch.dtype = torch.bfloat16,
                 tag: str | None = None) -> None:
        self.page_size, self.dtype = PAGE, dtype
        self.layer_num, self.head_num, self.head_dim = LAYERS, heads, HEAD_DIM
        self.size = PAGE * PAGES
        self.storage_format_tag = tag
        g = torch.Generator().manual_seed(seed)
        values = torch.randn(2, LAYERS, self.size, heads, HEAD_DIM, generator=g)
        self.kv_buffer = (values.to(dtype) if dtype != torch.uint8 else
                          torch.randint(0, 255, values.shape, generator=g, dtype=torch.uint8))


def backend(endpoint: str, tenant: str, pool: HostPool, model_name: str = "tiny-llama",
            extra: dict[str, Any] | None = None, **config: Any) -> Any:
    fields: dict[str, Any] = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model_name)
    fields.update(config)
    storage = StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(
        **fields, extra_config={
            "backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
            "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
            "endpoint": endpoint, "tenant": tenant, **(extra or {})}), pool)
    storage.register_mem_pool_host(pool)
    return storage


def keys(start: int) -> list[str]:
    return get_hash_str(list(range(start, start + 4 * PAGE)), None, page_size=PAGE)


def shared(first: Any, second: Any, first_pool: HostPool, second_pool: HostPool,
           start: int) -> dict[str, Any]:
    """Pages the first engine stores: what the second finds of them, and whether a load
    brought it the first's bytes."""
    ks = keys(start)
    stored = first.batch_set_v1(ks, pages(0, 4), HiCacheStorageExtraInfo())
    found = second.batch_exists(ks)
    got = second.batch_get_v1(ks, pages(8, 4))
    same = bool(torch.equal(second_pool.kv_buffer[:, :, 8 * PAGE:12 * PAGE],
                            first_pool.kv_buffer[:, :, 0:4 * PAGE]))
    return {"stored": all(stored), "found": found, "loaded": sum(got),
            "got_the_others_bytes": same}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--checkpoint", required=True, help="a scratch directory")
    a = parser.parse_args()
    ep, tenant = a.endpoint, a.tenant
    out: dict[str, Any] = {}
    made: list[Any] = []

    def make(pool: HostPool, **kw: Any) -> Any:
        made.append(backend(ep, tenant, pool, **kw))
        return made[-1]

    # attention context parallelism: each rank another slice of every page
    p0, p1 = ShapedPool(10), ShapedPool(11)
    out["cp"] = shared(make(p0, attn_cp_rank=0, attn_cp_size=2),
                       make(p1, attn_cp_rank=1, attn_cp_size=2), p0, p1, 1000)
    # decode context parallelism (MLA): each shard another part of every page
    m0, m1 = ShapedPool(20, heads=1), ShapedPool(21, heads=1)
    dcp = dict(is_mla_model=True, tp_size=2, dcp_size=2, logical_page_size=PAGE)
    out["dcp"] = shared(make(m0, tp_rank=0, dcp_rank=0, **dcp),
                        make(m1, tp_rank=1, dcp_rank=1, **dcp), m0, m1, 2000)
    # fp8 pools hold bytes: the format comes from the config, and formats do not share
    e4, e5 = ShapedPool(30, dtype=torch.uint8), ShapedPool(31, dtype=torch.uint8)
    s4 = make(e4, extra={"kv_cache_dtype": "fp8_e4m3"})
    s5 = make(e5, extra={"kv_cache_dtype": "fp8_e5m2"})
    out["fp8"] = shared(s4, s5, e4, e5, 3000)
    out["fp8_dtypes"] = [s4._identity.kv_dtype, s5._identity.kv_dtype]
    again = ShapedPool(32, dtype=torch.uint8)
    out["fp8_same_format"] = shared(s4, make(again, extra={"kv_cache_dtype": "fp8_e4m3"}),
                                    e4, again, 3500)
    try:
        make(ShapedPool(33, dtype=torch.uint8))
        out["fp8_unnamed"] = "accepted"
    except ValueError as exc:
        out["fp8_unnamed"] = str(exc)
    # a checkpoint's weights replaced in place, named as SGLang names it to storage
    # backends: its path with the host pool's format tag appended
    ckpt = Path(a.checkpoint)
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)

    def weights(value: int) -> None:
        (ckpt / "config.json").write_text('{"architectures": ["Tiny"]}')
        (ckpt / "model.safetensors").write_bytes(bytes([value]) * 4096)

    tag = "unified-token-major"
    weights(1)
    old_pool = ShapedPool(40, tag=tag)
    old = make(old_pool, model_name=f"{ckpt}-{tag}")
    weights(2)
    new_pool = ShapedPool(41, tag=tag)
    new = make(new_pool, model_name=f"{ckpt}-{tag}")
    out["replaced_weights"] = shared(old, new, old_pool, new_pool, 4000)
    out["revisions"] = [old._identity.model_revision, new._identity.model_revision]
    same_pool = ShapedPool(42, tag=tag)
    out["same_weights"] = shared(new, make(same_pool, model_name=f"{ckpt}-{tag}"),
                                 new_pool, same_pool, 5000)
    for storage in made:
        storage.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
