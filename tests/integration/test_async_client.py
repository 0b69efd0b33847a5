"""The asyncio client against the real daemon: the blocking client's every verb, and
releases that do not wait."""

from __future__ import annotations

import asyncio
import inspect
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_proc import DaemonProcess, free_port
from kvtest import make_identity

from kvstore import AsyncClient, Client, PlanItem
from kvstore import protocol as p
from kvstore.aclient import AsyncHeld, AsyncNamespace, AsyncReservation
from kvstore.client import Held, Namespace, Reservation
from kvstore.client_core import SessionCore
from kvstore.errors import (
    KVStoreError,
    MalformedError,
    UnavailableError,
    UnknownNamespaceError,
)

BIG = make_identity(num_layers=4, num_kv_heads=4, head_dim=128)  # 128 KiB blocks
TWINS = [(Client, AsyncClient), (Namespace, AsyncNamespace), (Reservation, AsyncReservation),
         (Held, AsyncHeld)]
ASYNC_ONLY = {"connect"}  # the blocking client connects in its constructor


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize(("blocking", "asynchronous"), TWINS, ids=lambda c: c.__name__)
def test_the_async_classes_have_every_verb_of_the_blocking_ones(
        blocking: type, asynchronous: type) -> None:
    assert public(blocking) - public(asynchronous) == set()
    assert public(asynchronous) - public(blocking) <= ASYNC_ONLY
    # what the blocking shell does with I/O, the async shell does its own way, with the
    # same arguments (a verb that only the core had would be inherited, not awaited)
    for name in public(blocking) & set(vars(blocking)):
        assert name in vars(asynchronous), f"{asynchronous.__name__}.{name} is inherited"
        ours = inspect.signature(getattr(blocking, name)).parameters
        theirs = inspect.signature(getattr(asynchronous, name)).parameters
        assert list(ours) == list(theirs), name


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_keep_warm_soft_pins_blocks(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes),
                       extra=["--slab-size", str(8 * BIG.block_bytes)])

    async def main() -> None:
        async with AsyncClient(d.endpoint, tenant="acme") as c:
            ns = await c.namespace(BIG)
            prompt = ns.keys(range(16 * 2))
            await ns.put(prompt, [bytes(BIG.block_bytes)] * 2)
            assert await ns.keep_warm(prompt, 60) == 2
            assert await ns.keep_warm(ns.keys(range(9 * 10**8, 9 * 10**8 + 16)), 60) == 0
            for i in range(10):                          # colder traffic passes through
                keys = ns.keys(range(10**6 * (i + 1), 10**6 * (i + 1) + 16 * 2))
                await ns.put(keys, [bytes(BIG.block_bytes)] * 2)
            assert (await ns.lookup(prompt)).blocks == 2  # still there
            assert (await c.stats())["tiers"]["dram"]["evictions"] > 0

    run(main())


def test_prefetch_waits_for_blocks_to_come_up_from_ssd_and_report_is_counted(
        daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes), ssd_capacity="64MiB",
                       extra=["--slab-size", str(8 * BIG.block_bytes)])

    async def main() -> None:
        async with AsyncClient(d.endpoint, tenant="acme") as c:
            ns = await c.namespace(BIG)
            first = ns.keys(range(16 * 4))
            await ns.put(first, [b"\1" * BIG.block_bytes] * 4)
            for i in range(4):                           # push `first` down to SSD
                keys = ns.keys(range(10**6 * (i + 1), 10**6 * (i + 1) + 16 * 4))
                await ns.put(keys, [bytes(BIG.block_bytes)] * 4)
            assert set((await ns.lookup(first)).tiers) == {"ssd"}
            result = await ns.prefetch(first, wait=True, timeout=10)
            assert (result.ready, result.cached) == (4, 4)
            assert (await ns.lookup(first)).tiers == ["dram"] * 4
            missing = ns.keys(range(5 * 10**7, 5 * 10**7 + 16 * 2))
            partial = await ns.prefetch(first + missing, wait=True)
            assert (partial.ready, partial.cached) == (4, 4)   # a usable prefix
            assert await ns.get(first) == [b"\1" * BIG.block_bytes] * 4

            await c.report(recomputed_tokens=32)
            await c.report(recomputed_tokens=16)
            assert (await c.stats())["scheduling"]["recomputed_tokens"] == 48

    run(main())


