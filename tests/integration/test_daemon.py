"""The real daemon process over real ZeroMQ sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kvtest import make_identity, wait_for_lease_end
from daemon_proc import DaemonProcess

from kvstore import Client
from kvstore.errors import (
    CapacityError,
    ForbiddenError,
    KVStoreError,
    LeaseExpiredError,
    MalformedError,
    NotFoundError,
    UnknownNamespaceError,
)

BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 256 KiB blocks
WORKERS = str(Path(__file__).parent.parent / "workers.py")


def dram(client: Client) -> dict[str, Any]:
    stats = client.stats()
    assert stats["invariant_violations"] == 0
    tier: dict[str, Any] = stats["tiers"]["dram"]
    return tier


def blocks_for(n: int, size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_round_trip_through_both_planes_from_several_processes(
        daemon: DaemonProcess, transport: str) -> None:
    endpoint = daemon.endpoint if transport == "ipc" else daemon.tcp_endpoint
    assert endpoint is not None
    procs = [subprocess.Popen([sys.executable, WORKERS, "roundtrip", endpoint, f"s{i}", "3"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(4)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip() == b"ok", err.decode()
    with Client(endpoint, tenant="acme") as client:
        t = dram(client)
        assert t["reserved"] == 0 and t["pinned_blocks"] == 0
        assert t["blocks"] == 4 * 3 * 8


def test_async_client_pipelines(daemon: DaemonProcess) -> None:
    import asyncio

    from kvstore import AsyncClient

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, tenant="acme") as client:
            ns = await client.namespace(make_identity())
            chains = [ns.keys([c * 1000 + t for t in range(64)]) for c in range(8)]
            data = [blocks_for(4, ns.block_bytes) for _ in chains]
            await asyncio.gather(*(ns.put(k, d) for k, d in zip(chains, data)))
            got = await asyncio.gather(*(ns.get(k) for k in chains))
            assert got == data
            async with ns.reserve(ns.keys(range(50_000, 50_032))) as r:
                for buf in r.buffers:
                    buf[:] = b"\x07" * ns.block_bytes
                assert await r.commit() == 2
            async with ns.acquire(ns.keys(range(50_000, 50_032))) as held:
                assert all(bytes(b) == b"\x07" * ns.block_bytes for b in held.buffers)
            assert (await ns.lookup(chains[3])).blocks == 4
            stats = await client.stats()
            assert stats["tiers"]["dram"]["pinned_blocks"] == 0

    asyncio.run(main())


@pytest.mark.parametrize("first_release", ["a", "b"])
def test_shared_prefix_is_freed_only_after_the_last_pin(
        daemon_factory: Any, first_release: str) -> None:
    ident = BIG
    # exactly eight slots in the tier
    d = daemon_factory(dram_capacity=str(8 * ident.block_bytes),
                       extra=["--slab-size", str(8 * ident.block_bytes)])
    with Client(d.endpoint, tenant="acme") as a, Client(d.endpoint, tenant="acme") as b:
        ns_a, ns_b = a.namespace(ident), b.namespace(ident)
        prefix = list(range(16 * 8))
        keys = ns_a.keys(prefix)
        data = blocks_for(8, ns_a.block_bytes)
        ns_a.put(keys, data)
        keys_b = ns_b.keys(prefix)
        assert keys_b == keys
        assert ns_b.lookup(keys_b).blocks == 8
        held_a, held_b = ns_a.acquire(keys), ns_b.acquire(keys_b)
        assert [bytes(x) for x in held_b.buffers] == data
        other = ns_a.keys(list(range(90_000, 90_016)))
        with pytest.raises(CapacityError):
            ns_a.reserve(other)
        first, second = (held_a, held_b) if first_release == "a" else (held_b, held_a)
        first.release()
        with pytest.raises(CapacityError):
            ns_a.reserve(other)
        assert ns_a.get(keys) == data
        second.release()
        with ns_a.reserve(other) as r:       # now the leaf of the shared chain goes
            r.commit()
        assert ns_b.lookup(keys).blocks == 7
        assert dram(a)["evictions"] == 1


def test_abort_and_exception_in_with_return_every_slot(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(16 * 10))
        r = ns.reserve(keys)
        assert dram(client)["reserved_slots"] == 10
        r.abort()
        assert dram(client)["reserved_slots"] == 0
        with pytest.raises(RuntimeError):
            with ns.reserve(keys) as r:
                r.buffers[0][:3] = b"abc"
                raise RuntimeError("engine failed mid-write")
        with ns.reserve(keys[:2]):
            pass                                   # left without commit: aborted
        t = dram(client)
        assert t["reserved_slots"] == 0 and t["committed_slots"] == 0
        assert ns.lookup(keys).blocks == 0


@pytest.mark.parametrize("worker,stat", [("hold_reservation", "reserved_slots"),
                                         ("hold_pin", "pinned_blocks")])
def test_a_killed_client_loses_its_holdings_when_its_lease_ends(
        daemon_factory: Any, worker: str, stat: str) -> None:
    d = daemon_factory(lease=1.0)
    proc = subprocess.Popen([sys.executable, WORKERS, worker, d.endpoint, "6"],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() in (b"reserved", b"pinned")
    with Client(d.endpoint, tenant="acme") as client:
        assert dram(client)[stat] == 6
        proc.kill()
        proc.wait()
        proc.stdout.close()
        deadline = time.monotonic() + 10
        while dram(client)[stat] and time.monotonic() < deadline:
            time.sleep(0.2)
        t = dram(client)
        assert t[stat] == 0 and t["reserved_slots"] == 0
        assert t["lease_expiries"] >= 1


def test_a_silent_client_gets_lease_expired(daemon_factory: Any) -> None:
    d = daemon_factory(lease=0.5)
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        r = ns.reserve(ns.keys(range(32)))
        wait_for_lease_end(d.endpoint, "acme", at_most=1.5)
        with pytest.raises(LeaseExpiredError):
            r.commit()


def test_a_full_tier_evicts_leaves_and_refuses_when_all_is_pinned(
        daemon_factory: Any) -> None:
    ident = BIG
    d = daemon_factory(dram_capacity=str(16 * ident.block_bytes),
                       extra=["--slab-size", str(16 * ident.block_bytes)])
    with Client(d.endpoint, tenant="acme") as client:
        ns = client.namespace(ident)
        first = ns.keys(range(16 * 12))
        ns.put(first, blocks_for(12, ns.block_bytes))
        second = ns.keys(range(100_000, 100_000 + 16 * 8))
        data = blocks_for(8, ns.block_bytes)
        ns.put(second, data)              # needs 4 evictions: the leaves of `first`
        assert ns.lookup(first).blocks == 8, "eviction must take leaves first"
        assert ns.get(second) == data
        assert dram(client)["evictions"] == 4
        held = ns.acquire(first[:8])
        held2 = ns.acquire(second)
        with pytest.raises(CapacityError):
            ns.put(ns.keys(range(200_000, 200_016)), blocks_for(1, ns.block_bytes))
        assert dram(client)["reserved_slots"] == 0
        client.ping()                      # the daemon keeps serving
        held.release()
        held2.release()
        assert ns.put(ns.keys(range(200_000, 200_016)), blocks_for(1, ns.block_bytes)) == 1


@pytest.mark.parametrize("change", [
    {"model_revision": "r2"}, {"adapter": "lora-a"}, {"kv_dtype": "bfloat16"},
    {"block_tokens": 32}, {"salt": "image:1"},
])
def test_any_identity_change_misses(module_daemon: DaemonProcess,
                                    change: dict[str, Any]) -> None:
    """(The cases share a daemon: a base stored again is still a hit, and no case stores
    under a changed identity.)"""
    daemon = module_daemon
    with Client(daemon.endpoint, tenant="acme") as client:
        base = client.namespace(make_identity())
        tokens = list(range(256))
        base.put(base.keys(tokens), blocks_for(16, base.block_bytes))
        other = client.namespace(make_identity(**change))
        assert other.lookup(other.keys(tokens)).blocks == 0
        assert base.lookup(base.keys(tokens)).blocks == 16


def test_tenants_are_isolated(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, tenant="acme") as a, \
            Client(daemon.endpoint, tenant="globex") as b:
        ns_a = a.namespace(make_identity(tenant="acme"))
        keys = ns_a.keys(range(128))
        ns_a.put(keys, blocks_for(8, ns_a.block_bytes))
        with pytest.raises(ForbiddenError):
            b.namespace(make_identity(tenant="acme"))
        ns_b = b.namespace(make_identity(tenant="globex"))
        assert ns_b.lookup(ns_b.keys(range(128))).blocks == 0
        assert ns_b.lookup(keys).blocks == 0       # A's very keys, in B's namespace
        with pytest.raises(NotFoundError):
            ns_b.acquire(keys)
        with pytest.raises(NotFoundError):
            ns_b.get(keys)
        ns_b.id = ns_a.id                          # forge A's namespace id
        for call in (lambda: ns_b.lookup(keys), lambda: ns_b.acquire(keys),
                     lambda: ns_b.get(keys), lambda: ns_b.evict(keys), ns_b.drop):
            with pytest.raises(UnknownNamespaceError):
                call()
        assert ns_a.lookup(keys).blocks == 8


def test_parent_evicted_between_lookup_and_reserve_is_reported(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(64))
        ns.put(keys[:2], blocks_for(2, ns.block_bytes))
        assert ns.lookup(keys).blocks == 2
        assert ns.evict(keys[:1]) == 2              # takes the child with it
        with pytest.raises(NotFoundError, match="parent"):
            ns.reserve(keys[2:])
        assert dram(client)["reserved_slots"] == 0


def test_bad_client_input_is_rejected_cleanly(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(make_identity())
        keys = ns.keys(range(64))
        with pytest.raises(MalformedError):
            ns.put(keys, blocks_for(3, ns.block_bytes))
        with pytest.raises(MalformedError):
            ns.put(keys[:1], [b"short"])
        with pytest.raises(MalformedError):
            ns.lookup([b"not sixteen bytes"])
        with pytest.raises(KVStoreError):
            ns.reserve(keys * 2000)                # more keys than one request may carry
        t = dram(client)
        assert t["reserved_slots"] == 0 and t["committed_slots"] == 0


def test_readers_verify_what_they_read_end_to_end(daemon: DaemonProcess) -> None:
    from kvstore.errors import CorruptError

    with Client(daemon.endpoint, tenant="acme", checksums=True) as writer, \
            Client(daemon.endpoint, tenant="acme") as reader:
        ns = writer.namespace(make_identity())
        keys = ns.keys(range(64))
        data = blocks_for(4, ns.block_bytes)
        ns.put(keys[:2], data[:2])                               # frames
        with ns.reserve(keys[2:]) as r:                          # arena
            for buf, block in zip(r.buffers, data[2:]):
                buf[:] = block
            r.commit()
        rns = reader.namespace(make_identity())
        assert rns.get(keys) == data
        with rns.acquire(keys) as held:
            held.verify()
            offset = held.offsets[3]
        # a buggy colocated writer scribbles over a committed block in the shared arena
        view = writer._slots([offset], ns.block_bytes, readonly=False)[0]
        view[:8] = b"\xff" * 8
        view.release()
        with pytest.raises(CorruptError):
            rns.get(keys)
        with rns.acquire(keys) as held, pytest.raises(CorruptError):
            held.verify()
        assert rns.get(keys[:3]) == data[:3]


def test_release_is_sent_without_waiting_and_reaches_the_daemon(
        daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    import signal

    assert daemon.proc is not None
    with Client(daemon.endpoint, tenant="acme", timeout=5) as client:
        ns = client.namespace(BIG)
        keys = ns.keys(range(8 * 16))
        ns.put(keys, blocks_for(8, ns.block_bytes))
        held = ns.acquire(keys)
        assert dram(client)["pinned_blocks"] == 8
        daemon.proc.send_signal(signal.SIGSTOP)  # a daemon that answers nothing for now
        try:
            started = time.monotonic()
            held.release()
            assert time.monotonic() - started < 1.0  # no round trip (a call would wait 5 s)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert dram(client)["pinned_blocks"] == 0  # served before the next request

        # Released just before close: close sends it on before the socket goes.
        ns.acquire(keys).release()
    with Client(daemon.endpoint, tenant="acme") as other:
        assert dram(other)["pinned_blocks"] == 0

    # A release the daemon refuses (no such pin) is logged; the next call is unaffected.
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(BIG)
        held = ns.acquire(keys)
        real = held.pin
        held.pin = real + 1000
        with caplog.at_level("WARNING", logger="kvstore.client"):
            held.release()
            assert ns.lookup(keys).blocks == 8
        assert any("refused a posted release" in r.getMessage() and "pin" in r.getMessage()
                   for r in caplog.records)
        assert dram(client)["pinned_blocks"] == 8  # the real pin is still held


def test_every_burst_is_answered_whatever_its_size(daemon: DaemonProcess) -> None:
    """The drain stops after one message when nothing else waits, and reads on when more
    do: bursts of 1, 2, 3 and past a drain's batch (and past the receive high-water
    mark) are each answered in full, with no wake-up lost between them."""
    import zmq

    from kvstore import protocol as p

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(daemon.endpoint)
    try:
        sock.send(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "acme", "")))
        assert isinstance(p.reply_decoder.decode(sock.recv()), p.HelloReply)
        rid = 1
        for burst in (1, 2, 1, 3, 1, 600, 1, 2):
            rids = list(range(rid + 1, rid + 1 + burst))
            rid += burst
            for r in rids:
                sock.send(p.encoder.encode(p.Ping(r)))
            got = [p.reply_decoder.decode(sock.recv()) for _ in rids]
            assert [(type(reply), reply.rid) for reply in got] == [(p.OkReply, r)
                                                                   for r in rids]
    finally:
        sock.close()
        ctx.term()
