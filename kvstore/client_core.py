"""The client's core, without I/O: everything the blocking and the asyncio client share.

It builds each verb's request message, checks and decodes the reply into the result
types, splits requests that are too big into batches, remembers chain parents, keeps
the state of a session, its reservations and its pins, verifies checksums and maps the
arena's views.  It never sends or receives on the daemon's ZeroMQ socket (its one
exchange of its own is with the side socket beside an ipc endpoint: a short local
round trip for a memfd arena's descriptor or a handshake ticket, ``tiers.arena_fds``,
which ``kvstore.aclient`` runs in an executor, off its loop):
``kvstore.client`` (blocking) and
``kvstore.aclient`` (asyncio) are thin shells that carry what it builds to the daemon
and hand it what comes back, the way h11 and httpcore split protocol from I/O.

A verb of one request is two calls: ``_<verb>_request(...)`` builds the message, and an
``_on_<reply>(received)`` turns the reply into the result, raising the typed error of an
error reply (or a ``KVStoreError`` for a reply of the wrong type), the same on both
sides.  A verb that may take several requests (lookup, put and get of more keys than
one request carries) is an ``Exchange``: a generator that yields each request with its
payload, is sent each reply, and returns the result.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from kvstore import protocol as p
from kvstore.client_wire import (
    CurveKeys,
    Exchange,
    Received,
    _cache_device,
    _check_blocks,
    _copies_done,
    _curve_from_env,
    _listed,
    _per,
    _same_device,
    _tenant,
    _token,
    check_reply,
    checksum,
    client_timeout,
    got_blocks,
    map_named_arena,
    no_daemon_hint,
    slot_views,
    verify,
)
from kvstore.config import client_endpoint
from kvstore.errors import (ForbiddenError, KVStoreError, LeaseExpiredError, MalformedError,
                             NoSessionError, SessionExpiredError, UnavailableError)
from kvstore.identity import Identity
from kvstore.keys import chain_keys
from kvstore.client_chains import Chains as _Chains
from kvstore.client_drops import GivingBack
from kvstore.client_drops import let_go as _let_go
from kvstore.tiers.arena_fds import (
    MEMFD_PREFIX,
    admit,
    map_handed_arena,
    refused_hint,
    side_path,
    tcp_credentials,
)

T = TypeVar("T")
ResT = TypeVar("ResT")
S = TypeVar("S", bound="SessionCore")
N = TypeVar("N", bound="NamespaceCore[Any]")
RC = TypeVar("RC", bound="ReservationCore[Any]")

log = logging.getLogger("kvstore.client")

SNAPSHOT_PAGE = p.SNAPSHOT_PAGE  # entries' worth of a snapshot's page (the daemon's loop turn)
CLOSE_WAIT_S = 1.0  # how long close() waits for the replies to posted releases
_NO_PAYLOAD: Sequence[Any] = ()
SESSION_EXPIRED = SessionExpiredError.PREFIX  # how the daemon says so (``sessions``)
_FORKS = [0]  # forks of this process: a client made before one is its parent's, not ours
os.register_at_fork(after_in_child=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


# ----------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------

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
class BatchResult(Generic[ResT]):
    """``admitted``: every request got its blocks (``reservations``, one each); else
    ``fitting`` names the requests that would fit and nothing was reserved."""

    admitted: bool
    blocks: list[int]
    fitting: list[int]
    reservations: list[ResT]


@dataclass(frozen=True)
class LookupResult:
    """``blocks`` leading keys are cached; ``tiers[i]`` names the tier of hit block i."""

    blocks: int
    tiers: list[str]


@dataclass(frozen=True)
class PinnedLookup:
    """``lookup_pin``'s answer: the lookup's, and the pin of the leading ``len(offsets)``
    hits, in DRAM at those arena offsets (``pin`` 0: none)."""

    found: LookupResult
    pin: int = 0
    offsets: tuple[int, ...] = ()
    checksums: tuple[int, ...] = ()


# ----------------------------------------------------------------------------------------
# the session
# ----------------------------------------------------------------------------------------

class SessionCore(GivingBack):
    """A client's session without its socket: the connection settings, the hello facts
    and the arena mappings; request ids, the requests posted without waiting and what
    it gives back unasked are ``GivingBack``'s (``client_drops``)."""

    def __init__(self, endpoint: str | None, *, tenant: str | None, token: str | None,
                 timeout: float, map_arena: bool, curve: CurveKeys | None,
                 checksums: bool) -> None:
        self.endpoint = client_endpoint(endpoint)
        self.timeout = client_timeout(timeout)
        self.checksums = checksums  # send xxh3_64 of what is written, for readers to verify
        self._tenant = _tenant(tenant, token)
        self._tenant_named = bool(tenant or os.environ.get("KVSTORE_TENANT"))
        self._handshake = ""  # its credentials in the handshake: "ticket", "token" or none
        self._token = _token(token)
        self._curve = curve or _curve_from_env()
        super().__init__()
        self.hello: p.HelloReply | None = None
        self.tokens_wanted = True  # commits carry token ids (replies say: events heard)
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}  # arena path -> mapping
        self._map_arenas = map_arena
        self._pinned: dict[str, Any] = {}  # arena path -> its background CUDA registration
        self._pool: Any = None  # the GPU tier's pool, mapped (kvstore.tiers.gpu.PoolMapping)
        self.gpu_reason = ""  # why there is no GPU pool, once asked
        self._forks = _FORKS[0]  # the forks before this client: another count, a child's
        self._pid = os.getpid()
        self._lost = ""  # why the daemon has no session for this client any more, once told
        self._holding = 0  # reservations and pins held (a goodbye would drop them in use)

    # -- whether this client can still ask ------------------------------------------------
    @property
    def _forked(self) -> bool:
        """Whether this is a forked child's copy of the client (its parent's socket)."""
        return self._forks != _FORKS[0]

    def _usable(self) -> None:
        if (gone := self._gone()) is not None:
            raise gone

    def _gone(self) -> KVStoreError | None:
        """Why no request can be answered, if none can: in a forked child (the parent's
        socket: the child spun in ZeroMQ's retries), or once the daemon said the session
        is gone (it restarted, or the lease ran out: each call after that waited out its
        whole timeout, for good, the requests dropped unread)."""
        if self._forks != _FORKS[0]:
            return KVStoreError(f"this client was opened in process {self._pid}, before a "
                                f"fork: open a new client in process {os.getpid()}")
        if self._lost:
            kind = (SessionExpiredError if self._lost.startswith(SESSION_EXPIRED)
                    else NoSessionError)
            return kind(f"the daemon has no session for this client any more (it said: "
                        f"{self._lost}): open a new client")
        return None

    def _bye_request(self) -> bytes | None:
        """On the way out, the goodbye that ends the session now (``p.Bye``, unread),
        while nothing is held: pins held at close stay until the lease ends (a thread may
        still read their buffers).  None: no goodbye."""
        if self.hello is None or self._lost or self._forked or self._holding:
            return None
        return p.encoder.encode(p.Bye(self._next_rid()))

    def _heard(self, reply: p.Message) -> bool:
        """Whether ``reply`` says this client's session is gone (noted: ``_usable``)."""
        if type(reply) is not p.ErrorReply:
            return False
        if ((reply.code == ForbiddenError.code
             and reply.message.startswith(NoSessionError.PREFIX))
                or (reply.code == LeaseExpiredError.code
                    and reply.message.startswith(SESSION_EXPIRED))):
            self._lost = reply.message
            return True
        return False

    def _no_reply(self) -> UnavailableError:
        # a refused ZeroMQ handshake is silent: say what it checks
        why = "" if self.hello is not None else (refused_hint(self._handshake)
                                                 or no_daemon_hint(self.endpoint))
        return UnavailableError(f"no reply from the daemon at {self.endpoint} "
                                f"within {self.timeout}s{why}")

    def _checks_handshake(self) -> bool:
        """Whether the daemon checks this client's ZeroMQ handshake (a ticket or token as
        PLAIN credentials, or CurveZMQ keys over tcp), so that it may refuse it."""
        return bool(self._handshake) or (self._curve is not None
                                         and self.endpoint.startswith("tcp://"))

    def _handshake_refused(self, status: int) -> ForbiddenError:
        why = refused_hint(self._handshake) or (
            "; its CurveZMQ key may not be among the daemon's clients" if self._curve else "")
        return ForbiddenError(f"the daemon at {self.endpoint} refused the handshake "
                              f"(ZeroMQ status {status}){why}")

    def _close_wait(self) -> float:
        """Seconds close() waits for the replies to posted requests."""
        return min(self.timeout, CLOSE_WAIT_S)

    # -- the session's verbs --------------------------------------------------------------
    def _admission(self) -> tuple[str, str] | None:
        """Before connecting, the ZeroMQ PLAIN user name and password: on a gated ipc
        endpoint the tenant and one-time ticket its side socket hands out for this
        client's token (or, with none, for its uid), ForbiddenError saying why if refused;
        on tcp without CurveZMQ the tenant and token (``tcp_credentials``); else None."""
        side = side_path(self.endpoint)
        if side is None:
            tcp = tcp_credentials(self.endpoint, self._token, self._tenant, bool(self._curve))
            self._handshake = "token" if tcp is not None else ""
            return tcp
        admitted = admit(side, self._token, self.timeout)
        if admitted is not None and not self._tenant_named:
            self._tenant = ""  # the credentials name it
        self._handshake = "ticket" if admitted is not None else ""
        return admitted

    def _hello_request(self) -> p.Hello:
        return p.Hello(self._next_rid(), p.PROTOCOL_VERSION, self._tenant, self._token)

    def _on_hello(self, received: Received) -> None:
        hello = self.hello = check_reply(received[0], p.HelloReply)
        if self._map_arenas and (not hello.arena_path.startswith(MEMFD_PREFIX)
                                 or side_path(self.endpoint) is not None):
            self._view_of(hello.arena_path, hello.arena_bytes)

    def _namespace_request(self, identity: Identity) -> p.OpenNamespace:
        return p.OpenNamespace(self._next_rid(), identity)

    def _stats_request(self) -> p.Stats:
        return p.Stats(self._next_rid())

    def _ping_request(self) -> p.Ping:
        return p.Ping(self._next_rid())

    def _snapshot_pages(self, page: int) -> Exchange[p.SnapshotReply]:
        """``snapshot``: its pages, one request each, in one reply."""
        received = yield p.Snapshot(self._next_rid(), 0, page), _NO_PAYLOAD
        reply = check_reply(received[0], p.SnapshotReply)
        blocks, cursor = reply.blocks, reply.cursor
        while cursor:
            received = yield p.Snapshot(self._next_rid(), cursor, page), _NO_PAYLOAD
            more = check_reply(received[0], p.SnapshotReply)
            blocks += more.blocks
            cursor = more.cursor
        return p.SnapshotReply(reply.rid, reply.seq, blocks)

    def _report_request(self, recomputed_tokens: int) -> p.Report:
        return p.Report(self._next_rid(), recomputed_tokens)

    def _gpu_request(self) -> p.GpuAttach | None:
        """None once the pool is mapped or known to be missing."""
        if self._pool is not None or self.gpu_reason:
            return None
        return p.GpuAttach(self._next_rid())

    @staticmethod
    def _on_stats(received: Received) -> dict[str, Any]:
        return check_reply(received[0], p.StatsReply).stats

    @staticmethod
    def _on_ok(received: Received) -> None:
        check_reply(received[0], p.OkReply)

    def _on_gpu(self, received: Received) -> Any:
        reply = check_reply(received[0], p.GpuReply)
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

    # -- the arena ------------------------------------------------------------------------
    def _view_of(self, path: str, size: int) -> memoryview:
        mapped = self._maps.get(path)
        if mapped is None:
            if not self._map_arenas:
                raise KVStoreError("this client did not map the arena (map_arena=False); "
                                   "use put/get instead")
            if path.startswith(MEMFD_PREFIX):
                assert self.hello is not None, "an arena is asked for after hello"
                arena = map_handed_arena(self.endpoint, self.hello.session,
                                         path[len(MEMFD_PREFIX):], size, self.timeout)
            else:
                arena = map_named_arena(path, size)
            mapped = self._maps[path] = (arena, memoryview(arena))
        return mapped[1]

    def _maps_ahead(self, path: str) -> bool:
        """Whether the arena ``path`` is one to map before its first use (this client
        maps arenas, has not mapped this one, and could: a ``memfd:`` arena only over
        an ipc endpoint)."""
        return (self._map_arenas and path not in self._maps
                and (not path.startswith(MEMFD_PREFIX) or side_path(self.endpoint) is not None))

    def _slots(self, offsets: Sequence[int], size: int, readonly: bool,
               arena: tuple[str, int] | None = None) -> list[memoryview]:
        """Views of slots in an arena (the namespace's; by default the hello's)."""
        view = self._arena_view(arena)
        if readonly:
            view = view.toreadonly()
        return slot_views(view, offsets, size)

    def _arena_view(self, arena: tuple[str, int] | None = None) -> memoryview:
        """The whole of an arena (the namespace's; by default the hello's), mapped."""
        if arena is None or not arena[0]:
            assert self.hello is not None, "the arena is known after hello"
            arena = (self.hello.arena_path, self.hello.arena_bytes)
        return self._view_of(*arena)

    def _pin_arena(self, arena: tuple[str, int], kv_caches: Any) -> None:
        """Page-lock the arena for CUDA, in the background and once, when the engine's
        cache is on a GPU, so that copies to and from it run as DMA without staging."""
        if not arena[0]:
            assert self.hello is not None, "the arena is known after hello"
            arena = (self.hello.arena_path, self.hello.arena_bytes)
        if arena[0] in self._pinned or _cache_device(kv_caches).type != "cuda":
            return
        from kvstore.kernels.pinned import register_in_background

        self._view_of(*arena)
        self._pinned[arena[0]] = register_in_background(self._maps[arena[0]][0])

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
        assert self.hello is not None, "the session id is known after hello"
        return self.hello.session

    @property
    def max_keys(self) -> int:
        return self.hello.max_keys if self.hello else 4096

    @property
    def max_request_bytes(self) -> int:
        return self.hello.max_request_bytes if self.hello else 1 << 28

    def __repr__(self) -> str:
        session = self.hello.session[:8] if self.hello else None
        return f"{type(self).__name__}({self.endpoint}, session={session})"


