"""Run in the LMCache environment: kvstore's L2 adapter under set-ups the other checks
do not take (argv[1] the check, argv[2] a work directory, argv[3] the tenant): objects
of sizes that are no powers of two, a chunk's keys under several models and salts
read by another adapter instance, keys named twice in a lookup, unlocks of keys never
locked, the daemon killed and started again under the adapter, the adapter closed with
tasks in flight.  The daemon is this run's own (started, killed and started again
here); prints, as JSON, what each step saw."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import make_object_keys
from lmcache_adapter_checks import load, lookup, pinned, same, store
from lmcache_setups_checks import kv_objects

from kvstore.integrations.lmcache import KVStoreL2Adapter


def serve(endpoint: str, ssd: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint,
         "--dram-capacity", "64MiB", "--slab-size", "16MiB", "--ssd-capacity", "0",
         "--ssd-path", str(ssd), "--debug-invariants", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    while b"serving on" not in proc.stdout.readline():
        if proc.poll() is not None:
            raise RuntimeError("the daemon did not start")
    return proc


def odd_sizes(endpoint: str, tenant: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in (1, 1000, 15015, 200003, 1048573):
        adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant,
                                    "object_bytes": size})
        source = kv_objects(3, (size,), torch.uint8, size)
        target = kv_objects(3, (size,), torch.uint8, size + 1)
        keys = make_object_keys(3, model_name=f"m{size}")
        found = lookup(adapter, keys) if all(store(adapter, keys, source)) else []
        loaded = load(adapter, keys, target)
        adapter.submit_unlock(keys)
        out[str(size)] = [len(found), len(loaded), same(source, target)]
        adapter.close()
    return out


def models_salts_repeats(endpoint: str, tenant: str) -> dict[str, Any]:
    size, n = 4096, 3
    a = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    b = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size})
    base = make_object_keys(n, model_name="mA")
    out: dict[str, Any] = {}
    for i, (model, salt) in enumerate((m, s) for m in ("mA", "mB") for s in ("", "s1")):
        keys = [dataclasses.replace(k, model_name=model, cache_salt=salt) for k in base]
        source = kv_objects(n, (size,), torch.uint8, 100 + i)
        target = kv_objects(n, (size,), torch.uint8, 200 + i)
        store(a, keys, source)
        out[f"{model}/{salt}"] = [len(lookup(b, keys)), len(load(b, keys, target)),
                                  same(source, target)]  # another adapter's objects
        b.submit_unlock(keys)
    ghosts = make_object_keys(2, model_name="never-stored")
    a.submit_unlock(ghosts + base)  # none locked: nothing happens
    out["ghost_lookup"] = len(lookup(a, ghosts))
    out["pinned_after_ghosts"] = pinned(endpoint, 0)
    out["twice_lookup"] = lookup(a, [base[0], base[0]])
    out["pinned_twice"] = pinned(endpoint, 1)
    a.submit_unlock([base[0]])
    out["pinned_one_unlock"] = pinned(endpoint, 1)
    a.submit_unlock([base[0]])
    out["pinned_two_unlocks"] = pinned(endpoint, 0)
    b.close()
    a.close()
    return out


def restarted(endpoint: str, tenant: str, workdir: Path,
              daemon: subprocess.Popen[bytes]) -> tuple[dict[str, Any], subprocess.Popen[bytes]]:
    size, n = 4096, 4
    adapter = KVStoreL2Adapter({"endpoint": endpoint, "tenant": tenant, "object_bytes": size,
                                "timeout": 2.0})
    keys = make_object_keys(n, model_name="restarted")
    source = kv_objects(n, (size,), torch.uint8, 31)
    target = kv_objects(n, (size,), torch.uint8, 32)
    out: dict[str, Any] = {"stored": store(adapter, keys, source),
                           "locked": len(lookup(adapter, keys))}
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    daemon = serve(endpoint, workdir / "ssd-2")
    out["loaded_after"] = len(load(adapter, keys, target))  # locked on the daemon killed
    out["untouched"] = same(kv_objects(n, (size,), torch.uint8, 32), target)
    adapter.submit_unlock(keys)
    out["found_after"] = len(lookup(adapter, keys))
    stored = store(adapter, keys, source)
    out["stored_again"] = stored if all(stored) else store(adapter, keys, source)
    out["found"] = len(lookup(adapter, keys))
    out["loaded"] = len(load(adapter, keys, target))
    out["same"] = same(source, target)
    adapter.submit_unlock(keys)
    out["pinned"] = pinned(endpoint, 0)
    more = make_object_keys(32, model_name="in-flight")
    objects = kv_objects(32, (size,), torch.uint8, 40)
    adapter.submit_store_task(more, objects)
    lookup_id = adapter.submit_lookup_and_lock_task(more, {})
    load_id = adapter.submit_load_task(more, objects)
    adapter.close()
    out["answered_in_flight"] = [len(adapter.pop_completed_store_tasks()),
                                 adapter.query_lookup_and_lock_result(lookup_id) is not None,
                                 adapter.query_load_result(load_id) is not None]
    out["pinned_after_close"] = pinned(endpoint, 0)
    return out, daemon


def main() -> None:
    workdir, tenant = Path(sys.argv[2]), sys.argv[3]
    endpoint = f"ipc://{workdir / 'own.sock'}"
    daemon = serve(endpoint, workdir / "ssd-1")
    try:
        out = {"odd_sizes": odd_sizes(endpoint, tenant),
               "models_salts_repeats": models_salts_repeats(endpoint, tenant)}
        out["restarted"], daemon = restarted(endpoint, tenant, workdir, daemon)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
