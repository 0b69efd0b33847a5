"""A router's own view of several daemons' caches, kept from their KV event streams.

``Router`` asks every daemon at each route: a probe each, sent at once, so a route
costs the slowest daemon's round trip, and on a host with fewer cores than daemons
the daemons' turns one after another (8 daemons on 2 cores: about 6 times one lookup).
``RouteView`` asks none of them per route.  It follows each daemon's event stream
(``[events] endpoint``), starting from the daemon's snapshot (``snapshot``: its
blocks per tier, and the sequence number of the batch it was taken after), applying
every batch after that one in order, and filling a gap in the numbers through the
daemon's replay socket (``[events] replay_endpoint``); what it has heard answers
``route``: a dictionary lookup a key a daemon, in the router's own process.

What the stream does not carry comes from a probe of every daemon at once (a
``Router`` of the view's own thread), every ``figures_every`` seconds: the daemon's
wait ahead of a new transfer, its load bandwidth per tier, and the block bytes of the
namespace of the chain routed last (kept by block size: the transfer time of a chain
of a size no probe has answered for yet is not counted).  A daemon whose probe has not
answered for ``stale_after`` seconds (down, or its session refused), or whose stream
the view could not follow (a gap the replay could not fill, a snapshot refused), ranks
last with the reason, as one that does not answer a ``Router`` in time.  Nothing of
a daemon that does not answer its probe is asked (no snapshot, no replay), and what is
asked of one that does waits at most ``figures_every`` (one that died a moment ago).
A daemon that started again (its stream's numbers going back), or whose probe answers
again after failing (it may have), is followed again from a new snapshot, on a new
socket (what the old one queued may be of the life gone), at most one every
``figures_every`` seconds (a stream that keeps failing is not snapshotted every route).

The stream carries every tenant's blocks; a tenant's chains are keyed by its own
namespaces, so another tenant's blocks answer none of its routes (but take the view's
memory: an entry a block).

The view counts what the daemon's own probe counts (``kvstore.routing``): the leading
keys of the chain cached in any tier, each in its fastest; the costs are ``Router``'s
(``kvstore.router.rank``).  What it says is as old as the last batch the daemon sent
(a batch waits ``[events] interval_ms`` for others, longer under load): a router that
must know of a block stored the moment before asks with ``Router``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import msgspec
import zmq

from kvstore import protocol as p
from kvstore.client import Client
from kvstore.client_wire import event_socket
from kvstore.errors import KVStoreError, MalformedError
from kvstore.router import DEFAULT_PREFILL_RATE, RouteResult, Router, checked, rank

# (medium, locality) of the stream's events -> the daemon's tier; the fastest first
_TIERS = {("GPU", None): "gpu", ("CPU", None): "dram", ("STORAGE", "LOCAL"): "ssd",
          ("STORAGE", "REMOTE"): "remote"}
# which of a block's tiers a probe names (``Block.tier``): DRAM, SSD, then the others
_ORDER = ("dram", "ssd", "gpu", "remote")
_BIT = {tier: 1 << i for i, tier in enumerate(_ORDER)}
# a key's tiers (a set of bits) -> its fastest tier
_FASTEST = {bits: next(t for t in _ORDER if bits & _BIT[t]) for bits in range(1, 16)}
_BITS = 15
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                  "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                  "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")
_END = -1  # the replay's last frame's sequence number
_SIZE_SHIFT = 4  # ``_Follow.tiers``: the code of the block's tokens above its tiers' bits
_SIZES = 15  # block sizes given a code (a 16th and later: not known, as a snapshot's)
_HEADS_KEPT = 4096  # chains whose block size a view remembers from its probes
_BATCHES_A_ROUTE = 4096  # batches read of one stream before a route answers (the rest later)


class _Follow:
    """One daemon: its stream's sockets, what the stream said so far, its figures."""

    def __init__(self, endpoint: str, events: str, replay: str) -> None:
        self.endpoint = endpoint
        self.events = events
        self.replay = replay
        self.sub: Any = None
        self.client: Client | None = None  # the route thread's (snapshots)
        # key -> its tiers' bits, and above them (``<< _SIZE_SHIFT``) the code of its
        # block's tokens as its event said (``RouteView._sizes``; 0: not said, as a
        # snapshot's blocks): at most 255, an int Python shares, not one an entry
        self.tiers: dict[bytes, int] = {}
        self.next_seq = 0
        self.live_seq = -1  # the last batch the socket brought (a new life's go back)
        self.synced = False
        self.retry_at = 0.0  # (the view's clock) no new snapshot of it before
        self.trouble = "not followed yet"  # why it ranks last while not synced
        self.figures: p.ProbeReply | None = None  # the figures thread's latest
        self.figures_at = 0.0  # (the view's clock) when they came
        self.figures_error = ""
        self.lost_session = False  # its probe answers again after failing: a restart?


