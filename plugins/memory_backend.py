"""``memory``: an in-process dict of stored values, for unit tests and examples."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Self

import msgspec

from . import codec
from .base import BackendHealth, BytesLike, StorageBackend, parse_options


class MemoryOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None  # stored bytes, headers included


class MemoryBackend(StorageBackend):
    """Values in a dict keyed by namespace id + block key; puts past ``max_bytes`` fail."""

    keys_tags = True  # values go through the codec with ``tag_secret``

    def __init__(self, max_bytes: int | None = None) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._values: dict[bytes, bytearray] = {}
        self._generation = os.urandom(16)

    def __repr__(self) -> str:
        return (
            f"MemoryBackend(values={len(self._values)}, used_bytes={self.used_bytes}, "
            f"max_bytes={self.max_bytes}, corrupt_values={self.counters.corrupt_values})"
        )

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        parsed = parse_options("memory", options, MemoryOptions)
        return cls(max_bytes=parsed.max_bytes)

    def stored_value(self, namespace: bytes, key: bytes) -> bytearray | None:
        """The stored bytes (header included), mutable in place: for tests that corrupt them."""
        return self._values.get(namespace + key)

    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if namespace + key not in self._values:
                break
            count += 1
        return count

    async def get_into(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[bool]:
        found: list[bool] = []
        for key, buffer in zip(keys, buffers, strict=True):
            stored = self._values.get(namespace + key)
            hit = stored is not None and codec.decode_into(namespace, key, stored, buffer,
                                                                self.tag_secret)
            if stored is not None and not hit:
                self.counters.corrupt_values += 1
            found.append(hit)
        return found

    async def put(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike]
    ) -> list[bool]:
        return await self.put_checksummed(namespace, keys, values, [None] * len(keys))

    async def put_checksummed(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike],
        checksums: Sequence[int | None],
    ) -> list[bool]:
        stored: list[bool] = []
        for key, value, digest in zip(keys, values, checksums, strict=True):
            encoded = bytearray(codec.encode_header(namespace, key, value, digest,
                                                        self.tag_secret))
            encoded += value
            previous = self._values.get(namespace + key)
            freed = len(previous) if previous is not None else 0
            after = self.used_bytes - freed + len(encoded)
            if self.max_bytes is not None and after > self.max_bytes:
                stored.append(False)
                continue
            self._values[namespace + key] = encoded
            self.used_bytes = after
            stored.append(True)
        return stored

    async def generation(self) -> bytes | None:
        return self._generation

    def lose_everything(self) -> None:
        """Forget every value, as a store restarted empty would: for tests."""
        self._values.clear()
        self.used_bytes = 0
        self._generation = os.urandom(16)

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            value = self._values.pop(namespace + key, None)
            if value is not None:
                self.used_bytes -= len(value)
                removed += 1
        return removed

    async def health(self) -> BackendHealth:
        return BackendHealth(
            ok=True,
            detail=f"{len(self._values)} values in process memory",
            capacity_bytes=self.max_bytes,
            used_bytes=self.used_bytes,
        )

    async def close(self) -> None:
        self._values.clear()
        self.used_bytes = 0