# ----------------------------------------------------------------------------------------
# namespaces
# ----------------------------------------------------------------------------------------

class NamespaceCore(Generic[S]):
    """An opened namespace without I/O: keys, chain memory, and each verb's request and
    reply."""

    def __init__(self, client: S, identity: Identity, reply: p.NamespaceReply) -> None:
        self.client = client
        self.identity = identity
        self.id = reply.ns
        self.block_bytes = reply.block_bytes
        self.arena = (reply.arena_path, reply.arena_bytes)  # where its blocks live
        self.slot_bytes = reply.slot_bytes  # a block's slot in it
        self._chains = _Chains()

    @staticmethod
    def _opened(received: Received) -> p.NamespaceReply:
        return check_reply(received[0], p.NamespaceReply)

    def keys(self, token_ids: Sequence[int] | Any, parent: bytes | None = None) -> list[bytes]:
        """One chained key per full block of ``token_ids``."""
        events = self.events
        if events:  # one array for the keys and the token ids kept for commits
            try:
                token_ids = np.asarray(token_ids, dtype="<i8")
            except (TypeError, ValueError, OverflowError):
                pass  # chain_keys says what is wrong with them
        keys = chain_keys(self.id, token_ids, self.identity.block_tokens, parent)
        self._chains.remember(keys, parent)
        if events and keys:
            self._chains.remember_tokens(keys, token_ids, self.identity.block_tokens)
        return keys

    @property
    def events(self) -> bool:
        """Whether the daemon publishes KV events (commits then carry token ids)."""
        hello = self.client.hello
        return hello is not None and hello.events

    @property
    def token_buffer(self) -> bool:
        """Whether the daemon takes a commit's token ids in one buffer (``token_ids``);
        an older one takes only each block's (``tokens``)."""
        hello = self.client.hello
        return hello is not None and hello.token_buffer

    def _parent(self, keys: Sequence[bytes], parent: bytes | None) -> bytes | None:
        return parent if parent is not None or not keys else self._chains.parent_of(keys[0])

    # -- verbs of one or more requests ----------------------------------------------------
    def _lookup(self, keys: Sequence[bytes]) -> Exchange[LookupResult]:
        c = self.client
        total, tiers = 0, []
        per = max(1, c.max_keys)
        for start in range(0, len(keys), per):
            part = _listed(keys) if per >= len(keys) else _listed(keys[start:start + per])
            received = yield p.Lookup(c._next_rid(), self.id, part), _NO_PAYLOAD
            r = check_reply(received[0], p.LookupReply)
            total += r.blocks
            for tier, count in r.tier_runs:
                tiers.extend([tier] * count)
            if r.blocks < len(part):
                break
        return LookupResult(total, tiers)

    def _lookup_pin(self, keys: Sequence[bytes]) -> Exchange[PinnedLookup]:
        """``_lookup`` that pins the leading hits in DRAM in the same round trip; keys
        over one request's limit are looked up as ``_lookup`` does, nothing pinned."""
        c = self.client
        if len(keys) > max(1, c.max_keys):
            return PinnedLookup((yield from self._lookup(keys)))
        received = yield p.LookupPin(c._next_rid(), self.id, _listed(keys)), _NO_PAYLOAD
        r = check_reply(received[0], p.LookupPinReply)
        tiers: list[str] = []
        for tier, count in r.tier_runs:
            tiers.extend([tier] * count)
        return PinnedLookup(LookupResult(r.blocks, tiers), r.pin, tuple(r.offsets),
                            tuple(r.checksums))

    def _put(self, keys: Sequence[bytes], blocks: Sequence[Any],
             parent: bytes | None) -> Exchange[int]:
        _check_blocks(blocks, len(keys), self.block_bytes)
        c = self.client
        created = 0
        previous = self._parent(keys, parent)
        per = _per(self.block_bytes, c.max_keys, c.max_request_bytes)
        for start in range(0, len(keys), per):
            part = _listed(keys[start:start + per])
            payload = list(blocks[start:start + per])
            sums = [checksum(b) for b in payload] if c.checksums else []
            each, tokens = (self._chains.tokens_of(part, self.token_buffer)
                            if self.events and c.tokens_wanted else ([], b""))
            received = yield (p.Put(c._next_rid(), self.id, part, previous, sums, each,
                                    tokens), payload)
            reply = check_reply(received[0], p.PutReply)
            created += reply.created
            c.tokens_wanted = reply.tokens
            previous = part[-1]
        return created

    def _get(self, keys: Sequence[bytes], verify_sums: bool) -> Exchange[list[bytes]]:
        c = self.client
        out: list[bytes] = []
        per = _per(self.block_bytes, c.max_keys, c.max_request_bytes)
        for start in range(0, len(keys), per):
            part = _listed(keys[start:start + per])
            received = yield (p.Get(c._next_rid(), self.id, part), _NO_PAYLOAD)
            reply = check_reply(received[0], p.GetReply)
            blocks = got_blocks(reply, received[1], len(part), self.block_bytes)
            if verify_sums:
                verify(blocks, reply.checksums)
            out.extend(blocks)
        return out

    # -- verbs of one request -------------------------------------------------------------
    def _acquire_request(self, keys: list[bytes]) -> p.Acquire:
        return p.Acquire(self.client._next_rid(), self.id, keys)

    def _evict_request(self, keys: Sequence[bytes]) -> p.Evict:
        return p.Evict(self.client._next_rid(), self.id, _listed(keys))

    def _warm_request(self, keys: Sequence[bytes], seconds: float) -> p.Warm:
        return p.Warm(self.client._next_rid(), self.id, _listed(keys), seconds)

    def _prefetch_request(self, keys: Sequence[bytes], wait: bool,
                          timeout: float | None) -> p.Prefetch:
        ms = int(timeout * 1000) if timeout else 0
        return p.Prefetch(self.client._next_rid(), self.id, _listed(keys), wait, ms)

    def _drop_request(self) -> p.DropNamespace:
        return p.DropNamespace(self.client._next_rid(), self.id)

    def _reserve_batch_request(self, plan: Sequence[PlanItem]) -> p.ReserveBatch:
        items = [p.PlanItem(i.reserved_tokens, i.new_tokens, list(i.keys), i.parent)
                 for i in plan]
        return p.ReserveBatch(self.client._next_rid(), self.id, items, skip_held=True,
                              skip_pending=True)

    @staticmethod
    def _on_count(received: Received) -> int:
        return check_reply(received[0], p.CountReply).count

    @staticmethod
    def _on_prefetch(received: Received) -> PrefetchResult:
        r = check_reply(received[0], p.PrefetchReply)
        return PrefetchResult(r.ready, r.cached)

    def _on_reserve_batch(self, plan: Sequence[PlanItem], received: Received,
                          make: Callable[[list[bytes]], RC]) -> BatchResult[RC]:
        """The result, with a reservation (``make(keys)``, filled in here) for each
        request of the plan that has keys, when the plan was admitted."""
        r = check_reply(received[0], p.BatchReply)
        reservations = []
        for item, rid, offsets in zip([i for i in plan if i.keys], r.reservations, r.offsets):
            reservation = make(list(item.keys))
            reservation._take(p.ReserveReply(0, rid, offsets, r.lease_seconds, r.tokens))
            reservations.append(reservation)
        return BatchResult(r.admitted, r.blocks, r.fitting, reservations)

    # -- an engine's pages ----------------------------------------------------------------
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

    @staticmethod
    def _gather(kv_caches: Any, page_ids: Sequence[int], r: ReservationCore[Any],
                layout: Any) -> None:
        """Copy pages into a reservation's slots (none into a key held already: -1)."""
        from kvstore.kernels import gather

        wanted = [i for i, offset in enumerate(r.offsets) if offset >= 0]
        gather(kv_caches, [page_ids[i] for i in wanted], [r.buffers[i] for i in wanted],
               layout=layout)
        _copies_done(kv_caches)  # (the commit publishes the bytes: they must be there)

    def _scatter(self, held: HeldCore[Any], kv_caches: Any, page_ids: Sequence[int],
                 layout: Any) -> None:
        """Copy pinned blocks into an engine's pages: those with a copy in the GPU tier's
        pool device to device (when the pool is mapped here and on the cache's device),
        the rest from the arena.  Returns once the copies are done, so the pin may go."""
        from kvstore.kernels import scatter

        pool = self.client._pool
        page_ids = list(page_ids)
        on_pool: list[int] = []
        if (pool is not None and held.gpu_offsets
                and _same_device(pool.device, _cache_device(kv_caches))):
            on_pool = [i for i, off in enumerate(held.gpu_offsets) if off >= 0]
        if on_pool:
            from kvstore.tiers.gpu import CopyFence

            sources = pool.slots([held.gpu_offsets[i] for i in on_pool], self.block_bytes)
            scatter(sources, kv_caches, [page_ids[i] for i in on_pool], layout=layout)
            CopyFence.record(pool.device).wait()
        taken = set(on_pool)
        rest = [i for i in range(len(held.offsets)) if i not in taken]
        if rest:
            views = self.client._slots([held.offsets[i] for i in rest], self.block_bytes,
                                       readonly=False, arena=self.arena)
            scatter(views, kv_caches, [page_ids[i] for i in rest], layout=layout)
            _copies_done(kv_caches)  # (the pin goes next: the slots may be reused)
            for view in views:
                view.release()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.identity.model}, {self.id.hex()[:12]})"


