"""A reserve (or put) of blocks the daemon already holds in DRAM takes no slot for them
and makes no room for them: with DRAM full, saving a chain it holds evicts nothing and
stores nothing new; the commit counts those keys duplicates; their blocks stay held
until the commit, the abort or the lease's end, and count against a writer grantee's
share.  An older client's reserve (no
``skip_held``) still gets a slot for every key (real daemon process)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity, wait_for_lease_end

from kvstore import AsyncClient, Client
from kvstore import protocol as p
from kvstore.auth import issue_token, read_secret
from kvstore.errors import LimitExceededError
from kvstore.client_wire import check_reply

# 128 KiB blocks: a 16 MiB arena holds 128 of them
IDENTITY = make_identity(model="held-reserves", num_kv_heads=8, head_dim=128)
CAPACITY = "16MiB"
SLOTS = 128
HALF = SLOTS // 2


def _dram(c: Client) -> dict[str, Any]:
    tier: dict[str, Any] = c.stats()["tiers"]["dram"]
    return tier


def _fill(ns: Any, first: int, count: int) -> tuple[list[bytes], list[bytes]]:
    """Put a chain of ``count`` blocks of its own (tokens from ``first``): keys, bytes."""
    bt = IDENTITY.block_tokens
    keys = ns.keys(range(first * bt, (first + count) * bt))
    blocks = [os.urandom(ns.block_bytes) for _ in keys]
    assert ns.put(keys, blocks) == count
    return keys, blocks


def _full(c: Client, ns: Any) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """DRAM full: a chain ``held`` of HALF blocks and another of HALF; returns the held
    chain's keys and bytes and the other's keys."""
    held, blocks = _fill(ns, 0, HALF)
    other, _ = _fill(ns, 10_000, HALF)
    assert ns.get(held) == blocks  # the warmer chain: room is made from the other
    dram = _dram(c)
    assert dram["committed_slots"] == SLOTS and dram["free"] == 0, dram
    assert dram["evictions"] == 0, dram
    return held, blocks, other


def test_a_reserve_of_held_keys_in_a_full_dram_takes_no_slot_and_evicts_nothing(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, blocks, other = _full(c, ns)
        r = ns.reserve(held)
        assert r.offsets == [-1] * HALF
        dram = _dram(c)
        assert dram["reserved_slots"] == 0 and dram["reserved"] == 0, dram
        assert dram["pinned_blocks"] == HALF, dram  # held till the commit
        assert dram["evictions"] == 0, dram
        for buf in r.buffers:  # a caller that fills every buffer writes nowhere that counts
            buf[:] = bytes(ns.block_bytes)
        assert r.commit() == 0
        dram = _dram(c)
        assert dram["duplicates"] == HALF and dram["evictions"] == 0, dram
        assert dram["pinned_blocks"] == 0 and dram["committed_slots"] == SLOTS, dram
        assert ns.lookup(other).blocks == HALF
        assert ns.get(held) == blocks


def test_the_commit_reply_counts_the_held_keys_duplicates(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, _, _ = _full(c, ns)
        got = check_reply(c._call(p.Reserve(c._next_rid(), ns.id, held, None, True))[0],
                          p.ReserveReply)
        assert got.offsets == [-1] * HALF
        done = check_reply(c._call(p.Commit(c._next_rid(), got.reservation))[0],
                           p.CommitReply)
        assert (done.created, done.duplicates) == (0, HALF)


def test_a_put_of_held_keys_evicts_nothing_and_copies_no_byte(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, blocks, other = _full(c, ns)
        assert ns.put(held, [os.urandom(ns.block_bytes) for _ in held]) == 0
        dram = _dram(c)
        assert dram["duplicates"] == HALF and dram["evictions"] == 0, dram
        assert dram["reserved_slots"] == 0 and dram["pinned_blocks"] == 0, dram
        assert ns.get(held) == blocks  # the first bytes, not the second put's
        assert ns.lookup(other).blocks == HALF


def test_a_chain_half_held_stores_only_its_new_half(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    quarter = HALF // 2
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, _, _ = _full(c, ns)
        bt = IDENTITY.block_tokens
        chain = ns.keys(range((HALF + quarter) * bt))  # the held chain and a quarter more
        assert chain[:HALF] == held
        with ns.reserve(chain) as r:
            assert r.offsets[:HALF] == [-1] * HALF
            assert all(o >= 0 for o in r.offsets[HALF:])
            dram = _dram(c)
            # room for the new quarter only, and none of it taken from the held half
            assert dram["reserved_slots"] == quarter and dram["evictions"] == quarter, dram
            new = [os.urandom(ns.block_bytes) for _ in range(quarter)]
            for buf, data in zip(r.buffers[HALF:], new):
                buf[:] = data
            assert r.commit() == quarter
        dram = _dram(c)
        assert dram["duplicates"] == HALF and dram["committed_slots"] == SLOTS, dram
        assert dram["commits"] == SLOTS + quarter and dram["evictions"] == quarter, dram
        assert ns.lookup(chain).blocks == len(chain)
        assert ns.get(chain[HALF:]) == new


def test_an_engine_s_fill_writes_only_the_keys_given_slots(daemon_factory: Any) -> None:
    """``store_missing`` without a lookup (the LMCache adapter's keys, not a chain)
    calls its fill for the runs of keys given slots only: no copy of a held block's
    bytes into scratch."""
    from kvstore.integrations.engine_side import store_missing

    d = daemon_factory(dram_capacity=CAPACITY)
    quarter = HALF // 2
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, _, _ = _full(c, ns)
        chain = ns.keys(range((HALF + quarter) * IDENTITY.block_tokens))
        new = [os.urandom(ns.block_bytes) for _ in range(quarter)]
        calls: list[tuple[int, int]] = []

        def fill(slots: Any, first: int) -> None:
            calls.append((first, len(slots)))
            for slot, data in zip(slots, new[first - HALF:]):
                slot[:] = data

        stored = store_missing(ns, chain, fill, lookup=False)
        assert stored.error is None and stored.created == quarter
        assert calls == [(HALF, quarter)]
        assert ns.get(chain[HALF:]) == new


def test_a_batch_reserve_skips_held_keys(daemon_factory: Any) -> None:
    from kvstore.client_core import PlanItem

    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, _, _ = _full(c, ns)
        bt = IDENTITY.block_tokens
        plan = [PlanItem(0, 8 * bt, held[:8]), PlanItem(8 * bt, 8 * bt, held[8:16], held[7])]
        result = ns.reserve_batch(plan)
        assert result.admitted
        assert [r.offsets for r in result.reservations] == [[-1] * 8, [-1] * 8]
        assert _dram(c)["reserved_slots"] == 0
        assert [r.commit() for r in result.reservations] == [0, 0]
        dram = _dram(c)
        assert dram["duplicates"] == 16 and dram["evictions"] == 0, dram


def test_the_async_client_skips_held_keys_too(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        held, blocks, _ = _full(c, c.namespace(IDENTITY))

    async def save_again() -> tuple[list[int], int]:
        async with AsyncClient(d.endpoint, tenant="acme") as ac:
            ns = await ac.namespace(IDENTITY)
            async with ns.reserve(held) as r:
                for buf in r.buffers:
                    buf[:] = bytes(ns.block_bytes)
                return r.offsets, await r.commit()

    offsets, created = asyncio.run(save_again())
    assert offsets == [-1] * HALF and created == 0
    with Client(d.endpoint, tenant="acme") as c:
        dram = _dram(c)
        assert dram["evictions"] == 0 and dram["duplicates"] == HALF, dram
        assert c.namespace(IDENTITY).get(held) == blocks


def test_an_abort_lets_the_held_blocks_go(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, _, _ = _full(c, ns)
        r = ns.reserve(held)
        assert _dram(c)["pinned_blocks"] == HALF
        r.abort()
        dram = _dram(c)
        assert dram["pinned_blocks"] == 0 and dram["aborts"] == 1, dram
        # evictable again: a new chain of a whole arena's worth takes their slots
        _fill(ns, 20_000, SLOTS)
        assert ns.lookup(held).blocks == 0


def test_a_lease_end_lets_the_held_blocks_go(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY, lease=1.0)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, _, _ = _full(c, ns)
        r = ns.reserve(held)
        assert _dram(c)["pinned_blocks"] == HALF
        wait_for_lease_end(d.endpoint, "acme", at_most=10)
    with Client(d.endpoint, tenant="acme") as again:
        dram = _dram(again)
        assert dram["pinned_blocks"] == 0 and dram["lease_expiries"] >= 1, dram
        assert dram["reserved_slots"] == 0, dram
    assert r.offsets == [-1] * HALF


def test_an_older_clients_reserve_gets_a_slot_for_every_key(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        held, _, _ = _full(c, ns)
        got = check_reply(c._call(p.Reserve(c._next_rid(), ns.id, held, None))[0],
                          p.ReserveReply)
        assert len(got.offsets) == HALF and min(got.offsets) >= 0
        dram = _dram(c)
        assert dram["reserved_slots"] == HALF and dram["evictions"] == HALF, dram
        assert dram["pinned_blocks"] == 0, dram
        done = check_reply(c._call(p.Commit(c._next_rid(), got.reservation))[0],
                           p.CommitReply)
        assert (done.created, done.duplicates) == (0, HALF)
        dram = _dram(c)
        assert dram["reserved_slots"] == 0 and dram["committed_slots"] == HALF, dram


def test_a_block_held_only_on_ssd_gets_a_slot_and_its_dram_copy_again(
        daemon_factory: Any) -> None:
    """A copy only below DRAM is not held: the commit gives it a DRAM copy again."""
    d = daemon_factory(dram_capacity=CAPACITY, ssd_capacity="64MiB")
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        below, blocks = _fill(ns, 0, HALF)
        _fill(ns, 10_000, SLOTS)  # the first chain leaves DRAM for the SSD
        assert ns.lookup(below).tiers == ["ssd"] * HALF
        with ns.reserve(below) as r:
            assert min(r.offsets) >= 0
            for buf, data in zip(r.buffers, blocks):
                buf[:] = data
            assert r.commit() == HALF
        assert ns.lookup(below).tiers == ["dram"] * HALF
        assert ns.get(below) == blocks


def test_a_writer_grantee_s_held_keys_count_against_its_share(daemon_factory: Any,
                                                              tmp_path: Path) -> None:
    """The blocks a ``shared_writers`` grantee's reservations hold in the owner's DRAM
    count against its share as reserved slots do: else, holding what the owner cached,
    reservation after reservation, it pinned the owner's whole arena."""
    secret = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "kvstore", "keygen", "--secret", str(secret)],
                   check=True, capture_output=True, timeout=60)
    config = tmp_path / "grants.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret}"\n'
                      '[auth.shared_tenants]\npublic = ["acme"]\n'
                      '[auth.shared_writers]\npublic = ["acme"]\n')
    d = daemon_factory(dram_capacity="2MiB", extra=["--config", str(config),
                                                    "--slab-size", "1MiB"])
    ident = make_identity(tenant="public", model="sp", num_layers=4, num_kv_heads=4,
                          head_dim=64)  # 64 KiB blocks: 32 in the 2 MiB arena, share 8
    key = read_secret(secret)
    with Client(d.endpoint, token=issue_token(key, "public", 3600.0)) as owner, \
            Client(d.endpoint, token=issue_token(key, "acme", 3600.0)) as writer:
        mine, theirs = owner.namespace(ident), writer.namespace(ident)
        cached = mine.keys(range(16 * ident.block_tokens))
        mine.put(cached, [os.urandom(mine.block_bytes) for _ in cached])
        r = theirs.reserve(cached[:8])  # its share, all held
        assert r.offsets == [-1] * 8
        with pytest.raises(LimitExceededError, match="reserved slots"):
            theirs.reserve(cached[8:16], parent=cached[7])
        r.abort()
        theirs.reserve(cached[8:16], parent=cached[7]).abort()  # its share came back


