"""``redis``: blocks as string values in Redis or Valkey, standalone or Redis Cluster.

URLs: ``redis://[user:password@]host:port/db`` (also ``rediss://``, ``unix://``,
``valkey://``) for one server; ``redis+cluster://[user:password@]host:port[,host:port]``
(also ``rediss+cluster://``, ``valkey+cluster://``) for a cluster, whose other nodes are
discovered.  A stored key is ``key_prefix + namespace id + block key``, binary.

Blocks are large (MiB), so each value is its own GET or SET, and up to ``connections``
of them run in parallel on separate connections; pipelining many large values on one
connection only queues them behind each other.  ``exists`` pipelines, its replies are tiny.

redis.asyncio connections always pack commands with redis-py's pure-Python packer
(``Connection.pack_command``), which hands a large value to the socket as its own chunk.
The hiredis packer, the synchronous client's default, was unreliable for 2 MiB SETs; the
asyncio client has no option to choose it, and a test checks that this stays so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Self
from urllib.parse import unquote, urlsplit

import msgspec
import redis.asyncio
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvstore.errors import BackendError, ConfigError, KVStoreError, UnavailableError

from . import codec
from .base import (
    BackendHealth,
    BytesLike,
    StorageBackend,
    parse_options,
    run_bounded,
)

STANDALONE_SCHEMES = {"redis": "redis", "rediss": "rediss", "unix": "unix",
                      "valkey": "redis", "valkeys": "rediss"}
CLUSTER_SCHEMES = {"redis+cluster": False, "valkey+cluster": False,
                   "rediss+cluster": True, "valkeys+cluster": True}  # scheme -> TLS
DEFAULT_PORT = 6379
_EXISTS_CHUNK = 128  # keys per pipelined EXISTS round trip; the run stops at the first miss

_HIT, _MISS, _CORRUPT = range(3)
# Failures where the server may answer again later (restart, failover, network).
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,  # includes BusyLoading, MaxConnections, Authentication
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,  # e.g. no reachable startup node
    OSError,
)
_LIBRARY_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)


class RedisOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: Annotated[str, msgspec.Meta(min_length=1)]
    connections: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    key_prefix: str = "kvstore:"
    ttl_s: Annotated[int, msgspec.Meta(ge=1)] | None = None  # expire stored blocks; None: never


class RedisBackend(StorageBackend):
    """A Redis/Valkey server or cluster; see the module docstring for URLs and keys."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        connections: int = 4,
        key_prefix: str = "kvstore:",
        ttl_s: int | None = None,
    ) -> None:
        super().__init__()
        self.url = url
        self.timeout_s = timeout_s
        self.connections = connections
        self.key_prefix = key_prefix.encode()
        self.ttl_s = ttl_s
        self.cluster = _scheme(url) in CLUSTER_SCHEMES
        self._client = _make_client(url, timeout_s=timeout_s, connections=connections)
        # Data commands share these slots, so the backend never uses more than
        # ``connections`` connections (per node) for data, however many calls overlap.
        self._slots = asyncio.Semaphore(connections)
        self._health_lock = asyncio.Lock()  # health uses the one spare connection

    def __repr__(self) -> str:
        mode = "cluster" if self.cluster else "standalone"
        return (
            f"RedisBackend({_redact(self.url)!r}, {mode}, connections={self.connections}, "
            f"corrupt_values={self.counters.corrupt_values})"
        )

    @classmethod
    def from_options(cls, options: Mapping[str, object], *, timeout_s: float) -> Self:
        parsed = parse_options("redis", options, RedisOptions)
        return cls(
            parsed.url,
            timeout_s=timeout_s,
            connections=parsed.connections,
            key_prefix=parsed.key_prefix,
            ttl_s=parsed.ttl_s,
        )

    def redis_key(self, namespace: bytes, key: bytes) -> bytes:
        """The Redis key that holds ``(namespace, key)``."""
        return self.key_prefix + namespace + key

    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        count = 0
        try:
            for start in range(0, len(keys), _EXISTS_CHUNK):
                async with self._slots:
                    pipe = self._client.pipeline(transaction=False)
                    for key in keys[start:start + _EXISTS_CHUNK]:
                        pipe.exists(self.redis_key(namespace, key))
                    replies = await pipe.execute()
                for reply in replies:
                    if not reply:
                        return count
                    count += 1
        except _LIBRARY_ERRORS as exc:
            raise self._error("exists", exc) from exc
        return count

    async def get_into(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[bool]:
        async def fetch(index: int) -> int:
            key = keys[index]
            try:
                async with self._slots:
                    stored = await self._client.get(self.redis_key(namespace, key))
            except redis.exceptions.ResponseError as exc:
                if not str(exc).startswith("WRONGTYPE"):
                    raise
                return _CORRUPT  # something else sits under our key
            if stored is None:
                return _MISS
            if not isinstance(stored, bytes):  # only with decode_responses, which we never set
                return _CORRUPT
            return _HIT if codec.decode_into(namespace, key, stored, buffers[index]) else _CORRUPT

        try:
            statuses = await run_bounded(len(keys), self.connections, fetch)
        except _LIBRARY_ERRORS as exc:
            raise self._error("get_into", exc) from exc
        self.counters.corrupt_values += statuses.count(_CORRUPT)
        return [status == _HIT for status in statuses]

    async def put(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike]
    ) -> list[bool]:
        async def store(index: int) -> bool:
            key = keys[index]
            value = codec.encode_value(namespace, key, values[index])
            try:
                async with self._slots:
                    reply = await self._client.set(
                        self.redis_key(namespace, key), value, ex=self.ttl_s
                    )
            except redis.exceptions.ResponseError as exc:
                if isinstance(exc, redis.exceptions.OutOfMemoryError) or str(exc).startswith("OOM"):
                    return False  # maxmemory reached with a no-eviction policy: this key only
                raise
            return bool(reply)

        try:
            return await run_bounded(len(keys), self.connections, store)
        except _LIBRARY_ERRORS as exc:
            raise self._error("put", exc) from exc

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        try:
            async with self._slots:
                # UNLINK frees the memory in the background; redis-py splits it by slot
                # on a cluster.
                removed = await self._client.unlink(*(self.redis_key(namespace, k) for k in keys))
        except _LIBRARY_ERRORS as exc:
            raise self._error("delete", exc) from exc
        return int(removed)

    async def health(self) -> BackendHealth:
        where = _redact(self.url)
        try:
            async with self._health_lock, asyncio.timeout(self.timeout_s):
                if isinstance(self._client, RedisCluster):
                    return await self._cluster_health(where)
                memory = await self._client.info("memory")
        except TimeoutError:
            return BackendHealth(
                ok=False, detail=f"{where} did not answer within {self.timeout_s:g} s"
            )
        except _LIBRARY_ERRORS as exc:
            return BackendHealth(ok=False, detail=f"{where} is unreachable: {exc}")
        used, capacity = _memory_use([memory])
        return BackendHealth(
            ok=True, detail=f"redis at {where}", capacity_bytes=capacity, used_bytes=used
        )

    async def _cluster_health(self, where: str) -> BackendHealth:
        assert isinstance(self._client, RedisCluster), "only called for a cluster"
        state = (await self._client.cluster_info()).get("cluster_state")
        per_node = await self._client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        memories = list(per_node.values()) if isinstance(per_node, dict) else []
        used, capacity = _memory_use(memories)
        return BackendHealth(
            ok=state == "ok",
            detail=f"redis cluster at {where}: {len(memories)} primaries, cluster_state {state}",
            capacity_bytes=capacity,
            used_bytes=used,
        )

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except _LIBRARY_ERRORS as exc:
            raise self._error("close", exc) from exc

    def _error(self, op: str, exc: BaseException) -> KVStoreError:
        what = f"redis backend at {_redact(self.url)}: {op}"
        if isinstance(exc, _UNAVAILABLE):
            return UnavailableError(f"{what}: {exc}")
        return BackendError(f"{what}: {exc}")


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()


