"""A client whose daemon restarted, a client copied by a fork, a client two threads
use at once, and a ``with`` whose abort fails: each says so at once, in a typed error,
and never hands back a wrong result.  Real daemon processes and real sockets.

Before: after a restart every call of the old client past the daemon's few answers to a
peer without a session waited out its whole timeout, for good; a forked child's call
spun in ZeroMQ's retries at full CPU, and its ``close`` of an AsyncClient deafened the
parent's (the loop's epoll is shared); two threads' frames interleaved on one socket
(a put's payload carried the other's header, a get returned another call's blocks);
and an abort that failed on the way out of a ``with`` replaced the body's own error.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore.errors import KVStoreError, NoSessionError

IDENT = make_identity()


def elapsed(call: Any) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 (the test looks at what it was)
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def test_a_client_of_a_restarted_daemon_is_told_at_once(daemon_factory: Any) -> None:
    d = daemon_factory()
    c = Client(d.endpoint, tenant="acme", timeout=5)
    try:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        ns.put(keys, [b"\x01" * IDENT.block_bytes] * 4)
        d.stop(signal.SIGKILL)
        d.start()
        # every call after the restart: NoSessionError, none waits its timeout (before:
        # the first eight were refused, every one after them waited 5 s)
        for i in range(12):
            took, exc = elapsed(lambda: ns.lookup(keys))
            assert isinstance(exc, NoSessionError), (i, exc)
            assert took < 2.5, (i, took)
        took, exc = elapsed(lambda: ns.put(keys[:1], [b"\x02" * IDENT.block_bytes]))
        assert isinstance(exc, NoSessionError) and took < 2.5, (took, exc)
        assert "open a new client" in str(exc)
    finally:
        c.close()
    with Client(d.endpoint, tenant="acme") as fresh:  # a new one is served
        assert fresh.namespace(IDENT).lookup(keys).blocks == 0


def test_a_client_used_while_its_daemon_was_down_is_told_at_once(
        daemon_factory: Any) -> None:
    """Requests sent while the daemon was down reach the new one all at once: it answers
    a few with "no session", then drops the rest unread, the next call's among them."""
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        c.timeout = 0.3  # (for the calls to the killed daemon: not the hello under load)
        d.stop(signal.SIGKILL)
        for _ in range(12):
            with pytest.raises(KVStoreError):  # (no reply: UnavailableError)
                ns.lookup(keys)
        d.start()
        c.timeout = 5
        for i in range(4):
            took, exc = elapsed(lambda: ns.lookup(keys))
            assert isinstance(exc, NoSessionError) and took < 2.5, (i, took, exc)


def test_an_async_client_of_a_restarted_daemon_is_told_at_once(daemon_factory: Any) -> None:
    d = daemon_factory()

    async def scenario() -> None:
        async with AsyncClient(d.endpoint, tenant="acme", timeout=5) as c:
            ns = await c.namespace(IDENT)
            keys = ns.keys(range(4 * IDENT.block_tokens))
            d.stop(signal.SIGKILL)
            d.start()
            for i in range(12):
                started = time.monotonic()
                with pytest.raises(NoSessionError):
                    await ns.lookup(keys)
                assert time.monotonic() - started < 2.5, i

    asyncio.run(scenario())


def test_a_forked_child_cannot_use_or_break_its_parents_client(daemon_factory: Any) -> None:
    d = daemon_factory()
    read, write = os.pipe()

    async def child_async(ac: AsyncClient) -> str:
        try:
            await ac.ping()
            return "served"
        except KVStoreError as exc:
            return "refused" if "fork" in str(exc) else f"other: {exc}"
        finally:
            await ac.close()  # (before: removed the parent's reader from the shared epoll)

    async def scenario() -> None:
        async with AsyncClient(d.endpoint, tenant="acme", timeout=2) as ac:
            with Client(d.endpoint, tenant="acme", timeout=2) as c:
                pid = os.fork()
                if pid == 0:  # the child: both clients refuse at once, and close quietly
                    verdicts = []
                    try:
                        c.ping()
                        verdicts.append("served")
                    except KVStoreError as exc:
                        verdicts.append("refused" if "fork" in str(exc) else f"other: {exc}")
                    c.close()
                    verdicts.append(asyncio.new_event_loop().run_until_complete(
                        child_async(ac)))
                    os.write(write, ",".join(verdicts).encode())
                    os._exit(0)
                os.close(write)
                deadline = time.monotonic() + 30
                while os.waitpid(pid, os.WNOHANG) == (0, 0):  # (a child that spins: killed)
                    if time.monotonic() > deadline:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        pytest.fail("the forked child's calls never returned")
                    await asyncio.sleep(0.05)
                got = os.read(read, 1000).decode()
                os.close(read)
                assert got == "refused,refused", got
                # the parent's clients still work
                c.ping()
                for _ in range(3):
                    await ac.ping()

    asyncio.run(scenario())


