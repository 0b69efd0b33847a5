"""Run in the LMCache environment: checks of kvstore's L2 adapter against a daemon
(argv[1] the check, argv[2] the endpoint, argv[3] the tenant); prints, as JSON, what
each step saw, including the daemon's count of pinned blocks (its own oracle of what
the adapter holds)."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import (
    make_memory_objects,
    make_object_keys,
)

import kvstore.integrations.lmcache as lmcache_adapter
from kvstore.client import Client
from kvstore.errors import LeaseExpiredError
from kvstore.integrations.lmcache import KVStoreL2Adapter


class Broken:
    """A memory object whose bytes cannot be read (an L1 buffer gone bad)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def get_size(self) -> int:
        return int(self.obj.get_size())

    @property
    def byte_array(self) -> Any:
        raise RuntimeError("this object's bytes are gone")


def wait(fd: int, timeout: float = 60.0) -> None:
    ready, _, _ = select.select([fd], [], [], timeout)
    if ready:
        os.read(fd, 8)


def store(adapter: KVStoreL2Adapter, keys: list[Any], objects: list[Any]) -> list[bool]:
    adapter.submit_store_task(keys, objects)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        wait(adapter.get_store_event_fd(), 1)
        done = adapter.pop_completed_store_tasks()
        if done:
            return [int(r) >= 0 for r in done.values()]
    raise TimeoutError("store")


def _positions(fd: int, query: Any, task: Any, what: str) -> list[int]:
    """The positions a lookup or load task's result names, once it came."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        wait(fd, 1)
        result = query(task)
        if result is not None:
            return sorted(result.get_indices_list())
    raise TimeoutError(what)


def lookup(adapter: KVStoreL2Adapter, keys: list[Any],
           layouts: dict[int, Any] | None = None) -> list[int]:
    """The positions of the keys found (and locked).  ``layouts``: the layout of each
    object group's objects, as LMCache passes them (none: objects of bytes, which name
    no layout)."""
    return _positions(adapter.get_lookup_and_lock_event_fd(),
                      adapter.query_lookup_and_lock_result,
                      adapter.submit_lookup_and_lock_task(keys, layouts or {}), "lookup")


def load(adapter: KVStoreL2Adapter, keys: list[Any], objects: list[Any]) -> list[int]:
    """The positions of the keys loaded."""
    return _positions(adapter.get_load_event_fd(), adapter.query_load_result,
                      adapter.submit_load_task(keys, objects), "load")


def same(a: list[Any], b: list[Any]) -> bool:
    return all(bytes(x.byte_array) == bytes(y.byte_array) for x, y in zip(a, b))


def pinned(endpoint: str, want: int | None = None) -> int:
    """The daemon's pinned blocks: once they are ``want`` (unlocks are queued, and
    releases posted), or as they are after a few seconds."""
    deadline = time.monotonic() + 5
    with Client(endpoint) as client:
        while True:
            count = int(client.stats()["tiers"]["dram"]["pinned_blocks"])
            if want is None or count == want or time.monotonic() > deadline:
                return count
            time.sleep(0.05)


def many_keys(endpoint: str, tenant: str) -> dict[str, Any]:
    """Lookups and loads of more keys than one request may carry (4096), with a key
    missing past the first request's worth; then the same with a failure partway."""
    n, size, gap = 5000, 1024, 4500
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    buffer = torch.zeros(2 * n * size, dtype=torch.uint8)
    keys = make_object_keys(n)
    source = make_memory_objects(buffer, n, size, 0, fill_offset=1)
    target = make_memory_objects(buffer, n, size, n * size, fill_offset=7)
    kept = [i for i in range(n) if i != gap]
    out: dict[str, Any] = {"n": n, "gap": gap}
    out["stored"] = store(adapter, [keys[i] for i in kept], [source[i] for i in kept])
    found = lookup(adapter, keys)
    out["found_all_but_gap"] = found == kept
    out["pinned_after_lookup"] = pinned(endpoint, n - 1)
    loaded = load(adapter, keys, target)
    out["loaded_all_but_gap"] = loaded == kept
    out["same_bytes"] = same([source[i] for i in kept], [target[i] for i in kept])
    out["pinned_after_load"] = pinned(endpoint, n - 1)

    # A copy that fails in the second request's part: none of the load's pins stay.
    broken = list(target)
    broken[n - 10] = Broken(target[n - 10])
    out["loaded_with_broken"] = len(load(adapter, keys, broken))
    out["pinned_after_broken_load"] = pinned(endpoint, n - 1)

    adapter.submit_unlock(keys)
    out["pinned_after_unlock"] = pinned(endpoint, 0)

    # A lookup that fails after its first part pinned: LMCache is told nothing was
    # locked, so nothing may stay pinned.
    found, calls = lookup_failing_second(adapter, keys, RuntimeError("injected"))
    out["found_with_failure"] = found
    out["acquire_calls_with_failure"] = calls
    out["pinned_after_failed_lookup"] = pinned(endpoint, 0)
    out["pinned_keys_after_failed_lookup"] = adapter.report_status()["pinned_keys"]

    # The daemon forgets the session between the parts (restarted, say): the link lets
    # its client go, and the first part's pins with it, so they are no locks either.
    found, _ = lookup_failing_second(
        adapter, keys, LeaseExpiredError("injected: this session's lease ran out"))
    out["found_with_session_gone"] = found
    out["pinned_keys_after_session_gone"] = adapter.report_status()["pinned_keys"]
    out["found_after_session_gone"] = len(lookup(adapter, keys))  # connected again
    adapter.submit_unlock(keys)
    adapter.close()
    return out


