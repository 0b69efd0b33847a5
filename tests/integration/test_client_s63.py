"""Pins and reservations whose objects the caller drops unreleased, against a real daemon
process: a ``Held`` (acquire) or a ``Reservation`` (reserve) garbage-collected without
``release()``, ``commit()`` or ``abort()`` (an exception path in the caller's code, a
forgotten call).

Before: the daemon kept the blocks pinned and the slots reserved for the whole life
of the client, and past its close until the lease ended (a client closing with them
said no goodbye): 8 blocks pinned by a dropped Held in an arena of 8 kept every put
refused (CapacityError), and so did 8 slots of a dropped Reservation.  Now the
object's finalizer queues its pin or reservation on the client, which releases or
aborts it just before its next request, and at its close.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore.errors import KVStoreError

BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB blocks
ROOM = 8  # blocks the daemons' DRAM holds
DROPPED = "were dropped without release(), commit() or abort()"
# a program that exits holding (a pin alive, one in a cycle, one dropped and never given
# back: no call after it), its client never closed: finalizers at interpreter exit
AT_EXIT = """
import sys
from kvstore import Client, Identity
c = Client(sys.argv[1], tenant="acme", timeout=2)
ns = c.namespace(Identity(**eval(sys.argv[2])))
keys = ns.keys(range(5 * 10**6, 5 * 10**6 + 32))
ns.put(keys, [bytes(ns.block_bytes)] * 2)
held, r = ns.acquire(keys), ns.reserve(ns.keys(range(6 * 10**6, 6 * 10**6 + 16)))
cycle = ns.acquire(keys[:1])
cycle.me = cycle
del cycle
ns.acquire(keys[1:])
"""


def small_daemon(daemon_factory: Any, **kwargs: Any) -> Any:
    """A daemon whose DRAM holds ``ROOM`` blocks of ``BIG``, and one slab of them."""
    return daemon_factory(dram_capacity=str(ROOM * BIG.block_bytes),
                          extra=["--slab-size", str(ROOM * BIG.block_bytes),
                                 *kwargs.pop("extra", [])], **kwargs)


def held_now(stats: dict[str, Any]) -> tuple[int, int]:
    dram = stats["tiers"]["dram"]
    return dram["pinned_blocks"], dram["reserved_slots"]


def chain(ns: Any, n: int, start: int = 0) -> list[bytes]:
    keys: list[bytes] = ns.keys(range(start, start + n * BIG.block_tokens))
    return keys


@pytest.fixture
def unraisable() -> Iterator[list[str]]:
    """What finalizers raised meanwhile (Python only reports it, to this hook)."""
    seen: list[str] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(f"{u.exc_type.__name__}: {u.exc_value} "
                                               f"in {u.object!r}")
    try:
        yield seen
    finally:
        sys.unraisablehook = previous


def test_a_dropped_held_is_released_at_the_next_call(daemon_factory: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    d = small_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(BIG)
        keys = chain(ns, ROOM)
        ns.put(keys, [bytes([i + 1]) * BIG.block_bytes for i in range(ROOM)])
        held = ns.acquire(keys)
        assert held_now(c.stats()) == (ROOM, 0)
        with caplog.at_level(logging.WARNING, logger="kvstore.client"):
            del held
            gc.collect()
            assert held_now(c.stats()) == (0, 0)  # before: (8, 0), for the client's life
        assert [r.getMessage() for r in caplog.records if DROPPED in r.getMessage()] == [
            f"1 pin(s) or reservation(s) of this client {DROPPED} (garbage-collected): 1 "
            "given back now; release them explicitly, or use them in a with block"]
        assert (c.drops.given_back, c.drops.kept) == (1, 0)
        # the room is usable: a new block evicts one of those that were pinned
        other = chain(ns, 1, start=10**6)
        assert ns.put(other, [b"\x09" * BIG.block_bytes]) == 1  # before: CapacityError
        assert ns.get(other) == [b"\x09" * BIG.block_bytes]


def test_a_dropped_reservation_is_aborted_at_the_next_call(daemon_factory: Any) -> None:
    d = small_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(BIG)
        r = ns.reserve(chain(ns, ROOM))
        r.buffers[0][:1] = b"\x01"
        del r
        gc.collect()
        assert held_now(c.stats()) == (0, 0)  # before: (0, 8)
        keys = chain(ns, ROOM, start=10**6)
        assert ns.put(keys, [b"\x02" * BIG.block_bytes] * ROOM) == ROOM  # the whole room
        assert c.drops.given_back == 1


def test_an_async_clients_dropped_held_and_reservation_are_given_back(
        daemon_factory: Any) -> None:
    d = small_daemon(daemon_factory)

    async def scenario() -> None:
        async with AsyncClient(d.endpoint, tenant="acme", timeout=10) as c:
            ns = await c.namespace(BIG)
            keys = chain(ns, ROOM // 2)
            await ns.put(keys, [b"\x01" * BIG.block_bytes] * (ROOM // 2))
            held = await ns.acquire(keys)
            r = await ns.reserve(chain(ns, ROOM // 2, start=10**6))
            assert held_now(await c.stats()) == (ROOM // 2, ROOM // 2)
            del held, r
            gc.collect()
            assert held_now(await c.stats()) == (0, 0)  # before: (4, 4)
            fresh = chain(ns, ROOM, start=2 * 10**6)
            assert await ns.put(fresh, [b"\x03" * BIG.block_bytes] * ROOM) == ROOM
            assert c.drops.given_back == 2

            # a post (a release) is a next call too
            held = await ns.acquire(fresh[:2])
            kept = await ns.acquire(fresh[2:4])
            del held
            gc.collect()
            await kept.release()
            assert held_now(await c.stats()) == (0, 0)
            assert c.drops.given_back == 3

    asyncio.run(scenario())


class Py_buffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object),
                ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                ("internal", ctypes.c_void_p)]


def test_a_dropped_held_whose_buffer_is_exported_keeps_its_pin(daemon_factory: Any) -> None:
    """A buffer of a dropped Held that C code still reads (an export of it, taken as
    an extension does) keeps the pin: released, the slot could be reused under the
    reader.  A view merely kept is released with its pin, as an explicit release does:
    read after, it raises rather than read another block's bytes."""
    d = small_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(BIG)
        keys = chain(ns, 4)
        ns.put(keys, [bytes([i + 1]) * BIG.block_bytes for i in range(4)])
        exported, viewed = ns.acquire(keys[:2]), ns.acquire(keys[2:])
        export = Py_buffer()
        get_buffer = ctypes.pythonapi.PyObject_GetBuffer
        get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(Py_buffer), ctypes.c_int]
        assert get_buffer(exported.buffers[1], ctypes.byref(export), 0) == 0
        view = viewed.buffers[0]
        try:
            del exported, viewed
            gc.collect()
            assert held_now(c.stats()) == (2, 0)  # before: (4, 0)
            assert (c.drops.given_back, c.drops.kept) == (1, 1)
            assert ctypes.string_at(export.buf, 4) == b"\x02" * 4
            with pytest.raises(ValueError, match="released"):
                bytes(view)
        finally:
            ctypes.pythonapi.PyBuffer_Release(ctypes.byref(export))


