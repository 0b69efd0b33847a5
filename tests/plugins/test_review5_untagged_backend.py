"""A third-party backend knows nothing of the daemons' tag secret unless it reads
``tag_secret``: given one, it went on storing and taking unkeyed values, and the daemon
ran as if its values were keyed, with no word of it.  A backend now says it keys its
tags (``keys_tags``), and the daemon refuses a tag secret for one that does not."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Self

import pytest

from kvstore.errors import ConfigError
from kvstore.plugins import GuardedBackend, StorageBackend
from kvstore.plugins.base import BackendHealth, BytesLike
from kvstore.plugins.memory_backend import MemoryBackend


class Unaware(StorageBackend):
    """A backend written before tag secrets: it never reads ``tag_secret``."""

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        return cls()

    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return 0

    async def get_into(self, namespace: bytes, keys: Sequence[bytes],
                       buffers: Sequence[memoryview]) -> list[bool]:
        return [False] * len(keys)

    async def put(self, namespace: bytes, keys: Sequence[bytes],
                  values: Sequence[BytesLike]) -> list[bool]:
        return [True] * len(keys)

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return 0

    async def health(self) -> BackendHealth:
        return BackendHealth(ok=True)

    async def close(self) -> None:
        pass


def test_a_tag_secret_for_a_backend_that_ignores_it_is_refused() -> None:
    guarded = GuardedBackend(Unaware(), name="unaware", timeout_s=1.0)
    with pytest.raises(ConfigError, match="tag_secret_file.*unaware"):
        guarded.key_tags(bytes(range(32)))
    assert guarded.tag_secret is None and guarded.inner.tag_secret is None


def test_the_built_in_backends_key_their_tags() -> None:
    guarded = GuardedBackend(MemoryBackend(), name="memory", timeout_s=1.0)
    guarded.key_tags(bytes(range(32)))
    assert guarded.inner.tag_secret == bytes(range(32))
