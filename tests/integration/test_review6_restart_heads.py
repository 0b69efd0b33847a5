"""A warm restart from an SSD index that holds one first key in namespaces of two
tenants (one of them sent the other's first key as a key of its own making) brings
both back under that key: each tenant's probe finds its own chain, the store's map of
first blocks checked on every request.  A real daemon process, restarted."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from kvtest import make_identity

from kvstore import Client

ACME = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="acme")
EVIL = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, tenant="evil")


def ssd_slots(client: Client) -> int:
    stats = client.stats()
    assert stats["invariant_violations"] == 0
    slots: int = stats["tiers"]["ssd"]["committed_slots"]
    return slots


def test_one_first_key_of_two_tenants_comes_back_for_both(daemon_factory: Any) -> None:
    d = daemon_factory(ssd_capacity="64MiB", dram_capacity="2MiB",
                       extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-through"])
    with Client(d.endpoint, tenant="acme") as acme, Client(d.endpoint, tenant="evil") as evil:
        mine = acme.namespace(ACME)
        keys = mine.keys(range(4 * ACME.block_tokens))
        evil.namespace(EVIL).put(keys[:2], [os.urandom(EVIL.block_bytes)] * 2)
        mine.put(keys, [os.urandom(ACME.block_bytes) for _ in keys])
        deadline = time.monotonic() + 10
        while ssd_slots(acme) < 6:
            assert time.monotonic() < deadline, "write-through did not reach the ssd"
            time.sleep(0.05)
    assert d.stop(signal.SIGTERM) == 0
    d.start()
    with Client(d.endpoint, tenant="acme") as acme, Client(d.endpoint, tenant="evil") as evil:
        assert ssd_slots(acme) == 6
        assert acme.probe(keys).tier_runs == [("ssd", 4)]
        assert evil.probe(keys).tier_runs == [("ssd", 2)]
        evil.namespace(EVIL).drop()
        assert acme.probe(keys).tier_runs == [("ssd", 4)]
        assert evil.probe(keys).tier_runs == []
        assert ssd_slots(acme) == 4