def test_an_explicitly_released_object_gives_nothing_back_twice(
        daemon_factory: Any, caplog: pytest.LogCaptureFixture, unraisable: list[str]) -> None:
    d = small_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(BIG)
        keys = chain(ns, 4)
        ns.put(keys, [b"\x01" * BIG.block_bytes] * 4)
        released = ns.acquire(keys[:2])
        released.release()
        with ns.acquire(keys[2:]) as in_with:
            pass
        _, found = ns.lookup_pin(keys)
        assert found is not None
        found.release()
        committed = ns.reserve(chain(ns, 1, start=10**6))
        committed.commit()
        aborted = ns.reserve(chain(ns, 1, start=2 * 10**6))
        aborted.abort()
        with ns.reserve(chain(ns, 1, start=3 * 10**6)) as left:
            pass  # (aborted leaving the block)
        dropped = ns.acquire(keys[:1])  # the one dropped unreleased
        with caplog.at_level(logging.WARNING, logger="kvstore.client"):
            del released, in_with, found, committed, aborted, left, dropped
            gc.collect()
            assert held_now(c.stats()) == (0, 0)  # before: (1, 0)
            released = ns.acquire(keys[:1])
            released.release()
            released.release()  # a no-op, as before
            del released
            gc.collect()
            c.ping()
        assert held_now(c.stats()) == (0, 0)
        assert [r.levelname for r in caplog.records] == ["WARNING"], caplog.text
        assert (c.drops.given_back, c.drops.kept) == (1, 0)  # exactly the dropped one
    assert not unraisable


