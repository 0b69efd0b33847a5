"""``lookup_pin`` against the real daemon: a lookup that pins its leading DRAM hits in
the same round trip, and leaves no pin when it is refused."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client
from kvstore import protocol as p
from kvstore.aclient import AsyncClient
from kvstore.client_wire import check_reply
from kvstore.errors import MalformedError, TooLargeError, UnknownNamespaceError


def pinned(client: Client) -> int:
    stats = client.stats()
    assert stats["invariant_violations"] == 0
    count: int = stats["tiers"]["dram"]["pinned_blocks"]
    return count


def test_lookup_pin_answers_as_lookup_and_pins_the_leading_hits(
        daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(16 * 6))
        data = [os.urandom(ns.block_bytes) for _ in range(4)]
        ns.put(keys[:4], data)
        found, held = ns.lookup_pin(keys)
        assert found == ns.lookup(keys)
        assert found.blocks == 4 and found.tiers == ["dram"] * 4
        assert held is not None and held.keys == keys[:4] and len(held.offsets) == 4
        assert [bytes(b) for b in held.buffers] == data  # the pinned slots hold the blocks
        assert pinned(client) == 4
        held.release()
        assert pinned(client) == 0
        missing, none = ns.lookup_pin(ns.keys(range(50_000, 50_032)))
        assert missing.blocks == 0 and none is None and pinned(client) == 0


def test_lookup_pin_over_a_lookup_only_client_gives_offsets_and_releases(
        daemon: DaemonProcess) -> None:
    # A scheduler's link maps no arena: the pin's offsets are what it passes on.
    with Client(daemon.endpoint, tenant="acme") as writer, \
            Client(daemon.endpoint, tenant="acme", map_arena=False) as looker:
        ident = make_identity()
        keys = writer.namespace(ident).keys(range(16 * 3))
        writer.namespace(ident).put(keys, [os.urandom(ident.block_bytes)] * 3)
        ns = looker.namespace(ident)
        found, held = ns.lookup_pin(keys)
        assert found.blocks == 3 and held is not None
        assert len(held.offsets) == 3 and held.buffers == []
        assert pinned(writer) == 3
        held.release()  # posted: done before the looker's next request
        assert pinned(looker) == 0


def ask(client: Client, ns_id: bytes, keys: list[bytes]) -> p.LookupPinReply:
    received = client._call(p.LookupPin(client._next_rid(), ns_id, keys))
    return check_reply(received[0], p.LookupPinReply)


def test_refused_lookup_pins_leave_no_pin(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(16 * 2))
        ns.put(keys, [os.urandom(ns.block_bytes)] * 2)
        with pytest.raises(UnknownNamespaceError):
            ask(client, b"\0" * 16, keys)
        with pytest.raises(MalformedError):  # a key of the wrong length
            ask(client, ns.id, [keys[0], b"short"])
        too_many = keys * (client.max_keys // 2 + 1)
        with pytest.raises(TooLargeError):
            ask(client, ns.id, too_many)
        assert pinned(client) == 0
        # past one request's keys the client looks up as lookup does: nothing pinned
        found, held = ns.lookup_pin(too_many)
        assert found == ns.lookup(too_many) and held is None and pinned(client) == 0


def test_a_session_at_its_pin_limit_gets_the_lookup_and_no_pin(
        daemon_factory: Any) -> None:
    d = daemon_factory(env={"KVSTORE_SERVER_MAX_PINS_PER_SESSION": "1"})
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(16 * 2))
        ns.put(keys, [os.urandom(ns.block_bytes)] * 2)
        first = ns.acquire(keys[:1])
        found, held = ns.lookup_pin(keys)
        assert found.blocks == 2 and held is None
        assert pinned(client) == 1
        first.release()
        found, held = ns.lookup_pin(keys)
        assert found.blocks == 2 and held is not None and pinned(client) == 2
        held.release()
        assert pinned(client) == 0


def test_async_lookup_pin(daemon: DaemonProcess) -> None:
    async def run() -> Any:
        async with AsyncClient(daemon.endpoint, tenant="acme") as client:
            ns = await client.namespace(make_identity())
            keys = ns.keys(range(16 * 3))
            await ns.put(keys, [os.urandom(ns.block_bytes)] * 3)
            found, held = await ns.lookup_pin(keys)
            assert found.blocks == 3 and held is not None and len(held.buffers) == 3
            stats = await client.stats()
            assert stats["tiers"]["dram"]["pinned_blocks"] == 3
            await held.release()
            stats = await client.stats()
            return stats["tiers"]["dram"]["pinned_blocks"]
    assert asyncio.run(run()) == 0
