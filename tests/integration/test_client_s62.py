"""A user's careless use of the blocking client against a real daemon process: what a
call interrupted by a signal (Ctrl-C's KeyboardInterrupt) leaves behind, and what the
same client's next call gets; and a release or commit refused because another thread
is in a call.

Before: a timed-out call's late reply gave its pins or slots back, but an interrupted
one's did not: an acquire interrupted while the daemon was slow to answer left its
blocks pinned (never evicted) and a reserve its slots taken for as long as the client
lived, with nothing left in the program that could release them.  And a release or
commit refused ("in use by another thread") had marked the pin released or the
reservation done before the refusal: the retried release did nothing, the retried
commit said "already committed or aborted", and the pins and slots stayed held.  An
``AsyncClient`` closed while another task's call waited for its reply left that call
waiting out its whole timeout (30 s by default), then blaming the daemon
(``UnavailableError``, "no reply from the daemon").
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore.errors import KVStoreError

IDENT = make_identity()


@contextmanager
def daemon_stopped(d: Any) -> Iterator[None]:
    """The daemon does not run meanwhile: a call waits for its reply until it goes on."""
    d.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        d.proc.send_signal(signal.SIGCONT)


def interrupt_during(call: Callable[[], object]) -> None:
    """Run ``call`` while the daemon is stopped, and Ctrl-C this process 0.3 s into its
    wait, as a user at a terminal does (SIGINT, Python's own KeyboardInterrupt)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)


def dram(c: Client) -> dict[str, int]:
    stats: dict[str, int] = c.stats()["tiers"]["dram"]
    return {k: stats[k] for k in ("pinned_blocks", "reserved_slots")}


def test_an_interrupted_call_gives_back_what_its_reply_holds(daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        blocks = [bytes([i + 1]) * IDENT.block_bytes for i in range(4)]
        ns.put(keys, blocks)

        with daemon_stopped(d):
            interrupt_during(lambda: ns.acquire(keys))
        # the next call gets its own reply, not the interrupted acquire's
        assert ns.get(keys[2:3]) == [blocks[2]]
        # and the acquire's pins, answered after the interrupt, went back (before: 4
        # blocks pinned for the life of the client)
        assert dram(c) == {"pinned_blocks": 0, "reserved_slots": 0}

        fresh = ns.keys(range(1000, 1000 + 2 * IDENT.block_tokens))
        with daemon_stopped(d):
            interrupt_during(lambda: ns.reserve(fresh))
        assert ns.get(keys[1:2]) == [blocks[1]]
        assert dram(c) == {"pinned_blocks": 0, "reserved_slots": 0}  # (before: 2 slots)
        # the keys are free to reserve and store again
        assert ns.put(fresh, [b"\x07" * IDENT.block_bytes] * 2) == 2
        assert ns.get(fresh) == [b"\x07" * IDENT.block_bytes] * 2


def test_a_release_or_commit_refused_for_another_thread_can_be_retried(
        daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        ns.put(keys, [b"\x01" * IDENT.block_bytes] * 4)
        held = ns.acquire(keys)
        fresh = ns.keys(range(1000, 1000 + 2 * IDENT.block_tokens))
        r = ns.reserve(fresh)
        for buf in r.buffers:
            buf[:] = b"\x05" * IDENT.block_bytes
        with daemon_stopped(d):
            other = threading.Thread(target=c.ping)  # in a call till the daemon goes on
            other.start()
            time.sleep(0.3)
            for refused in (held.release, r.commit, r.abort):
                with pytest.raises(KVStoreError, match="in use by another thread"):
                    refused()
        other.join()
        # the refusals changed nothing: the pin and the reservation are as they were
        assert not held.released and not r.done
        held.release()
        assert r.commit() == 2  # (before: "already committed or aborted")
        assert ns.get(fresh) == [b"\x05" * IDENT.block_bytes] * 2
        assert dram(c) == {"pinned_blocks": 0, "reserved_slots": 0}  # (before: 4, 2)
        held.release()  # nothing left to do: a no-op, as before
        r.abort()


def test_an_async_call_in_flight_when_its_client_closes_is_told_at_once(
        daemon_factory: Any) -> None:
    d = daemon_factory()

    async def scenario() -> tuple[BaseException | None, float]:
        c = await AsyncClient(d.endpoint, tenant="acme", timeout=10).connect()
        ns = await c.namespace(IDENT)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        await ns.put(keys, [b"\x01" * IDENT.block_bytes] * 4)
        call = asyncio.ensure_future(ns.get(keys))  # another task's call, sent...
        await asyncio.sleep(0)
        started = time.monotonic()
        await c.close()  # ... and its reply never read
        try:
            await call
        except BaseException as exc:  # noqa: BLE001 (the test looks at what it was)
            return exc, time.monotonic() - started
        return None, time.monotonic() - started

    exc, took = asyncio.run(scenario())
    # before: UnavailableError ("no reply from the daemon ... within 10s") after 10 s
    assert type(exc) is KVStoreError and "closed" in str(exc), exc
    assert took < 2, took
