"""The client library: the public face of kvstore.

``Client`` is synchronous, ``AsyncClient`` is for asyncio; both speak the same protocol
over a ZeroMQ DEALER socket, map the daemon's DRAM arena for zero-copy reads and
writes, and raise the typed errors of ``kvstore.errors``.  Requests carry ids, so an
``AsyncClient`` may have many in flight at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import xxhash
import zmq
import zmq.asyncio

from kvstore import protocol as p
from kvstore.config import endpoint_from_env
from kvstore.errors import (
    CorruptError,
    KVStoreError,
    MalformedError,
    UnavailableError,
    error_from_code,
)
from kvstore.identity import Identity
from kvstore.keys import chain_keys
from kvstore.tiers.dram import map_arena

R = TypeVar("R", bound=p.Message)
log = logging.getLogger("kvstore.client")

_CLOSE_WAIT_S = 1.0  # how long close() waits for the replies to posted releases
_PARENT_MEMORY = 1 << 20  # chain links remembered per namespace, for reserve/put parents


@dataclass(frozen=True)
class PrefetchResult:
    """``ready`` leading keys are in DRAM now; ``cached`` are cached in some tier."""

    ready: int
    cached: int


@dataclass(frozen=True)
class PlanItem:
    """One request of a token plan: tokens it holds, tokens it adds, and the keys of the
    blocks those complete; ``parent`` is the key before them."""

    reserved_tokens: int
    new_tokens: int
    keys: list[bytes]
    parent: bytes | None = None


@dataclass
class BatchResult:
    """``admitted``: every request got its blocks (``reservations``, one each); else
    ``fitting`` names the requests that would fit and nothing was reserved."""

    admitted: bool
    blocks: list[int]
    fitting: list[int]
    reservations: list[Reservation]


@dataclass(frozen=True)
class LookupResult:
    """``blocks`` leading keys are cached; ``tiers[i]`` names the tier of hit block i."""

    blocks: int
    tiers: list[str]


def _token(token: str | None) -> str:
    return token if token is not None else os.environ.get("KVSTORE_TOKEN", "")


def _tenant(tenant: str | None, token: str | None) -> str:
    """The tenant to name in hello: given, from the environment, or (with credentials) left
    for the daemon to take from them."""
    if tenant:
        return tenant
    if os.environ.get("KVSTORE_TENANT"):
        return os.environ["KVSTORE_TENANT"]
    return "" if _token(token) else "default"


def _check_reply(reply: p.Message, expected: type[R]) -> R:
    if isinstance(reply, p.ErrorReply):
        raise error_from_code(reply.code, reply.message)
    if not isinstance(reply, expected):
        raise KVStoreError(f"expected a {expected.__name__}, got {type(reply).__name__}")
    return reply


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ for ``tcp://``: the daemon's public key and this client's key pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_public_file: str, client_secret_file: str) -> CurveKeys:
        """From ``kvstore keygen`` files: the server's ``.key`` and the client's
        ``.key_secret``."""
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(server_public_file)
        public, secret = zmq.auth.load_certificate(client_secret_file)
        if secret is None:
            raise MalformedError(f"{client_secret_file} holds no secret key")
        return cls(server_public, public, secret)


def _curve_from_env() -> CurveKeys | None:
    server = os.environ.get("KVSTORE_CURVE_SERVER_KEY")
    client = os.environ.get("KVSTORE_CURVE_CLIENT_CERT")
    return CurveKeys.from_files(server, client) if server and client else None


def _make_socket(ctx: zmq.Context[Any], endpoint: str, curve: CurveKeys | None = None) -> Any:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if curve is not None and endpoint.startswith("tcp://"):
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    sock.connect(endpoint)
    return sock


class _Session:
    """What both clients share: the hello facts, the arena mapping, request ids."""

    def __init__(self) -> None:
        self._rids = itertools.count(1)
        self.hello: p.HelloReply | None = None
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}  # arena path -> mapping
        self.checksums = False  # send xxh3_64 of what is written, for readers to verify
        self._map_arenas = True
        self._pinned: dict[str, Any] = {}  # arena path -> its background CUDA registration
        self._pool: Any = None  # the GPU tier's pool, mapped (kvstore.tiers.gpu.PoolMapping)
        self.gpu_reason = ""  # why there is no GPU pool, once asked

    def _next_rid(self) -> int:
        return next(self._rids)

    def _map(self, hello: p.HelloReply, map_arena_pages: bool) -> None:
        self.hello = hello
        self._map_arenas = map_arena_pages
        if map_arena_pages:
            self._view_of(hello.arena_path, hello.arena_bytes)

    def _view_of(self, path: str, size: int) -> memoryview:
        mapped = self._maps.get(path)
        if mapped is None:
            if not self._map_arenas:
                raise KVStoreError("this client did not map the arena (map_arena=False); "
                                   "use put/get instead")
            arena = map_arena(path, size)
            mapped = self._maps[path] = (arena, memoryview(arena))
        return mapped[1]

    def _slots(self, offsets: Sequence[int], size: int, readonly: bool,
               arena: tuple[str, int] | None = None) -> list[memoryview]:
        """Views of slots in an arena (the namespace's; by default the hello's)."""
        if arena is None or not arena[0]:
            assert self.hello is not None
            arena = (self.hello.arena_path, self.hello.arena_bytes)
        view = self._view_of(*arena)
        if readonly:
            view = view.toreadonly()
        return [view[o:o + size] for o in offsets]

    def _pin_arena(self, arena: tuple[str, int], kv_caches: Any) -> None:
        """Page-lock the arena for CUDA, in the background and once, when the engine's
        cache is on a GPU, so that copies to and from it run as DMA without staging."""
        if not arena[0]:
            assert self.hello is not None
            arena = (self.hello.arena_path, self.hello.arena_bytes)
        if arena[0] in self._pinned or _cache_device(kv_caches).type != "cuda":
            return
        from kvstore.kernels.pinned import register_in_background

        self._view_of(*arena)
        self._pinned[arena[0]] = register_in_background(self._maps[arena[0]][0])

    def _attach_pool(self, reply: p.GpuReply) -> Any:
        if not reply.pool:
            self.gpu_reason = reply.reason or "the daemon has no GPU tier"
            return None
        from kvstore.tiers.gpu import PoolHandle, PoolMapping

        try:
            self._pool = PoolMapping.open(msgspec.msgpack.decode(reply.pool, type=PoolHandle))
        except KVStoreError as exc:
            self.gpu_reason = f"the GPU tier's pool cannot be mapped here: {exc}"
            return None
        return self._pool

    def _unmap(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for registration in self._pinned.values():
            registration.unregister()
        self._pinned.clear()
        for arena, view in self._maps.values():
            view.release()
            try:
                arena.close()
            except BufferError:
                pass  # the caller still holds a view; the mapping goes with it
        self._maps.clear()

    @property
    def session_id(self) -> str:
        assert self.hello is not None
        return self.hello.session

    @property
    def max_keys(self) -> int:
        return self.hello.max_keys if self.hello else 4096

    @property
    def max_request_bytes(self) -> int:
        return self.hello.max_request_bytes if self.hello else 1 << 28


class _Chains:
    """Parents remembered from ``keys()`` so that reserve/put can name a chain's parent."""

    def __init__(self) -> None:
        self._parents: OrderedDict[bytes, bytes | None] = OrderedDict()

    def remember(self, keys: list[bytes], parent: bytes | None) -> None:
        for key in keys:
            self._parents[key] = parent
            parent = key
        while len(self._parents) > _PARENT_MEMORY:
            self._parents.popitem(last=False)

    def parent_of(self, first_key: bytes) -> bytes | None:
        return self._parents.get(first_key)


