"""Requests in line for room: one that waited for room coming keeps its place, passes on a
wake it cannot use, and defers (where the pressure chain has "defer") when the room that
came went to others.  Real daemons, real sockets, SSD writes stalled by a wrapper
(``tests/stalled_disk.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client

TOKENS = 16
BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=TOKENS)  # 64 KiB
STALLED_DISK = Path(__file__).resolve().parents[1] / "stalled_disk.py"


def blocks(first: int, count: int) -> list[bytes]:
    return [bytes([(first + i) % 256]) * BIG.block_bytes for i in range(count)]


def keys(first: int, count: int) -> list[int]:
    return list(range(first, first + TOKENS * count))


def start(tmp_path: Path, **env: str) -> tuple[DaemonProcess, Path]:
    """A daemon of 16 DRAM slots (1 MiB of 64 KiB blocks) over an SSD whose writes stall
    while the returned flag exists; 12 blocks committed, only in DRAM."""
    flag = tmp_path / "stall"
    d = DaemonProcess(tmp_path / "d", dram_capacity="1MiB", ssd_capacity="8MiB",
                      extra=["--slab-size", "1MiB"], env={"STALL_FLAG": str(flag), **env})
    d.run_through(STALLED_DISK).start()
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(BIG)
        ns.put(ns.keys(keys(0, 12)), blocks(0, 12))
        assert c.stats()["tiers"]["ssd"]["committed_slots"] == 0
    return d, flag


def on_thread(results: dict[str, Any], name: str, work: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = work()
        except Exception as exc:  # (reported by the test)
            results[name] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def reserve_and_commit(d: DaemonProcess, first: int, count: int, timeout: float = 60
                       ) -> Callable[[], Any]:
    def work() -> Any:
        with Client(d.endpoint, tenant="acme", timeout=timeout) as c:
            ns = c.namespace(BIG)
            with ns.reserve(ns.keys(keys(first, count))) as r:
                return r.commit(), time.monotonic()
    return work


def wait_for(c: Client, test: Callable[[dict[str, Any]], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not test(c.stats()):
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def waiting(c: Client, count: int) -> None:
    """Until ``count`` requests are in line for room (deferred, or for room coming)."""
    wait_for(c, lambda s: s["scheduling"]["waiting_for_room"] == count,
             f"never {count} requests in line for room")


def test_room_coming_taken_by_another_defers_the_request_until_room_frees(
        tmp_path: Path) -> None:
    """A reserve of 16 demotes the 12 committed blocks, its SSD write stalled; a reserve of
    5 meanwhile waits for that room coming.  The write ends and the first reserve takes
    every slot (held open): the second, "defer" in the pressure chain, waits for room in
    line and goes in once the first is aborted.  Before, it was refused at once ("0 free
    and 0 evictable"), as if the chain had no "defer"."""
    d, flag = start(tmp_path, KVSTORE_DRAM_DEFER_SECONDS="20")
    try:
        flag.touch()
        results: dict[str, Any] = {}
        abort = threading.Event()

        def hold_sixteen() -> int:
            with Client(d.endpoint, tenant="acme", timeout=60) as c:
                ns = c.namespace(BIG)
                r = ns.reserve(ns.keys(keys(1000, 16)))
                abort.wait(30)
                r.abort()
                return 16

        holder = on_thread(results, "holder", hold_sixteen)
        with Client(d.endpoint, tenant="acme") as c:
            wait_for(c, lambda s: s["tiers"]["ssd"]["reserved"] > 0, "no demotion began")
            waiter = on_thread(results, "waiter", reserve_and_commit(d, 5000, 5))
            waiting(c, 1)  # (for the room coming)
            assert c.stats()["scheduling"]["defers"] == 0
            flag.unlink()
            wait_for(c, lambda s: s["tiers"]["dram"]["reserved_slots"] >= 16,
                     "the holder never got its 16 slots")
            time.sleep(0.5)
            assert "waiter" not in results, results  # (deferred: neither in nor refused)
            aborted = time.monotonic()
            abort.set()
            holder.join(30)
            waiter.join(30)
            committed, when = results["waiter"]
            assert committed == 5
            assert when - aborted < 10  # woken by the abort, not at its 20 s deadline
            assert c.stats()["scheduling"]["defers"] >= 1
    finally:
        flag.unlink(missing_ok=True)
        d.stop()


def test_a_wake_the_oldest_waiter_cannot_use_goes_to_the_next_that_can(
        tmp_path: Path) -> None:
    """Two reserves wait for the room a stalled demotion is to free, the older for 10
    slots, the younger for 2 (no "defer" in the chain; each wait for room coming here
    20 s unless woken).  Another client lets 4 slots go: the older, woken, is still
    short and passes the wake on, and the younger goes in at once.  Before, the older
    kept the wake, and the younger waited out its 20 s with the room free."""
    d, flag = start(tmp_path, KVSTORE_DRAM_PRESSURE="evict,demote,reject",
                    ROOM_COMING_WAIT="20", ROOM_COMING_SECONDS="120")
    try:
        results: dict[str, Any] = {}
        with Client(d.endpoint, tenant="acme", timeout=60) as c:
            ns = c.namespace(BIG)
            held = ns.reserve(ns.keys(keys(2000, 4)))  # the 4 free slots
            flag.touch()
            putter = on_thread(results, "put", lambda: _put(d, 3000, 12))  # demotes the 12
            wait_for(c, lambda s: s["tiers"]["ssd"]["reserved"] > 0, "no demotion began")
            older = on_thread(results, "older", reserve_and_commit(d, 5000, 10))
            waiting(c, 1)
            younger = on_thread(results, "younger", reserve_and_commit(d, 7000, 2))
            waiting(c, 2)
            assert not {"older", "younger"} & results.keys(), results
            released = time.monotonic()
            held.abort()
            younger.join(15)
            assert "younger" in results, "the younger waiter was not woken"
            committed, when = results["younger"]
            assert committed == 2
            assert when - released < 5
            flag.unlink()
            putter.join(30)
            older.join(60)
            assert results["put"] == 12
            assert results["older"][0] == 10
    finally:
        flag.unlink(missing_ok=True)
        d.stop()


def _put(d: DaemonProcess, first: int, count: int) -> int:
    with Client(d.endpoint, tenant="acme", timeout=60) as c:
        ns = c.namespace(BIG)
        return ns.put(ns.keys(keys(first, count)), blocks(first % 256, count))
