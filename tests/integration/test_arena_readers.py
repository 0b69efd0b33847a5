"""With more tenants than the budget over their arenas has slabs, a tenant holding none
takes the last slab only of an arena idle for ``MIN_HOLD``: a real daemon, 16 slabs, 16
tenants holding one each and reading their blocks, a 17th writing.  A tenant that only
read looked idle, and the writer took its slab, its cache evicted while it was read;
reads count as use now."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess
from kvtest import make_identity, tenants_daemon

from kvstore.arena_budget import MIN_HOLD
from kvstore.client import Client
from kvstore.errors import CapacityError
from kvstore.keys import chain_keys

READERS = 16


def test_a_tenant_reading_its_blocks_keeps_its_slab_from_a_writer_holding_none(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    d, token = tenants_daemon(daemon_factory, tmp_path, "1MiB",
                              'slab_size = "64KiB"\narena_kind = "memfd"\n'
                              'defer_seconds = 0.01\n')
    names = [f"r{i}" for i in range(READERS)] + ["w"]
    clients = {t: Client(d.endpoint, token=token(t)) for t in names}
    ops = Client(d.endpoint, token=token("ops"))
    try:
        spaces = {t: c.namespace(make_identity(tenant=t)) for t, c in clients.items()}
        block = spaces["w"].identity.block_bytes
        assert ops.stats()["tiers"]["dram"]["budget_slabs"] == READERS
        keys = {t: chain_keys(ns.id, list(range(16)), 16)[:1] for t, ns in spaces.items()}
        for t in names[:READERS]:  # a slab each
            spaces[t].put(keys[t], [t.encode().ljust(block, b".")])
        writer = spaces["w"]
        refused = 0
        started = time.monotonic()
        while time.monotonic() - started < 2.5 * MIN_HOLD:  # readers read, w writes
            for t in names[:READERS]:
                assert spaces[t].get(keys[t]) == [t.encode().ljust(block, b".")], t
            try:
                writer.put(keys["w"], [b"w" * block])
                break
            except CapacityError as exc:
                assert "raise dram.capacity" in str(exc)
                refused += 1
        dram = ops.stats()["tiers"]["dram"]
        assert dram["budget_taken"] == 0 and refused > 0, (dram, refused)
        time.sleep(MIN_HOLD * 1.2)  # the readers stop: one's slab is the writer's
        writer.put(keys["w"], [b"w" * block])
        assert writer.get(keys["w"]) == [b"w" * block]
        assert ops.stats()["tiers"]["dram"]["budget_taken"] == 1
        assert ops.stats()["invariant_violations"] == 0
    finally:
        for c in [*clients.values(), ops]:
            c.close()
