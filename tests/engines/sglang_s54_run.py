"""kvstore's HiCache backend under SGLang set-ups the other runners do not take, against
real daemons: extra configs with misspelt keys or values of the wrong type; page sizes
of 1, 7 and 100 tokens through both interfaces; MLA pages shared by tensor-parallel
ranks; batches naming a key twice; hits with gaps; a daemon whose DRAM is pinned full
by another engine; a daemon killed and started again under the backend; pages stored
again into a full DRAM (``--role stored_again``).

Runs inside the SGLang test environment, started by test_engine_sglang_s54.py: ``--role
NAME`` runs one set of checks and prints one JSON object on the last line of stdout.
The host pools are stand-ins (sglang_run.py): SGLang's own need CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
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
from sglang_run import HostPool, backend  # noqa: E402
from sglang_setups_run import BIG_PAGE, BigPool, held, indices  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.integrations.sglang import page_key  # noqa: E402

NO_PREFIX = HiCacheStorageExtraInfo(prefix_keys=None)


class Pool(HostPool):
    """The stand-in layer_first MHA pool with pages of ``page`` tokens."""

    def __init__(self, seed: int, page: int, pages: int = 8) -> None:
        self.page_size, self.dtype = page, torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = 2, 2, 32
        self.size = page * pages
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(2, 2, self.size, 2, 32, generator=g).to(self.dtype)


class MlaPool:
    """The page accessors of SGLang's MLATokenToKVPoolHost, ``layer_first``: one latent
    vector of 576 values a token and layer (DeepSeek's 512 + 64 of rope)."""

    layout = "layer_first"

    def __init__(self, seed: int, page: int = 16, pages: int = 8) -> None:
        self.page_size, self.dtype, self.layer_num, self.width = page, torch.bfloat16, 3, 576
        self.size = page * pages
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(3, self.size, 1, 576, generator=g).to(self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((3, self.page_size, 1, 576), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
            3, self.page_size, 1, 576)


def mla_backend(endpoint: str, tenant: str, pool: MlaPool, rank: int) -> Any:
    config = HiCacheStorageConfig(
        tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="tiny-mla",
        extra_config={"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
                      "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
                      "endpoint": endpoint, "tenant": tenant})
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def keys_of(page: int, count: int, start: int = 0) -> list[str]:
    return get_hash_str(list(range(start, start + count * page)), None, page_size=page)


def rows(page: int, first: int, count: int) -> torch.Tensor:
    return torch.arange(first * page, (first + count) * page, dtype=torch.int64)


def same(a: Any, b: Any, page: int, first_a: int, first_b: int, count: int) -> bool:
    return bool(torch.equal(a.kv_buffer[:, :, first_a * page:(first_a + count) * page],
                            b.kv_buffer[:, :, first_b * page:(first_b + count) * page]))


def config(endpoint: str, tenant: str) -> dict[str, Any]:
    """What SGLang's start meets with each extra config: the error, or "started"."""
    out: dict[str, Any] = {}
    for extra in ({"tennant": "other"}, {"model_revison": "r2"},
                  {"endpont": "ipc:///run/kvstore/kvstore.sock"},
                  {"timeout": "10s"}, {"timeout": 0}, {"timeout": -1}, {"salt": ["a"]},
                  {"model_name": 7}, {"enable_metadata_cache": True},
                  {"salt": 3, "timeout": 2.5}):
        try:
            backend(endpoint, tenant, Pool(1, 16), **extra).close()
            out[json.dumps(extra)] = "started"
        except Exception as exc:  # what SGLang's start would raise
            out[json.dumps(extra)] = f"{type(exc).__name__}: {exc}"
    return out


def page_sizes(endpoint: str, tenant: str) -> dict[str, Any]:
    """Five pages of 1, 7 and 100 tokens, stored and loaded by another engine through
    the v1 interface and the tensor one: [stored, found, loaded, same bytes]."""
    out: dict[str, Any] = {}
    for page in (1, 7, 100):
        for v1 in (1, 0):
            source, target = Pool(page, page), Pool(page + 1, page)
            name = f"{tenant}-{page}-{v1}"
            writer = backend(endpoint, name, source, interface_v1=v1)
            reader = backend(endpoint, name, target, interface_v1=v1)
            keys = keys_of(page, 5)
            if v1:
                stored = sum(writer.batch_set_v1(keys, rows(page, 0, 5), NO_PREFIX))
                found = reader.batch_exists(keys)
                loaded = sum(reader.batch_get_v1(keys, rows(page, 0, 5)))
                equal = same(source, target, page, 0, 0, 5)
            else:
                pages = [source.get_data_page(i * page) for i in range(5)]
                stored = 5 * writer.batch_set(keys, pages)
                found = reader.batch_exists(keys)
                got = reader.batch_get(keys, [target.get_dummy_flat_data_page() for _ in keys])
                loaded = sum(g is not None for g in got)
                equal = all(g is not None and torch.equal(g, p) for g, p in zip(got, pages))
            out[f"{page}/v1={v1}"] = [stored, found, loaded, equal]
            writer.close()
            reader.close()
    return out


def shapes(endpoint: str, tenant: str) -> dict[str, Any]:
    """MLA pages across ranks, a key twice in a batch, hits with a gap."""
    out: dict[str, Any] = {}
    source, target = MlaPool(1), MlaPool(2)
    rank0 = mla_backend(endpoint, tenant + "-mla", source, 0)
    rank1 = mla_backend(endpoint, tenant + "-mla", target, 1)
    keys = keys_of(16, 4)
    out["mla"] = [sum(rank0.batch_set_v1(keys, torch.arange(0, 64), NO_PREFIX)),
                  rank1.batch_exists(keys), sum(rank1.batch_get_v1(keys, torch.arange(0, 64))),
                  bool(torch.equal(source.kv_buffer[:, :64], target.kv_buffer[:, :64]))]
    rank0.close()
    rank1.close()
    pool = Pool(3, 16, 16)
    store = backend(endpoint, tenant + "-twice", pool)
    keys = keys_of(16, 3)
    twice = [keys[0], keys[1], keys[0], keys[2]]  # pages 0..3: the key's first page kept
    out["twice_set"] = store.batch_set_v1(twice, rows(16, 0, 4), NO_PREFIX)
    out["twice_exists"] = store.batch_exists(twice)
    out["twice_get"] = store.batch_get_v1(twice, rows(16, 8, 4))
    out["twice_pages"] = [same(pool, pool, 16, 8 + i, j, 1) for i, j in enumerate([0, 1, 0, 3])]
    store.close()
    source, target = Pool(4, 16), Pool(5, 16)
    writer = backend(endpoint, tenant + "-gap", source)
    reader = backend(endpoint, tenant + "-gap", target)
    keys = keys_of(16, 6)
    writer.batch_set_v1(keys[:3], rows(16, 0, 3), NO_PREFIX)
    writer.batch_set_v1(keys[4:5], rows(16, 4, 1), NO_PREFIX)
    out["gap_exists"] = reader.batch_exists(keys)
    out["gap_get_v1"] = reader.batch_get_v1(keys, rows(16, 0, 6))
    out["gap_get"] = [g is not None for g in reader.batch_get(
        keys, [target.get_dummy_flat_data_page() for _ in keys])]
    out["gap_bytes"] = [same(source, target, 16, 0, 0, 3),
                        same(Pool(5, 16), target, 16, 3, 3, 3)]  # the misses untouched
    writer.close()
    reader.close()
    out["held"] = held(endpoint)
    return out


def pinned_full(endpoint: str, tenant: str) -> dict[str, Any]:
    """A daemon of 64 MiB whose DRAM another engine fills and pins (48 pages of 1 MiB): an
    engine's batch of 20 pages is stored as far as it fits, and no more is found."""
    other_pool, source, target = BigPool(1, 48), BigPool(2, 20), BigPool(3, 20)
    other = backend(endpoint, tenant + "-other", other_pool)
    other_keys = keys_of(BIG_PAGE, 48, start=10**6)
    out: dict[str, Any] = {"other": sum(other.batch_set_v1(other_keys, indices(0, 48),
                                                         NO_PREFIX))}
    pins = other._namespace().acquire([page_key(k) for k in other_keys[:out["other"]]])
    writer = backend(endpoint, tenant, source)
    keys = keys_of(BIG_PAGE, 20)
    out["set"] = writer.batch_set_v1(keys, indices(0, 20), NO_PREFIX)
    reader = backend(endpoint, tenant, target)
    out["found"] = reader.batch_exists(keys)
    loaded = sum(reader.batch_get_v1(keys, indices(0, 20)))
    out["loaded"] = loaded
    out["same"] = bool(torch.equal(source.kv_buffer[:, :, :loaded * BIG_PAGE],
                                   target.kv_buffer[:, :, :loaded * BIG_PAGE]))
    out["rest_untouched"] = bool(torch.equal(BigPool(3, 20).kv_buffer[:, :, loaded * BIG_PAGE:],
                                             target.kv_buffer[:, :, loaded * BIG_PAGE:]))
    pins.release()
    for store in (other, writer, reader):
        store.close()
    out["held"] = held(endpoint)
    return out


def restarted(endpoint: str, tenant: str, workdir: Path) -> dict[str, Any]:
    """A daemon (this run's own) killed and started again under a serving backend: its
    first calls miss, the next reconnect, and pages stored again load right."""
    def serve(name: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint,
             "--dram-capacity", "64MiB", "--slab-size", "16MiB", "--ssd-capacity", "0",
             "--ssd-path", str(workdir / name), "--debug-invariants", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        while b"serving on" not in proc.stdout.readline():
            if proc.poll() is not None:
                raise RuntimeError("the daemon did not start")
        return proc

    daemon = serve("ssd-1")
    try:
        source, target = HostPool(1), HostPool(2)
        keys = keys_of(16, 6)
        writer = backend(endpoint, tenant, source, timeout=2)
        reader = backend(endpoint, tenant, target, timeout=2)
        out: dict[str, Any] = {"stored": sum(writer.batch_set_v1(keys[:3], rows(16, 0, 3),
                                                                 NO_PREFIX))}
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        daemon = serve("ssd-2")
        out["found_after"] = reader.batch_exists(keys)
        out["loaded_after"] = sum(reader.batch_get_v1(keys, rows(16, 0, 6)))
        out["untouched"] = same(HostPool(2), target, 16, 0, 0, 6)
        out["set_after"] = writer.batch_set_v1(keys, rows(16, 0, 6), NO_PREFIX)
        out["set_again"] = writer.batch_set_v1(keys, rows(16, 0, 6), NO_PREFIX)
        out["found"] = reader.batch_exists(keys)
        out["loaded"] = sum(reader.batch_get_v1(keys, rows(16, 0, 6)))
        out["same"] = same(source, target, 16, 0, 0, 6)
        writer.close()
        reader.close()
        out["held"] = held(endpoint)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    return out


def stored_again(endpoint: str, tenant: str) -> dict[str, Any]:
    """A DRAM left 4 pages free by another engine's pages: one engine stores pages 2-7 of
    a request (a chain of their own), another the whole request (its lookup finds no
    leading page: pages 2-7 are sent again), then the whole request once more; each
    time, the daemon's evictions, duplicates and new blocks."""
    def dram() -> dict[str, int]:
        with Client(endpoint, tenant="stats") as c:
            figures: dict[str, int] = c.stats()["tiers"]["dram"]
            return figures

    fill = dram()["free"] // (1 << 20) - 4
    other = backend(endpoint, tenant + "-other", BigPool(1, fill))
    out: dict[str, Any] = {"other": sum(other.batch_set_v1(
        keys_of(BIG_PAGE, fill, start=10**6), indices(0, fill), NO_PREFIX))}
    out["free"] = dram()["free"] // (1 << 20)
    source, target = BigPool(2, 8), BigPool(3, 8)
    first, second = backend(endpoint, tenant, source), backend(endpoint, tenant, source)
    keys = keys_of(BIG_PAGE, 8)
    for name, store, part in (("part", first, 2), ("whole", second, 0), ("again", second, 0)):
        before = dram()
        out[f"{name}_set"] = sum(store.batch_set_v1(keys[part:], indices(part, 8 - part),
                                                    NO_PREFIX))
        after = dram()
        out[name] = {f: after[f] - before[f] for f in ("evictions", "duplicates", "commits")}
    reader = backend(endpoint, tenant, target)
    out["loaded"] = sum(reader.batch_get_v1(keys, indices(0, 8)))
    out["same"] = bool(torch.equal(source.kv_buffer, target.kv_buffer))
    for store in (other, first, second, reader):
        store.close()
    out["held"] = held(endpoint)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["config", "setups", "stored_again"], required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--full-endpoint")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--tenant", required=True)
    args = parser.parse_args()
    if args.role == "config":
        print(json.dumps(config(args.endpoint, args.tenant)))
        return
    if args.role == "stored_again":
        print(json.dumps(stored_again(args.endpoint, args.tenant)))
        return
    out = {"page_sizes": page_sizes(args.endpoint, args.tenant),
           "shapes": shapes(args.endpoint, args.tenant),
           "pinned_full": pinned_full(args.full_endpoint, args.tenant),
           "restarted": restarted(f"ipc://{args.workdir / 'own.sock'}", args.tenant,
                                  args.workdir)}
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
