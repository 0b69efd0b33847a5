"""Room the daemon's own background work is about to free counts as room coming: a request
for DRAM slots that this work holds for a moment waits for it and goes in, rather than
being refused as if engines' pins held the slots.  Real daemons, real sockets; with no
"defer" step in the pressure chain, so that only the wait for room coming can save such
a request."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from kvtest import make_identity, removed_after, wait_for_file

from kvstore import AsyncClient, Client
from kvstore.errors import CapacityError

TOKENS = 16
BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=TOKENS)  # 64 KiB
NO_DEFER = {"KVSTORE_DRAM_PRESSURE": "evict,demote,reject"}
STALLED_DISK = Path(__file__).resolve().parents[1] / "stalled_disk.py"


def blocks(first: int, count: int) -> list[bytes]:
    return [bytes([(first + i) % 256]) * BIG.block_bytes for i in range(count)]


def fill_dram(d: DaemonProcess) -> None:
    """12 of the 16 slots of a 1 MiB DRAM: below where blocks are copied to SSD ahead of
    need, so that every one is only in DRAM and must be demoted before its slot frees."""
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        ns.put(ns.keys(range(TOKENS * 12)), blocks(0, 12))
        assert c.stats()["tiers"]["ssd"]["committed_slots"] == 0


A_KEYS = list(range(10_000, 10_000 + TOKENS * 16))  # the 4 free slots, the 12 demoted
B_KEYS = list(range(50_000, 50_000 + TOKENS * 5))  # one more than is free


def put_behind_stalled_demotions(d: DaemonProcess, results: dict[str, Any],
                                 timeout: float) -> threading.Thread:
    """A put of 16 blocks into a DRAM of 12 (``fill_dram``) on a thread, its result (or
    error) in ``results["put"]``; returned once the write of its demotions began (and
    stalled, the disk's flag set)."""
    def put() -> None:
        try:
            with Client(d.endpoint, tenant="acme", timeout=timeout) as c:
                ns = c.namespace(BIG)
                results["put"] = ns.put(ns.keys(A_KEYS), blocks(100, 16))
        except Exception as exc:  # (reported by the caller)
            results["put"] = exc

    putter = threading.Thread(target=put)
    putter.start()
    with Client(d.endpoint, tenant="acme") as c:
        deadline = time.monotonic() + 10
        while c.stats()["tiers"]["ssd"]["reserved"] == 0:  # the demotions' write
            assert time.monotonic() < deadline, "the put's demotions never began"
            time.sleep(0.01)
    return putter


def test_the_room_a_requests_demotions_free_is_its_own_first(tmp_path: Path) -> None:
    """A put demotes the 12 blocks it needs the slots of, its SSD write slow; a reserve
    of 5 slots meanwhile waits for that room coming.  The write ends: the put takes its
    16 slots, then the reserve gets what the put's blocks make (it demotes 5 of them).
    Before, the write's end woke the reserve, whose task ran before the put's, and took
    5 of the slots just freed; the put, 11 free and nothing evictable, was refused."""
    flag = tmp_path / "stall"
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB", ssd_capacity="8MiB",
                      extra=["--slab-size", "1MiB"], env={**NO_DEFER, "STALL_FLAG": str(flag)})
    d.run_through(STALLED_DISK)
    d.start()
    try:
        fill_dram(d)
        flag.touch()
        results: dict[str, Any] = {}

        def reserve() -> None:
            try:
                with Client(d.endpoint, tenant="acme", timeout=30) as c:
                    ns = c.namespace(BIG)
                    with ns.reserve(ns.keys(B_KEYS)) as r:
                        results["reserve"] = r.commit()
            except Exception as exc:
                results["reserve"] = exc

        putter = put_behind_stalled_demotions(d, results, timeout=30)
        reserver = threading.Thread(target=reserve)
        reserver.start()
        time.sleep(0.3)  # (the reserve waits for the room coming meanwhile)
        assert "reserve" not in results, results
        flag.unlink()
        putter.join(30)
        reserver.join(30)
        assert results == {"put": 16, "reserve": 5}, results
    finally:
        flag.unlink(missing_ok=True)
        d.stop()


