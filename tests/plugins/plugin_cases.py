"""Each built-in backend as a test case: how to load it, and how to reach past it to the
stored bytes (to corrupt them)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvstore.plugins import GuardedBackend, StorageBackend, load_backend
from kvstore.plugins.fs_backend import FsBackend
from kvstore.plugins.memory_backend import MemoryBackend
from kvstore.plugins.redis_backend import RedisBackend

T = TypeVar("T")


RawRead = Callable[[StorageBackend, bytes, bytes], bytes | None]
RawWrite = Callable[[StorageBackend, bytes, bytes, bytes], None]


@dataclass
class BackendCase:
    """How to load one backend, and how to reach past it to the stored bytes."""

    backend_name: str
    options: dict[str, object]
    read_raw: RawRead
    write_raw: RawWrite

    def run(self, scenario: Callable[[GuardedBackend], Awaitable[T]]) -> T:
        """Run ``scenario`` on a freshly loaded backend in a new event loop; close it after."""

        async def main() -> T:
            async with load_backend(self.backend_name, self.options) as backend:
                return await scenario(backend)

        return asyncio.run(main())


def memory_case() -> BackendCase:
    def read(inner: StorageBackend, namespace: bytes, key: bytes) -> bytes | None:
        assert isinstance(inner, MemoryBackend)
        stored = inner.stored_value(namespace, key)
        return None if stored is None else bytes(stored)

    def write(inner: StorageBackend, namespace: bytes, key: bytes, data: bytes) -> None:
        assert isinstance(inner, MemoryBackend)
        stored = inner.stored_value(namespace, key)
        assert stored is not None, "tests only rewrite values they stored"
        stored[:] = data

    return BackendCase("memory", {}, read, write)


def fs_case(root: Path) -> BackendCase:
    def read(inner: StorageBackend, namespace: bytes, key: bytes) -> bytes | None:
        assert isinstance(inner, FsBackend)
        path = inner.path_for(namespace, key)
        return path.read_bytes() if path.exists() else None

    def write(inner: StorageBackend, namespace: bytes, key: bytes, data: bytes) -> None:
        assert isinstance(inner, FsBackend)
        inner.path_for(namespace, key).write_bytes(data)

    return BackendCase("fs", {"path": str(root), "threads": 4}, read, write)


def redis_case(url: str, client: Any) -> BackendCase:
    def read(inner: StorageBackend, namespace: bytes, key: bytes) -> bytes | None:
        assert isinstance(inner, RedisBackend)
        value = client.get(inner.redis_key(namespace, key))
        return None if value is None else bytes(value)

    def write(inner: StorageBackend, namespace: bytes, key: bytes, data: bytes) -> None:
        assert isinstance(inner, RedisBackend)
        client.set(inner.redis_key(namespace, key), data)

    return BackendCase("redis", {"url": url, "timeout_s": 5.0}, read, write)