def test_two_threads_on_one_client_are_refused_never_mixed(daemon_factory: Any) -> None:
    d = daemon_factory()
    wrong: list[str] = []
    refused = [0]
    served = [0]
    with Client(d.endpoint, tenant="acme", timeout=5) as c:
        ns = c.namespace(IDENT)

        def work(me: int) -> None:
            deadline = time.monotonic() + 2
            i = 0
            while time.monotonic() < deadline:
                i += 1
                # the threads' keys never meet (each thread's runs of 32 tokens odd or
                # even: one thread refused runs far ahead of the other, and with a fixed
                # offset between them its keys came to be the other's, cached already)
                start = (2 * i + me) * 32
                keys = ns.keys(range(start, start + 32))
                value = bytes([me]) * IDENT.block_bytes
                try:
                    ns.put(keys, [value, value])
                    got = ns.get(keys)
                    served[0] += 1
                    if got != [value, value]:
                        # what came, to tell a short reply from another call's blocks
                        wrong.append(f"thread {me} got another's blocks: "
                                     f"{[(len(b), b[:1]) for b in got]}")
                except KVStoreError as exc:
                    if "another thread" in str(exc):
                        refused[0] += 1
                    elif "not found" not in str(exc).lower():
                        wrong.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=work, args=(n,)) for n in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not wrong, wrong[:5]
        assert refused[0] and served[0]
        time.sleep(0.2)
        assert c.stats()["tiers"]["dram"]["pinned_blocks"] == 0


def test_a_failed_abort_leaves_the_bodys_error(daemon_factory: Any) -> None:
    # The abort alone waits a short timeout out: a hello of 0.3 s ran out on a loaded
    # machine (the daemon just started), before the reservation the test is about.
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(2 * IDENT.block_tokens))
        with pytest.raises(ValueError, match="the body's own"):
            with ns.reserve(keys):
                c.timeout = 0.3
                d.stop(signal.SIGKILL)
                raise ValueError("the body's own error")

    d.start()

    async def scenario() -> None:
        async with AsyncClient(d.endpoint, tenant="acme") as ac:
            ns = await ac.namespace(IDENT)
            with pytest.raises(ValueError, match="the body's own"):
                async with ns.reserve(keys):
                    ac.timeout = 0.3
                    d.stop(signal.SIGKILL)
                    raise ValueError("the body's own error")

    asyncio.run(scenario())


def test_closing_a_client_ends_its_session_now(daemon_factory: Any) -> None:
    """A client that closes holding nothing says goodbye: its session ends at once
    rather than when its lease would have ended (30 s).  One that still holds pins or
    a reservation does not (their buffers may still be read, by a thread copying out of
    them): those stay until the lease ends, as before."""
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme") as watcher:
        before = watcher.stats()["sessions"]

        def ends(what: str, sessions: int, pinned: int, reserved: int) -> None:
            deadline = time.monotonic() + 5
            while True:
                dram = watcher.stats()["tiers"]["dram"]
                now = (watcher.stats()["sessions"], dram["pinned_blocks"],
                       dram["reserved_slots"])
                if now == (sessions, pinned, reserved):
                    return
                assert time.monotonic() < deadline, (what, now)
                time.sleep(0.02)

        c = Client(d.endpoint, tenant="acme")
        ns = c.namespace(IDENT)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        ns.put(keys[:2], [b"\x01" * IDENT.block_bytes] * 2)
        with ns.acquire(keys[:2]):
            pass
        ns.reserve(keys[2:]).abort()
        c.close()
        ends("sync, nothing held", before, 0, 0)

        async def scenario() -> None:
            async with AsyncClient(d.endpoint, tenant="acme") as ac:
                ans = await ac.namespace(IDENT)
                async with ans.acquire(keys[:2]):
                    pass
                assert watcher.stats()["sessions"] == before + 1
        asyncio.run(scenario())
        ends("async, nothing held", before, 0, 0)

        c = Client(d.endpoint, tenant="acme")
        ns = c.namespace(IDENT)
        held = ns.acquire(keys[:2])  # (kept: a copy may still read its buffers)
        r = ns.reserve(keys[2:])  # (kept too: one dropped is aborted at the close)
        c.close()
        time.sleep(0.3)
        ends("sync, holding", before + 1, 2, 2)
        assert bytes(held.buffers[0][:1]) == b"\x01" and not r.done