def test_a_reserve_read_with_a_put_that_plans_demotions_waits_for_them(
        daemon_factory: Any) -> None:
    """A put and a reserve read in one drain of the socket (queued while the daemon was
    busy): the put plans the demotion of the one evictable DRAM block to SSD; the reserve,
    needing more than is free, found nothing evictable and no SSD write under way yet
    (the put's starts in a task, after the reserve was handled) and was refused, "1 free
    and 0 evictable", though the demotion was about to free room, and the put's blocks
    to be evictable."""
    d = daemon_factory(dram_capacity="1MiB", ssd_capacity="8MiB",
                       extra=["--slab-size", "1MiB"], env=NO_DEFER)
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        held = ns.reserve(ns.keys(range(90_000, 90_000 + TOKENS * 13)))  # left open
        ns.put(ns.keys(range(TOKENS * 2)), blocks(0, 2))  # 2 evictable, 1 slot free

        async def put_and_reserve() -> list[Any]:
            async with AsyncClient(d.endpoint, tenant="acme") as ac:
                ans = await ac.namespace(BIG)

                async def reserve_then_commit() -> int:
                    r = await ans.reserve(ans.keys(B_KEYS[:TOKENS * 3]))
                    return await r.commit()

                assert d.proc is not None
                d.proc.send_signal(signal.SIGSTOP)
                try:
                    # (small messages, both taken in by the daemon's socket while it is
                    # stopped, so that it reads them in one drain once going again)
                    a = asyncio.ensure_future(ans.put(ans.keys(A_KEYS[:TOKENS * 2]),
                                                      blocks(100, 2)))
                    b = asyncio.ensure_future(reserve_then_commit())
                    await asyncio.sleep(0.5)  # both sent, unread by the stopped daemon
                finally:
                    d.proc.send_signal(signal.SIGCONT)
                return list(await asyncio.gather(a, b, return_exceptions=True))

        assert asyncio.run(put_and_reserve()) == [2, 3]
        assert c.stats()["tiers"]["ssd"]["demotions"] >= 1  # the put's room
        held.abort()


def reserve_beside_a_held_prefetch(c: Client, first: list[bytes], flag: Path,
                                   reached: Path) -> None:
    """The 12 blocks of ``first`` prefetched back into DRAM, their reads held while
    ``flag`` exists (a wrapper creates ``reached`` then): a reserve of 5 meanwhile waits
    for them, the flag gone after a while, and goes in."""
    ns = c.namespace(BIG)
    flag.touch()
    ns.post_prefetch(first)
    wait_for_file(reached, "the prefetch's reads never began")
    dram = c.stats()["tiers"]["dram"]
    assert dram["reserved_slots"] == 12, dram
    with removed_after(flag):
        with ns.reserve(ns.keys(B_KEYS)) as r:
            assert r.commit() == 5
    assert ns.lookup(ns.keys(B_KEYS)).blocks == 5


def test_a_reserve_waits_for_the_promotions_that_hold_dram_slots(tmp_path: Path) -> None:
    """A prefetch's reads from SSD hold 12 of the 16 DRAM slots (reserved for them) while
    the disk is slow; a reserve of 5, with 4 blocks evictable, waits for the reads, then
    evicts what they brought in (a prefetch pins nothing).  Before, it was refused, "0
    free and 4 evictable", as if engines' pins held the slots being read into."""
    stall, reads, reached = tmp_path / "stall", tmp_path / "reads", tmp_path / "reached"
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB", ssd_capacity="8MiB",
                      extra=["--slab-size", "1MiB"],
                      env={**NO_DEFER, "STALL_FLAG": str(stall),
                           "STALL_READS_FLAG": str(reads), "STALL_READS_REACHED": str(reached)})
    d.run_through(STALLED_DISK)
    d.start()
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(BIG)
            first = ns.keys(range(TOKENS * 12))
            ns.put(first, blocks(0, 12))
            ns.put(ns.keys(A_KEYS), blocks(100, 16))  # the first 12 go down to SSD
            assert ns.lookup(first).tiers == ["ssd"] * 12
            reserve_beside_a_held_prefetch(c, first, reads, reached)  # from SSD
    finally:
        reads.unlink(missing_ok=True)
        d.stop()


