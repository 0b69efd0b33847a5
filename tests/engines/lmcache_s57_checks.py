"""Run in the LMCache environment: kvstore's L2 adapter for engines whose model is a
checkpoint directory (as LMCache's vLLM integration names it: the path vLLM loaded),
against a daemon (argv[1] the endpoint, argv[2] the tenant, argv[3] a scratch
directory).  One engine's adapter stores objects; the checkpoint's weights are replaced
in place; a new engine's adapter (after the restart that loads them) looks the objects
up.  Prints, as JSON, what each step saw."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys
from lmcache_adapter_checks import load, lookup, pinned, same, store
from lmcache_setups_checks import kv_objects

from kvstore.integrations.lmcache import KVStoreL2Adapter

SIZE, N = 4096, 3


def weights(ckpt: Path, value: int) -> None:
    (ckpt / "config.json").write_text('{"architectures": ["Tiny"]}')
    (ckpt / "model.safetensors").write_bytes(bytes([value]) * 4096)


def engine(endpoint: str, tenant: str, **params: Any) -> KVStoreL2Adapter:
    return KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": SIZE,
                             **params})


def main() -> None:
    endpoint, tenant, scratch = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    ckpt = scratch / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    keys = make_object_keys(N, model_name=str(ckpt))
    out: dict[str, Any] = {}

    def seen(adapter: KVStoreL2Adapter, seed: int) -> list[Any]:
        """What ``adapter`` finds and loads of the keys, and whether the bytes are the
        ones stored (``seed``'s)."""
        source = kv_objects(N, (SIZE,), torch.uint8, seed)
        target = kv_objects(N, (SIZE,), torch.uint8, seed + 1000)
        found, loaded = len(lookup(adapter, keys)), len(load(adapter, keys, target))
        adapter.submit_unlock(keys)
        return [found, loaded, same(source, target)]

    weights(ckpt, 1)
    old = engine(endpoint, tenant)
    out["stored_old"] = all(store(old, keys, kv_objects(N, (SIZE,), torch.uint8, 1)))
    old.close()
    again = engine(endpoint, tenant)  # an engine restarted on the same weights
    out["same_weights"] = seen(again, 1)
    again.close()
    weights(ckpt, 2)  # a fine-tune of the same shape, deployed in place
    new = engine(endpoint, tenant)
    out["replaced_weights"] = seen(new, 1)
    new.close()
    # a revision given names the weights, whatever the directory holds
    given = [engine(endpoint, tenant, model_revision="v1") for _ in range(2)]
    out["stored_given"] = all(store(given[0], keys, kv_objects(N, (SIZE,), torch.uint8, 5)))
    out["given"] = seen(given[1], 5)
    for adapter in given:
        adapter.close()
    out["pinned_at_end"] = pinned(endpoint, 0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
