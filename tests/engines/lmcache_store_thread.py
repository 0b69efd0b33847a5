"""Run in the LMCache environment: kvstore's L2 adapter against a daemon (argv[1] the
endpoint, argv[2] the tenant), with one store held up until its objects' bytes are
released; prints, as JSON, what finished while it was held and what after."""

from __future__ import annotations

import json
import select
import sys
import threading
import time
from typing import Any

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import (
    make_memory_objects,
    make_object_keys,
)

from kvstore.integrations.lmcache import KVStoreL2Adapter

OBJECT = 64 * 1024


class HeldUp:
    """A memory object whose bytes are not ready until ``gate`` is set."""

    def __init__(self, obj: Any, gate: threading.Event) -> None:
        self.obj, self.gate = obj, gate

    def get_size(self) -> int:
        return int(self.obj.get_size())

    @property
    def byte_array(self) -> Any:
        self.gate.wait(60)
        return self.obj.byte_array


def wait(fd: int, timeout: float) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout)
    if ready:
        import os
        os.read(fd, 8)
    return bool(ready)


def main() -> None:
    adapter = KVStoreL2Adapter({"endpoint": sys.argv[1], "tenant": sys.argv[2],
                                "object_bytes": OBJECT})
    buffer = torch.zeros(4 * 8 * OBJECT, dtype=torch.uint8)
    first = make_object_keys(8, key_offset=0)
    second = make_object_keys(8, key_offset=100)
    stored = make_memory_objects(buffer, 8, OBJECT, 0, fill_offset=1)
    late = make_memory_objects(buffer, 8, OBJECT, 8 * OBJECT, fill_offset=2)
    loaded = make_memory_objects(buffer, 8, OBJECT, 16 * OBJECT, fill_offset=3)
    out: dict[str, Any] = {}

    adapter.submit_store_task(first, stored)
    out["first_store"] = wait(adapter.get_store_event_fd(), 30)
    out["first_result"] = [int(r) >= 0 for r in adapter.pop_completed_store_tasks().values()]

    gate = threading.Event()
    adapter.submit_store_task(second, [HeldUp(o, gate) for o in late])  # type: ignore[misc]
    started = time.monotonic()
    lookup = adapter.submit_lookup_and_lock_task(first, {})
    out["lookup_while_held"] = wait(adapter.get_lookup_and_lock_event_fd(), 10)
    bitmap = adapter.query_lookup_and_lock_result(lookup)
    out["found"] = bitmap.popcount() if bitmap is not None else -1
    load = adapter.submit_load_task(first, loaded)
    out["load_while_held"] = wait(adapter.get_load_event_fd(), 10)
    result = adapter.query_load_result(load)
    out["loaded"] = result.popcount() if result is not None else -1
    out["same_bytes"] = all(bytes(a.byte_array) == bytes(b.byte_array)
                            for a, b in zip(stored, loaded))
    out["held_store_done_early"] = bool(adapter.pop_completed_store_tasks())
    out["seconds_while_held"] = time.monotonic() - started
    adapter.submit_unlock(first)

    gate.set()
    out["late_store"] = wait(adapter.get_store_event_fd(), 30)
    out["late_result"] = [int(r) >= 0 for r in adapter.pop_completed_store_tasks().values()]
    adapter.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
