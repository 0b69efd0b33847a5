"""``redis``: blocks as string values in Redis or Valkey, standalone or Redis Cluster.

URLs: ``redis://[user:password@]host:port/db`` (also ``rediss://``, ``unix://``,
``valkey://``) for one server; ``redis+cluster://[user:password@]host:port[,host:port]``
(also ``rediss+cluster://``, ``valkey+cluster://``) for a cluster, whose other nodes are
discovered.  A stored key is ``key_prefix + namespace id + block key``, binary.

Values move on a data path of our own (``resp.py``): per server, up to ``connections``
connections, each taking a contiguous chunk of the batch's keys as one pipeline (all the
SETs or GETs written at once, then the replies read in order).  A GET reply is received
straight into the caller's buffer and checked there, so a value is copied once; a SET
sends the codec header, then the caller's buffer as it is.  On a cluster, keys are
routed by slot with redis-py's view of the cluster; a key that meets a redirection
(MOVED, ASK) or TRYAGAIN is retried through redis-py, which follows it and refreshes that
view.  Everything else (``exists``, ``delete``, health) goes through redis-py, whose
replies are small.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Self
from urllib.parse import unquote, urlsplit

import msgspec
import redis.asyncio
import redis.asyncio.connection
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
from .redis_corrupt import NOT_A_STRING, CorruptValues, Found, same_bytes, same_length
from .redis_generation import ClusterTokens, server_token
from .resp import ReplyError, RespConnection, pack_command, pack_set
from .turns import UrgentFirst, turn

STANDALONE_SCHEMES = {"redis": "redis", "rediss": "rediss", "unix": "unix",
                      "valkey": "redis", "valkeys": "rediss"}
CLUSTER_SCHEMES = {"redis+cluster": False, "valkey+cluster": False,
                   "rediss+cluster": True, "valkeys+cluster": True}  # scheme -> TLS
DEFAULT_PORT = 6379
GENERATION_KEY = b"generation"  # after key_prefix: the store's generation token
# bytes of values one connection carries for a call before it is handed on in turn: a
# few milliseconds on a local server, a little under the pipelining a call of more keeps
PIECE_BYTES = 4 << 20
_EXISTS_CHUNK = 128  # keys per pipelined EXISTS round trip; the run stops at the first miss

_HIT, _MISS, _CORRUPT, _REDIRECTED = range(4)
# Error replies of a cluster in motion: redis-py retries these keys, following the cluster.
_REDIRECTIONS = frozenset({"MOVED", "ASK", "TRYAGAIN"})
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

    keys_tags = True  # values go through the codec with ``tag_secret``

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
        # The data path's connections, per server ("" for a standalone one); each pool
        # bounds its connections, so however many calls overlap, a server sees at most
        # ``connections`` data connections from this backend.
        self._pools: dict[str, _Pool] = {}
        if not self.cluster:
            assert isinstance(self._client, redis.asyncio.Redis)
            self._pools[""] = _Pool(_standalone_opener(self._client), connections)
        self._slots = asyncio.Semaphore(connections)  # for redis-py's commands (exists)
        self._health_lock = asyncio.Lock()  # health uses the one spare connection
        # the generation token last read, and the server's (run_id, evicted_keys) then
        self._generation: tuple[bytes, tuple[str, int] | None] | None = None
        self._tokens = ClusterTokens()  # a cluster's: a token per primary
        self._corrupt = CorruptValues(self.counters)  # read so, to delete if unchanged

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
        return [digest is not None
                for digest in await self.get_into_checksums(namespace, keys, buffers)]

    async def get_into_checksums(
        self, namespace: bytes, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        statuses = [_MISS] * len(keys)
        sums: list[int | None] = [None] * len(keys)

        async def fetch(conn: RespConnection, indices: list[int]) -> None:
            await conn.write([
                part
                for index in indices
                for part in pack_command([b"GET", self.redis_key(namespace, keys[index])])
            ])
            # Read every reply, then check the payloads.  Each payload is received straight
            # into its buffer; around it, the connection receives no more than the framing
            # that a hit of the expected size has (what a miss has is shorter).
            prefixes = [_value_prefix_bytes(buffers[index]) for index in indices]
            heads: list[bytearray | None] = []
            for at, index in enumerate(indices):
                then = _CRLF_BYTES + (prefixes[at + 1] if at + 1 < len(indices) else 0)
                heads.append(await self._read_value(
                    conn, index, buffers[index], statuses, ahead=prefixes[at], then=then,
                    name=self.redis_key(namespace, keys[index])))
            def check() -> None:
                for index, head in zip(indices, heads):
                    if head is not None:
                        sums[index] = self._check(namespace, keys[index], head, buffers[index])
                        statuses[index] = _HIT if sums[index] is not None else _CORRUPT
                        if sums[index] is None:  # (recorded on the loop, below)
                            bad.append((index, same_bytes(head, buffers[index])))

            bad: list[tuple[int, Found]] = []
            await self._off_loop(check, sum(buffers[i].nbytes for i in indices))
            for index, found in bad:
                self._corrupt.found(self.redis_key(namespace, keys[index]), found)

        try:
            await self._on_connections(namespace, keys, fetch,
                                       buffers[0].nbytes if buffers else 0)
            redirected = [i for i, status in enumerate(statuses) if status == _REDIRECTED]
            for index in redirected:  # rare: a cluster moving slots; redis-py follows it
                statuses[index], sums[index] = await self._get_slowly(
                    namespace, keys[index], buffers[index])
        except _LIBRARY_ERRORS as exc:
            raise self._error("get_into", exc) from exc
        self.counters.corrupt_values += statuses.count(_CORRUPT)
        return sums

    async def _read_value(
        self, conn: RespConnection, index: int, out: memoryview, statuses: list[int], *,
        ahead: int, then: int, name: bytes,
    ) -> bytearray | None:
        """Read one GET reply (of the Redis key ``name``): the codec header (returned) and
        the payload, into ``out``; None, with ``statuses[index]`` set, if there is no
        payload of ``out``'s size.  ``ahead``/``then``: the bytes expected before and
        after the payload."""
        reply = await conn.read_bulk_header(ahead=ahead)
        if reply is None:
            statuses[index] = _MISS
            return None
        if isinstance(reply, ReplyError):
            statuses[index] = self._reply_status(reply, "GET")
            if statuses[index] == _CORRUPT:
                self._corrupt.found(name, NOT_A_STRING)
            return None
        if reply != codec.HEADER_BYTES + out.nbytes:
            await conn.skip(reply)
            await conn.end_bulk()
            statuses[index] = _CORRUPT
            self._corrupt.found(name, same_length(reply))
            return None
        head = bytearray(codec.HEADER_BYTES)
        await conn.read_into(memoryview(head), then=0)
        await conn.read_into(out, then=then)
        await conn.end_bulk()
        return head

    async def _off_loop(self, work: Callable[[], None], nbytes: int) -> None:
        """Run ``work`` (headers made or checked over ``nbytes`` of payloads): on a thread
        where it hashes more than ``_KEYED_ON_LOOP_BYTES`` with the tag secret
        (HMAC-SHA256, about 34 us per 64 KiB, 1.1 ms per 2 MiB: a batch's would hold the
        daemon's loop for milliseconds), else here (a thread's hop, about 80 us, costs
        more than the xxh3 alone, or a small keyed batch's MAC)."""
        if self.tag_secret is None or nbytes <= _KEYED_ON_LOOP_BYTES:
            work()
            return
        done = asyncio.get_running_loop().run_in_executor(None, work)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # the thread reads the caller's buffers, which the caller may let go of as
            # soon as this returns: not before it ends (a few milliseconds at most),
            # through any further cancellation
            while not done.done():
                try:
                    await asyncio.wait({done})
                except asyncio.CancelledError:
                    pass
            raise

    def _check(self, namespace: bytes, key: bytes, head: bytearray,
               out: memoryview) -> int | None:
        """The payload's checksum if the value is good, else None."""
        header = codec.read_header(head)
        if header is None:
            return None
        return codec.verified_checksum(namespace, key, header, out, self.tag_secret)

    def _reply_status(self, reply: ReplyError, command: str) -> int:
        if reply.kind in _REDIRECTIONS:
            return _REDIRECTED
        if reply.kind == "WRONGTYPE":
            return _CORRUPT  # something else sits under our key
        if command == "SET" and reply.kind == "OOM":
            return _MISS  # maxmemory reached with a no-eviction policy: this key only
        if reply.kind in _REFUSED_CREDENTIALS:
            raise self._error(command, redis.exceptions.AuthenticationError(reply.message))
        raise BackendError(f"{command} failed: {reply.message}")

    async def _get_slowly(self, namespace: bytes, key: bytes,
                          out: memoryview) -> tuple[int, int | None]:
        name = self.redis_key(namespace, key)
        try:
            stored = await self._client.get(name)
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            self._corrupt.found(name, NOT_A_STRING)
            return _CORRUPT, None
        if stored is None:
            return _MISS, None
        if not isinstance(stored, bytes):  # only with decode_responses, which we never set
            return _CORRUPT, None
        digest = codec.decode_checked(namespace, key, stored, out, self.tag_secret)
        if digest is None:
            self._corrupt.found(name, same_bytes(stored))
        return (_HIT if digest is not None else _CORRUPT), digest

    async def put(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike]
    ) -> list[bool]:
        return await self.put_checksummed(namespace, keys, values, [None] * len(keys))

    async def put_checksummed(
        self, namespace: bytes, keys: Sequence[bytes], values: Sequence[BytesLike],
        checksums: Sequence[int | None],
    ) -> list[bool]:
        statuses = [_MISS] * len(keys)

        async def store(conn: RespConnection, indices: list[int]) -> None:
            buffers: list[BytesLike] = []

            def pack() -> None:
                for index in indices:
                    key, value = keys[index], values[index]
                    head = codec.encode_header(namespace, key, value, checksums[index],
                                               self.tag_secret)
                    buffers.extend(pack_set(self.redis_key(namespace, key), head, value,
                                            self.ttl_s))

            await self._off_loop(pack, sum(memoryview(values[i]).nbytes for i in indices))
            await conn.write(buffers)
            for index in indices:
                reply = await conn.read_reply()
                if isinstance(reply, ReplyError):
                    statuses[index] = self._reply_status(reply, "SET")
                else:
                    statuses[index] = _HIT if reply == b"OK" else _MISS

        try:
            await self._on_connections(namespace, keys, store,
                                       len(values[0]) if values else 0)
            for index, status in enumerate(statuses):
                if status == _REDIRECTED:
                    statuses[index] = await self._set_slowly(
                        namespace, keys[index], values[index], checksums[index])
        except _LIBRARY_ERRORS as exc:
            raise self._error("put", exc) from exc
        return [status == _HIT for status in statuses]

    async def _set_slowly(self, namespace: bytes, key: bytes, value: BytesLike,
                          digest: int | None) -> int:
        stored = codec.encode_value(namespace, key, value, digest, self.tag_secret)
        try:
            reply = await self._client.set(self.redis_key(namespace, key), passed_on(stored),
                                           ex=self.ttl_s)
        except redis.exceptions.ResponseError as exc:
            if isinstance(exc, redis.exceptions.OutOfMemoryError) or str(exc).startswith("OOM"):
                return _MISS
            raise
        return _HIT if reply else _MISS

    async def _on_connections(
        self, namespace: bytes, keys: Sequence[bytes], job: _Job, key_bytes: int = 0
    ) -> None:
        """Run ``job`` over the keys: per server, in contiguous chunks of at most
        ``PIECE_BYTES`` (values of ``key_bytes``), up to ``connections`` at once, each
        on a connection taken for it in its caller's turn (``turns``).  A chunk held its
        connection for a quarter of a 64 MiB call: another tenant's read, next in turn,
        waited for a whole one."""
        by_server: dict[str, list[int]] = {}
        if self.cluster:
            client = self._client
            assert isinstance(client, RedisCluster)
            await client.initialize()
            for index, key in enumerate(keys):
                stored_key: Any = self.redis_key(namespace, key)  # typed str, takes bytes
                node = client.get_node_from_key(stored_key)
                if node is None:
                    raise redis.exceptions.ClusterDownError("a slot has no node")
                by_server.setdefault(node.name, []).append(index)
                if node.name not in self._pools:
                    self._pools[node.name] = _Pool(_cluster_opener(node), self.connections)
        else:
            by_server[""] = list(range(len(keys)))
        chunks: list[tuple[_Pool, list[int]]] = []
        for name, indices in by_server.items():
            per = -(-len(indices) // self.connections)
            if key_bytes:
                per = min(per, max(1, PIECE_BYTES // key_bytes))
            chunks += [(self._pools[name], indices[i:i + per])
                       for i in range(0, len(indices), per)]

        async def run(chunk: int) -> None:
            pool, indices = chunks[chunk]
            async with pool.connection() as conn:
                await job(conn, indices)

        await run_bounded(len(chunks), self.connections * len(by_server), run)

    async def generation(self) -> bytes | None:
        """A token under ``key_prefix + "generation"`` (no block's key: those are 32
        bytes past the prefix), made by the first daemon to ask (SET NX, never to
        expire), the same for every daemon of the store.  A server that comes back
        empty (restarted without its data, failed over to an empty replica), or is
        flushed, has none: the first daemon to notice makes another, and each daemon
        sees another token than the one it knew.  But Redis under an ``allkeys-*``
        maxmemory policy may evict the token itself, as it evicts blocks: where the
        token is gone from the same server (its ``run_id``) that evicted keys since the
        last call (``evicted_keys``), it was taken by eviction, and is put back as it
        was, the store's contents otherwise as they were (before, under allkeys-lru,
        daemons found a new generation every few seconds, and forgot every mark each
        time).  Where the token is gone on a server that evicted nothing, or from
        another server, the store lost what it held: another token.  A flush while the
        server evicts reads as an eviction; on a cluster (a token per primary:
        ``redis_generation``) a token gone is always a loss.  b"" where it is gone and
        the server would not take another (full, noeviction)."""
        key = self.key_prefix + GENERATION_KEY
        try:
            async with self._slots:
                if isinstance(self._client, RedisCluster):
                    return await self._tokens.generation(self._client, key)
                token, server = await server_token(self._client, key, self._generation)
        except _LIBRARY_ERRORS as exc:
            raise self._error("generation", exc) from exc
        if isinstance(token, Exception):
            raise self._error("generation", token)
        token = token if isinstance(token, bytes) else b""
        self._generation = (token, server)
        return token

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        try:
            async with self._slots:
                # UNLINK frees the memory in the background; redis-py splits it by slot
                # on a cluster.
                removed = await self._client.unlink(*(self.redis_key(namespace, k) for k in keys))
        except _LIBRARY_ERRORS as exc:
            raise self._error("delete", exc) from exc
        return int(removed)

    async def delete_corrupt(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        try:
            async with self._slots:  # (``redis_corrupt``)
                return await self._corrupt.delete(
                    self._client, [self.redis_key(namespace, k) for k in keys])
        except _LIBRARY_ERRORS as exc:
            raise self._error("delete", exc) from exc

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
        for pool in self._pools.values():
            pool.close()
        try:
            await self._client.aclose()
        except _LIBRARY_ERRORS as exc:
            raise self._error("close", exc) from exc

    def _error(self, op: str, exc: BaseException) -> KVStoreError:
        return _backend_error(self.url, op, exc)


# error replies of a server that refused the connection's credentials (or none given)
_REFUSED_CREDENTIALS = frozenset({"NOAUTH", "WRONGPASS"})


def _backend_error(url: str, op: str, exc: BaseException) -> KVStoreError:
    """The failure ``exc`` of a call ``op`` as the daemon's error, naming the store (not
    its password): unavailable where the server may answer again later."""
    what = f"redis backend at {_redact(url)}: {op}"
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return UnavailableError(f"{what}: {_refused_login(url, exc)}")
    if isinstance(exc, _UNAVAILABLE):
        return UnavailableError(f"{what}: {exc}")
    return BackendError(f"{what}: {exc}")


def _refused_login(url: str, exc: BaseException) -> str:
    """An operator's reading of a refused login, a password the URL lacks or a wrong
    one, with the server's own words after it: those depend on the library's handshake
    ("HELLO must be called with the client already authenticated ..."), and say
    nothing of the URL."""
    if _redact(url) == url:  # (no password in the URL)
        return (f"the server asks for a password and the URL gives none: give it as "
                f"redis://:PASSWORD@HOST:PORT/DB, or USER:PASSWORD@ for an ACL user "
                f"(the server said: {exc})")
    return f"the server refused the URL's user name or password (the server said: {exc})"


# payload bytes a keyed batch hashes on the loop (about 140 us); more go to a thread
_KEYED_ON_LOOP_BYTES = 256 << 10
_Job = Callable[[RespConnection, list[int]], Awaitable[None]]
_Opener = Callable[[], Awaitable[RespConnection]]


class _Pool:
    """Up to ``size`` data-path connections to one server, opened on demand and kept."""

    def __init__(self, opener: _Opener, size: int) -> None:
        self._opener = opener
        self._idle: list[RespConnection] = []
        # handed out in turns: reads first, tenants in turn (``turns``); a semaphore's
        # order queued a read behind every piece of the calls let in before it
        self._slots = UrgentFirst(size)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[RespConnection]:
        """A connection for one job; kept if the job ends cleanly, else closed."""
        async with self._slots.hold(*turn()):
            conn = None
            while self._idle and conn is None:
                conn = self._idle.pop()
                if not conn.usable:  # the server closed it meanwhile
                    conn.abort()
                    conn = None
            if conn is None:
                conn = await self._opener()
            try:
                yield conn
            except BaseException:  # an error, a timeout: its state is unknown
                conn.abort()
                raise
            if conn.usable:
                conn.idle()
                self._idle.append(conn)
            else:
                conn.abort()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()


def _opener(connection: redis.asyncio.connection.AbstractConnection) -> _Opener:
    """Opens data-path connections with the address, credentials, TLS settings and
    database of a (never connected) redis-py connection."""
    context: ssl.SSLContext | None = None
    if isinstance(connection, redis.asyncio.SSLConnection):
        context = connection.ssl_context.get()
    path = getattr(connection, "path", None)
    host, port = getattr(connection, "host", None), getattr(connection, "port", DEFAULT_PORT)
    timeout_s = connection.socket_connect_timeout

    async def open_connection() -> RespConnection:
        username, password = connection.username, connection.password
        provider = connection.credential_provider
        if provider is not None:
            credentials = await provider.get_credentials_async()  # (password,) or (user, pw)
            username = credentials[0] if len(credentials) == 2 else None
            password = credentials[-1]
        async with asyncio.timeout(timeout_s):
            return await RespConnection.open(
                host=host, port=int(port), path=path, ssl_context=context,
                username=username, password=password, db=int(connection.db or 0),
            )

    return open_connection


def _standalone_opener(client: redis.asyncio.Redis) -> _Opener:
    pool = client.connection_pool
    return _opener(pool.connection_class(**pool.connection_kwargs))


def _cluster_opener(node: ClusterNode) -> _Opener:
    # a node's connection_kwargs carry its host and port already
    return _opener(node.connection_class(**node.connection_kwargs))


_CRLF_BYTES = 2


def _value_prefix_bytes(out: memoryview) -> int:
    """What comes before the payload in the GET reply of a value sized for ``out``: the
    bulk reply's ``$<length>`` line and the codec header."""
    return len(b"$%d\r\n" % (codec.HEADER_BYTES + out.nbytes)) + codec.HEADER_BYTES


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()


def passed_on(value: bytes) -> memoryview:
    """A value as redis-py's Python packer takes it: passed on to the socket as it is.
    Since redis-py 8, its asyncio connections pack commands with hiredis where it is
    installed, unless an argument is a ``memoryview``: the hiredis packer copies each
    value into one buffer, and was unreliable for 2 MiB SETs."""
    return memoryview(value)


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
