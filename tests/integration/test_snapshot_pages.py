"""A snapshot in pages while the store changes, against a real daemon with events on.

The pages of one snapshot are read with blocks committed, evicted and dropped between
them; the entries read, then every event after the snapshot's sequence number applied in
order (set operations per block and tier), must equal the daemon's exact state: a
snapshot taken once nothing changes, and the daemon's own lookups.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec
import pytest
from daemon_proc import free_port
from events_sub import TIERS, Subscriber, as_dicts
from kvtest import make_identity

from kvstore import Client
from kvstore import protocol as p
from kvstore.client_wire import check_reply
from kvstore.aclient import AsyncClient
from kvstore.errors import LimitExceededError, MalformedError, NotFoundError
from kvstore.routing import SNAPSHOTS_OPEN, WHOLE_OPEN

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)  # 512-byte blocks

Entry = tuple[bytes, str]


def page(client: Client, cursor: int, limit: int) -> p.SnapshotReply:
    return check_reply(client._call(p.Snapshot(client._next_rid(), cursor, limit))[0],
                       p.SnapshotReply)


def apply(state: set[Entry], payload: bytes) -> None:
    """One batch's events, as a router applies them: idempotent set operations."""
    for event in msgspec.msgpack.decode(payload)[1]:
        e = as_dicts(event)
        if e["type"] == "AllBlocksCleared":
            state.clear()
            continue
        tier = TIERS[(e["medium"], e.get("locality"))]
        for key in e["block_hashes"]:
            if e["type"] == "BlockStored":
                state.add((key, tier))
            else:
                state.discard((key, tier))


def test_a_snapshot_read_while_blocks_change_converges_with_the_events(
        daemon_factory: Any) -> None:
    pub, replay = free_port(), free_port()
    d = daemon_factory(dram_capacity="64MiB", env={
        "KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
        "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}"})
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    rng = random.Random(11)
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            chains = []
            for _ in range(20):
                keys = [rng.randbytes(16) for _ in range(300)]
                ns.reserve(keys).commit()
                chains.append(keys)
            first = page(c, 0, 500)
            assert first.cursor and len(first.blocks) <= 500
            read = {(k, t) for k, _, t in first.blocks}
            pages = 1
            cursor = first.cursor
            while cursor:
                # the store changes between pages: new chains, evictions, extensions
                step = rng.randrange(3)
                if step == 0:
                    keys = [rng.randbytes(16) for _ in range(50)]
                    ns.reserve(keys).commit()
                    chains.append(keys)
                elif step == 1:
                    chain = rng.choice(chains)
                    ns.evict([chain[rng.randrange(len(chain))]])
                else:
                    chain = rng.choice(chains)
                    if ns.lookup(chain).blocks == len(chain):
                        more = [rng.randbytes(16) for _ in range(20)]
                        ns.reserve(more, parent=chain[-1]).commit()
                reply = page(c, cursor, 500)
                assert reply.seq == first.seq  # every page is of the one snapshot
                read |= {(k, t) for k, _, t in reply.blocks}
                cursor = reply.cursor
                pages += 1
            assert pages > 10
            final = c.snapshot()  # nothing changes now: exact
            exact = {(k, t) for k, _, t in final.blocks}
            assert final.seq > first.seq
            sub.until(final.seq)
            state = set(read)
            for seq, payload in sub.payloads:
                if first.seq < seq <= final.seq:
                    apply(state, payload)
            assert read != exact, "nothing changed while the snapshot was read"
            assert state == exact
            # and the daemon's own lookups agree, chain by chain
            for chain in chains:
                hits = ns.lookup(chain).blocks
                assert all((k, "dram") in state for k in chain[:hits])
                assert hits == len(chain) or (chain[hits], "dram") not in state
            # parents first, in the exact one
            seen: set[bytes] = set()
            for key, parent, _ in final.blocks:
                assert parent is None or parent in seen
                seen.add(key)
    finally:
        sub.close()