def test_close_from_another_thread_never_raises(daemon_factory: Any) -> None:
    """A thread in a call (the daemon stopped) and another that closes the client: the
    close waits for the call's timeout, then closes, without an error."""
    d = daemon_factory()
    c = Client(d.endpoint, tenant="acme", timeout=1)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)
    try:
        caller = threading.Thread(target=lambda: elapsed(c.ping))
        caller.start()
        time.sleep(0.2)
        took, exc = elapsed(c.close)
        assert exc is None and took < 3, (took, exc)
        caller.join()
    finally:
        d.proc.send_signal(signal.SIGCONT)


def acquire_given_up(c: Client) -> None:
    """An acquire of two stored blocks sent, its wait then refused (another thread in
    the socket): its reply, when read, holds a pin nobody takes."""
    ns = c.namespace(IDENT)
    keys = ns.keys(range(2 * IDENT.block_tokens))
    ns.put(keys, [b"\x02" * IDENT.block_bytes] * 2)
    finish = ns._send_acquire(keys)
    inside, leave = threading.Event(), threading.Event()

    def occupy() -> None:
        with c._io:  # another thread in the socket
            inside.set()
            leave.wait(5)
    other = threading.Thread(target=occupy)
    other.start()
    inside.wait(5)
    with pytest.raises(KVStoreError, match="another thread"):
        finish()
    leave.set()
    other.join()


def test_a_wait_refused_to_a_second_thread_gives_its_pin_back(daemon_factory: Any) -> None:
    """A request sent, its wait then refused (another thread in the socket): the pins
    its reply brings go back when the reply is read, not at the lease's end."""
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme", timeout=5) as c:
        acquire_given_up(c)
        c.ping()  # reads the acquire's reply: its pin goes back
        deadline = time.monotonic() + 5
        while c.stats()["tiers"]["dram"]["pinned_blocks"]:
            assert time.monotonic() < deadline, "the pin was kept"
            time.sleep(0.02)


def test_a_give_back_with_no_connection_to_send_on_never_waits(daemon_factory: Any) -> None:
    """A reply to a request given up on is read, and what it holds is given back; where
    ZeroMQ has no connection to queue that on (dropped), the give-back is let go at once
    (the daemon's lease takes the pin back) rather than waited on for the timeout and
    raised into the read of the replies, and no reply to it is awaited at close."""
    import zmq

    d = daemon_factory()
    with Client(d.endpoint, tenant="acme", timeout=3) as c:
        acquire_given_up(c)  # its reply's pin is to be given back
        real = c._sock

        class NoConnection:
            """The client's socket, with no connection to queue a send on."""

            def send(self, *args: Any, **kwargs: Any) -> None:
                raise zmq.Again()

            def poll(self, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
                if flags & zmq.POLLOUT:  # never writable: waits its whole timeout
                    time.sleep((timeout or 0) / 1000)
                    return 0
                return int(real.poll(timeout, flags))

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        assert real.poll(5000), "the acquire's reply never came"
        c._sock = NoConnection()
        try:
            started = time.monotonic()
            c._file(c._receive())  # the reply read: its give-back cannot go
            assert time.monotonic() - started < 1.0
            assert not c._unread  # nothing awaited at close
        finally:
            c._sock = real