def test_a_reserve_waits_for_the_remote_reads_that_hold_dram_slots(
        tmp_path: Path, redis_server: Any) -> None:
    """A prefetch's reads from the remote store hold 12 of the 16 DRAM slots (reserved for
    them) while the store is slow; a reserve of 5, with 4 blocks evictable, waits for the
    reads, then evicts what they brought in.  Before, it was refused, "0 free and 4
    evictable", and nothing woke what waited for room when the reads ended."""
    flag, reached = tmp_path / "hold", tmp_path / "reached"
    remote = ["--remote", redis_server.url]
    writer = DaemonProcess(tmp_path / "writer", extra=remote)
    writer.start()
    try:
        with Client(writer.endpoint, tenant="acme") as c:
            ns = c.namespace(BIG)
            first = ns.keys(range(TOKENS * 12))
            ns.put(first, blocks(0, 12))  # (written through to the remote store)
            deadline = time.monotonic() + 10
            while c.stats()["remote"]["writes"] < 12:
                assert time.monotonic() < deadline, c.stats()["remote"]
                time.sleep(0.02)
    finally:
        writer.stop()
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB", extra=["--slab-size", "1MiB", *remote],
                      env={**NO_DEFER, "REMOTE_HOLD_FLAG": str(flag),
                           "REMOTE_HOLD_REACHED": str(reached)})
    d.run_through(Path(__file__).resolve().parents[1] / "slow_remote.py")
    d.start()
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(BIG)
            ns.put(ns.keys(A_KEYS[:TOKENS * 4]), blocks(100, 4))  # 4 evictable
            reserve_beside_a_held_prefetch(c, first, flag, reached)  # from the remote store
    finally:
        flag.unlink(missing_ok=True)
        d.stop()


def test_a_put_waits_for_the_write_through_sends_that_pin_dram(
        tmp_path: Path, redis_server: Any) -> None:
    """Every DRAM block pinned by its write-through send to the remote store, the store
    slow: a put waits for the sends, then evicts what they sent.  Before, it was
    refused, "0 free and 0 evictable", as if engines held the pins; and then (each wait
    for room coming here 20 s unless woken) the sends' end woke nobody: the put went in
    only when its wait ran out."""
    flag, reached = tmp_path / "hold", tmp_path / "reached"
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB",
                      extra=["--slab-size", "1MiB", "--remote", redis_server.url],
                      env={**NO_DEFER, "REMOTE_HOLD_FLAG": str(flag),
                           "REMOTE_HOLD_REACHED": str(reached), "REMOTE_HOLD_WRITES": "1",
                           "ROOM_COMING_WAIT": "20"})
    d.run_through(Path(__file__).resolve().parents[1] / "slow_remote.py")
    d.start()
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(BIG)
            flag.touch()
            ns.put(ns.keys(A_KEYS), blocks(100, 16))  # all of DRAM, its sends held
            deadline = time.monotonic() + 10
            while c.stats()["tiers"]["dram"]["pinned_blocks"] < 16:
                assert time.monotonic() < deadline, c.stats()["tiers"]["dram"]
                time.sleep(0.01)
            start = time.monotonic()
            with removed_after(flag):
                assert ns.put(ns.keys(B_KEYS), blocks(200, 5)) == 5
            assert time.monotonic() - start < 10  # woken as the sends ended
            assert ns.lookup(ns.keys(B_KEYS)).blocks == 5
    finally:
        flag.unlink(missing_ok=True)
        d.stop()


