"""Run in the LMCache environment: kvstore's L2 adapter under set-ups of LMCache users
that ``lmcache_adapter_checks.py`` does not take (argv[1] the check, argv[2] the
endpoint, argv[3] the tenant, argv[4] the daemon's pid); prints, as JSON, what each step saw."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache_adapter_checks import load, lookup, pinned, same, store

from kvstore.integrations.lmcache import KVStoreL2Adapter


def kv_objects(n: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[Any]:
    """``n`` memory objects of ``shape`` and ``dtype`` (as LMCache's L1 hands them to
    an adapter: a flat byte buffer and its layout), filled with random bytes."""
    numel = 1
    for dim in shape:
        numel *= dim
    size = numel * torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0,
                                 phy_size=size, fmt=MemoryFormat.KV_2LTD, ref_count=1)
        out.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))
    return out


def layout_of(shape: tuple[int, ...], dtype: torch.dtype) -> dict[int, MemoryLayoutDesc]:
    """What LMCache passes a lookup of ``kv_objects(n, shape, dtype)``: object group
    0's layout (the objects' namespace names it)."""
    return {0: MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype])}


def large_chunk(endpoint: str, tenant: str) -> dict[str, Any]:
    """Chunks of DeepSeek-V3 (MLA: 61 layers of 576 bf16 values a token) of 256 tokens:
    17,989,632 bytes each, half a slot of which (with its header) has a prime factor
    past an identity's bound on its dimensions."""
    n, shape = 2, (61, 256, 576)
    source = kv_objects(n, shape, torch.bfloat16, 1)
    target = kv_objects(n, shape, torch.bfloat16, 2)
    size = int(source[0].get_size())
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    keys = make_object_keys(n, model_name="deepseek-ai/DeepSeek-V3")
    out: dict[str, Any] = {"n": n, "size": size}
    out["stored"] = store(adapter, keys, source)
    out["found"] = len(lookup(adapter, keys, layout_of(shape, torch.bfloat16)))
    out["loaded"] = len(load(adapter, keys, target))
    out["same_bytes"] = same(source, target)
    adapter.submit_unlock(keys)
    out["pinned_at_end"] = pinned(endpoint, 0)
    out["last_error"] = adapter.report_status()["last_error"]
    adapter.close()
    return out


