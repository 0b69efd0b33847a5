"""A token plan's keys another session's open reservation holds a slot for take no slot
(awaited: that writer's bytes are coming), yet ``reserve_batch`` admitted the plan as
if each needed one: with DRAM nearly full, a plan whose few new blocks fit was refused
(``capacity_rejects``), the engine recomputing and saving nothing.  Now admission counts
the slots the plan takes: it is admitted and evicts as many blocks as its new keys need,
and no more.  A real daemon process, two clients."""

from __future__ import annotations

import os
from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.client_core import PlanItem

# 128 KiB blocks: a 16 MiB arena holds 128 of them
IDENTITY = make_identity(model="batch-awaited", num_kv_heads=8, head_dim=128)
COLD = make_identity(model="batch-awaited-cold", num_kv_heads=8, head_dim=128)
SLOTS = 128
SHARED, OWN = 96, 8  # keys the first writer holds open, keys the plan adds after them


def _dram(c: Client) -> dict[str, Any]:
    tier: dict[str, Any] = c.stats()["tiers"]["dram"]
    return tier


def test_a_plans_awaited_keys_need_no_room_at_admission(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="16MiB")
    with Client(d.endpoint, tenant="acme") as c1, Client(d.endpoint, tenant="acme") as c2:
        ns1, ns2 = c1.namespace(IDENTITY), c2.namespace(IDENTITY)
        bt = IDENTITY.block_tokens
        keys = ns1.keys(range((SHARED + OWN) * bt))
        data = {k: os.urandom(ns1.block_bytes) for k in keys}
        first = ns1.reserve(keys[:SHARED])
        for key, buf in zip(first.keys, first.buffers):
            buf[:] = data[key]
        cold = c1.namespace(COLD)  # the rest of DRAM: cold blocks, evictable
        cold_keys = cold.keys(range((SLOTS - SHARED) * bt))
        assert cold.put(cold_keys, [bytes(cold.block_bytes)] * len(cold_keys)) == len(
            cold_keys)
        before = _dram(c1)
        assert before["free"] == 0 and before["reserved_slots"] == SHARED, before
        # the plan: a request of the shared prefix (awaited) and its own tail, 104
        # blocks of which 8 need a slot, where 32 could be had; and a request of 4
        # blocks of its own
        other = ns2.keys(range(5000 * bt, 5004 * bt))
        plan = [PlanItem(0, (SHARED + OWN) * bt, keys), PlanItem(0, 4 * bt, other)]
        result = ns2.reserve_batch(plan)
        assert result.admitted, result
        r, small = result.reservations
        assert r.offsets[:SHARED] == [-1] * SHARED and min(r.offsets[SHARED:]) >= 0
        after = _dram(c1)
        assert after["evictions"] - before["evictions"] == OWN + 4, after
        assert after["capacity_rejects"] == before["capacity_rejects"]
        for key, buf in zip(keys[SHARED:], r.buffers[SHARED:]):
            buf[:] = data[key]
        for buf in small.buffers:
            buf[:] = bytes(ns2.block_bytes)
        assert first.commit() == SHARED
        assert [r.commit(), small.commit()] == [OWN, 4]
        assert r.dropped == 0
        assert ns2.get(keys) == [data[k] for k in keys]
        dram = _dram(c1)
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram
        assert c1.stats()["invariant_violations"] == 0
