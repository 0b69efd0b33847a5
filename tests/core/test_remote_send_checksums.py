"""The remote tier sends a block under its commit's checksum, not a digest made as the
backend encodes it: bytes a writer changes through its mapping between the daemon's
check and that encoding (the backend encodes in its own time, on another thread for
some) then read back as damaged, where before they went out under a digest of their
own and every daemon sharing the store served them as good."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import xxhash
from kvtest import make_identity

from kvstore.config import Config, RemoteConfig
from kvstore.keys import chain_keys
from kvstore.plugins.base import BytesLike
from kvstore.plugins.memory_backend import MemoryBackend
from kvstore.remote import RemoteTier
from kvstore.store import BlockStore
from kvstore.transfers import TransferGate

IDENT = make_identity(tenant="acme", model="m")


def test_bytes_changed_after_the_check_read_back_as_damaged() -> None:
    async def main() -> None:
        store = BlockStore(8 * IDENT.block_bytes, 8 * IDENT.block_bytes)
        ns = store.open_namespace(IDENT)
        keys = chain_keys(ns.id, list(range(IDENT.block_tokens * 2)), IDENT.block_tokens)
        good = [bytes([1 + i]) * IDENT.block_bytes for i in range(2)]
        r = store.reserve("s1", ns, keys, None, 0.0)
        store.commit("s1", r.id, 0.0,  # type: ignore[union-attr]
                     checksums=[xxhash.xxh3_64_intdigest(g) for g in good])
        blocks = [ns.blocks[k] for k in keys]
        views = [memoryview(bytearray(g)) for g in good]
        remote = RemoteTier(Config(remote=RemoteConfig(url="memory://")), store,
                            lambda _ns, _off: memoryview(b""), TransferGate(4))
        inner = remote.backend.inner
        assert isinstance(inner, MemoryBackend)
        original = inner.put_checksummed

        async def scribbled(namespace: bytes, keys: Sequence[bytes],
                            values: Sequence[BytesLike],
                            checksums: Sequence[int | None]) -> list[bool]:
            views[0][:8] = b"\xee" * 8      # after the daemon's check, before encoding
            return await original(namespace, keys, values, checksums)

        async def scribbled_put(namespace: bytes, keys: Sequence[bytes],
                                values: Sequence[BytesLike]) -> list[bool]:
            return await scribbled(namespace, keys, values, [None] * len(keys))

        inner.put_checksummed = scribbled  # type: ignore[method-assign]
        inner.put = scribbled_put  # type: ignore[method-assign]
        written = await remote.send(ns, keys, views, "write", write_back=False, blocks=blocks)
        assert written == [True, True]
        out = [memoryview(bytearray(IDENT.block_bytes)) for _ in keys]
        got = await remote.backend.get_into_checksums(ns.id, keys, out)
        assert got[0] is None                           # damaged, a miss: never good
        assert got[1] == blocks[1].checksum and bytes(out[1]) == good[1]
        assert inner.counters.corrupt_values == 1
        await remote.close()

    asyncio.run(main())
