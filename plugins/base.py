"""The storage backend interface, and the guard the daemon puts around every backend.

A backend stores opaque block values under ``(namespace id, block key)``, both 16 bytes.
It is batch-first and async: each call takes a namespace and a list of keys.  Third
parties subclass :class:`StorageBackend`, register the class under the entry-point group
``kvstore.backends``, and the daemon loads it by name (see ``kvstore.plugins.registry``).

The daemon never calls a backend directly: :class:`GuardedBackend` checks arguments and
results, bounds every call by the configured timeout, and maps whatever a library raises
into ``kvstore.errors``, so a faulty or stuck plugin cannot hang or crash the daemon.
"""

from __future__ import annotations

import asyncio
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Self, TypeVar, cast

import msgspec
import xxhash

from kvstore.errors import (
    BackendError,
    CallTimeoutError,
    ConfigError,
    KVStoreError,
    MalformedError,
    UnavailableError,
)
from kvstore.keys import KEY_BYTES

NAMESPACE_BYTES = 16  # kvstore.identity.namespace_id is a 16-byte digest
GENERATION_MOST = 256  # bytes of a store's generation token, at most

BytesLike = bytes | bytearray | memoryview

T = TypeVar("T")
OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)


class BackendHealth(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend says about itself; ``capacity_bytes``/``used_bytes`` are None if unknown."""

    ok: bool
    detail: str = ""
    capacity_bytes: int | None = None
    used_bytes: int | None = None


@dataclasses.dataclass(slots=True)
class BackendCounters:
    """Counts a backend keeps for the daemon's metrics."""

    corrupt_values: int = 0  # stored values that failed the codec's checks; read as misses
    corrupt_changed: int = 0  # ... not deleted: another value was there by then
    deletes_refused: int = 0  # ... not deleted: the store refused (a user without DEL)
    timeouts: int = 0
    errors: int = 0


class StorageBackend(ABC):
    """A remote (or extra) store of block values, batch-first and async.

    Keys are ``(namespace, key)`` with a 16-byte namespace id and 16-byte block keys; an
    implementation must keep namespaces apart in what it stores.  Values go through
    ``kvstore.plugins.codec`` so that a torn, truncated or foreign value reads as a miss.
    Subclasses call ``super().__init__()`` and count corrupt values in ``self.counters``.
    ``async with backend:`` closes it at the end.

    Failures that concern the whole call (the store is unreachable, the connection broke)
    raise: ``UnavailableError`` when retrying later may work, ``BackendError`` otherwise.
    """

    # The daemons' tag secret (``remote.tag_secret_file``), set by the daemon after it
    # loads the backend: a backend storing values through the codec passes it to the
    # codec's calls, so values are tagged with it and only values tagged with it read,
    # and says so with ``keys_tags = True``.  The daemon refuses a secret for a backend
    # that does not (one written before secrets would ignore it: no value keyed).
    tag_secret: bytes | None = None
    keys_tags: ClassVar[bool] = False

    def __init__(self) -> None:
        self.counters = BackendCounters()

    @classmethod
    @abstractmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        """Build a backend from its configured options, without I/O.

        Raise ``ConfigError`` naming the bad option; ``parse_options`` does this for a
        msgspec Struct of options.  ``timeout_s`` is the per-operation timeout.
        """

    @abstractmethod
    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """The length of the leading run of ``keys`` that are stored."""

    @abstractmethod
    async def get_into(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[bool]:
        """Read each key's value into its buffer; per key, whether it was found.

        ``buffers`` are writable, contiguous 1-D byte memoryviews, one per key, sized to
        the block.  A value whose length or checksum does not match is a miss (counted in
        ``counters.corrupt_values``).  The contents of a buffer whose key missed, or of
        every buffer when the call raises, are undefined; but once the call has returned
        or raised, the backend must not write into any of them again.
        """

    async def get_into_checksums(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        """As :meth:`get_into`, with each found payload's xxh3_64 instead of True (None for
        a miss).  The daemon keeps that checksum for the block; a backend that verified
        the payload against it anyway (the built-in codec's checksum is exactly this)
        returns it, so the payload is hashed once.  By default: ``get_into``, then hash."""
        found = await self.get_into(namespace, keys, buffers)
        return [xxhash.xxh3_64_intdigest(buffer) if hit else None
                for hit, buffer in zip(found, buffers)]

    @abstractmethod
    async def put(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike]
    ) -> list[bool]:
        """Store each value under its key (replacing any); per key, whether it was stored.

        The backend must not keep references to ``values`` after it returns.
        """

    async def put_checksummed(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike],
        checksums: Sequence[int | None],
    ) -> list[bool]:
        """``put``, with each value's xxh3_64 as the daemon checked it (the block's commit
        gave it; None: not known).  A backend whose values carry a checksum (the built-in
        codec's) stores the one given rather than hashing the bytes again: bytes that
        change after the daemon's check (a writer scribbling through its mapping while
        the value is encoded) then read back as damaged, never as good.  By default:
        ``put``, the backend's own digest."""
        return await self.put(namespace, keys, values)

    @abstractmethod
    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Remove the keys; the number that were stored."""

    async def delete_corrupt(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Remove those of ``keys`` a read found corrupt, each only if the store still
        holds the value found (another writer may have put a good one since), never
        those that missed; the number removed.  A store that refuses the delete (its
        permissions) counts it in ``counters.deletes_refused`` and raises nothing.  By
        default: ``delete`` (a backend that cannot compare removes whatever is there)."""
        return await self.delete(namespace, keys)

    async def generation(self) -> bytes | None:
        """A token that names what the store holds: the same while it keeps what it was
        given (a restart that loads its data again included), another once it lost it
        all (restarted empty, flushed, failed over to an empty replica).  The backend
        keeps it in the store, made on the first call.  The daemon asks every
        ``remote.check_seconds`` and, when it changed, forgets which blocks it believed
        the store held, and writes them again.  None (the default): the backend cannot
        tell, and the daemon trusts what it was told."""
        return None

    @abstractmethod
    async def health(self) -> BackendHealth:
        """Whether the store answers, and its capacity and use where known; never raises."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections, threads and files."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class GuardedBackend(StorageBackend):
    """The daemon's view of a backend: checked arguments, bounded time, typed errors.

    Every call finishes within ``timeout_s`` or raises ``UnavailableError``; any other
    exception from the plugin that is not a ``KVStoreError`` becomes ``BackendError``.
    ``health()`` never raises.  ``counters`` is shared with the wrapped backend.
    """

    def __init__(self, inner: StorageBackend, *, name: str, timeout_s: float) -> None:
        super().__init__()
        self.inner = inner
        self.name = name
        self.timeout_s = timeout_s
        self.counters = inner.counters
        self._closed = False

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"GuardedBackend({self.name!r}, timeout_s={self.timeout_s:g}, "
            f"corrupt_values={c.corrupt_values}, timeouts={c.timeouts}, errors={c.errors}"
            f"{', closed' if self._closed else ''})"
        )

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        raise ConfigError("GuardedBackend wraps a loaded backend; use load_backend()")

    def key_tags(self, secret: bytes) -> None:
        """Tag values with ``secret`` and take only values tagged with it; ConfigError
        for a backend that does not say it keys its tags (``keys_tags``)."""
        if not self.inner.keys_tags:
            raise ConfigError(
                f"remote.tag_secret_file is set, but the {self.name!r} backend does not key "
                "its values' tags with it (keys_tags): values anyone can write would be "
                "taken; unset it, or use a backend that does (redis, fs)")
        self.tag_secret = self.inner.tag_secret = secret

    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return await self._count("exists", namespace, keys, self.inner.exists)

    async def _count(self, op: str, namespace: bytes, keys: Sequence[bytes],
                     call: Callable[[bytes, Sequence[bytes]], Awaitable[int]]) -> int:
        """``call(namespace, keys)`` of the inner backend, checked, bounded in time, its
        answer a count of the keys (BackendError if not)."""
        self._check_open()
        self._check_keys(namespace, keys)
        if not keys:
            return 0
        count = await self._bounded(op, call(namespace, keys))
        if type(count) is not int or not 0 <= count <= len(keys):
            raise self._bad_result(op, f"{count!r} for {len(keys)} keys")
        return count

    def _get_views(self, namespace: bytes, keys: Sequence[bytes],
                   buffers: Sequence[memoryview]) -> list[memoryview]:
        self._check_open()
        self._check_keys(namespace, keys)
        if len(buffers) != len(keys):
            raise MalformedError(f"get_into got {len(keys)} keys but {len(buffers)} buffers")
        return [_byte_view(buffer, writable=True) for buffer in buffers]

    async def get_into(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[bool]:
        views = self._get_views(namespace, keys, buffers)
        if not keys:
            return []
        found = await self._bounded("get_into", self.inner.get_into(namespace, keys, views))
        return self._check_flags("get_into", found, len(keys))

    async def get_into_checksums(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        views = self._get_views(namespace, keys, buffers)
        if not keys:
            return []
        sums = await self._bounded(
            "get_into", self.inner.get_into_checksums(namespace, keys, views))
        if not isinstance(sums, list) or len(sums) != len(keys) or not all(
                s is None or (type(s) is int and 0 <= s < 1 << 64) for s in sums):
            raise self._bad_result("get_into_checksums",
                                   f"{type(sums).__name__} instead of {len(keys)} checksums")
        return sums

    async def put(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike]
    ) -> list[bool]:
        payloads = self._put_values(namespace, keys, values)
        if not keys:
            return []
        stored = await self._bounded("put", self.inner.put(namespace, keys, payloads))
        return self._check_flags("put", stored, len(keys))

    async def put_checksummed(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike],
        checksums: Sequence[int | None],
    ) -> list[bool]:
        payloads = self._put_values(namespace, keys, values)
        if len(checksums) != len(keys) or not all(
                s is None or (type(s) is int and 0 <= s < 1 << 64) for s in checksums):
            raise MalformedError(f"put got {len(keys)} keys but checksums {checksums!r:.80}")
        if not keys:
            return []
        stored = await self._bounded(
            "put", self.inner.put_checksummed(namespace, keys, payloads, checksums))
        return self._check_flags("put", stored, len(keys))

    def _put_values(self, namespace: bytes, keys: Sequence[bytes],
                    values: Sequence[BytesLike]) -> list[BytesLike]:
        self._check_open()
        self._check_keys(namespace, keys)
        if len(values) != len(keys):
            raise MalformedError(f"put got {len(keys)} keys but {len(values)} values")
        return [value if isinstance(value, bytes) else _byte_view(value, writable=False)
                for value in values]

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return await self._count("delete", namespace, keys, self.inner.delete)

    async def delete_corrupt(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return await self._count("delete", namespace, keys, self.inner.delete_corrupt)

    async def generation(self) -> bytes | None:
        self._check_open()
        token = await self._bounded("generation", self.inner.generation())
        if token is not None and (type(token) is not bytes or len(token) > GENERATION_MOST):
            raise self._bad_result("generation", f"{type(token).__name__} instead of a token")
        return token

    async def health(self) -> BackendHealth:
        if self._closed:
            return BackendHealth(ok=False, detail=f"{self.name} backend is closed")
        try:
            async with asyncio.timeout(self.timeout_s):
                health = await self.inner.health()
        except TimeoutError:
            self.counters.timeouts += 1
            return BackendHealth(
                ok=False, detail=f"health check did not answer within {self.timeout_s:g} s"
            )
        except Exception as exc:  # noqa: BLE001 - health reports failures, never raises them
            return BackendHealth(ok=False, detail=f"health check failed: {exc}")
        if not isinstance(health, BackendHealth):
            return BackendHealth(ok=False, detail=f"plugin returned {type(health).__name__}")
        return health

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._bounded("close", self.inner.close())

    async def _bounded(self, op: str, call: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call
        except TimeoutError:
            self.counters.timeouts += 1
            raise CallTimeoutError(
                f"{self.name} backend: {op} did not finish within {self.timeout_s:g} s"
            ) from None
        except KVStoreError:
            self.counters.errors += 1
            raise
        except Exception as exc:
            self.counters.errors += 1
            raise BackendError(f"{self.name} backend: {op} failed: {exc!r}") from exc

    def _check_flags(self, op: str, flags: object, count: int) -> list[bool]:
        if (
            not isinstance(flags, list)
            or len(flags) != count
            or not all(type(flag) is bool for flag in flags)
        ):
            raise self._bad_result(op, f"{type(flags).__name__} instead of {count} bools")
        return cast(list[bool], flags)

    def _bad_result(self, op: str, what: str) -> BackendError:
        self.counters.errors += 1
        return BackendError(f"{self.name} backend: {op} returned {what}")

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"{self.name} backend is closed")

    @staticmethod
    def _check_keys(namespace: bytes, keys: Sequence[bytes]) -> None:
        if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
            raise MalformedError(f"namespace id must be {NAMESPACE_BYTES} bytes")
        for key in keys:
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise MalformedError(f"block keys must be {KEY_BYTES} bytes, got {key!r}")


def _byte_view(buffer: BytesLike, *, writable: bool) -> memoryview:
    """``buffer`` as a flat unsigned-byte view, or MalformedError."""
    try:
        view = memoryview(buffer)
    except TypeError:
        raise MalformedError(f"{type(buffer).__name__} is not a buffer") from None
    if writable and view.readonly:
        raise MalformedError("get_into needs writable buffers")
    if not view.c_contiguous:
        raise MalformedError("buffers must be C-contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


async def run_bounded(count: int, limit: int, job: Callable[[int], Awaitable[T]]) -> list[T]:
    """``[await job(0), ..., await job(count - 1)]`` with at most ``limit`` running at once.

    The first failure cancels the other jobs, waits for them to end, and is raised as
    itself rather than inside an ExceptionGroup.
    """
    results: list[Any] = [None] * count
    indices = iter(range(count))

    async def worker() -> None:
        for index in indices:  # the workers share one iterator: each index runs once
            results[index] = await job(index)

    workers = min(limit, count)
    if workers <= 1:
        await worker()
        return cast(list[T], results)
    first_failure: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(workers):
                group.create_task(worker())
    except BaseExceptionGroup as failure:
        first_failure = failure.exceptions[0]
    if first_failure is not None:
        raise first_failure  # outside the handler, so it keeps its own cause and context
    return cast(list[T], results)


def parse_options(backend: str, options: Mapping[str, object], kind: type[OptionsT]) -> OptionsT:
    """Validate ``options`` into the Struct ``kind``; a clear ``ConfigError`` if they don't fit.

    Give ``kind`` ``forbid_unknown_fields=True`` so a misspelt option is an error.
    """
    try:
        return msgspec.convert(dict(options), kind, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"backend {backend!r}: bad options: {exc}") from None
