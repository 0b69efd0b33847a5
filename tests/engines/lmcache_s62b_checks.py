"""Run in the LMCache environment: kvstore's L2 adapter for three engines of one model,
tenant and chunk size in bytes whose KV caches differ in format: fp16, bf16, and fp16
of other shapes (argv[1] the daemon's endpoint, argv[2] the tenant).  The fp16 engine
stores its objects; the others look them up and load them with the layout LMCache
gives each (its ``group_layout_descs`` for a lookup, its memory objects for a load);
then the bf16 engine stores its own; and an adapter LMCache serializes objects for.
Prints, as JSON, what each step saw."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys
from lmcache_adapter_checks import load, lookup, pinned, same, store
from lmcache_setups_checks import kv_objects, layout_of

from kvstore.integrations.lmcache import KVStoreL2Adapter, KVStoreL2AdapterConfig

N = 3
SHAPE = (2, 2, 16, 64)   # K and V, 2 layers, 16 tokens, 64 values a token: 8 KiB in fp16
OTHER = (2, 2, 32, 32)   # as many values, as many bytes, another layout
FORMATS = {"fp16": (SHAPE, torch.float16), "bf16": (SHAPE, torch.bfloat16),
           "fp16_other_shape": (OTHER, torch.float16)}


def main() -> None:
    endpoint, tenant = sys.argv[1], sys.argv[2]
    size = 2 * 2 * 16 * 64 * 2
    engines = {name: KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant,
                                       "object_bytes": size, "model_revision": "r1"})
               for name in FORMATS}
    keys = make_object_keys(N, model_name="org/tiny")
    objects = {name: kv_objects(N, shape, dtype, seed)
               for seed, (name, (shape, dtype)) in enumerate(FORMATS.items(), 1)}
    out: dict[str, Any] = {"stored_fp16": all(store(engines["fp16"], keys, objects["fp16"]))}

    def reads(name: str) -> list[Any]:
        """What engine ``name`` finds (and locks) and loads of ``keys``: the counts, and
        whether the bytes loaded are its own objects' or the fp16 engine's."""
        shape, dtype = FORMATS[name]
        engine = engines[name]
        found = len(lookup(engine, keys, layout_of(shape, dtype)))
        engine.submit_unlock(keys)
        target = kv_objects(N, shape, dtype, 100)
        loaded = len(load(engine, keys, target))
        return [found, loaded, loaded > 0 and same(objects[name], target),
                loaded > 0 and same(objects["fp16"], target)]

    for name in FORMATS:
        out[f"before_bf16_stored/{name}"] = reads(name)
    # The bf16 engine computes and stores its own: each engine then loads its own bytes.
    out["stored_bf16"] = all(store(engines["bf16"], keys, objects["bf16"]))
    for name in FORMATS:
        out[f"after_bf16_stored/{name}"] = reads(name)
    out["serde"] = serialized(endpoint, tenant, size)
    out["pinned_at_end"] = pinned(endpoint, 0)
    for engine in engines.values():
        engine.close()
    print(json.dumps(out))


def serialized(endpoint: str, tenant: str, size: int) -> list[Any]:
    """An adapter LMCache serializes objects for (``serde_config`` on its config, as
    LMCache's parse sets it): handed the serialized bytes to store and load (one flat
    buffer each), and the engine's fp16 layout to look up, as LMCache's
    ``SerdeL2AdapterWrapper`` hands them.  [found, loaded, the bytes stored]."""
    from lmcache.v1.distributed.serde import SerdeConfig

    config = KVStoreL2AdapterConfig.from_dict({"endpoint": endpoint, "tenant": tenant,
                                               "object_bytes": size, "model_revision": "r1"})
    config.serde_config = SerdeConfig(type="fp8", kwargs={"fp8_dtype": "float8_e4m3fn"})
    engine = KVStoreL2Adapter(config)
    keys = make_object_keys(N, model_name="org/serialized")
    source = kv_objects(N, (size // 2,), torch.uint8, 7)  # (fp8: half the bytes)
    assert all(store(engine, keys, source))
    found = len(lookup(engine, keys, layout_of(SHAPE, torch.float16)))
    engine.submit_unlock(keys)
    target = kv_objects(N, (size // 2,), torch.uint8, 8)
    loaded = len(load(engine, keys, target))
    engine.close()
    return [found, loaded, loaded > 0 and same(source, target)]


if __name__ == "__main__":
    main()