def test_a_finalizer_run_while_another_thread_is_in_a_call_only_queues(
        daemon_factory: Any, unraisable: list[str]) -> None:
    """The blocking client: the collector runs a dropped Held's finalizer in a second
    thread while the first waits in a call for its reply (the daemon stopped)."""
    d = small_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(BIG)
        keys = chain(ns, 4)
        blocks = [bytes([i + 1]) * BIG.block_bytes for i in range(4)]
        ns.put(keys, blocks)
        box = [ns.acquire(keys[:2])]
        got: list[Any] = []
        d.proc.send_signal(signal.SIGSTOP)
        try:
            call = threading.Thread(target=lambda: got.append(ns.get(keys)))
            call.start()
            time.sleep(0.3)  # in its wait

            def drop() -> None:
                box.clear()
                gc.collect()
            collector = threading.Thread(target=drop)
            collector.start()
            collector.join()
            assert not c._unread  # queued, not posted: the socket is the first thread's
        finally:
            d.proc.send_signal(signal.SIGCONT)
        call.join()
        assert got == [blocks]  # the call in flight got its own reply, whole
        assert held_now(c.stats()) == (0, 0)  # before: (2, 0)
        assert c.drops.given_back == 1
    assert not unraisable


def test_a_finalizer_run_inside_a_call_of_the_same_thread_is_given_back_in_it(
        daemon_factory: Any, tmp_path: Any, unraisable: list[str]) -> None:
    """A Held collected in the middle of a put of several requests (the put's own
    thread, between two of its requests): its release goes out before the next one,
    and the put is whole."""
    config = tmp_path / "keys.toml"
    config.write_text("[server]\nmax_keys_per_request = 2\n")
    d = small_daemon(daemon_factory, extra=["--config", str(config)])

    class DropsWhileSliced(list):  # type: ignore[type-arg]
        """The put's blocks: slicing out its second request's drops the Held."""

        def __getitem__(self, i: Any) -> Any:
            if isinstance(i, slice) and i.start:
                box.clear()
                gc.collect()
            return super().__getitem__(i)

    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(BIG)
        pinned = chain(ns, 2, start=10**6)
        ns.put(pinned, [b"\x07" * BIG.block_bytes] * 2)
        box = [ns.acquire(pinned)]
        keys = chain(ns, 7)
        blocks = [bytes([i + 1]) * BIG.block_bytes for i in range(7)]
        # 7 new blocks need the room of one of the 2 pinned: it goes, once released
        assert ns.put(keys, DropsWhileSliced(blocks)) == 7  # before: CapacityError
        assert not box and c.drops.given_back == 1
        assert ns.get(keys) == blocks
        assert held_now(c.stats()) == (0, 0)
    assert not unraisable


@pytest.mark.parametrize("client", ["blocking", "async"])
def test_a_close_after_drops_gives_them_back(daemon_factory: Any, client: str) -> None:
    """Nothing called after the drops but close: it gives them back, and (nothing
    held any more) says goodbye, so the session ends at once."""
    d = small_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme", timeout=10) as watcher:
        keys = chain(watcher.namespace(BIG), 4)
        watcher.namespace(BIG).put(keys, [b"\x01" * BIG.block_bytes] * 4)
        sessions = watcher.stats()["sessions"]
        if client == "blocking":
            c = Client(d.endpoint, tenant="acme", timeout=10)
            ns = c.namespace(BIG)
            held, r = ns.acquire(keys), ns.reserve(chain(ns, 2, start=10**6))
            del held, r
            gc.collect()
            c.close()
            closed: Any = c
        else:
            async def scenario() -> AsyncClient:
                c = await AsyncClient(d.endpoint, tenant="acme", timeout=10).connect()
                ns = await c.namespace(BIG)
                held = await ns.acquire(keys)
                r = await ns.reserve(chain(ns, 2, start=10**6))
                del held, r
                gc.collect()
                await c.close()
                return c
            closed = asyncio.run(scenario())
        deadline = time.monotonic() + 5
        while (now := (watcher.stats()["sessions"], *held_now(watcher.stats()))) != (
                sessions, 0, 0):
            # before: 4 pinned and 2 reserved, the session kept, for the lease's 30 s
            assert time.monotonic() < deadline, now
            time.sleep(0.02)
        assert closed.drops.given_back == 2