def checksum(block: Any) -> int:
    """xxh3_64 of a block's bytes: what writers send and readers check."""
    return xxhash.xxh3_64_intdigest(block)


def _cache_device(kv_caches: Any) -> Any:
    """The torch device of an engine's paged cache (a tensor, or a list or tuple of them)."""
    import torch

    first = kv_caches
    while isinstance(first, (list, tuple)):
        first = first[0]
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")


def _scatter_held(session: _Session, arena: tuple[str, int], block_bytes: int,
                  offsets: list[int], gpu_offsets: list[int], kv_caches: Any,
                  page_ids: list[int], layout: Any) -> None:
    """Copy pinned blocks into an engine's pages: those with a copy in the GPU tier's pool
    device to device (when the pool is mapped here and on the cache's device), the rest
    from the arena.  Returns once the copies are done, so the pin may go."""
    from kvstore.kernels import scatter

    pool = session._pool
    on_pool: list[int] = []
    if pool is not None and gpu_offsets and _same_device(pool.device, _cache_device(kv_caches)):
        on_pool = [i for i, off in enumerate(gpu_offsets) if off >= 0]
    if on_pool:
        from kvstore.tiers.gpu import CopyFence

        sources = pool.slots([gpu_offsets[i] for i in on_pool], block_bytes)
        scatter(sources, kv_caches, [page_ids[i] for i in on_pool], layout=layout)
        CopyFence.record(pool.device).wait()
    taken = set(on_pool)
    rest = [i for i in range(len(offsets)) if i not in taken]
    if rest:
        views = session._slots([offsets[i] for i in rest], block_bytes, readonly=False,
                               arena=arena)
        scatter(views, kv_caches, [page_ids[i] for i in rest], layout=layout)
        for view in views:
            view.release()