def test_a_batch_of_held_keys_is_admitted_by_the_slots_it_takes(daemon_factory: Any) -> None:
    """A batch's keys held in DRAM need no slot: its admission counts only the others.
    Here the held chain is pinned by a reader (an engine loading it) and DRAM has room
    for the new blocks alone; counted as needing slots, the batch was refused."""
    from kvstore.client_core import PlanItem

    d = daemon_factory(dram_capacity=CAPACITY)
    quarter = HALF // 2
    with Client(d.endpoint, tenant="acme") as c, Client(d.endpoint, tenant="acme") as reader:
        ns = c.namespace(IDENTITY)
        held, _ = _fill(ns, 0, HALF)
        pinned = reader.namespace(IDENTITY).acquire(held)
        chain = ns.keys(range((HALF + quarter) * IDENTITY.block_tokens))
        _fill(ns, 10_000, HALF - quarter // 2)  # 16 free, 48 evictable: 64 < 96 keys
        bt = IDENTITY.block_tokens
        plan = [PlanItem(0, HALF * bt, chain[:HALF]),
                PlanItem(HALF * bt, quarter * bt, chain[HALF:], chain[HALF - 1])]
        result = ns.reserve_batch(plan)
        assert result.admitted, result
        first, second = result.reservations
        assert first.offsets == [-1] * HALF and min(second.offsets) >= 0
        assert _dram(c)["reserved_slots"] == quarter
        new = [os.urandom(ns.block_bytes) for _ in range(quarter)]
        for buf, data in zip(second.buffers, new):
            buf[:] = data
        assert [r.commit() for r in result.reservations] == [0, quarter]
        pinned.release()
        assert ns.get(chain[HALF:]) == new
        # (the get's reply pins its blocks until ZeroMQ says it is sent, which pyzmq's
        # own thread tells a moment after the bytes arrived: seen at 32 on a loaded run)
        deadline = time.monotonic() + 10
        while _dram(c)["pinned_blocks"]:
            assert time.monotonic() < deadline, _dram(c)
            time.sleep(0.01)


def test_a_batch_s_room_for_one_item_evicts_no_block_another_item_holds(
        daemon_factory: Any) -> None:
    """The held blocks of every item are pinned before any item's room is made: the
    first item's room could else evict the blocks the second holds (the coldest), and
    the second then needs slots the admission did not count."""
    from kvstore.client_core import PlanItem

    d = daemon_factory(dram_capacity=CAPACITY)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        cold, blocks = _fill(ns, 0, HALF)  # the coldest: the first eviction's victims
        _fill(ns, 10_000, HALF)  # DRAM full
        bt = IDENTITY.block_tokens
        fresh = ns.keys(range(20_000 * bt, (20_000 + HALF) * bt))
        plan = [PlanItem(0, HALF * bt, fresh), PlanItem(0, HALF * bt, cold)]
        result = ns.reserve_batch(plan)
        assert result.admitted, result
        first, second = result.reservations
        assert min(first.offsets) >= 0 and second.offsets == [-1] * HALF
        for buf in first.buffers:
            buf[:] = bytes(ns.block_bytes)
        assert [r.commit() for r in result.reservations] == [HALF, 0]
        assert ns.get(cold) == blocks


def test_the_commit_sums_only_the_keys_given_slots(daemon_factory: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A held key's buffer is scratch, which the daemon never reads: the client sums
    only the new keys' slots, and their sums reach the daemon unchanged (a reader
    verifies them)."""
    from kvstore import client_core

    d = daemon_factory(dram_capacity=CAPACITY)
    quarter = HALF // 2
    summed: list[int] = []
    real = client_core.checksum

    def counting(data: Any) -> int:
        summed.append(len(data))
        return real(data)

    with Client(d.endpoint, tenant="acme", checksums=True) as c:
        ns = c.namespace(IDENTITY)
        held, _, _ = _full(c, ns)
        chain = ns.keys(range((HALF + quarter) * IDENTITY.block_tokens))
        new = [os.urandom(ns.block_bytes) for _ in range(quarter)]
        monkeypatch.setattr(client_core, "checksum", counting)
        with ns.reserve(chain) as r:
            for buf, data in zip(r.buffers[HALF:], new):
                buf[:] = data
            assert r.commit() == quarter
        monkeypatch.undo()
        assert len(summed) == quarter
        got = ns.acquire(chain[HALF:])
        assert got.checksums == [real(data) for data in new]
        got.release()
        assert ns.get(chain[HALF:]) == new


def test_held_keys_are_not_announced_stored_again(daemon_factory: Any) -> None:
    """The event stream announces a commit's new blocks only: its held keys (already
    announced, in DRAM all along) are in no BlockStored event, and the new blocks that
    follow them hang below the last held key."""
    import msgspec
    from daemon_proc import free_port
    from events_sub import Subscriber, as_dicts

    pub, replay = free_port(), free_port()
    d = daemon_factory(dram_capacity=CAPACITY, env={
        "KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
        "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}"})
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENTITY)
            held, _ = _fill(ns, 0, 8)
            sub.until(c.snapshot().seq)
            seen = len(sub.payloads)
            chain = ns.keys(range(12 * IDENTITY.block_tokens))
            with ns.reserve(chain) as r:
                assert r.offsets[:8] == [-1] * 8
                for buf in r.buffers[8:]:
                    buf[:] = os.urandom(ns.block_bytes)
                assert r.commit() == 4
            sub.until(c.snapshot().seq)
        stored = [e for _, payload in sub.payloads[seen:]
                  for e in map(as_dicts, msgspec.msgpack.decode(payload)[1])
                  if e["type"] == "BlockStored"]
        assert [k for e in stored for k in e["block_hashes"]] == chain[8:]
        assert stored[0]["parent_block_hash"] == held[-1]
        assert sub.index.lookup(chain) == ["dram"] * 12
    finally:
        sub.close()