# ----------------------------------------------------------------------------------------
# reservations and pins
# ----------------------------------------------------------------------------------------

class ReservationCore(Generic[N]):
    """Slots reserved for ``keys`` (once ``reserved``): writable ``buffers`` in the arena
    until commit or abort.  A key whose block the daemon holds in DRAM already, or
    another open reservation holds a slot for, gets no slot (``offsets[i]`` -1): its
    buffer is scratch, its bytes need not be written; the commit stores the keys after
    it only if that block is cached by then (``dropped``).  Dropped unreleased, it is
    aborted at the client's next call (``client_drops``)."""

    reserved = done = False  # (an object whose __init__ failed has nothing to give back)

    def __init__(self, ns: N, keys: list[bytes], parent: bytes | None = None) -> None:
        self.ns = ns
        self.keys = _listed(keys)
        self._parent = parent
        self.id = 0
        self.offsets: list[int] = []
        self.buffers: list[memoryview] = []
        self.reserved = False
        self.done = False
        # keys the commit did not store: from the first one another writer was to store
        # (offset -1, the daemon gave it no slot) that was not cached by then, on
        self.dropped = 0

    def _reserve_request(self) -> p.Reserve:
        return p.Reserve(self.ns.client._next_rid(), self.ns.id, self.keys, self._parent,
                         skip_held=True, skip_pending=True)  # (an older daemon: a slot
        # for every key)

    def _on_reserved(self, received: Received) -> None:
        self._take(check_reply(received[0], p.ReserveReply))

    def _take(self, reply: p.ReserveReply) -> None:
        self.id, self.offsets = reply.reservation, reply.offsets
        self.ns.client.tokens_wanted = reply.tokens
        self.buffers = self.ns.client._slots(reply.offsets, self.ns.block_bytes,
                                             readonly=False, arena=self.ns.arena)
        self.reserved = True
        self.ns.client._holding += 1

    def _commit_request(self) -> p.Commit:
        if not self.reserved:
            raise KVStoreError("nothing reserved yet: await the reservation first")
        c = self.ns.client
        # (a key held already, -1, has no bytes here: the daemon reads no sum for it)
        sums = ([checksum(b) if o >= 0 else 0 for b, o in zip(self.buffers, self.offsets)]
                if c.checksums else [])
        each, tokens = (self.ns._chains.tokens_of(self.keys, self.ns.token_buffer)
                        if self.ns.events and c.tokens_wanted else ([], b""))
        self._finish()
        return p.Commit(c._next_rid(), self.id, sums, each, tokens)

    def _on_commit(self, received: Received) -> int:
        reply = check_reply(received[0], p.CommitReply)
        self.dropped = reply.dropped
        return reply.created

    def _abort_request(self) -> p.Abort | None:
        """None when there is nothing to abort (never reserved, committed or aborted)."""
        if self.done or not self.reserved:
            return None
        self._finish()
        return p.Abort(self.ns.client._next_rid(), self.id)

    def _finish(self) -> None:
        if self.done:
            raise KVStoreError(f"reservation {self.id} was already committed or aborted")
        _let_go(self.buffers, f"reservation {self.id}")  # (first: refused, nothing changed)
        self.done = True
        self.ns.client._holding -= 1

    def __del__(self) -> None:  # (only queued: any thread, any time; see client_drops)
        if self.reserved and not self.done:
            self.ns.client.drops.note(False, self.id, self.buffers)

    def __repr__(self) -> str:
        state = "done" if self.done else "reserved" if self.reserved else "asked"
        return f"{type(self).__name__}({self.id}, {len(self.keys)} keys, {state})"


