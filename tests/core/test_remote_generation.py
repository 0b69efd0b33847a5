"""The remote tier when its store loses what it held, with the memory backend: the
watch notices the new generation and takes every mark back, and a send under way when
it changed marks nothing (what it wrote may have gone with the rest)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtest import make_identity

from kvstore.config import Config, RemoteConfig
from kvstore.keys import chain_keys
from kvstore.plugins.base import BytesLike
from kvstore.plugins.memory_backend import MemoryBackend
from kvstore.remote import RemoteTier
from kvstore.store import BlockStore
from kvstore.transfers import TransferGate

IDENT = make_identity(tenant="acme", model="m")


def test_a_lost_generation_unmarks_and_a_send_across_it_marks_nothing() -> None:
    async def main() -> None:
        store = BlockStore(8 * IDENT.block_bytes, 8 * IDENT.block_bytes, remote_tier=True)
        ns = store.open_namespace(IDENT)
        keys = chain_keys(ns.id, list(range(IDENT.block_tokens * 4)), IDENT.block_tokens)
        r = store.reserve("s1", ns, keys, None, 0.0)
        store.commit("s1", r.id, 0.0)  # type: ignore[union-attr]
        blocks = [ns.blocks[k] for k in keys]
        remote = RemoteTier(
            Config(remote=RemoteConfig(url="memory://", write_policy="write-back")), store,
            lambda _ns, _off: memoryview(bytearray(IDENT.block_bytes)), TransferGate(4))
        inner = remote.backend.inner
        assert isinstance(inner, MemoryBackend)
        assert not await remote.watch.check()                  # the first: taken as it is
        views = [memoryview(bytearray(IDENT.block_bytes)) for _ in keys]
        assert await remote.send(ns, keys[:2], views[:2], "write", write_back=True,
                                 blocks=blocks[:2]) == [True, True]
        for b in blocks[:2]:
            b.remote = True

        original = inner.put_checksummed
        sending = asyncio.Event()
        go_on = asyncio.Event()

        async def slow(namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike],
                       checksums: Sequence[int | None]) -> list[bool]:
            sending.set()
            await go_on.wait()
            return await original(namespace, keys, values, checksums)

        inner.put_checksummed = slow  # type: ignore[method-assign]
        send = asyncio.create_task(remote.send(ns, keys[2:], views[2:], "write",
                                               write_back=True, blocks=blocks[2:]))
        await sending.wait()
        inner.lose_everything()                                # a store restarted empty
        assert await remote.watch.check()
        go_on.set()
        assert await send == [False, False]                    # sent to what was lost
        await remote.watch.forgotten()
        assert not any(b.remote for b in blocks)
        assert remote.counters["generations_lost"] == 1
        assert remote.counters["marks_forgotten"] == 2
        assert not await remote.watch.check()                  # the new one, kept
        await remote.close()

    asyncio.run(main())