def _same_device(a: Any, b: Any) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    import torch

    def index(d: Any) -> int:
        return d.index if d.index is not None else torch.cuda.current_device()

    return index(a) == index(b)


def _verify(blocks: Sequence[Any], sums: Sequence[int]) -> None:
    for i, (block, want) in enumerate(zip(blocks, sums)):
        if want and checksum(block) != want:
            raise CorruptError(f"block {i} does not match the checksum it was written with")


def _batches(keys: Sequence[bytes], size: int, max_keys: int, max_bytes: int) -> list[slice]:
    per = max(1, min(max_keys, max_bytes // max(size, 1)))
    return [slice(i, i + per) for i in range(0, len(keys), per)]


def _check_blocks(blocks: Sequence[Any], count: int, size: int) -> None:
    if len(blocks) != count:
        raise MalformedError(f"{count} keys but {len(blocks)} blocks")
    for i, block in enumerate(blocks):
        n = memoryview(block).nbytes
        if n != size:
            raise MalformedError(f"block {i} holds {n} bytes; this namespace's blocks are {size}")


# ========================================================================================
# synchronous client
# ========================================================================================

class Client(_Session):
    """A synchronous connection to the daemon.  Use as a context manager or call close().

    ``tenant`` (or $KVSTORE_TENANT) names the tenant where the daemon trusts its clients;
    where it checks credentials, ``token`` (or $KVSTORE_TOKEN) or, on ``tcp://``, ``curve``
    keys (or $KVSTORE_CURVE_SERVER_KEY and $KVSTORE_CURVE_CLIENT_CERT) decide it.
    With ``checksums``, every block written carries its xxh3_64, which readers verify
    (``get`` does, ``held.verify()`` on request); it costs a pass over the bytes."""

    def __init__(self, endpoint: str | None = None, *, tenant: str | None = None,
                 token: str | None = None, timeout: float = 30.0, map_arena: bool = True,
                 curve: CurveKeys | None = None, checksums: bool = False) -> None:
        super().__init__()
        self.endpoint = endpoint or endpoint_from_env()
        self.timeout = timeout
        self.checksums = checksums
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = _make_socket(self._ctx, self.endpoint, curve or _curve_from_env())
        self._early: dict[int, tuple[p.Message, list[zmq.Frame]]] = {}
        self._unread: set[int] = set()  # requests sent by _post, their replies not yet read
        try:
            hello = self._call(p.Hello(self._next_rid(), p.PROTOCOL_VERSION,
                                       _tenant(tenant, token), _token(token)),
                               p.HelloReply)[0]
            self._map(hello, map_arena)
        except BaseException:
            self.close()
            raise

    def _call(self, req: p.Message, expected: type[R],
              payload: Sequence[Any] = ()) -> tuple[R, list[zmq.Frame]]:
        if self._sock is None:
            raise KVStoreError("the client is closed")
        header = p.encoder.encode(req)
        if payload:
            self._sock.send_multipart([header, *payload], copy=False)
        else:
            self._sock.send(header)
        reply, frames = self._wait(req.rid)
        return _check_reply(reply, expected), frames

    def _post(self, req: p.Message) -> None:
        """Send a request whose reply nobody waits for (a release): it is read, and
        dropped, while waiting for a later reply, or at ``close``.  The daemon serves a
        connection's requests in order, so the next request sees it done.  A refusal is
        logged (there is nobody left to raise it to)."""
        if self._sock is None:
            raise KVStoreError("the client is closed")
        while self._unread and self._sock.poll(0, zmq.POLLIN):  # keep the backlog short
            self._file(*self._receive())
        self._sock.send(p.encoder.encode(req))
        self._unread.add(req.rid)

    def _wait(self, rid: int) -> tuple[p.Message, list[zmq.Frame]]:
        if rid in self._early:
            return self._early.pop(rid)
        timeout_ms = int(self.timeout * 1000)
        while True:
            if not self._sock.poll(timeout_ms, zmq.POLLIN):
                raise UnavailableError(
                    f"no reply from the daemon at {self.endpoint} within {self.timeout}s")
            reply, frames = self._receive()
            if reply.rid == rid or reply.rid == 0:
                return reply, frames
            self._file(reply, frames)

    def _receive(self) -> tuple[p.Message, list[zmq.Frame]]:
        frames = self._sock.recv_multipart(copy=False)
        try:
            reply = p.reply_decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise KVStoreError(f"undecodable reply from the daemon: {exc}") from None
        return reply, frames[1:]

    def _file(self, reply: p.Message, frames: list[zmq.Frame]) -> None:
        """Keep a reply that came before the one awaited; drop a posted request's."""
        if reply.rid not in self._unread:
            self._early[reply.rid] = (reply, frames)
            return
        self._unread.discard(reply.rid)
        if isinstance(reply, p.ErrorReply):
            log.warning("the daemon refused a release: %s: %s", reply.code, reply.message)

    def namespace(self, identity: Identity) -> Namespace:
        """Open (or create) the namespace of an identity."""
        reply = self._call(p.OpenNamespace(self._next_rid(), identity), p.NamespaceReply)[0]
        return Namespace(self, identity, reply)

    def stats(self) -> dict[str, Any]:
        return self._call(p.Stats(self._next_rid()), p.StatsReply)[0].stats

    def ping(self) -> None:
        """Renew this session's leases (reservations and pins)."""
        self._call(p.Ping(self._next_rid()), p.OkReply)

    def gpu_pool(self) -> Any:
        """The GPU tier's device pool, mapped into this process (a
        ``kvstore.tiers.gpu.PoolMapping``), or None (``gpu_reason`` says why).  Reloads
        use it by themselves once it is mapped."""
        if self._pool is None and not self.gpu_reason:
            self._attach_pool(self._call(p.GpuAttach(self._next_rid()), p.GpuReply)[0])
        return self._pool

    def report(self, recomputed_tokens: int) -> None:
        """Tell the daemon (for its metrics) how many tokens the engine recomputed."""
        self._call(p.Report(self._next_rid(), recomputed_tokens), p.OkReply)

    def close(self) -> None:
        self._unmap()
        if self._sock is not None:
            # Posted releases must reach the daemon before the socket goes (it drops what
            # it has not sent), or their pins would stay until the session's lease ends.
            deadline = time.monotonic() + min(self.timeout, _CLOSE_WAIT_S)
            try:
                while self._unread and (left := deadline - time.monotonic()) > 0:
                    if not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                        break
                    self._file(*self._receive())
            except (KVStoreError, zmq.ZMQError) as exc:
                log.warning("closing without the replies to posted releases: %s", exc)
            self._sock.close(linger=0)
            self._sock = None
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.endpoint}, session={self.hello.session[:8] if self.hello else None})"


