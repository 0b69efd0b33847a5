"""The remote tier's stop when a call inside the generation watch swallows the cancel
(Python 3.11's ``asyncio.wait_for`` loses a cancel that comes as its call ends, and so
may a backend's client library): the watch's loop checked on, and the stop waited for
it forever (seen once as a daemon that hung "closing the remote store")."""

from __future__ import annotations

import asyncio

import pytest
from kvtest import make_identity

import kvstore.remote_watch
from kvstore.config import Config, RemoteConfig
from kvstore.blocks import Block
from kvstore.plugins.memory_backend import MemoryBackend
from kvstore.remote import RemoteTier
from kvstore.remote_copies import ForgetMarks
from kvstore.store import BlockStore
from kvstore.transfers import TransferGate

IDENT = make_identity(tenant="acme", model="m")


def test_the_stop_ends_a_watch_whose_call_swallowed_the_cancel() -> None:
    async def main() -> None:
        store = BlockStore(8 * IDENT.block_bytes, 8 * IDENT.block_bytes, remote_tier=True)
        remote = RemoteTier(
            Config(remote=RemoteConfig(url="memory://", check_seconds=0.1)), store,
            lambda _ns, _off: memoryview(bytearray(IDENT.block_bytes)), TransferGate(4))
        inner = remote.backend.inner
        assert isinstance(inner, MemoryBackend)
        asking = asyncio.Event()
        swallowed = 0

        async def stubborn() -> bytes | None:
            nonlocal swallowed
            asking.set()
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                swallowed += 1  # as a library that loses the cancel: answers anyway
            return b"gen-1"

        inner.generation = stubborn  # type: ignore[method-assign]
        remote.watch.start()
        await asyncio.wait_for(asking.wait(), 5)
        await asyncio.sleep(0.01)  # inside the call
        closing = asyncio.ensure_future(remote.close())
        await asyncio.wait({closing}, timeout=4)
        hung = not closing.done()
        if hung:  # (the code before: a second cancel, a stop's deadline, ends it)
            closing.cancel()
            await asyncio.wait({closing})
        assert not hung, "the stop still waited for the watch after 4 s"
        closing.result()
        assert swallowed >= 1
        checks = remote.counters["generation_checks"]
        await asyncio.sleep(0.3)  # three intervals: nothing checks any more
        assert remote.counters["generation_checks"] == checks

    asyncio.run(main())


def test_the_stop_ends_the_forgetting_a_check_it_waited_for_began(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that swallowed the stop's cancel found a new generation and began
    forgetting the marks: the stop had read which tasks to end before it, and the
    forgetting ran on after the stop, on a tier whose backend was closed."""
    class Long(ForgetMarks):  # a store of millions of blocks: many steps, over seconds
        def step(self, budget: int, seconds: float) -> tuple[bool, list[Block]]:
            return False, []

    monkeypatch.setattr(kvstore.remote_watch, "ForgetMarks", Long)

    async def main() -> None:
        store = BlockStore(8 * IDENT.block_bytes, 8 * IDENT.block_bytes, remote_tier=True)
        remote = RemoteTier(
            Config(remote=RemoteConfig(url="memory://", check_seconds=0.1,
                                       write_policy="write-back")), store,
            lambda _ns, _off: memoryview(bytearray(IDENT.block_bytes)), TransferGate(4))
        inner = remote.backend.inner
        assert isinstance(inner, MemoryBackend)
        assert not await remote.watch.check()  # the first answer: taken as it is
        asking = asyncio.Event()

        async def stubborn() -> bytes | None:
            asking.set()
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass  # lost, and the store answers: it lost what it held
            return b"another generation"

        inner.generation = stubborn  # type: ignore[method-assign]
        remote.watch.start()
        await asyncio.wait_for(asking.wait(), 5)
        await asyncio.sleep(0.01)  # inside the call
        await asyncio.wait_for(remote.close(), 5)
        assert remote.counters["generations_lost"] == 1
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in left:
            t.cancel()
        assert not left, f"tasks ran on after the stop: {left}"

    asyncio.run(main())
