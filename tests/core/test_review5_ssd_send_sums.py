"""SSD copies sent to the remote store (its write-back mode) went without a checksum:
the backend hashed the bytes once more as it encoded them, though the SSD read had just
checked them against the block's.  They now go with the block's checksum."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import xxhash
from kvtest import make_identity

from kvstore.config import Config, RemoteConfig
from kvstore.keys import chain_keys
from kvstore.moves import Moves
from kvstore.plugins.base import BytesLike
from kvstore.plugins.memory_backend import MemoryBackend
from kvstore.remote import RemoteTier
from kvstore.store import Block, BlockStore
from kvstore.transfers import TransferGate

IDENT = make_identity(tenant="acme", model="m")


class _Ssd:
    """An SSD mover whose reads hand back given bytes, checked (as the real one's are)."""

    write_through = False

    def __init__(self, data: dict[bytes, bytes]) -> None:
        self.data = data
        self.removed_ids: list[tuple[bytes, bytes]] = []

    async def read_copies(self, blocks: list[Block], views: list[memoryview]) -> list[bool]:
        for b, view in zip(blocks, views):
            view[:] = self.data[b.key]
        return [xxhash.xxh3_64_intdigest(self.data[b.key]) == b.checksum for b in blocks]

    def removed(self, ids: list[tuple[bytes, bytes]]) -> None:
        self.removed_ids += ids


def test_ssd_copies_go_with_the_checksum_their_read_checked() -> None:
    async def main() -> None:
        store = BlockStore(8 * IDENT.block_bytes, 8 * IDENT.block_bytes)
        ns = store.open_namespace(IDENT)
        keys = chain_keys(ns.id, list(range(IDENT.block_tokens * 2)), IDENT.block_tokens)
        data = {k: bytes([1 + i]) * IDENT.block_bytes for i, k in enumerate(keys)}
        r = store.reserve("s1", ns, keys, None, 0.0)
        store.commit("s1", r.id, 0.0,  # type: ignore[union-attr]
                     checksums=[xxhash.xxh3_64_intdigest(data[k]) for k in keys])
        blocks = [ns.blocks[k] for k in keys]
        remote = RemoteTier(Config(remote=RemoteConfig(url="memory://",
                                                       write_policy="write-back")),
                            store, lambda _ns, _off: memoryview(b""), TransferGate(4))
        inner = remote.backend.inner
        assert isinstance(inner, MemoryBackend)
        given: list[Sequence[int | None]] = []
        original = inner.put_checksummed

        async def spy(namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike],
                      checksums: Sequence[int | None]) -> list[bool]:
            given.append(list(checksums))
            return await original(namespace, keys, values, checksums)

        inner.put_checksummed = spy  # type: ignore[method-assign]
        moves = Moves(store, lambda: 0.0, ssd=_Ssd(data), remote=remote)  # type: ignore[arg-type]
        for b in blocks:
            b.ssd_holds += 1                 # as ``ssd_write_back_plan`` holds them
        assert await moves._copy_from_ssd(blocks) == 2
        assert given == [[b.checksum for b in blocks]]
        assert all(b.remote and b.ssd_holds == 0 for b in blocks)
        out = [memoryview(bytearray(IDENT.block_bytes)) for _ in keys]
        assert await remote.backend.get_into_checksums(ns.id, keys, out) == \
            [b.checksum for b in blocks]
        await remote.close()

    asyncio.run(main())