def test_reserve_batch_is_all_or_none(daemon_factory: Any) -> None:
    d = daemon_factory(dram_capacity=str(8 * BIG.block_bytes),
                       extra=["--slab-size", str(8 * BIG.block_bytes)])
    bt = BIG.block_tokens

    async def main() -> None:
        async with AsyncClient(d.endpoint, tenant="acme") as c:
            ns = await c.namespace(BIG)

            def item(i: int, reserved: int, new: int) -> PlanItem:
                need = -(-(reserved + new) // bt) - -(-reserved // bt)
                return PlanItem(reserved, new, ns.keys(range(10**6 * (i + 1),
                                                             10**6 * (i + 1) + need * bt)))

            too_big = await ns.reserve_batch(
                [item(1, 0, 5 * bt), item(2, 3, 2 * bt), item(3, 0, 2 * bt)])   # 9 > 8
            assert not too_big.admitted and too_big.blocks == [5, 2, 2]
            assert too_big.fitting == [0, 1] and too_big.reservations == []
            assert (await c.stats())["tiers"]["dram"]["reserved_slots"] == 0

            plan = [item(4, 0, 3 * bt), item(5, bt, bt + 1)]
            fits = await ns.reserve_batch(plan)
            assert fits.admitted and fits.blocks == [3, 2]
            first, second = fits.reservations
            assert all(isinstance(r, AsyncReservation) for r in fits.reservations)
            assert [len(r.buffers) for r in fits.reservations] == [3, 2]
            assert (await c.stats())["tiers"]["dram"]["reserved_slots"] == 5
            for buf in first.buffers:
                buf[:] = b"\5" * BIG.block_bytes
            assert await first.commit() == 3
            async with second:                    # made already: entering reserves nothing
                pass                              # and leaving without commit aborts
            dram = (await c.stats())["tiers"]["dram"]
            assert dram["reserved_slots"] == 0 and dram["blocks"] == 3
            assert await ns.get(plan[0].keys) == [b"\5" * BIG.block_bytes] * 3
            assert (await ns.lookup(plan[1].keys)).blocks == 0

    run(main())


def test_release_does_not_wait_for_the_daemon_and_is_served_before_the_next_request(
        daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    assert daemon.proc is not None
    proc = daemon.proc

    def pinned(stats: dict[str, Any]) -> int:
        assert stats["invariant_violations"] == 0
        count: int = stats["tiers"]["dram"]["pinned_blocks"]
        return count

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, tenant="acme", timeout=5) as c:
            ns = await c.namespace(BIG)
            keys = ns.keys(range(8 * 16))
            await ns.put(keys, [bytes(BIG.block_bytes)] * 8)
            held = await ns.acquire(keys)
            assert pinned(await c.stats()) == 8
            proc.send_signal(signal.SIGSTOP)       # a daemon that answers nothing for now
            try:
                started = time.monotonic()
                await held.release()
                assert time.monotonic() - started < 1.0  # no round trip (a call waits 5 s)
            finally:
                proc.send_signal(signal.SIGCONT)
            assert pinned(await c.stats()) == 0      # served before the next request

            # released just before close: close waits for it before the socket goes
            async with ns.acquire(keys):
                pass
        async with AsyncClient(daemon.endpoint, tenant="acme") as other:
            assert pinned(await other.stats()) == 0

        # a release the daemon refuses (no such pin) is logged; the next call goes on
        async with AsyncClient(daemon.endpoint, tenant="acme") as c:
            ns = await c.namespace(BIG)
            held = await ns.acquire(keys)
            real = held.pin
            held.pin = real + 1000
            with caplog.at_level("WARNING", logger="kvstore.client"):
                await held.release()
                assert (await ns.lookup(keys)).blocks == 8
                await c.ping()
            assert any("refused a posted release" in r.getMessage() for r in caplog.records)
            assert pinned(await c.stats()) == 8      # the real pin is still held

    run(main())


# -- replies that are not what was asked for: the same on both clients ------------------

@pytest.fixture
def odd_daemon(tmp_path: Path) -> Iterator[str]:
    """A ROUTER peer that greets like the daemon, then answers ``stats`` with the wrong
    reply, ``ping`` with an error and ``evict`` with bytes that are no reply at all, and
    never answers ``snapshot``."""
    endpoint = f"ipc://{tmp_path}/odd.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            peer, header, *_ = sock.recv_multipart()
            req = p.request_decoder.decode(header)
            reply: bytes
            if isinstance(req, p.Hello):
                reply = p.encoder.encode(p.HelloReply(req.rid, p.PROTOCOL_VERSION, "s", "t",
                                                      "", 0, 60.0, 4096, 1 << 28))
            elif isinstance(req, p.Stats):
                reply = p.encoder.encode(p.OkReply(req.rid))
            elif isinstance(req, p.Ping):
                reply = p.encoder.encode(p.ErrorReply(req.rid, "unknown_namespace", "gone"))
            elif isinstance(req, p.Snapshot):
                continue
            else:
                reply = b"\xc1 not msgpack"
            sock.send_multipart([peer, reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield endpoint
    stop.set()
    thread.join()
    sock.close(linger=0)
    ctx.term()


def test_bad_replies_raise_the_same_errors_on_both_clients(odd_daemon: str) -> None:
    with Client(odd_daemon, map_arena=False, timeout=5) as c:
        with pytest.raises(KVStoreError, match="expected a StatsReply, got OkReply"):
            c.stats()
        with pytest.raises(UnknownNamespaceError, match="gone"):
            c.ping()
        with pytest.raises(KVStoreError, match="undecodable reply"):
            c.report(1)

    async def main() -> None:
        async with AsyncClient(odd_daemon, map_arena=False, timeout=5) as c:
            with pytest.raises(KVStoreError, match="expected a StatsReply, got OkReply"):
                await c.stats()
            with pytest.raises(UnknownNamespaceError, match="gone"):
                await c.ping()
            started = time.monotonic()
            with pytest.raises(KVStoreError, match="undecodable reply"):
                await c.report(1)
            assert time.monotonic() - started < 2      # raised, not timed out

    run(main())


def test_pins_and_slots_of_a_reply_given_up_on_go_back(daemon: DaemonProcess) -> None:
    """An acquire or reserve whose caller stopped waiting (cancelled, or past the
    timeout) is answered all the same: the pin or slots go back to the daemon when the
    reply comes, rather than staying until the session ends."""
    ident = make_identity()

    def pinned(stats: dict[str, Any]) -> tuple[int, int]:
        dram = stats["tiers"]["dram"]
        return dram["pinned_blocks"], dram["reserved_slots"]

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, tenant="acme") as c:
            ns = await c.namespace(ident)
            keys = ns.keys(range(ident.block_tokens * 2))
            await ns.put(keys, [b"\1" * ns.block_bytes] * 2)
            other = ns.keys(range(10_000, 10_000 + ident.block_tokens))

            async def acquire() -> None:
                await ns.acquire(keys)

            async def reserve() -> None:
                await ns.reserve(other)

            for ask in (acquire, reserve):
                for turns in range(4):  # cancelled at several points, sent or not
                    task = asyncio.ensure_future(ask())
                    for _ in range(turns):
                        await asyncio.sleep(0)
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
            c.timeout = 1e-6  # the reply comes after the caller gave up
            try:
                held = await ns.acquire(keys)
            except UnavailableError:
                pass
            else:  # (a loaded machine: the reply was in before the timer)
                await held.release()
            c.timeout = 5.0
            await c.stats()  # the late replies are in, their give-backs sent
            assert pinned(await c.stats()) == (0, 0)

    run(main())
    with Client(daemon.endpoint, tenant="acme") as c:
        ns = c.namespace(ident)
        keys = ns.keys(range(ident.block_tokens * 2))
        c.timeout = 1e-6
        for ask in (lambda: ns.acquire(keys),
                    lambda: ns.reserve(ns.keys(range(20_000, 20_000 + ident.block_tokens)))):
            try:
                got = ask()
            except UnavailableError:
                continue  # given up on: the late reply's pin or slots go back
            with got:  # (a loaded machine: the reply was in before the receive began)
                pass
        c.timeout = 5.0
        c.stats()
        assert pinned(c.stats()) == (0, 0) and not c._early


def test_a_reply_read_after_its_caller_gave_up_but_before_it_woke_goes_back(
        daemon: DaemonProcess) -> None:
    """A reply read in the same loop batch as its caller's cancellation (the reader's
    callback after the cancel, before the caller's task runs): the reader finds the
    waiter done, and gives back the pin then, not the caller (it has no reply to give
    back): nothing stays pinned, and nothing waits for a reply that will not come."""
    ident = make_identity()

    async def main() -> None:
        async with AsyncClient(daemon.endpoint, tenant="acme") as c:
            ns = await c.namespace(ident)
            keys = ns.keys(range(ident.block_tokens * 2))
            await ns.put(keys, [b"\1" * ns.block_bytes] * 2)
            loop = asyncio.get_running_loop()
            loop.remove_reader(c._fd)  # the acquire's reply queues, unread
            task = asyncio.ensure_future(ns.acquire(keys))
            while not c._waiting:
                await asyncio.sleep(0)
            assert c._sock.poll(10_000, zmq.POLLIN)  # its reply has come
            task.cancel()  # in one batch: a callback cancels the caller ...
            c._drain()     # ... and the reader's callback reads the reply
            loop.add_reader(c._fd, c._readable)
            with pytest.raises(asyncio.CancelledError):
                await task
            await c.stats()  # the give-back's reply is in
            assert (await c.stats())["tiers"]["dram"]["pinned_blocks"] == 0
            assert not c._abandoned and not c._unread

    run(main())


def test_a_connect_that_fails_with_the_refusal_monitor_open_closes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both clients, failing between making the socket (and the monitor that hears a
    refused handshake: a token on tcp) and the hello: the error comes, and the context
    goes (its term would wait for ever on the open monitor)."""
    def broken(self: object) -> p.Hello:
        raise KVStoreError("no hello")

    monkeypatch.setattr(SessionCore, "_hello_request", broken)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    outcome: list[str] = []

    def connect_both() -> None:
        with pytest.raises(KVStoreError, match="no hello"):
            Client(endpoint, tenant="acme", token="t", map_arena=False)
        outcome.append("blocking")

        async def main() -> None:
            with pytest.raises(KVStoreError, match="no hello"):
                await AsyncClient(endpoint, tenant="acme", token="t", map_arena=False).connect()
        run(main())
        outcome.append("async")

    threads = threading.active_count()
    thread = threading.Thread(target=connect_both, daemon=True)
    thread.start()
    thread.join(60)  # not a timing: a close that hangs would hang the test run
    assert outcome == ["blocking", "async"]
    assert threading.active_count() == threads  # the contexts' I/O threads ended


@pytest.mark.parametrize("endpoint", ["tcp://no-host:no-port", "udp://127.0.0.1:1"])
def test_an_endpoint_zeromq_cannot_connect_to_is_a_typed_error_that_leaks_nothing(
        endpoint: str) -> None:
    """Both clients raise MalformedError (not ZeroMQ's own error) and close the socket
    and context they made: no descriptor or I/O thread stays behind, however often."""
    def open_fds() -> int:
        return len(list(Path("/proc/self/fd").iterdir()))

    fds, threads = open_fds(), threading.active_count()
    for _ in range(5):
        with pytest.raises(MalformedError, match="cannot connect to the endpoint"):
            Client(endpoint, tenant="acme", map_arena=False)

    async def main() -> None:
        for _ in range(5):
            with pytest.raises(MalformedError, match="ipc://PATH or tcp://HOST:PORT"):
                await AsyncClient(endpoint, tenant="acme", map_arena=False).connect()

    run(main())
    assert (open_fds(), threading.active_count()) == (fds, threads)


def test_connect_keeps_the_loop_running_while_the_side_socket_answers(tmp_path: Path) -> None:
    """The side socket's exchange at connect (a ticket, an arena) runs off the loop: a
    side socket that never answers stalls connect, not the loop's other tasks."""
    import socket

    from kvstore.tiers.arena_fds import SIDE_TIMEOUT_S

    endpoint = f"ipc://{tmp_path / 'kvstore.sock'}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(str(tmp_path / "kvstore.sock.fd"))
        silent.listen(8)

        async def main() -> float:
            gaps: list[float] = []
            stop = asyncio.Event()

            async def tick() -> None:
                last = time.monotonic()
                while not stop.is_set():
                    await asyncio.sleep(0.01)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            ticker = asyncio.get_running_loop().create_task(tick())
            with pytest.raises(UnavailableError, match="side socket"):
                await AsyncClient(endpoint, tenant="acme", timeout=2).connect()
            stop.set()
            await ticker
            return max(gaps, default=float("inf"))  # none: the loop never ran it

        start = time.monotonic()
        worst = asyncio.run(main())
        took = time.monotonic() - start
        assert 2 * 0.9 <= took < SIDE_TIMEOUT_S  # connect waited its own timeout (2 s)
        assert worst < 1.0, f"the loop stalled {worst:.2f}s"


def test_async_client_maps_handed_out_arenas(daemon_factory: Any, tmp_path: Path) -> None:
    """Against a daemon of memfd arenas: hello's and a namespace's arenas come over the
    side socket, mapped off the loop before their first use."""
    config = tmp_path / "memfd.toml"
    config.write_text('[dram]\narena_kind = "memfd"\nper_tenant_arenas = true\n')
    d = daemon_factory(dram_capacity="8MiB", extra=["--config", str(config)])

    async def main() -> None:
        client = await AsyncClient(d.endpoint, tenant="acme").connect()
        try:
            assert client.hello is not None and client.hello.arena_path.startswith("memfd:")
            ns = await client.namespace(make_identity(tenant="acme"))
            assert ns.arena[0] in client._maps          # mapped at open, not at first use
            keys = ns.keys(range(32))
            async with ns.reserve(keys) as r:
                r.buffers[0][:] = b"\2" * ns.block_bytes
                await r.commit()
            async with ns.acquire(keys) as held:
                assert bytes(held.buffers[0]) == b"\2" * ns.block_bytes
        finally:
            await client.close()

    asyncio.run(main())


def test_an_unanswered_request_times_out_on_both_clients_and_the_next_is_served(
        odd_daemon: str) -> None:
    with Client(odd_daemon, map_arena=False, timeout=30) as c:
        c.timeout = 0.5  # a timeout changed after connecting holds from the next request
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="no reply from the daemon"):
            c.snapshot()
        assert 0.4 < time.monotonic() - started < 3
        with pytest.raises(UnknownNamespaceError, match="gone"):
            c.ping()

    async def main() -> None:
        async with AsyncClient(odd_daemon, map_arena=False, timeout=30) as c:
            c.timeout = 0.5  # from the requests on: the hello has the usual time
            started = time.monotonic()
            silent, answered = await asyncio.gather(c.snapshot(), c.ping(),
                                                    return_exceptions=True)
            assert isinstance(silent, UnavailableError), silent
            assert "no reply from the daemon" in str(silent)
            assert isinstance(answered, UnknownNamespaceError), answered
            assert 0.4 < time.monotonic() - started < 3
            assert not c._waiting  # nothing left waiting for a reply
            with pytest.raises(UnknownNamespaceError, match="gone"):
                await c.ping()

    run(main())
