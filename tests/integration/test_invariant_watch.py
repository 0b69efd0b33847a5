"""The invariant check after requests: inline while the store is small, in a forked
snapshot beyond, one at a time, with the last state always checked."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from daemon_proc import DaemonProcess

from kvstore import Client, Identity
from kvstore.invariant_watch import InvariantWatch


class State:
    """What the check asserts on, and how long it takes."""

    def __init__(self, size: int) -> None:
        self.ok = True
        self.size = size
        self.delay = 0.0
        self.found: list[str] = []

    def check(self) -> None:
        time.sleep(self.delay)
        if not self.ok:
            raise AssertionError("the state is broken")


def _watch(loop: asyncio.AbstractEventLoop, state: State) -> InvariantWatch:
    return InvariantWatch(loop, state.check, lambda: state.size, state.found.append,
                          inline_blocks=100)


async def _settled(watch: InvariantWatch) -> None:
    deadline = time.monotonic() + 30
    while watch.running and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not watch.running


def test_a_small_store_is_checked_inline() -> None:
    async def go() -> None:
        state = State(size=100)
        watch = _watch(asyncio.get_running_loop(), state)
        assert watch.after_request() is True
        state.ok = False
        assert watch.after_request() is False
        assert state.found == ["the state is broken"] and watch.forked == 0

    asyncio.run(go())


def test_a_large_store_is_checked_in_a_snapshot_off_the_loop() -> None:
    async def go() -> None:
        state = State(size=101)
        watch = _watch(asyncio.get_running_loop(), state)
        state.ok = False
        assert watch.after_request() is True  # the verdict comes later
        state.ok = True  # mended at once here; the child checks the state as it was
        assert watch.running and not state.found
        await _settled(watch)
        assert state.found == ["the state is broken"]
        watch.after_request()
        await _settled(watch)
        assert state.found == ["the state is broken"] and watch.forked == 2

    asyncio.run(go())


def test_requests_during_a_check_ask_for_one_more() -> None:
    async def go() -> None:
        state = State(size=10_000)
        state.delay = 1.0
        watch = _watch(asyncio.get_running_loop(), state)
        watch.after_request()
        state.ok = False  # broken after the first snapshot: only the next check sees it
        started = time.monotonic()
        for _ in range(5):
            watch.after_request()
        assert time.monotonic() - started < 0.5  # the loop was not held by the checks
        await _settled(watch)
        await asyncio.sleep(0.05)
        await _settled(watch)
        assert watch.forked == 2
        assert state.found == ["the state is broken"]
        watch.close()

    asyncio.run(go())


def _children(pid: int) -> list[str]:
    """The states of a process's children (``Z`` for one not reaped)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(fields[0])
    return out


def test_a_daemon_past_the_inline_size_checks_in_snapshots_and_reaps_them(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(dram_capacity="160MiB", extra=["--lease", "600"])
    assert d.proc is not None
    ident = Identity(model="watch", model_revision="r", tenant="t", kv_dtype="float16",
                     num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16)
    with Client(d.endpoint, tenant="t") as client:
        ns = client.namespace(ident)
        chains = [[os.urandom(16) for _ in range(1024)] for _ in range(21)]
        for keys in chains:  # past 20k blocks: the checks after these go to a child
            ns.reserve(keys).commit()
        for keys in chains[-3:]:
            assert ns.lookup(keys).blocks == 1024
            ns.evict([keys[-1]])
        # every request ends with a check: once requests stop, the last one ends too
        # (a check queued meanwhile starts as the one before is reaped: quiet means no
        # child seen for a while)
        quiet, deadline = 0, time.monotonic() + 120
        while quiet < 10 and time.monotonic() < deadline:
            quiet = 0 if _children(d.proc.pid) else quiet + 1
            time.sleep(0.05)
        assert quiet == 10, "a checker's process was left behind"
        stats = client.stats()
        assert stats["invariant_checks_forked"] >= 1
        assert stats["invariant_violations"] == 0