def test_pages_cursors_and_the_whole_snapshot_of_older_clients(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity="64MiB")
    rng = random.Random(12)
    with Client(d.endpoint, tenant="acme") as c, Client(d.endpoint, tenant="acme") as other:
        ns = c.namespace(IDENT)
        for _ in range(30):  # more than a page: the whole one is built over loop turns
            ns.reserve([rng.randbytes(16) for _ in range(200)]).commit()
        whole = check_reply(c._call(p.Snapshot(c._next_rid()))[0], p.SnapshotReply)
        assert whole.cursor == 0 and len(whole.blocks) == 6000 and whole.seq == -1
        paged = c.snapshot(page=64)
        assert sorted(paged.blocks) == sorted(whole.blocks)
        # a cursor is its session's, and ends: no one else continues it
        first = page(c, 0, 10)
        with pytest.raises(NotFoundError):
            page(other, first.cursor, 10)
        # one more snapshot under way than a session may have ends its oldest
        more = [page(c, 0, 10) for _ in range(SNAPSHOTS_OPEN)]
        with pytest.raises(NotFoundError):
            page(c, first.cursor, 10)
        # (the newer four go on; a page of 10 visits may find no root among a split key
        # map's shards, which list entries by their keys' hashes, and so no entry)
        assert all(page(c, m.cursor, 10).seq == m.seq for m in more)
        with pytest.raises(MalformedError):
            page(c, 0, p.MAX_SNAPSHOT_PAGE + 1)


def test_many_snapshots_at_once_on_one_async_client(daemon_factory: Any) -> None:
    """An async client's snapshots wait for each other: the daemon keeps a few walks a
    session, and more at once than that would end each other's."""
    d = daemon_factory(dram_capacity="64MiB")
    rng = random.Random(3)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        for _ in range(10):
            ns.reserve([rng.randbytes(16) for _ in range(200)]).commit()

    async def main() -> list[p.SnapshotReply]:
        async with AsyncClient(d.endpoint, tenant="acme") as ac:
            return await asyncio.gather(*(ac.snapshot(page=100)
                                          for _ in range(SNAPSHOTS_OPEN + 2)))
    assert [len(r.blocks) for r in asyncio.run(main())] == [2000] * (SNAPSHOTS_OPEN + 2)


@pytest.mark.parametrize("limit", [0, 4096])
def test_a_change_the_first_page_reads_is_announced(daemon_factory: Any, limit: int) -> None:
    """A commit read by a snapshot's first page (sent in the same drain, after the
    snapshot) and evicted before the next batch: the snapshot with the events after its
    number still equals the daemon's state, for the whole snapshot of older clients (its
    first page built in a later task step) as for pages."""
    pub, replay = free_port(), free_port()
    d = daemon_factory(dram_capacity="64MiB", env={
        "KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
        "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}"})
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            ns.reserve([b"A" * 16]).commit()
            seen = 0
            for attempt in range(20):
                x = attempt.to_bytes(2, "big") * 8
                r = ns.reserve([x])
                snap = p.Snapshot(c._next_rid(), 0, limit)
                c._send(snap)
                commit = r._commit_request()
                c._send(commit)  # the same drain, after the snapshot
                first = check_reply(c._wait(snap.rid)[0], p.SnapshotReply)
                c._wait(commit.rid)
                read = {(k, t) for k, _, t in first.blocks}
                ns.evict([x])  # before its batch's quiet interval ends
                final = c.snapshot()
                sub.until(final.seq)
                state = set(read)
                for seq, payload in sub.payloads:
                    if first.seq < seq <= final.seq:
                        apply(state, payload)
                assert state == {(k, t) for k, _, t in final.blocks}, attempt
                seen += (x, "dram") in read
                if seen >= 3:
                    break
            # the whole snapshot's first page reads the commit (a later task step); a
            # page is read where it is asked, before the commit behind it
            assert bool(seen) == (limit == 0)
    finally:
        sub.close()


def test_whole_snapshots_under_way_are_capped_per_session(daemon_factory: Any) -> None:
    """Each whole snapshot (limit 0) keeps its list until its reply goes: a session may
    have ``WHOLE_OPEN`` under way (its tenant too), one more is refused (typed) and the
    others answered."""
    d = daemon_factory(dram_capacity="256MiB")
    rng = random.Random(5)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        for _ in range(80):  # many pages: each whole snapshot takes many loop turns
            ns.reserve([rng.randbytes(16) for _ in range(500)]).commit()
        asks = [p.Snapshot(c._next_rid()) for _ in range(WHOLE_OPEN + 1)]
        for ask in asks:
            c._send(ask)
        replies = [c._wait(ask.rid)[0] for ask in asks]
        assert [len(r.blocks) for r in replies[:WHOLE_OPEN]] == [40000] * WHOLE_OPEN
        with pytest.raises(LimitExceededError):
            check_reply(replies[-1], p.SnapshotReply)
        assert len(c.snapshot().blocks) == 40000  # and nothing is left counted