class _NamespaceBase:
    """Key computation and chain memory, the same for both clients."""

    def __init__(self, identity: Identity, reply: p.NamespaceReply) -> None:
        self.identity = identity
        self.id = reply.ns
        self.block_bytes = reply.block_bytes
        self.arena = (reply.arena_path, reply.arena_bytes)  # where its blocks live
        self._chains = _Chains()

    def keys(self, token_ids: Sequence[int] | Any, parent: bytes | None = None) -> list[bytes]:
        """One chained key per full block of ``token_ids``."""
        keys = chain_keys(self.id, token_ids, self.identity.block_tokens, parent)
        self._chains.remember(keys, parent)
        return keys

    def _parent(self, keys: Sequence[bytes], parent: bytes | None) -> bytes | None:
        return parent if parent is not None or not keys else self._chains.parent_of(keys[0])


    def _check_pages(self, kv_caches: Any, page_ids: Sequence[int], keys: Sequence[bytes],
                     layout: str) -> None:
        from kvstore.kernels import describe_layout

        if len(page_ids) != len(keys):
            raise MalformedError(f"{len(keys)} keys but {len(page_ids)} page ids")
        info = describe_layout(kv_caches, layout)  # type: ignore[arg-type]
        if info.block_bytes != self.block_bytes:
            raise MalformedError(
                f"a page of this cache holds {info.block_bytes} bytes; a block of this "
                f"namespace is {self.block_bytes} (check the identity's KV format)")