class RouteView:
    """Several daemons' caches as their event streams tell them, and routes over them.

    ``daemons``: each daemon's request endpoint, ``events`` its event stream's
    endpoint, ``replays`` its replay socket's ("" for none: a gap is then filled from a
    new snapshot), one each, in the same order.  The streams are followed from the
    first ``route``, ``sync`` or ``ready`` on; a snapshot is read in the caller's thread
    (at the start, and for a daemon followed again).  One thread routes at a time.
    Credentials: a token (``token``, of ``tenant``) for streams on tcp; ipc streams
    without credentials."""

    def __init__(self, daemons: Sequence[str], events: Sequence[str],
                 replays: Sequence[str], *, tenant: str | None = None,
                 token: str | None = None, prefill_rate: float = DEFAULT_PREFILL_RATE,
                 figures_every: float = 1.0, stale_after: float | None = None,
                 timeout: float = 5.0) -> None:
        if not daemons:
            raise MalformedError("route view: name at least one daemon endpoint")
        if not len(daemons) == len(events) == len(replays):
            raise MalformedError("route view: one event stream and one replay endpoint "
                                 "for each daemon, in the same order")
        if not prefill_rate > 0 or not figures_every > 0 or not timeout > 0:
            raise MalformedError("route view: prefill_rate, figures_every and timeout "
                                 "must be positive")
        self.prefill_rate = prefill_rate
        self.figures_every = figures_every
        # (the probes go to all at once and wait at most figures_every)
        self.stale_after = 4 * figures_every if stale_after is None else stale_after
        self._tenant, self._token, self._timeout = tenant, token, timeout
        # the figures thread's (made first: a bad endpoint is the caller's error)
        self._router = Router(daemons, tenant=tenant, token=token)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._follows = [_Follow(d, e, r) for d, e, r in zip(daemons, events, replays)]
        self._decode = msgspec.msgpack.Decoder().decode
        self._chain_head: bytes | None = None  # the last route's first key (figures)
        self._bytes: dict[int, int] = {}  # block tokens -> block bytes, as probes said
        self._wake_after = 0.0  # (the view's clock) no route wakes the figures thread before
        # the block tokens of chains probes were asked of, by first key (the latest
        # _HEADS_KEPT): what a snapshot's blocks do not say
        self._head_sizes: dict[bytes, int] = {}
        self._sizes: list[int] = [0]  # a block size's code (its place) -> its tokens
        self.replays = 0  # gaps filled through a replay socket
        self.probe_rounds = 0  # the figures thread's probes of every daemon
        self.snapshots = 0  # daemons followed from a snapshot (at start, or again)
        self._stop = threading.Event()
        self._wake = threading.Event()  # a probe now: a route of a size not yet known
        self._figures = threading.Thread(target=self._refresh, name="kvstore-route-view",
                                         daemon=True)
        try:
            for f in self._follows:  # subscribed before any snapshot: no batch between
                self._subscribe(f)
        except BaseException:  # (an event endpoint refused: nothing left open)
            for f in self._follows:
                if f.sub is not None:
                    f.sub.close(linger=0)
            self._ctx.term()
            self._router.close()
            raise
        self._figures.start()

    def _subscribe(self, f: _Follow) -> None:
        """A new socket on ``f``'s stream (what the old one queued goes with it)."""
        if f.sub is not None:
            f.sub.close(linger=0)
            f.sub = None
        f.live_seq = -1
        f.sub = event_socket(self._ctx, zmq.SUB, f.events, token=self._token or "",
                             tenant=self._tenant or "")
        f.sub.setsockopt(zmq.SUBSCRIBE, b"")

    # -- following the streams -------------------------------------------------------------
    def ready(self, timeout: float = 10.0) -> int:
        """Wait (at most ``timeout`` seconds) until every daemon is followed; how many
        are."""
        end = time.monotonic() + timeout
        while True:
            self.sync()
            followed = sum(f.synced for f in self._follows)
            if followed == len(self._follows) or time.monotonic() >= end:
                return followed
            time.sleep(0.01)

    def sync(self) -> None:
        """Read every stream's batches that came; a daemon not yet followed, or lost
        track of, from a new snapshot, once its probe has answered since (a daemon that
        is down is never waited on)."""
        for f in self._follows:
            try:
                if f.sub is None:  # (its socket could not be made last time)
                    self._subscribe(f)
                if f.lost_session:  # (it may have started again: its old life's state goes)
                    f.lost_session = False
                    self._lose(f, "its probe failed, then answered (started again?)")
                if not f.synced:
                    if not self._answering(f) or time.monotonic() < f.retry_at:
                        continue  # not answering its probe (or lost a moment ago): no
                        # snapshot asked of it (a stream that keeps failing is not
                        # snapshotted at every route)
                    self._snapshot(f)
                self._drain(f)
            except (KVStoreError, zmq.ZMQError, msgspec.DecodeError, ValueError,
                    TypeError, KeyError, IndexError, AttributeError,
                    RecursionError) as exc:  # (a batch not laid out as the stream's)
                self._lose(f, f"its event stream could not be followed: {exc!r}")

    def _answering(self, f: _Follow) -> bool:
        """Whether ``f``'s probe answered lately, and its last one did."""
        return (not f.figures_error and bool(f.figures_at)
                and time.monotonic() - f.figures_at <= self.stale_after)

    def _lose(self, f: _Follow, why: str) -> None:
        """Stop trusting what ``f``'s stream said: followed again from a new snapshot,
        on a new socket (the batches the old one queued may be of a life gone)."""
        f.synced, f.trouble = False, why
        f.retry_at = time.monotonic() + self.figures_every
        if f.client is not None:
            f.client.close()
            f.client = None
        try:
            self._subscribe(f)
        except zmq.ZMQError as exc:  # (tried again at the next sync)
            f.trouble = f"{why}; its stream cannot be subscribed to: {exc}"

    def _snapshot(self, f: _Follow) -> None:
        if f.client is None:
            f.client = Client(f.endpoint, tenant=self._tenant, token=self._token,
                              timeout=min(self._timeout, self.figures_every))
        snap = f.client.snapshot()
        self.snapshots += 1
        tiers: dict[bytes, int] = {}
        for key, _, tier in snap.blocks:
            tiers[key] = tiers.get(key, 0) | _BIT[tier]
        f.tiers, f.next_seq = tiers, snap.seq + 1
        f.synced, f.trouble = True, ""

    def _drain(self, f: _Follow) -> None:
        sub = f.sub
        for _ in range(_BATCHES_A_ROUTE):
            if not sub.get(zmq.EVENTS) & zmq.POLLIN:  # (cheaper than a failed receive)
                return
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                continue  # not a batch of the stream
            seq = int.from_bytes(frames[1], "big")
            if seq < f.live_seq:  # the socket brings a life's batches in order: a new life
                self._lose(f, "it started again")
                return
            f.live_seq = seq
            self._take(f, seq, frames[2])
            if not f.synced:
                return

    def _take(self, f: _Follow, seq: int, payload: bytes) -> None:
        batch = self._decode(payload)
        if seq < f.next_seq:
            return  # one applied already (from a replay, or the snapshot's)
        if seq > f.next_seq:  # batches missed: the replay socket has them, or resync
            for s, pl in self._replayed(f, f.next_seq):
                if f.next_seq <= s < seq:
                    if s != f.next_seq:
                        raise ValueError(f"the replay has no batch {f.next_seq}")
                    self._apply(f, s, self._decode(pl))
            if f.next_seq != seq:
                raise ValueError(f"batches {f.next_seq} to {seq - 1} are gone")
        self._apply(f, seq, batch)

    def _replayed(self, f: _Follow, first: int) -> list[tuple[int, bytes]]:
        if not f.replay:
            raise ValueError("no replay socket to fill the gap from")  # (a new snapshot)
        if not self._answering(f):
            raise ValueError("a gap, and the daemon does not answer its probe")
        self.replays += 1
        sock = event_socket(self._ctx, zmq.DEALER, f.replay, token=self._token or "",
                            tenant=self._tenant or "")
        try:
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            while True:
                if not sock.poll(int(min(self._timeout, self.figures_every) * 1000)):
                    raise ValueError("the replay socket did not answer")
                frames = sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END:
                    return out
                out.append((seq, frames[-1]))
        finally:
            sock.close(linger=0)

    def _apply(self, f: _Follow, seq: int, batch: Any) -> None:
        tiers = f.tiers
        for event in batch[1]:
            if isinstance(event, dict):
                kind = event.get("type")
            else:  # positional, its tag first
                kind, values = event[0], event[1:]
                names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
                event = dict(zip(names, values))
            if kind == "AllBlocksCleared":
                tiers.clear()
                continue
            bit = _BIT[_TIERS[(event["medium"], event.get("locality"))]]
            if kind == "BlockStored":
                size = self._code(int(event["block_size"])) << _SIZE_SHIFT
                for key in event["block_hashes"]:
                    tiers[key] = tiers.get(key, 0) & _BITS | bit | size
            elif kind == "BlockRemoved":
                for key in event["block_hashes"]:
                    held = tiers.get(key, 0) & ~bit
                    if held & _BITS:
                        tiers[key] = held
                    else:
                        tiers.pop(key, None)
        f.next_seq = seq + 1

    def _code(self, tokens: int) -> int:
        """The code of a block size in ``_Follow.tiers`` (0 past ``_SIZES`` of them)."""
        sizes = self._sizes
        if tokens in sizes:
            return sizes.index(tokens)
        if len(sizes) > _SIZES or tokens <= 0:
            return 0
        sizes.append(tokens)
        return len(sizes) - 1

    # -- the figures the stream does not carry -------------------------------------------
    def _refresh(self) -> None:
        """The figures thread: every daemon's probe, all at once, every
        ``figures_every`` seconds (a daemon down costs the round no more than that)."""
        router = self._router
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                head = self._chain_head
                self.probe_rounds += 1
                try:
                    answers = router.answers([head] if head is not None else [],
                                             deadline=self.figures_every)
                except Exception as exc:  # (the thread goes on whatever a daemon does)
                    answers = [(f.endpoint, None, f"{type(exc).__name__}: {exc}")
                               for f in self._follows]
                now = time.monotonic()
                for f, (_, answer, why) in zip(self._follows, answers):
                    if answer is None:
                        f.figures_error = why
                        continue
                    if answer.block_bytes and answer.block_tokens:
                        self._bytes[answer.block_tokens] = answer.block_bytes
                        if head is not None and head not in self._head_sizes:
                            if len(self._head_sizes) >= _HEADS_KEPT:
                                del self._head_sizes[next(iter(self._head_sizes))]
                            self._head_sizes[head] = answer.block_tokens
                    # answering again after failing: it may have started again
                    f.lost_session = f.lost_session or bool(f.figures_error)
                    f.figures, f.figures_at, f.figures_error = answer, now, ""
                self._wake.wait(max(0.0, self.figures_every - (time.monotonic() - started)))
                self._wake.clear()
        finally:
            router.close()

    # -- routes ---------------------------------------------------------------------------
    def route(self, keys: Sequence[bytes], *, tokens: int | None = None,
              block_tokens: int | None = None,
              prefill_rate: float | None = None) -> list[RouteResult]:
        """Every daemon's cached prefix of the key chain as its stream told it, costed
        as ``Router.route`` costs it, cheapest first; a daemon not followed, or whose
        figures are older than ``stale_after``, last."""
        keys, rate = checked(keys, self.prefill_rate if prefill_rate is None else prefill_rate)
        if self._ctx.closed:
            raise MalformedError("route view: routed after it was closed")
        self._chain_head = keys[0]
        self.sync()
        now = time.monotonic()
        size = self._chain_size(keys[0])
        block_bytes = self._bytes.get(size, 0)
        if not block_bytes and now >= self._wake_after:  # its size from a probe of it,
            # soon: at most four times a figures_every (a route of a chain no daemon
            # holds woke the thread at every route, a probe of every daemon each)
            self._wake_after = now + self.figures_every / 4
            self._wake.set()
        answers: list[tuple[str, p.ProbeReply | None, str]] = []
        for f in self._follows:
            figures = f.figures
            if not f.synced:
                answers.append((f.endpoint, None, f.trouble))
                continue
            if figures is None or now - f.figures_at > self.stale_after:
                answers.append((f.endpoint, None, "its probe has not answered lately"
                                + (f" ({f.figures_error})" if f.figures_error else "")))
                continue
            if f.figures_error:  # (its last probe failed: it may be down, or elsewhere)
                answers.append((f.endpoint, None, f"its last probe failed: {f.figures_error}"))
                continue
            answers.append((f.endpoint, p.ProbeReply(0, self._runs(f.tiers, keys), block_bytes,
                                                     size, figures.queue_seconds,
                                                     figures.bandwidth), ""))
        return rank(answers, len(keys), tokens, block_tokens, rate)

    def _chain_size(self, head: bytes) -> int:
        """The tokens of a block of the chain headed by ``head``: as a daemon's stream
        said of it, else as a probe of this chain did (lately), else the one size probes
        told of (a fleet of one model); 0 where none is known."""
        for f in self._follows:
            code = f.tiers.get(head, 0) >> _SIZE_SHIFT
            if code:
                return self._sizes[code]
        size = self._head_sizes.get(head, 0)
        if size:
            return size
        known = list(self._bytes)  # (the figures thread adds to it)
        return known[0] if len(known) == 1 else 0

    @staticmethod
    def _runs(tiers: dict[bytes, int], keys: list[bytes]) -> list[tuple[str, int]]:
        """(tier, count) runs over the leading keys held in any tier, each in its
        fastest (as the daemon's probe answers)."""
        held: list[str] = []
        get = tiers.get
        for key in keys:
            bits = get(key, 0) & _BITS
            if not bits:
                break
            held.append(_FASTEST[bits])
        return p.tier_runs(held)

    def close(self) -> None:
        if self._ctx.closed:
            return
        self._stop.set()
        self._wake.set()
        self._figures.join(self._timeout + self.figures_every + 1)
        for f in self._follows:
            if f.client is not None:
                f.client.close()
            if f.sub is not None:
                f.sub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> RouteView:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
