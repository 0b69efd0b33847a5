"""The remote tier moves a batch in backend calls of a bounded size, each within one
``timeout_s``.  Before, a read (an acquire of blocks only the remote store held) or a
write-back was one call for the whole batch: past what the store moves in ``timeout_s``
(2 GiB of a large model's blocks in 2 s), it failed every time, and each failure marked
the tier unhealthy for every tenant."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import xxhash
from kvtest import make_identity

import kvstore.remote
from kvstore.config import Config, RemoteConfig
from kvstore.keys import chain_keys
from kvstore.plugins.base import BytesLike
from kvstore.plugins.memory_backend import MemoryBackend
from kvstore.remote import REMOTE_OWNER, RemoteTier
from kvstore.store import BlockStore
from kvstore.transfers import TransferGate

IDENT = make_identity(tenant="acme", model="m")
BLOCKS = 16
PIECE = 4  # blocks a call may move
PER_BLOCK_S = 0.05  # the store's time a block: a whole batch takes 0.8 s, a piece 0.2


def test_a_batch_past_one_timeout_moves_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvstore.remote, "PUT_BYTES_MOST", PIECE * IDENT.block_bytes)
    monkeypatch.setattr(kvstore.remote, "READ_BYTES_MOST", PIECE * IDENT.block_bytes,
                        raising=False)

    async def main() -> None:
        store = BlockStore(2 * BLOCKS * IDENT.block_bytes, 2 * BLOCKS * IDENT.block_bytes)
        ns = store.open_namespace(IDENT)
        arena = bytearray(2 * BLOCKS * IDENT.block_bytes)

        def slot(_ns: object, offset: int) -> memoryview:
            return memoryview(arena)[offset:offset + IDENT.block_bytes]

        config = Config(remote=RemoteConfig(url="memory://", timeout_s=0.5))
        remote = RemoteTier(config, store, slot, TransferGate(4))
        inner = remote.backend.inner
        assert isinstance(inner, MemoryBackend)
        calls: list[int] = []  # the blocks of each call
        put, get = inner.put_checksummed, inner.get_into_checksums

        async def slow_put(namespace: bytes, keys: Sequence[bytes],
                           values: Sequence[BytesLike],
                           checksums: Sequence[int | None]) -> list[bool]:
            calls.append(len(keys))
            await asyncio.sleep(PER_BLOCK_S * len(keys))
            return await put(namespace, keys, values, checksums)

        async def slow_get(namespace: bytes, keys: Sequence[bytes],
                           buffers: Sequence[memoryview]) -> list[int | None]:
            calls.append(len(keys))
            await asyncio.sleep(PER_BLOCK_S * len(keys))
            return await get(namespace, keys, buffers)

        inner.put_checksummed = slow_put  # type: ignore[method-assign]
        inner.get_into_checksums = slow_get  # type: ignore[method-assign]
        keys = chain_keys(ns.id, list(range(IDENT.block_tokens * BLOCKS)), IDENT.block_tokens)
        values = [bytes([1 + i]) * IDENT.block_bytes for i in range(BLOCKS)]
        written = await remote.send(ns, keys, [memoryview(v) for v in values], "write",
                                    write_back=False)
        assert written == [True] * BLOCKS
        assert calls == [PIECE] * (BLOCKS // PIECE)
        assert remote.healthy
        calls.clear()
        r = store.reserve(REMOTE_OWNER, ns, keys, None, 0.0)
        assert not isinstance(r, kvstore.store.Plan)
        await remote.read_into(ns, keys, r)  # committed, or NotFoundError
        assert calls == [PIECE] * (BLOCKS // PIECE)
        for key, value in zip(keys, values):
            block = ns.blocks[key]
            assert block.offset is not None
            assert bytes(slot(ns, block.offset)) == value
            assert block.checksum == xxhash.xxh3_64_intdigest(value)
        assert remote.healthy and remote.counters["errors"] == 0
        await remote.close()

    asyncio.run(main())
