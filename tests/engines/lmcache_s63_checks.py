"""Run in the LMCache environment: kvstore's L2 adapter under LMCache's own per-salt
quota eviction (argv[1] the daemon's endpoint, argv[2] the tenant).  LMCache's
``IsolatedLRU`` L2 eviction policy and ``L2EvictionController`` (what its storage
manager wires to an adapter given ``"eviction": {"eviction_policy": "IsolatedLRU"}``)
watch the adapter's stores and, for each ``cache_salt`` over its quota in the
``QuotaManager`` (a salt with none holds nothing), call the adapter's ``delete``.
One eviction pass is run by hand (the controller's thread runs one a second).
Prints, as JSON, what each step saw."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys
from lmcache.v1.distributed.config import EvictionConfig
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.quota_manager import QuotaManager
from lmcache.v1.distributed.storage_controllers.eviction_controller import (
    L2AdapterEvictionState,
    L2EvictionController,
)
from lmcache_adapter_checks import load, lookup, pinned, same, store
from lmcache_setups_checks import kv_objects, layout_of

from kvstore.integrations.lmcache import KVStoreL2Adapter

SHAPE = (2, 2, 16, 64)  # 8 KiB of fp16 a chunk
SIZE = 2 * 2 * 16 * 64 * 2


def main() -> None:
    endpoint, tenant = sys.argv[1], sys.argv[2]
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "timeout": 5,
                                "object_bytes": SIZE, "model_revision": "r1"})
    quotas = QuotaManager()
    quotas.set_quota("alice", 6 * SIZE)  # six chunks
    quotas.set_quota("bob", 2 * SIZE)    # two chunks
    state = L2AdapterEvictionState(0, adapter, EvictionConfig(
        eviction_policy="IsolatedLRU", trigger_watermark=1.0, eviction_ratio=0.5))
    controller = L2EvictionController([state], quota_manager=quotas)
    layout = layout_of(SHAPE, torch.float16)

    def keys_of(salt: str) -> list[Any]:
        return [k.__class__(chunk_hash=k.chunk_hash, model_name=k.model_name,
                            kv_rank=k.kv_rank, object_group_id=k.object_group_id,
                            cache_salt=salt)
                for k in make_object_keys(4, model_name="org/tiny")]

    def found(keys: list[Any]) -> list[int]:
        hits = lookup(adapter, keys, layout)
        adapter.submit_unlock(keys)
        return hits

    out: dict[str, Any] = {}
    alice, bob, mallory = keys_of("alice"), keys_of("bob"), keys_of("mallory")
    objects = kv_objects(4, SHAPE, torch.float16, 1)
    # alice stores her four chunks, and again (a second request computed them too)
    out["alice_stored"] = [store(adapter, alice, objects), store(adapter, alice, objects)]
    out["bob_stored"] = store(adapter, bob, objects)        # twice his quota
    out["mallory_stored"] = store(adapter, mallory, objects)  # no quota: holds nothing
    out["usage_before"] = {s: n // SIZE for s, n in
                           adapter.get_usage().bytes_by_cache_salt.items()}
    controller._check_and_evict(state)  # one pass of the controller's loop
    out["usage_after"] = {s: n // SIZE for s, n in
                          adapter.get_usage().bytes_by_cache_salt.items()}
    out["found_after"] = {"alice": found(alice), "bob": found(bob),
                          "mallory": found(mallory)}
    target = kv_objects(4, SHAPE, torch.float16, 2)
    out["alice_loaded"] = load(adapter, alice, target)
    out["alice_same"] = same(objects, target)
    # a listener that deletes as it is told of a store, on the store thread (a policy of
    # its own): before, the delete was queued behind the store that told it, and waited
    # on its own thread for its whole wait (the adapter's timeout three times over)
    eve = keys_of("eve")

    class Deleter(L2AdapterListener):
        def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
            if keys and keys[0].cache_salt == "eve":
                adapter.delete(keys)

        def on_l2_keys_accessed(self, keys: list[Any]) -> None:
            pass

        def on_l2_keys_deleted(self, keys: list[Any]) -> None:
            pass

    adapter.register_listener(Deleter())
    began = time.monotonic()
    out["eve_stored"] = store(adapter, eve, objects)
    out["eve_seconds"] = time.monotonic() - began
    out["eve_found"] = found(eve)
    out["pinned_at_end"] = pinned(endpoint, 0)
    out["healthy"] = adapter.report_status()["is_healthy"]
    adapter.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