class HeldCore(Generic[N]):
    """Blocks pinned for ``keys`` (once acquired): read-only ``buffers`` in the arena until
    release.  Dropped unreleased, its pin goes at the client's next call (``client_drops``)."""

    acquired = released = False  # (an object whose __init__ failed has nothing to give back)

    def __init__(self, ns: N, keys: list[bytes]) -> None:
        self.ns = ns
        self.keys = _listed(keys)
        self.pin = 0
        self.offsets: list[int] = []
        self.checksums: list[int] = []
        self.gpu_offsets: list[int] = []
        self.buffers: list[memoryview] = []
        self.acquired = False
        self.released = False

    def _acquire_request(self) -> p.Acquire:
        return self.ns._acquire_request(self.keys)

    def _on_acquired(self, received: Received) -> None:
        reply = check_reply(received[0], p.AcquireReply)
        self.pin, self.offsets, self.checksums = reply.pin, reply.offsets, reply.checksums
        self.gpu_offsets = reply.gpu_offsets
        self.buffers = self.ns.client._slots(reply.offsets, self.ns.block_bytes,
                                             readonly=True, arena=self.ns.arena)
        self.acquired = True
        self.ns.client._holding += 1

    def _on_pinned(self, found: PinnedLookup) -> None:
        """Hold a ``lookup_pin``'s pin (buffers where the client maps the arena)."""
        self.keys = self.keys[:len(found.offsets)]
        self.pin, self.offsets = found.pin, list(found.offsets)
        self.checksums = list(found.checksums)
        client = self.ns.client
        if client._map_arenas:
            self.buffers = client._slots(self.offsets, self.ns.block_bytes, readonly=True,
                                         arena=self.ns.arena)
        self.acquired = True
        client._holding += 1

    def verify(self) -> None:
        """CorruptError unless every buffer matches the checksum it was written with."""
        verify(self.buffers, self.checksums)

    def _release_request(self) -> p.Release | None:
        """None when there is nothing to release (never acquired, or released already);
        the shells post it, without waiting for the reply."""
        if self.released or not self.acquired:
            return None
        _let_go(self.buffers, f"pin {self.pin}")  # (first: refused, nothing changed)
        self.released = True
        self.ns.client._holding -= 1
        return p.Release(self.ns.client._next_rid(), self.pin)

    def __del__(self) -> None:  # (only queued: any thread, any time; see client_drops)
        if self.acquired and not self.released:
            self.ns.client.drops.note(True, self.pin, self.buffers)

    def __repr__(self) -> str:
        state = "released" if self.released else f"pin {self.pin}"
        return f"{type(self).__name__}({len(self.keys)} keys, {state})"