def lookup_failing_second(adapter: KVStoreL2Adapter, keys: list[Any],
                          error: BaseException) -> tuple[int, int]:
    """A lookup whose second part's pins fail with ``error`` (raised where the adapter
    calls ``acquire_runs``): the keys it reports locked, and the calls made."""
    real = lmcache_adapter.acquire_runs
    calls = 0

    def fail_second(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise error
        return real(*args)

    lmcache_adapter.acquire_runs = fail_second  # type: ignore[assignment]
    try:
        return len(lookup(adapter, keys)), calls
    finally:
        lmcache_adapter.acquire_runs = real


def models_and_salts(endpoint: str, tenant: str) -> dict[str, Any]:
    """The same chunks of two models, and of one model under two salts, all locked;
    unlocking one model's (one salt's) must keep the other's pinned through eviction."""
    n, size = 4, 64 * 1024
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    a = make_object_keys(n, model_name="model-a")
    b = make_object_keys(n, model_name="model-b")                 # a's chunk hashes
    a2 = make_object_keys(n, model_name="model-a", key_offset=100)
    salted = [dataclasses.replace(k, cache_salt="user-2") for k in a2]  # a2's
    groups = {"a": a, "b": b, "a2": a2, "salted": salted}
    buffer = torch.zeros(2 * len(groups) * n * size, dtype=torch.uint8)
    sources, targets = {}, {}
    for g, (name, keys) in enumerate(groups.items()):
        sources[name] = make_memory_objects(buffer, n, size, 2 * g * n * size, g + 1)
        targets[name] = make_memory_objects(buffer, n, size, (2 * g + 1) * n * size, 99)
    out: dict[str, Any] = {"n": n}
    out["stored"] = [store(adapter, keys, sources[name]) for name, keys in groups.items()]
    out["found"] = {name: len(lookup(adapter, keys)) for name, keys in groups.items()}
    adapter.submit_unlock(a)        # LMCache is done with a and a2; b and salted stay
    adapter.submit_unlock(a2)       # locked until they are loaded
    out["pinned_after_unlock"] = pinned(endpoint, 2 * n)
    out["pinned_keys_after_unlock"] = adapter.report_status()["pinned_keys"]

    # Pressure: another engine's stores fill the daemon's DRAM twice over, evicting
    # whatever is not pinned.
    other = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    fill = 512
    filler = torch.zeros(fill * size, dtype=torch.uint8)
    for start in range(0, fill, 64):
        store(other, make_object_keys(64, model_name="filler", key_offset=10**6 + start),
              make_memory_objects(filler, 64, size, start * size, 3))
    other.close()
    out["found_a_after_pressure"] = len(lookup(adapter, a))  # (the pressure evicts)
    adapter.submit_unlock(a)
    for name in ("b", "salted"):
        out[f"loaded_{name}"] = len(load(adapter, groups[name], targets[name]))
        out[f"same_bytes_{name}"] = same(sources[name], targets[name])
    adapter.submit_unlock(b)
    adapter.submit_unlock(salted)
    out["pinned_at_end"] = pinned(endpoint, 0)

    # One lookup over two namespaces whose second loses the session: the first one's
    # pins went with it too, so neither is reported locked.
    both = b + salted
    out["found_both"] = len(lookup(adapter, both))
    adapter.submit_unlock(both)
    found, _ = lookup_failing_second(
        adapter, both, LeaseExpiredError("injected: this session's lease ran out"))
    out["found_both_session_gone"] = found
    out["pinned_keys_both_session_gone"] = adapter.report_status()["pinned_keys"]
    adapter.close()
    return out


def _four_objects(endpoint: str, tenant: str) -> tuple[KVStoreL2Adapter, list[Any],
                                                      list[Any], list[Any]]:
    """An adapter, four keys, and their objects' sources and targets (4 KiB each)."""
    n, size = 4, 4096
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    buffer = torch.zeros(2 * n * size, dtype=torch.uint8)
    return (adapter, make_object_keys(n), make_memory_objects(buffer, n, size, 0, fill_offset=1),
            make_memory_objects(buffer, n, size, n * size, fill_offset=7))


def lease(endpoint: str, tenant: str) -> dict[str, Any]:
    """Locked blocks stay pinned while the adapter is idle for longer than the daemon's
    lease (the daemon's is 2 s here, the adapter's request timeout 10 s)."""
    n = 4
    adapter, keys, source, target = _four_objects(endpoint, tenant)
    out: dict[str, Any] = {"n": n, "stored": store(adapter, keys, source)}
    out["found"] = len(lookup(adapter, keys))
    out["pinned_after_lookup"] = pinned(endpoint, n)
    time.sleep(5)
    out["pinned_after_idle"] = pinned(endpoint)
    out["loaded"] = len(load(adapter, keys, target))
    out["same_bytes"] = same(source, target)
    adapter.submit_unlock(keys)
    out["pinned_after_unlock"] = pinned(endpoint, 0)
    out["healthy"] = adapter.report_status()["is_healthy"]
    adapter.close()
    return out


def health(endpoint: str, tenant: str) -> dict[str, Any]:
    """A store and a load that raise make the adapter unhealthy; the next store and
    load that complete make it healthy again."""
    n = 4
    adapter, keys, source, target = _four_objects(endpoint, tenant)

    def status() -> dict[str, Any]:
        return {k: adapter.report_status()[k] for k in ("is_healthy", "last_error")}

    out: dict[str, Any] = {"healthy_at_start": status()}
    out["broken_store"] = store(adapter, keys, [Broken(o) for o in source])
    out["after_broken_store"] = status()
    out["store"] = store(adapter, keys, source)
    out["after_store"] = status()
    out["broken_load"] = len(load(adapter, keys, [Broken(o) for o in target]))
    out["after_broken_load"] = status()
    out["load"] = len(load(adapter, keys, target))
    out["same_bytes"] = same(source, target)
    out["after_load"] = status()
    adapter.close()
    return out


def dram(endpoint: str) -> dict[str, int]:
    with Client(endpoint) as client:
        figures: dict[str, int] = client.stats()["tiers"]["dram"]
        return figures


def stored_again(endpoint: str, tenant: str) -> dict[str, Any]:
    """Chunks stored into a DRAM nearly full of other chunks, then stored again, by
    another engine's adapter and by the same one (the adapter looks nothing up before a
    store): each time, the daemon's evictions, duplicates and new blocks."""
    n, size, free = 16, 64 * 1024, 4
    first = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    filler = torch.zeros(64 * size, dtype=torch.uint8)
    fill, start = 1, 0
    while start < fill:
        count = min(64, fill - start)
        store(first, make_object_keys(count, model_name="filler", key_offset=10**6 + start),
              make_memory_objects(filler, count, size, 0, 3))
        if start == 0:  # a slot holds a header too: the arena's slots, from the first
            figures = dram(endpoint)
            slot = figures["committed"] // figures["committed_slots"]
            fill = 1 + figures["free"] // slot - free
        start += count
    keys = make_object_keys(n, model_name="shared")
    buffer = torch.zeros(2 * n * size, dtype=torch.uint8)
    source = make_memory_objects(buffer, n, size, 0, 5)
    target = make_memory_objects(buffer, n, size, n * size, 9)
    second = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    out: dict[str, Any] = {"n": n, "free": dram(endpoint)["free"] // slot, "stored": []}
    figures = ("evictions", "duplicates", "commits")
    for name, adapter in (("first", first), ("second", second), ("again", first)):
        before = dram(endpoint)
        out["stored"].append(store(adapter, keys, source))
        after = dram(endpoint)
        out[name] = {f: after[f] - before[f] for f in figures}
    out["loaded"] = len(load(second, keys, target)) if len(lookup(second, keys)) == n else 0
    out["same_bytes"] = same(source, target)
    second.submit_unlock(keys)
    out["pinned_at_end"] = pinned(endpoint, 0)
    first.close()
    second.close()
    return out


CHECKS: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "many_keys": many_keys, "models_and_salts": models_and_salts, "lease": lease,
    "health": health, "stored_again": stored_again}

if __name__ == "__main__":
    print(json.dumps(CHECKS[sys.argv[1]](sys.argv[2], sys.argv[3])))