def _make_client(
    url: str, *, timeout_s: float, connections: int
) -> redis.asyncio.Redis | RedisCluster:
    """A redis.asyncio client for ``url``; ConfigError if the URL is not one we take."""
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # One quick retry (a pooled connection the server closed), never a backoff loop:
        # the caller's timeout bounds the whole call.
        "retry": Retry(NoBackoff(), 1),
        "max_connections": connections + 1,  # one spare for health checks
    }
    scheme = _scheme(url)
    if scheme in CLUSTER_SCHEMES:
        nodes, username, password = _parse_cluster_url(url)
        return RedisCluster(
            startup_nodes=nodes, username=username, password=password,
            ssl=CLUSTER_SCHEMES[scheme], **common,
        )
    if scheme not in STANDALONE_SCHEMES:
        known = ", ".join(f"{s}://" for s in [*STANDALONE_SCHEMES, *CLUSTER_SCHEMES])
        raise ConfigError(f"backend 'redis': url {_redact(url)!r}: expected one of {known}")
    plain_url = STANDALONE_SCHEMES[scheme] + url[len(scheme):]
    try:
        pool = redis.asyncio.BlockingConnectionPool.from_url(plain_url, timeout=timeout_s, **common)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"backend 'redis': url {_redact(url)!r}: {exc}") from None
    return redis.asyncio.Redis.from_pool(pool)


def _parse_cluster_url(url: str) -> tuple[list[ClusterNode], str | None, str | None]:
    """Startup nodes and credentials of ``redis+cluster://[user:pw@]host:port[,host:port]``."""
    rest = url.partition("://")[2]
    location, _, path = rest.partition("/")
    problem = None
    if "?" in rest or "#" in rest:
        problem = "cluster URLs take no query or fragment"
    elif path not in ("", "0"):
        problem = "a cluster has only database 0"
    userinfo, _, hosts = location.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes: list[ClusterNode] = []
    for address in hosts.split(","):
        try:
            parts = urlsplit(f"//{address}")
            host, port = parts.hostname, parts.port or DEFAULT_PORT
        except ValueError as exc:
            problem = str(exc)
            break
        if not host:
            problem = f"no host in {address!r}"
            break
        nodes.append(ClusterNode(host, port))
    if problem is not None:
        raise ConfigError(f"backend 'redis': url {_redact(url)!r}: {problem}")
    return nodes, unquote(username) or None, unquote(password) or None


def _memory_use(infos: Sequence[Mapping[str, object]]) -> tuple[int | None, int | None]:
    """(used bytes, capacity) summed over nodes; capacity None unless every node has maxmemory."""
    if not infos:
        return None, None
    used = sum(_int(info.get("used_memory")) for info in infos)
    limits = [_int(info.get("maxmemory")) for info in infos]
    return used, (sum(limits) if all(limits) else None)


def _int(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def _redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, location = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{location}"
