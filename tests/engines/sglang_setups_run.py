"""kvstore's HiCache backend under set-ups its other tests do not cover, against a real
daemon: engines of another page size sharing the daemon, batches longer than DRAM with
an SSD tier behind it, the daemon restarted under a serving engine.

Runs inside the SGLang test environment (.engine-envs/sglang), started by
test_engine_sglang_setups.py: ``--role NAME`` runs one set-up and prints one JSON object
of named checks on the last line of stdout.  The backend is built by SGLang's own
factory and called as its cache controller calls it; the host pool is sglang_run.py's
stand-in for SGLang's ``layer_first`` MHA pool (SGLang's own needs CUDA), here with
pages of 1 MiB (64 tokens, 4 layers, 8 heads of 128, bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang_run import HostPool, backend  # noqa: E402

from kvstore.client import Client  # noqa: E402

BIG_PAGE = 64  # tokens a page: 2 x 4 layers x 64 x 8 heads x 128 x 2 bytes = 1 MiB


class BigPool(HostPool):
    """The stand-in pool with pages of 1 MiB."""

    def __init__(self, seed: int, pages: int) -> None:
        self.page_size, self.dtype = BIG_PAGE, torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = 4, 8, 128
        self.size = BIG_PAGE * pages
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(2, 4, self.size, 8, 128, generator=g).to(self.dtype)


def indices(first: int, count: int) -> torch.Tensor:
    return torch.arange(first * BIG_PAGE, (first + count) * BIG_PAGE, dtype=torch.int64)


def same_pages(a: BigPool, b: BigPool, count: int) -> bool:
    return count > 0 and bool(torch.equal(a.kv_buffer[:, :, :count * BIG_PAGE],
                                          b.kv_buffer[:, :, :count * BIG_PAGE]))


def held(endpoint: str) -> dict[str, int]:
    """What the daemon holds for sessions once the engines are done: pins, reservations."""
    with Client(endpoint, tenant="stats") as c:
        dram = c.stats()["tiers"]["dram"]
    return {"pinned": dram["pinned_blocks"], "reserved": dram["reserved_slots"]}


def round_trip(endpoint: str, tenant: str, count: int) -> dict[str, Any]:
    """An engine backs up ``count`` pages of one request (one batch, as SGLang's backup
    thread passes them), another engine of the model finds and loads them."""
    source, target = BigPool(1, count), BigPool(2, count)
    keys = get_hash_str(list(range(count * BIG_PAGE)), None, page_size=BIG_PAGE)
    writer = backend(endpoint, tenant, source)
    stored = writer.batch_set_v1(keys, indices(0, count), HiCacheStorageExtraInfo())
    reader = backend(endpoint, tenant, target)
    found = reader.batch_exists(keys)
    loaded = reader.batch_get_v1(keys, indices(0, count))
    out = {"stored": sum(stored), "found": found, "loaded": sum(loaded),
           "bytes_equal": same_pages(source, target, sum(loaded))}
    writer.close()
    reader.close()
    return out


def mixed(endpoint: str, tenant: str) -> dict[str, Any]:
    """A daemon of 64 MiB (four slabs of 16) shared with an engine of small pages, which
    holds one slab: an engine of 1 MiB pages backs up 64 pages, 48 of which fit."""
    small = HostPool(seed=3)
    other = backend(endpoint, tenant + "-small", small)
    keys = get_hash_str(list(range(2 * small.page_size)), None, page_size=small.page_size)
    out: dict[str, Any] = {"small_stored": other.batch_set_v1(
        keys, torch.arange(0, 2 * small.page_size), HiCacheStorageExtraInfo())}
    out.update(round_trip(endpoint, tenant, 64))
    other.close()
    out["held"] = held(endpoint)
    return out


def longer_than_dram(endpoint: str, tenant: str) -> dict[str, Any]:
    """A daemon of 32 MiB of DRAM and an SSD tier: a request of 80 pages of 1 MiB."""
    out = round_trip(endpoint, tenant, 80)
    out["held"] = held(endpoint)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    roles = {"mixed": mixed, "longer_than_dram": longer_than_dram}
    parser.add_argument("--role", choices=sorted(roles), required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--tenant", required=True)
    args = parser.parse_args()
    print(json.dumps(roles[args.role](args.endpoint, args.tenant)))


if __name__ == "__main__":
    main()