class Namespace(_NamespaceBase):
    """An opened namespace: keys, lookup, reserve/commit, acquire/release, put/get."""

    def __init__(self, client: Client, identity: Identity, reply: p.NamespaceReply) -> None:
        super().__init__(identity, reply)
        self.client = client

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        c = self.client
        total, tiers = 0, []
        for part in _batches(keys, 0, c.max_keys, 1 << 62):
            r = c._call(p.Lookup(c._next_rid(), self.id, list(keys[part])), p.LookupReply)[0]
            total += r.blocks
            for tier, count in r.tier_runs:
                tiers.extend([tier] * count)
            if r.blocks < len(keys[part]):
                break
        return LookupResult(total, tiers)

    def reserve(self, keys: Sequence[bytes], parent: bytes | None = None) -> Reservation:
        """Slots for every key (all or CapacityError); commit() publishes them."""
        c = self.client
        reply = c._call(p.Reserve(c._next_rid(), self.id, list(keys),
                                  self._parent(keys, parent)), p.ReserveReply)[0]
        return Reservation(self, list(keys), reply)

    def acquire(self, keys: Sequence[bytes]) -> Held:
        """Pin every key's block (NotFoundError if any is not cached); release() unpins."""
        c = self.client
        reply = c._call(p.Acquire(c._next_rid(), self.id, list(keys)), p.AcquireReply)[0]
        return Held(self, list(keys), reply)

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any],
            parent: bytes | None = None) -> int:
        """Store blocks through frames (reserve, write and commit in one step); new blocks."""
        _check_blocks(blocks, len(keys), self.block_bytes)
        c = self.client
        created = 0
        previous = self._parent(keys, parent)
        for part in _batches(keys, self.block_bytes, c.max_keys, c.max_request_bytes):
            sums = [checksum(b) for b in blocks[part]] if c.checksums else []
            r = c._call(p.Put(c._next_rid(), self.id, list(keys[part]), previous, sums),
                        p.PutReply, list(blocks[part]))[0]
            created += r.created
            previous = keys[part][-1]
        return created

    def get(self, keys: Sequence[bytes], verify: bool = True) -> list[bytes]:
        """The blocks' bytes (NotFoundError if any is not cached; CorruptError if one does
        not match the checksum it was written with)."""
        c = self.client
        out: list[bytes] = []
        for part in _batches(keys, self.block_bytes, c.max_keys, c.max_request_bytes):
            reply, frames = c._call(p.Get(c._next_rid(), self.id, list(keys[part])),
                                    p.GetReply)
            blocks = [f.bytes for f in frames]
            if verify:
                _verify(blocks, reply.checksums)
            out.extend(blocks)
        return out

    def evict(self, keys: Sequence[bytes]) -> int:
        c = self.client
        return c._call(p.Evict(c._next_rid(), self.id, list(keys)), p.CountReply)[0].count

    def keep_warm(self, keys: Sequence[bytes], seconds: float) -> int:
        """Soft-pin blocks for ``seconds``: eviction takes them last.  Returns how many."""
        c = self.client
        return c._call(p.Warm(c._next_rid(), self.id, list(keys), seconds),
                       p.CountReply)[0].count

    def prefetch(self, keys: Sequence[bytes], *, wait: bool = False,
                 timeout: float | None = None) -> PrefetchResult:
        """Bring blocks up to DRAM ahead of use: best effort (returns at once), or wait
        (until done, or ``timeout`` seconds); the result is a usable prefix."""
        c = self.client
        ms = int(timeout * 1000) if timeout else 0
        r = c._call(p.Prefetch(c._next_rid(), self.id, list(keys), wait, ms),
                    p.PrefetchReply)[0]
        return PrefetchResult(r.ready, r.cached)

    def reserve_batch(self, plan: Sequence[PlanItem]) -> BatchResult:
        """Reserve the blocks of a token plan, all or none (CapacityError is not raised:
        the result says which requests would fit)."""
        c = self.client
        items = [p.PlanItem(i.reserved_tokens, i.new_tokens, list(i.keys), i.parent)
                 for i in plan]
        r = c._call(p.ReserveBatch(c._next_rid(), self.id, items), p.BatchReply)[0]
        reservations = [
            Reservation(self, list(item.keys),
                        p.ReserveReply(0, rid, offsets, r.lease_seconds))
            for item, rid, offsets in zip([i for i in plan if i.keys], r.reservations,
                                          r.offsets)]
        return BatchResult(r.admitted, r.blocks, r.fitting, reservations)

    def offload(self, kv_caches: Any, page_ids: Sequence[int], keys: Sequence[bytes], *,
                layout: str = "per_layer", parent: bytes | None = None) -> int:
        """Store an engine's pages under ``keys`` (cached leading keys are skipped).

        ``kv_caches`` is the engine's paged cache in ``layout`` (see ``kvstore.kernels``);
        page ``page_ids[i]`` holds the block of ``keys[i]``.  Returns blocks stored.
        """
        from kvstore.kernels import gather

        self._check_pages(kv_caches, page_ids, keys, layout)
        hit = self.lookup(keys).blocks
        if hit == len(keys):
            return 0
        todo = list(keys[hit:])
        with self.reserve(todo, parent=keys[hit - 1] if hit else parent) as r:
            gather(kv_caches, list(page_ids[hit:]), r.buffers, layout=layout)  # type: ignore[arg-type]
            return r.commit()

    def reload(self, keys: Sequence[bytes], kv_caches: Any, page_ids: Sequence[int], *,
               layout: str = "per_layer") -> int:
        """Copy the blocks of ``keys`` into the engine's pages (NotFoundError if any is
        missing, and then no page is written).  Returns blocks loaded."""
        self._check_pages(kv_caches, page_ids, keys, layout)
        if not keys:
            return 0
        self.client._pin_arena(self.arena, kv_caches)
        with self.acquire(keys) as held:
            _scatter_held(self.client, self.arena, self.block_bytes, held.offsets,
                          held.gpu_offsets, kv_caches, list(page_ids), layout)
        return len(keys)

    def drop(self) -> int:
        """Drop every unpinned block of this namespace."""
        c = self.client
        return c._call(p.DropNamespace(c._next_rid(), self.id), p.CountReply)[0].count

    def __repr__(self) -> str:
        return f"Namespace({self.identity.model}, {self.id.hex()[:12]})"