def past_dram(endpoint: str, tenant: str) -> dict[str, Any]:
    """More chunks than the daemon's DRAM holds, the older ones on its SSD tier: a
    lookup of them all locks what DRAM has room for (pinning brings a block back from
    SSD), the load of those copies them, and a load of them all what it can."""
    n, wanted, size = 400, 300, 256 * 1024
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    keys = make_object_keys(n)
    source = kv_objects(n, (size // 2,), torch.float16, 3)
    out: dict[str, Any] = {"n": n, "wanted": wanted}
    out["stored"] = [ok for start in range(0, n, 50)
                     for ok in store(adapter, keys[start:start + 50], source[start:start + 50])]
    found = lookup(adapter, keys[:wanted], layout_of((size // 2,), torch.float16))
    out["found"] = len(found)
    out["found_a_prefix"] = found == list(range(len(found)))
    out["pinned_after_lookup"] = pinned(endpoint, len(found))
    target = kv_objects(wanted, (size // 2,), torch.float16, 4)
    loaded = load(adapter, [keys[i] for i in found], [target[i] for i in found])
    out["loaded_locked"] = len(loaded)
    out["same_bytes"] = same([source[i] for i in found], [target[i] for i in found])
    adapter.submit_unlock([keys[i] for i in found])
    out["pinned_after_unlock"] = pinned(endpoint, 0)
    target = kv_objects(wanted, (size // 2,), torch.float16, 5)
    loaded = load(adapter, keys[:wanted], target)
    out["loaded_all"] = len(loaded)
    out["same_bytes_all"] = same([source[i] for i in loaded], [target[i] for i in loaded])
    out["pinned_at_end"] = pinned(endpoint, 0)
    adapter.close()
    return out


def closing(endpoint: str, tenant: str) -> dict[str, Any]:
    """Tasks submitted while ``close()`` runs on another thread, or after it: each is
    answered (failed: a store's result, a lookup's or a load's empty bitmap), none left
    unanswered for LMCache to wait on; nothing stays pinned."""
    n, size = 8, 4096
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    keys = make_object_keys(n)
    source = kv_objects(n, (size,), torch.uint8, 6)
    out: dict[str, Any] = {"stored": store(adapter, keys, source)}
    lookups, loads, stores = [], [], []
    stop = threading.Event()
    target = kv_objects(n, (size,), torch.uint8, 7)

    def submit() -> None:  # LMCache's controllers, still submitting
        while not stop.is_set():
            lookups.append(adapter.submit_lookup_and_lock_task(keys, {}))
            loads.append(adapter.submit_load_task(keys, target))
            stores.append(adapter.submit_store_task(keys, source))
            adapter.submit_unlock(keys)
            time.sleep(0.005)

    submitter = threading.Thread(target=submit)
    submitter.start()
    time.sleep(0.5)
    adapter.close()
    time.sleep(0.1)
    stop.set()
    submitter.join()
    lookups.append(adapter.submit_lookup_and_lock_task(keys, {}))  # after close
    loads.append(adapter.submit_load_task(keys, target))
    stores.append(adapter.submit_store_task(keys, source))
    out["tasks"] = len(lookups)
    out["unanswered_lookups"] = sum(
        adapter.query_lookup_and_lock_result(t) is None for t in lookups)
    out["unanswered_loads"] = sum(adapter.query_load_result(t) is None for t in loads)
    done = adapter.pop_completed_store_tasks()
    out["unanswered_stores"] = sum(t not in done for t in stores)
    out["after_close_failed"] = [int(done[stores[-1]]) < 0] if stores[-1] in done else []
    out["healthy"] = adapter.report_status()["is_healthy"]
    out["pinned_at_end"] = pinned(endpoint, 0)
    return out


def close_with_locks(endpoint: str, tenant: str) -> dict[str, Any]:
    """An adapter closed while chunks are locked (a prefetch in flight at shutdown):
    LMCache unlocks nothing after close, so the daemon must not keep them pinned."""
    n, size = 8, 4096
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    keys = make_object_keys(n)
    out: dict[str, Any] = {"stored": store(adapter, keys, kv_objects(n, (size,), torch.uint8, 8))}
    out["found"] = len(lookup(adapter, keys))
    out["pinned_after_lookup"] = pinned(endpoint, n)
    adapter.close()
    out["pinned_after_close"] = pinned(endpoint, 0)
    return out


def health(endpoint: str, tenant: str) -> dict[str, Any]:
    """report_status through daemon failures the adapter takes as misses: a daemon
    that stops answering (argv[4]: its pid, stopped and continued here), one that cannot
    hold the adapter's objects (larger than its slabs), an object past object_bytes;
    healthy again once a task meets none."""
    n, size = 4, 4096
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size,
                                "timeout": 1.0})
    keys = make_object_keys(n)
    source = kv_objects(n, (size,), torch.uint8, 10)

    def status() -> dict[str, Any]:
        got = adapter.report_status()
        return {"is_healthy": got["is_healthy"], "last_error": got["last_error"]}

    out: dict[str, Any] = {"stored": store(adapter, keys, source), "at_start": status()}
    pid = int(sys.argv[4])
    os.kill(pid, signal.SIGSTOP)
    try:
        out["stored_stopped"] = store(adapter, keys, source)
        out["after_store_stopped"] = status()
        out["found_stopped"] = len(lookup(adapter, keys))
        out["after_lookup_stopped"] = status()
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30  # each connection leaves the daemon alone for 10 s
    while time.monotonic() < deadline and not (stored := store(adapter, keys, source))[0]:
        time.sleep(0.5)
    out["stored_back"] = stored
    out["after_store_back"] = status()
    while time.monotonic() < deadline and len(found := lookup(adapter, keys)) < n:
        adapter.submit_unlock([keys[i] for i in found])
        time.sleep(0.5)
    out["found_back"] = len(found)
    out["after_lookup_back"] = status()
    adapter.submit_unlock(keys)
    out["stored_too_big"] = store(adapter, keys[:1],
                                  kv_objects(1, (2 * size,), torch.uint8, 11))
    out["after_too_big"] = status()
    adapter.close()
    huge = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant,
                             "object_bytes": 80 << 20})  # past the daemon's 64 MiB slabs
    out["stored_huge"] = store(huge, keys[:1], source[:1])
    out["after_huge"] = {k: huge.report_status()[k] for k in ("is_healthy",)}
    huge.close()
    out["pinned_at_end"] = pinned(endpoint, 0)
    return out


def store_results(endpoint: str, tenant: str) -> dict[str, Any]:
    """Store results popped (by LMCache's store controller) while the store thread
    publishes more: every task's result comes out once."""
    sys.setswitchinterval(1e-6)  # threads take turns often: the race shows at once
    n = 5000
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": 4096})
    got: dict[int, Any] = {}
    submitted = threading.Event()

    def pop() -> None:
        while not submitted.is_set() or adapter.report_status()["queued_tasks"]:
            got.update(adapter.pop_completed_store_tasks())

    popper = threading.Thread(target=pop)
    popper.start()
    tasks = [adapter.submit_store_task([], []) for _ in range(n)]
    submitted.set()
    popper.join()
    adapter.close()  # (its store thread ended: every result is published)
    got.update(adapter.pop_completed_store_tasks())
    return {"n": n, "lost": sum(t not in got for t in tasks),
            "failed": sum(int(r) < 0 for r in got.values())}


def many_salts(endpoint: str, tenant: str) -> dict[str, Any]:
    """More cache salts (one namespace each) than the daemon lets a session open (8
    here; 1024 by default): each user's chunks are stored, looked up and loaded."""
    users, size = 20, 4096
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    base = make_object_keys(2)
    source = kv_objects(2, (size,), torch.uint8, 12)
    out: dict[str, Any] = {"users": users, "stored": [], "found": [], "loaded": [],
                           "same_bytes": True}
    for user in range(users):
        keys = [dataclasses.replace(k, cache_salt=f"user-{user}") for k in base]
        out["stored"] += store(adapter, keys, source)
    for user in range(users):
        keys = [dataclasses.replace(k, cache_salt=f"user-{user}") for k in base]
        out["found"].append(len(lookup(adapter, keys)))
        target = kv_objects(2, (size,), torch.uint8, 13)
        out["loaded"].append(len(load(adapter, keys, target)))
        out["same_bytes"] &= same(source, target)
        adapter.submit_unlock(keys)
    out["pinned_at_end"] = pinned(endpoint, 0)
    out["healthy"] = adapter.report_status()["is_healthy"]

    # The session has users 16-19 open; 12-15 fill it.  Then one lookup over user 19
    # (open: pinned first) and user 0 (a namespace past the cap): the session holding
    # the lookup's own pins stays, and the link closes its least recently used
    # namespace to open user 0's: both users' chunks are locked.
    def salted(user: int) -> list[Any]:
        return [dataclasses.replace(k, cache_salt=f"user-{user}") for k in base]

    for user in range(12, 16):
        adapter.submit_unlock([salted(user)[i] for i in lookup(adapter, salted(user))])
    both = salted(19) + salted(0)
    found = lookup(adapter, both)
    out["found_across_cap"] = found
    out["pinned_across_cap"] = pinned(endpoint, len(found))
    adapter.submit_unlock([both[i] for i in found])
    out["pinned_after_unlock"] = pinned(endpoint, 0)
    adapter.close()
    return out


CHECKS: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "large_chunk": large_chunk, "past_dram": past_dram, "closing": closing,
    "close_with_locks": close_with_locks, "health": health,
    "store_results": store_results, "many_salts": many_salts}

if __name__ == "__main__":
    print(json.dumps(CHECKS[sys.argv[1]](sys.argv[2], sys.argv[3])))
