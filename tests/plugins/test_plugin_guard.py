"""GuardedBackend: checked arguments, bounded time and typed errors around any plugin."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Self

import numpy as np
import pytest

from kvstore.errors import BackendError, MalformedError, UnavailableError
from kvstore.plugins import (
    BackendHealth,
    BytesLike,
    GuardedBackend,
    StorageBackend,
    load_backend,
    run_bounded,
)

NS = bytes(16)
KEYS = [bytes([i]) * 16 for i in range(3)]


class ScriptedBackend(StorageBackend):
    """Every call does what ``behaviour`` says: 'hang', 'raise', 'unavailable' or 'bad'."""

    def __init__(self, behaviour: str) -> None:
        super().__init__()
        self.behaviour = behaviour

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        return cls(str(options["behaviour"]))

    async def _act(self, bad: Any) -> Any:
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        if self.behaviour == "raise":
            raise RuntimeError("library exploded")
        if self.behaviour == "unavailable":
            raise UnavailableError("store is down")
        return bad

    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        result: int = await self._act(len(keys) + 1)
        return result

    async def get_into(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[bool]:
        result: list[bool] = await self._act([True])
        return result

    async def put(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike]
    ) -> list[bool]:
        result: list[bool] = await self._act([1] * len(keys))
        return result

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        result: int = await self._act(-1)
        return result

    async def generation(self) -> bytes | None:
        result: bytes | None = await self._act(42)
        return result

    async def health(self) -> BackendHealth:
        result: BackendHealth = await self._act("fine")
        return result

    async def close(self) -> None:
        await self._act(None)


def guarded(behaviour: str, timeout_s: float = 0.2) -> GuardedBackend:
    return GuardedBackend(ScriptedBackend(behaviour), name="scripted", timeout_s=timeout_s)


def calls(backend: GuardedBackend) -> list[Any]:
    buffers = [memoryview(bytearray(8)) for _ in KEYS]
    return [
        lambda: backend.exists(NS, KEYS),
        lambda: backend.get_into(NS, KEYS, buffers),
        lambda: backend.put(NS, KEYS, [b"v"] * len(KEYS)),
        lambda: backend.delete(NS, KEYS),
        lambda: backend.generation(),
    ]


def test_a_hanging_plugin_times_out_with_unavailable() -> None:
    async def scenario() -> None:
        backend = guarded("hang")
        for call in calls(backend):
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="did not finish within 0.2 s"):
                await call()
            assert time.monotonic() - started < 1.0
        health = await backend.health()
        assert not health.ok and "did not answer" in health.detail
        assert backend.counters.timeouts == len(calls(backend)) + 1  # and health
        with pytest.raises(UnavailableError):
            await backend.close()

    asyncio.run(scenario())


def test_library_exceptions_become_backend_errors() -> None:
    async def scenario() -> None:
        backend = guarded("raise")
        for call in calls(backend):
            with pytest.raises(BackendError, match="library exploded") as caught:
                await call()
            assert isinstance(caught.value.__cause__, RuntimeError)
        health = await backend.health()
        assert not health.ok and "library exploded" in health.detail
        assert backend.counters.errors == len(calls(backend))

    asyncio.run(scenario())


def test_kvstore_errors_pass_through() -> None:
    async def scenario() -> None:
        for call in calls(guarded("unavailable")):
            with pytest.raises(UnavailableError, match="store is down"):
                await call()

    asyncio.run(scenario())


def test_results_of_the_wrong_shape_are_backend_errors() -> None:
    async def scenario() -> None:
        backend = guarded("bad")
        for call in calls(backend):
            with pytest.raises(BackendError, match="returned"):
                await call()
        health = await backend.health()
        assert not health.ok and "returned str" in health.detail

    asyncio.run(scenario())


def test_cancellation_is_not_turned_into_an_error() -> None:
    async def scenario() -> None:
        backend = guarded("hang", timeout_s=60)
        task = asyncio.create_task(backend.exists(NS, KEYS))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("namespace", "keys", "message"),
    [
        (bytes(15), KEYS, "namespace id must be 16 bytes"),
        ("0" * 16, KEYS, "namespace id must be 16 bytes"),
        (NS, [bytes(17)], "block keys must be 16 bytes"),
        (NS, ["k" * 16], "block keys must be 16 bytes"),
    ],
)
def test_malformed_keys_are_refused(namespace: Any, keys: Any, message: str) -> None:
    async def scenario() -> None:
        backend = load_backend("memory", {})
        for call in (
            lambda: backend.exists(namespace, keys),
            lambda: backend.get_into(namespace, keys, [memoryview(bytearray(1))] * len(keys)),
            lambda: backend.put(namespace, keys, [b"v"] * len(keys)),
            lambda: backend.delete(namespace, keys),
        ):
            with pytest.raises(MalformedError, match=message):
                await call()

    asyncio.run(scenario())


def test_malformed_buffers_are_refused() -> None:
    async def scenario() -> None:
        backend = load_backend("memory", {})
        with pytest.raises(MalformedError, match="2 keys but 1 buffers"):
            await backend.get_into(NS, KEYS[:2], [memoryview(bytearray(4))])
        with pytest.raises(MalformedError, match="writable"):
            await backend.get_into(NS, KEYS[:1], [memoryview(b"read-only")])
        with pytest.raises(MalformedError, match="contiguous"):
            await backend.get_into(NS, KEYS[:1], [memoryview(bytearray(8))[::2]])
        with pytest.raises(MalformedError, match="2 keys but 3 values"):
            await backend.put(NS, KEYS[:2], [b"a", b"b", b"c"])
        with pytest.raises(MalformedError, match="not a buffer"):
            await backend.put(NS, KEYS[:1], ["text"])  # type: ignore[list-item]
        for sums in ([1], [1, -1], [1, 1 << 64], [1, "x"]):
            with pytest.raises(MalformedError, match="checksums"):
                await backend.put_checksummed(NS, KEYS[:2], [b"a", b"b"], sums)  # type: ignore[arg-type]
        assert await backend.exists(NS, KEYS[:2]) == 0  # nothing stored by a refused put

    asyncio.run(scenario())


def test_typed_and_multidimensional_buffers_are_seen_as_bytes() -> None:
    async def scenario() -> None:
        backend = load_backend("memory", {})
        block = np.arange(64, dtype=np.float16).reshape(4, 16)
        assert await backend.put(NS, KEYS[:1], [memoryview(block)]) == [True]
        out = np.zeros((4, 16), dtype=np.float16)
        assert await backend.get_into(NS, KEYS[:1], [memoryview(out)]) == [True]
        assert np.array_equal(out, block)

    asyncio.run(scenario())


def test_a_closed_backend_is_unavailable() -> None:
    async def scenario() -> None:
        backend = load_backend("memory", {})
        await backend.close()
        await backend.close()  # idempotent
        with pytest.raises(UnavailableError, match="closed"):
            await backend.exists(NS, KEYS)
        assert not (await backend.health()).ok
        assert "closed" in repr(backend)
        async with load_backend("memory", {}) as scoped:
            await scoped.put(NS, KEYS[:1], [b"v"])
        with pytest.raises(UnavailableError, match="closed"):
            await scoped.exists(NS, KEYS)

    asyncio.run(scenario())


def test_repr_shows_the_counts() -> None:
    async def scenario() -> None:
        backend = load_backend("memory", {"timeout_s": 2})
        await backend.put(NS, KEYS[:1], [b"abc"])
        await backend.get_into(NS, KEYS[:1], [memoryview(bytearray(2))])
        assert repr(backend) == (
            "GuardedBackend('memory', timeout_s=2, corrupt_values=1, timeouts=0, errors=0)"
        )
        assert "values=1" in repr(backend.inner)

    asyncio.run(scenario())


def test_run_bounded_keeps_order_and_the_limit() -> None:
    running = peak = 0

    async def job(index: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001 * (index % 3))
        running -= 1
        return index * 10

    assert asyncio.run(run_bounded(20, 4, job)) == [i * 10 for i in range(20)]
    assert peak == 4
    assert asyncio.run(run_bounded(0, 4, job)) == []
    assert asyncio.run(run_bounded(3, 1, job)) == [0, 10, 20]


def test_run_bounded_raises_the_first_failure_and_stops_the_rest() -> None:
    finished: list[int] = []

    async def job(index: int) -> None:
        if index == 2:
            raise UnavailableError("gone")
        await asyncio.sleep(0.05)
        finished.append(index)

    with pytest.raises(UnavailableError, match="gone"):
        asyncio.run(run_bounded(10, 4, job))
    assert finished == []


def test_memory_backend_refuses_puts_past_max_bytes() -> None:
    async def scenario() -> None:
        backend = load_backend("memory", {"max_bytes": 200})
        key = os.urandom(16)
        assert await backend.put(NS, [key, KEYS[0]], [b"a" * 100, b"b" * 100]) == [True, False]
        assert await backend.put(NS, [key], [b"c" * 150]) == [True]  # replacing frees the old
        health = await backend.health()
        assert health.capacity_bytes == 200 and health.used_bytes is not None
        assert health.used_bytes <= 200

    asyncio.run(scenario())