class _Finishing:
    id: int
    done: bool
    buffers: list[memoryview]

    def _finish(self) -> None:
        if self.done:
            raise KVStoreError(f"reservation {self.id} was already committed or aborted")
        self.done = True
        for buf in self.buffers:
            buf.release()


class Reservation(_Finishing):
    """Reserved slots: write ``buffers``, then ``commit()``; leaving a ``with`` aborts."""

    def __init__(self, ns: Namespace, keys: list[bytes], reply: p.ReserveReply) -> None:
        self.ns = ns
        self.keys = keys
        self.id = reply.reservation
        self.offsets = reply.offsets
        self.buffers = ns.client._slots(reply.offsets, ns.block_bytes, readonly=False,
                                        arena=ns.arena)
        self.done = False

    def commit(self) -> int:
        """Publish the blocks; returns how many were new (the rest were cached already)."""
        c = self.ns.client
        sums = [checksum(b) for b in self.buffers] if c.checksums else []
        self._finish()
        return c._call(p.Commit(c._next_rid(), self.id, sums), p.CommitReply)[0].created

    def abort(self) -> None:
        if self.done:
            return
        c = self.ns.client
        self._finish()
        c._call(p.Abort(c._next_rid(), self.id), p.OkReply)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.done and self.ns.client._sock is not None:
            self.abort()


class Held:
    """Pinned blocks: read-only ``buffers`` in the arena until ``release()``."""

    def __init__(self, ns: Namespace, keys: list[bytes], reply: p.AcquireReply) -> None:
        self.ns = ns
        self.keys = keys
        self.pin = reply.pin
        self.offsets = reply.offsets
        self.checksums = reply.checksums
        self.gpu_offsets = reply.gpu_offsets
        self.buffers = ns.client._slots(reply.offsets, ns.block_bytes, readonly=True,
                                        arena=ns.arena)
        self.released = False

    def verify(self) -> None:
        """CorruptError unless every buffer matches the checksum it was written with."""
        _verify(self.buffers, self.checksums)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for buf in self.buffers:
            buf.release()
        c = self.ns.client
        c._post(p.Release(c._next_rid(), self.pin))  # no round trip: see Client._post

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ns.client._sock is not None:
            self.release()


# ========================================================================================
# asyncio client
# ========================================================================================