@contextmanager
def write_through_stalled(tmp_path: Path, **env: str) -> Iterator[Any]:
    """A namespace of a daemon of 16 DRAM slots writing through to SSD, the write of its
    first 2 blocks stalled (a client's timeout of 5 s)."""
    flag = tmp_path / "stall"
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB", ssd_capacity="8MiB",
                      extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-through"],
                      env={**NO_DEFER, "STALL_FLAG": str(flag), **env})
    d.run_through(STALLED_DISK).start()
    try:
        with Client(d.endpoint, tenant="acme", timeout=5) as c:
            ns = c.namespace(BIG)
            flag.touch()
            ns.put(ns.keys(range(TOKENS * 2)), blocks(0, 2))  # its write-through stalls
            deadline = time.monotonic() + 10
            while c.stats()["tiers"]["ssd"]["reserved"] == 0:
                assert time.monotonic() < deadline, "the write-through never began"
                time.sleep(0.01)
            yield ns
    finally:
        flag.unlink(missing_ok=True)
        d.stop()


def test_a_request_over_its_tenants_whole_quota_is_refused_at_once(tmp_path: Path) -> None:
    """A put of more than the tenant's whole DRAM quota can never fit: refused at once,
    however much of the tenant's room is coming (its write-through to SSD stalled here).
    Before, it waited for that room in rounds, and the stalled write kept it from an
    answer until its client gave up."""
    quota = {"KVSTORE_DRAM_TENANT_QUOTA": str(8 * BIG.block_bytes)}
    with write_through_stalled(tmp_path, **quota) as ns:
        with pytest.raises(CapacityError, match="quota"):
            ns.put(ns.keys(range(70_000, 70_000 + TOKENS * 9)), blocks(200, 9))


def test_a_request_for_more_than_the_whole_tier_is_refused_at_once(tmp_path: Path) -> None:
    """A put of 17 blocks into a DRAM tier of 16 slots can never fit: refused at once,
    however much room is coming (a write-through to SSD stalled here).  Before, it
    waited for that room in rounds, unanswered until its client gave up."""
    with write_through_stalled(tmp_path) as ns, pytest.raises(CapacityError, match="17 slots"):
        ns.put(ns.keys(range(70_000, 70_000 + TOKENS * 17)), blocks(200, 17))


def test_a_request_waits_for_room_coming_within_a_bound_then_is_refused(
        tmp_path: Path) -> None:
    """The disk stops answering under a put's demotions: a reserve waiting for the room
    they were to free is refused once its bound passes (here 1 s), its slots and payload
    let go, not held for its 1000 rounds of half a second (500 s); the disk back, the put
    goes in and a reserve then too."""
    flag = tmp_path / "stall"
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB", ssd_capacity="8MiB",
                      extra=["--slab-size", "1MiB"],
                      env={**NO_DEFER, "STALL_FLAG": str(flag), "ROOM_COMING_SECONDS": "1"})
    d.run_through(STALLED_DISK)
    d.start()
    try:
        fill_dram(d)
        flag.touch()
        results: dict[str, Any] = {}
        putter = put_behind_stalled_demotions(d, results, timeout=60)
        with Client(d.endpoint, tenant="acme", timeout=60) as c:
            ns = c.namespace(BIG)
            start = time.monotonic()
            with pytest.raises(CapacityError, match="did not end within 1s"):
                ns.reserve(ns.keys(B_KEYS))
            assert 1.0 <= time.monotonic() - start < 20
            assert c.stats()["tiers"]["dram"]["reserved_slots"] == 0  # none kept
            flag.unlink()
            putter.join(30)
            assert results == {"put": 16}, results
            with ns.reserve(ns.keys(B_KEYS)) as r:
                assert r.commit() == 5
    finally:
        flag.unlink(missing_ok=True)
        d.stop()