@pytest.mark.parametrize("client", ["blocking", "async"])
def test_drops_of_a_client_whose_daemon_is_gone_raise_nothing(
        daemon_factory: Any, client: str, caplog: pytest.LogCaptureFixture,
        unraisable: list[str]) -> None:
    d = small_daemon(daemon_factory)
    if client == "blocking":
        fields = {f: getattr(BIG, f) for f in ("model", "model_revision", "tenant", "kv_dtype",
                                               "num_layers", "num_kv_heads", "head_dim",
                                               "block_tokens")}
        exited = subprocess.run([sys.executable, "-c", AT_EXIT, d.endpoint, repr(fields)],
                                capture_output=True, text=True, timeout=60)
        assert exited.returncode == 0 and not exited.stderr, exited.stderr
        c = Client(d.endpoint, tenant="acme", timeout=2)
        ns = c.namespace(BIG)
        keys = chain(ns, 2)
        ns.put(keys, [b"\x01" * BIG.block_bytes] * 2)
        held, r = ns.acquire(keys), ns.reserve(chain(ns, 1, start=10**6))
        late = ns.acquire(keys[:1])
        d.stop(signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="kvstore.client"):
            del held, r
            gc.collect()
            started = time.monotonic()
            c.close()
            assert time.monotonic() - started < 5
            del late  # dropped after the close
            gc.collect()
        closed: Any = c
    else:
        async def scenario() -> AsyncClient:
            c = await AsyncClient(d.endpoint, tenant="acme", timeout=2).connect()
            ns = await c.namespace(BIG)
            keys = chain(ns, 2)
            await ns.put(keys, [b"\x01" * BIG.block_bytes] * 2)
            held = await ns.acquire(keys)
            r = await ns.reserve(chain(ns, 1, start=10**6))
            late = await ns.acquire(keys[:1])
            d.stop(signal.SIGKILL)
            with caplog.at_level(logging.WARNING, logger="kvstore.client"):
                del held, r
                gc.collect()
                with pytest.raises(KVStoreError):  # the next call: the drops go first
                    await c.ping()
                started = time.monotonic()
                await c.close()
                assert time.monotonic() - started < 5
                del late
                gc.collect()
            return c
        closed = asyncio.run(scenario())
    assert any(DROPPED in r.getMessage() for r in caplog.records), caplog.text
    assert closed.drops.given_back == 2  # (sent to no one: the daemon took them with it)
    assert not unraisable


def export_of(view: memoryview) -> Py_buffer:
    """An export of ``view``, taken as C code reading it does (until PyBuffer_Release)."""
    export = Py_buffer()
    get_buffer = ctypes.pythonapi.PyObject_GetBuffer
    get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(Py_buffer), ctypes.c_int]
    assert get_buffer(view, ctypes.byref(export), 0) == 0
    return export


@pytest.mark.parametrize("finish", ["release", "commit", "abort"])
def test_a_release_commit_or_abort_refused_for_an_exported_buffer_changes_nothing(
        daemon_factory: Any, finish: str) -> None:
    """While C code reads a slot (an export of its view), its release, commit or abort
    is refused (BufferInUseError) and the pin or slots stay held (its other views are
    let go): asked again once the export ends, it goes through.  Before, the object was marked released (or done)
    before its views were let go, so the BufferError came after: the release or abort
    was never sent, a retry did nothing (or said "already committed or aborted"), and
    the pin or slots stayed held for the client's life."""
    from kvstore.errors import BufferInUseError

    d = small_daemon(daemon_factory)
    with Client(d.endpoint, tenant="acme", timeout=10) as c:
        ns = c.namespace(BIG)
        keys = chain(ns, 2)
        if finish == "release":
            ns.put(keys, [b"\x01" * BIG.block_bytes] * 2)
            obj: Any = ns.acquire(keys)
            call, held = obj.release, (2, 0)
        else:
            obj = ns.reserve(keys)
            call, held = getattr(obj, finish), (0, 2)
        export = export_of(obj.buffers[1])
        try:
            with pytest.raises(BufferInUseError, match="exported"):
                call()
            assert held_now(c.stats()) == held  # (still held, as it should be)
        finally:
            ctypes.pythonapi.PyBuffer_Release(ctypes.byref(export))
        call()  # before: a no-op (release), or "already committed or aborted"
        assert held_now(c.stats()) == (0, 0)  # before: held for the client's life
        assert c.drops.given_back == 0
        if finish == "commit":
            assert ns.lookup(keys).blocks == 2