class AsyncClient(_Session):
    """An asyncio connection to the daemon; many requests may be in flight at once."""

    def __init__(self, endpoint: str | None = None, *, tenant: str | None = None,
                 token: str | None = None, timeout: float = 30.0, map_arena: bool = True,
                 curve: CurveKeys | None = None, checksums: bool = False) -> None:
        super().__init__()
        self.endpoint = endpoint or endpoint_from_env()
        self.timeout = timeout
        self.checksums = checksums
        self._tenant = _tenant(tenant, token)
        self._token = _token(token)
        self._curve = curve or _curve_from_env()
        self._map_arena = map_arena
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: Any = None
        self._waiting: dict[int, asyncio.Future[tuple[p.Message, list[zmq.Frame]]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def connect(self) -> AsyncClient:
        self._ctx = zmq.asyncio.Context()
        self._sock = _make_socket(self._ctx, self.endpoint, self._curve)
        self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        try:
            hello = (await self._call(p.Hello(self._next_rid(), p.PROTOCOL_VERSION,
                                              self._tenant, self._token), p.HelloReply))[0]
            self._map(hello, self._map_arena)
        except BaseException:
            await self.close()
            raise
        return self

    async def _read_replies(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                reply = p.reply_decoder.decode(frames[0].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            future = self._waiting.pop(reply.rid, None)
            if future is not None and not future.done():
                future.set_result((reply, frames[1:]))

    async def _call(self, req: p.Message, expected: type[R],
                    payload: Sequence[Any] = ()) -> tuple[R, list[zmq.Frame]]:
        if self._sock is None:
            raise KVStoreError("the client is not connected")
        future: asyncio.Future[tuple[p.Message, list[zmq.Frame]]] = (
            asyncio.get_running_loop().create_future())
        self._waiting[req.rid] = future
        try:
            header = p.encoder.encode(req)
            if payload:
                await self._sock.send_multipart([header, *payload], copy=False)
            else:
                await self._sock.send(header)
            try:
                reply, frames = await asyncio.wait_for(future, self.timeout)
            except TimeoutError:
                raise UnavailableError(f"no reply from the daemon at {self.endpoint} "
                                       f"within {self.timeout}s") from None
        finally:
            self._waiting.pop(req.rid, None)
        return _check_reply(reply, expected), frames

    def namespace(self, identity: Identity) -> AsyncNamespaceOpener:
        """``ns = await client.namespace(identity)``."""
        return AsyncNamespaceOpener(self, identity)

    async def stats(self) -> dict[str, Any]:
        return (await self._call(p.Stats(self._next_rid()), p.StatsReply))[0].stats

    async def ping(self) -> None:
        await self._call(p.Ping(self._next_rid()), p.OkReply)

    async def gpu_pool(self) -> Any:
        """See ``Client.gpu_pool``."""
        if self._pool is None and not self.gpu_reason:
            self._attach_pool((await self._call(p.GpuAttach(self._next_rid()),
                                                p.GpuReply))[0])
        return self._pool

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            self._reader = None
        self._unmap()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncNamespaceOpener:
    def __init__(self, client: AsyncClient, identity: Identity) -> None:
        self.client = client
        self.identity = identity

    def __await__(self) -> Any:
        return self._open().__await__()

    async def _open(self) -> AsyncNamespace:
        c = self.client
        reply = (await c._call(p.OpenNamespace(c._next_rid(), self.identity),
                               p.NamespaceReply))[0]
        return AsyncNamespace(c, self.identity, reply)


class AsyncNamespace(_NamespaceBase):
    """The asyncio twin of ``Namespace``."""

    def __init__(self, client: AsyncClient, identity: Identity, reply: p.NamespaceReply) -> None:
        super().__init__(identity, reply)
        self.client = client

    async def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        c = self.client
        total, tiers = 0, []
        for part in _batches(keys, 0, c.max_keys, 1 << 62):
            r = (await c._call(p.Lookup(c._next_rid(), self.id, list(keys[part])),
                               p.LookupReply))[0]
            total += r.blocks
            for tier, count in r.tier_runs:
                tiers.extend([tier] * count)
            if r.blocks < len(keys[part]):
                break
        return LookupResult(total, tiers)

    def reserve(self, keys: Sequence[bytes], parent: bytes | None = None) -> AsyncReservation:
        """``async with ns.reserve(keys) as r`` (or ``r = await ns.reserve(keys)``)."""
        return AsyncReservation(self, list(keys), self._parent(keys, parent))

    def acquire(self, keys: Sequence[bytes]) -> AsyncHeld:
        """``async with ns.acquire(keys) as held`` (or ``held = await ns.acquire(keys)``)."""
        return AsyncHeld(self, list(keys))

    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any],
                  parent: bytes | None = None) -> int:
        _check_blocks(blocks, len(keys), self.block_bytes)
        c = self.client
        created = 0
        previous = self._parent(keys, parent)
        for part in _batches(keys, self.block_bytes, c.max_keys, c.max_request_bytes):
            sums = [checksum(b) for b in blocks[part]] if c.checksums else []
            r = (await c._call(p.Put(c._next_rid(), self.id, list(keys[part]), previous, sums),
                               p.PutReply, list(blocks[part])))[0]
            created += r.created
            previous = keys[part][-1]
        return created

    async def get(self, keys: Sequence[bytes], verify: bool = True) -> list[bytes]:
        c = self.client
        out: list[bytes] = []
        for part in _batches(keys, self.block_bytes, c.max_keys, c.max_request_bytes):
            reply, frames = await c._call(p.Get(c._next_rid(), self.id, list(keys[part])),
                                          p.GetReply)
            blocks = [f.bytes for f in frames]
            if verify:
                _verify(blocks, reply.checksums)
            out.extend(blocks)
        return out

    async def evict(self, keys: Sequence[bytes]) -> int:
        c = self.client
        return (await c._call(p.Evict(c._next_rid(), self.id, list(keys)), p.CountReply))[0].count

    async def offload(self, kv_caches: Any, page_ids: Sequence[int], keys: Sequence[bytes],
                      *, layout: str = "per_layer", parent: bytes | None = None) -> int:
        """See ``Namespace.offload``."""
        from kvstore.kernels import gather

        self._check_pages(kv_caches, page_ids, keys, layout)
        hit = (await self.lookup(keys)).blocks
        if hit == len(keys):
            return 0
        todo = list(keys[hit:])
        async with self.reserve(todo, parent=keys[hit - 1] if hit else parent) as r:
            gather(kv_caches, list(page_ids[hit:]), r.buffers, layout=layout)  # type: ignore[arg-type]
            return await r.commit()

    async def reload(self, keys: Sequence[bytes], kv_caches: Any, page_ids: Sequence[int], *,
                     layout: str = "per_layer") -> int:
        """See ``Namespace.reload``."""
        self._check_pages(kv_caches, page_ids, keys, layout)
        if not keys:
            return 0
        self.client._pin_arena(self.arena, kv_caches)
        async with self.acquire(keys) as held:
            _scatter_held(self.client, self.arena, self.block_bytes, held.offsets,
                          held.gpu_offsets, kv_caches, list(page_ids), layout)
        return len(keys)

    async def drop(self) -> int:
        c = self.client
        return (await c._call(p.DropNamespace(c._next_rid(), self.id), p.CountReply))[0].count


class AsyncReservation(_Finishing):
    def __init__(self, ns: AsyncNamespace, keys: list[bytes], parent: bytes | None) -> None:
        self.ns = ns
        self.keys = keys
        self._parent = parent
        self.id = 0
        self.offsets: list[int] = []
        self.buffers: list[memoryview] = []
        self.done = False

    def __await__(self) -> Any:
        return self._reserve().__await__()

    async def _reserve(self) -> AsyncReservation:
        c = self.ns.client
        reply = (await c._call(p.Reserve(c._next_rid(), self.ns.id, self.keys, self._parent),
                               p.ReserveReply))[0]
        self.id, self.offsets = reply.reservation, reply.offsets
        self.buffers = c._slots(reply.offsets, self.ns.block_bytes, readonly=False,
                                arena=self.ns.arena)
        return self

    async def commit(self) -> int:
        c = self.ns.client
        sums = [checksum(b) for b in self.buffers] if c.checksums else []
        self._finish()
        return (await c._call(p.Commit(c._next_rid(), self.id, sums),
                              p.CommitReply))[0].created

    async def abort(self) -> None:
        if self.done:
            return
        c = self.ns.client
        self._finish()
        await c._call(p.Abort(c._next_rid(), self.id), p.OkReply)

    async def __aenter__(self) -> AsyncReservation:
        return await self._reserve()

    async def __aexit__(self, *exc: object) -> None:
        if not self.done and self.ns.client._sock is not None:
            await self.abort()


class AsyncHeld:
    def __init__(self, ns: AsyncNamespace, keys: list[bytes]) -> None:
        self.ns = ns
        self.keys = keys
        self.pin = 0
        self.offsets: list[int] = []
        self.checksums: list[int] = []
        self.gpu_offsets: list[int] = []
        self.buffers: list[memoryview] = []
        self.released = False

    def __await__(self) -> Any:
        return self._acquire().__await__()

    async def _acquire(self) -> AsyncHeld:
        c = self.ns.client
        reply = (await c._call(p.Acquire(c._next_rid(), self.ns.id, self.keys),
                               p.AcquireReply))[0]
        self.pin, self.offsets, self.checksums = reply.pin, reply.offsets, reply.checksums
        self.gpu_offsets = reply.gpu_offsets
        self.buffers = c._slots(reply.offsets, self.ns.block_bytes, readonly=True,
                                arena=self.ns.arena)
        return self

    def verify(self) -> None:
        """CorruptError unless every buffer matches the checksum it was written with."""
        _verify(self.buffers, self.checksums)

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        for buf in self.buffers:
            buf.release()
        c = self.ns.client
        await c._call(p.Release(c._next_rid(), self.pin), p.OkReply)

    async def __aenter__(self) -> AsyncHeld:
        return await self._acquire()

    async def __aexit__(self, *exc: object) -> None:
        if self.ns.client._sock is not None:
            await self.release()
