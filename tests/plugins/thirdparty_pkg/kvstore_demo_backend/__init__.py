"""A third-party storage backend: values in a dict, written against kvstore's public API."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Self

import msgspec

from kvstore.plugins import BackendHealth, BytesLike, StorageBackend, codec, parse_options

NOT_A_BACKEND = "just a string"


class DemoOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    label: str


class DemoBackend(StorageBackend):
    """Keeps encoded values in a dict keyed by namespace id + block key."""

    def __init__(self, label: str, timeout_s: float) -> None:
        super().__init__()
        self.label = label
        self.timeout_s = timeout_s
        self.values: dict[bytes, bytes] = {}

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        parsed = parse_options("demo", options, DemoOptions)
        return cls(parsed.label, timeout_s)

    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        count = 0
        while count < len(keys) and namespace + keys[count] in self.values:
            count += 1
        return count

    async def get_into(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[bool]:
        found = []
        for key, buffer in zip(keys, buffers):
            stored = self.values.get(namespace + key)
            hit = stored is not None and codec.decode_into(namespace, key, stored, buffer)
            self.counters.corrupt_values += stored is not None and not hit
            found.append(hit)
        return found

    async def put(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike]
    ) -> list[bool]:
        for key, value in zip(keys, values):
            self.values[namespace + key] = codec.encode_value(namespace, key, value)
        return [True] * len(keys)

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return sum(self.values.pop(namespace + key, None) is not None for key in keys)

    async def health(self) -> BackendHealth:
        return BackendHealth(ok=True, detail=f"demo backend {self.label!r}")

    async def close(self) -> None:
        self.values.clear()
