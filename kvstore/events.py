"""The KV event stream: vLLM's ``KVEventBatch`` of block events, published for routers.

Routers that send requests where their prefix is cached (llm-d's KV-cache-aware
scheduler, Dynamo's KV router) build their view from vLLM's event stream; this module
speaks it for kvstore's tiers.  The store marks blocks whose copies changed
(``kvstore.tier_changes``); once per loop turn the publisher drains the marks, turns them
into ``BlockStored`` / ``BlockRemoved`` events (one event per run of a chain, per tier;
``kvstore.kv_events_batch`` defines and encodes them, without I/O) and sends one batch in the stream's three frames: the topic, an 8-byte big-endian
sequence number, the msgpack payload.

Tiers map to vLLM's media: DRAM is ``CPU``, the GPU pool ``GPU``, SSD and the remote
store ``STORAGE`` (told apart by ``locality``: ``LOCAL`` and ``REMOTE``).  Events are
maps tagged ``type`` (vLLM's encoding today) or positional arrays tagged first (the
older one), as configured; the batch itself is always an array.

A slow subscriber never slows the daemon, nor starves the others: the PUB socket (an
XPUB that refuses rather than blocks) queues ``queue_batches`` per subscriber, fewer
where batches are large: about ``queue_bytes`` of them (``QueueBound``).  A batch
that a full subscriber's queue refuses is sent again at once, with drops allowed
(``XPUB_NODROP`` off for that one batch) if a queue is still full once ZeroMQ has
counted the latest reads: every subscriber with room gets it, the full ones miss it
(counted, ``lossy_batches``) and see a sequence jump.  ZeroMQ then passes a full
subscriber over, without telling, until it has read half its queue (ZeroMQ's low-water
mark), so the count is of the batches known to be missed, not all of them; the jump
shows each subscriber the rest.  Refusing the batch to everyone instead (as before) let
one subscriber that never reads stop the stream for all the others, for good.

The last ``buffer_steps`` batches stay in a ring; the replay socket (ROUTER) answers a
request naming a sequence number with every batch from there on, each as
``[seq, payload]``, and ends with ``[-1, b""]``, as vLLM's publisher does.  Answers go
out a slice a loop turn, the peers by turns, so replays never hold the tenants'
requests.  Without a replay socket the ring keeps only the last batch: nobody could ask
for the others.  Neither socket reads a frame larger than a request or a subscription
could be, and a subscription to a topic no batch matches makes nobody a listener.

Writers send their blocks' token ids only while someone hears the batches
(``tokens_wanted``: a subscriber, as last read, or a replay socket), as the daemon's
replies tell them; a block stored without them is announced with empty ``token_ids``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from kvstore.auth import Auth
from kvstore.blocks import parents_first
from kvstore.config import EventsConfig, parse_size
from kvstore.errors import ConfigError
from kvstore.files import check_socket_directory
# vLLM's events and their encoding, here as before (``kvstore.events.decoder`` decodes)
from kvstore.kv_events_batch import (  # noqa: F401
    MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, Event, EventMaker, KVCacheEvent,
    KVEventBatch, KVEventBatchArray, decoder)
from kvstore.store import BlockStore
from kvstore.tier_changes import TierChanges
from kvstore.transport import bind_error, check_tcp_port, socket_alive

log = logging.getLogger("kvstore.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How often batches read the subscriptions (seconds): a new subscriber's first batch may
# come that much later, a batch may go to no one for as long after the last one left.
SUBSCRIPTIONS_EVERY = 0.05
# Replays share the loop with every tenant's requests: one call sends at most this many
# batches of the answers under way, each answer a turn of its own slice (a request from
# the ring's first batch sent the whole ring in one go, 16 requests a call: a few peers
# asking again and again held every client's reply up to 170 ms with a ring of 1500)
_REPLAY_BATCHES_A_TURN = 256
_ANSWERS_AT_ONCE = 16  # requests under way; the next wait in ZeroMQ's queue (fairly read)
# The largest frame a peer of the stream's sockets may send: a replay request is an
# 8-byte sequence number, a subscription a topic's prefix.  Without a limit ZeroMQ read
# a frame of any size whole (gigabytes) before the daemon could look at it.  The limit
# holds for the handshake's frames too (a token names its tenant) and for frames as
# CurveZMQ encrypts them: room for both.
_FRAME_BYTES = 4096
# How early a timer may run by its loop's clock: uvloop keeps time in milliseconds and
# rounds a timer's delay to them, so a quiet timer runs up to a millisecond before its
# time.  Set again for what is left, it ran at once (a delay under half a millisecond
# rounds to none), again and again until the clock ticked: tens of wakes a batch.
_TIMER_SLACK = 0.001
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
# A frame's send without pyzmq's Python layer: ``send_multipart`` combines each frame's
# flags as ``IntFlag``s and checks for options a PUB socket never uses (routing ids,
# groups), which costs several times the three frames' sends themselves.
_send = zmq.backend.Socket.send

def _may_run_as_batch() -> bool:
    """Whether a thread of this process may set itself SCHED_BATCH.  ZeroMQ aborts the
    process when its I/O thread cannot set the policy it is given (as one started under
    SCHED_IDLE cannot, without CAP_SYS_NICE), so a throwaway thread tries first."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    refused: list[OSError] = []

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError as e:
            refused.append(e)

    thread = threading.Thread(target=attempt, name="kvstore-sched-probe")
    thread.start()
    thread.join()
    if refused:
        log.debug("event stream's I/O thread keeps the process's scheduling: %s",
                  refused[0])
    return not refused


class EventPublisher:
    """The PUB and replay sockets, the ring of recent batches, and the per-turn flush."""

    def __init__(self, config: EventsConfig, store: BlockStore, auth: Auth | None = None,
                 secure_file: Callable[[str, int], None] | None = None,
                 handshake_seconds: float = 5.0) -> None:
        self.config = config
        self.handshake_ms = round(handshake_seconds * 1000)  # ``server.handshake_seconds``
        self.store = store
        # an ipc socket file's mode and group, as the daemon's own (``Transport``)
        self.secure_file = secure_file
        # who may read the stream, when the daemon takes credentials: it carries every
        # tenant's keys and token ids (``Auth.secure_events``)
        self.auth = auth
        self.maker = EventMaker(config)
        self.encoder = msgspec.msgpack.Encoder()
        self.topic = config.topic.encode()
        self.rank = config.data_parallel_rank if config.data_parallel_rank >= 0 else None
        self.ring: deque[tuple[int, bytes]] = deque()
        self.ring_bytes = 0  # of the batches in it, within ``buffer_bytes``
        self.frames: dict[int, zmq.Frame] = {}  # the ring's, as replayed (``_answer``)
        self.ring_most = parse_size(config.buffer_bytes, "events.buffer_bytes")
        # Batches the ring keeps: ``buffer_steps`` for the replay socket; without one
        # nobody can ask for them, so only the last (a daemon that kept every batch
        # grew by each batch's bytes, new memory a page fault every few kB, up to
        # ``buffer_bytes``; one that keeps the last reuses the same memory)
        self.ring_steps = 1
        # a subscriber's queue, in batches, within ``queue_bytes``
        self.queue = QueueBound(parse_size(config.queue_bytes, "events.queue_bytes"),
                                config.queue_batches)
        self.seq = 0                # the next batch's sequence number
        self.batches = self.events = 0
        self.lossy_batches = 0      # refused by a full subscriber, sent to the others
        self.dropped = 0            # batches no subscriber got (the lossy send failed)
        self.replays = 0
        self.cut_replays = 0        # answers cut: the peer's queue was full, or it left
        self.bad_replays = 0        # requests not laid out as a replay request
        self.unheard = 0            # batches numbered but not built: nobody would get them
        self.subscriptions: set[bytes] = set()  # prefixes of the topic someone subscribes to
        # replay answers under way, by peer (each peer's requests answered in order, the
        # peers by turns): the sequence numbers left to send, first and last, a request
        self._answers: dict[bytes, deque[tuple[int, int]]] = {}
        self._ranges = 0  # requests under way, over all peers
        self._replay_turn: asyncio.Handle | None = None  # the next turn's serving, if set
        # Whether writers should send token ids (replies tell them): someone subscribes,
        # as last read, or batches are kept for replay.
        self.tokens_wanted = bool(config.replay_endpoint)
        self.changes = TierChanges(self._soon, self._more)
        self.endpoints: list[str] = []
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.interval = config.interval_ms / 1e3
        self.busy_interval = max(config.busy_interval_ms, config.interval_ms) / 1e3
        self.wait = self.interval  # how long the next batch waits for changes
        self.quiet = max(config.quiet_ms, config.interval_ms) / 1e3
        self._turn: asyncio.Handle | None = None  # the flush at this turn's end, if set
        self._quiet: asyncio.Handle | None = None  # the timer for a daemon gone quiet
        self._due = 0.0  # when a commit sends the batch (loop time; 0: at the timer)
        self._flushed_at = 0.0  # when the last batch went out (time.monotonic())
        self._read_at = -SUBSCRIPTIONS_EVERY  # when a batch last read the subscriptions
        self._fds: list[int] = []

    # -- lifecycle ------------------------------------------------------------------------
    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the sockets and start marking the store's changes."""
        self._loop = loop
        self._ctx = zmq.Context()
        if _may_run_as_batch():
            # Its I/O thread, woken by each batch, waits for the loop to yield rather
            # than preempt it: a batch's send costs the loop an enqueue, not a switch.
            self._ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        self._ctx.setsockopt(zmq.HANDSHAKE_IVL, self.handshake_ms)  # (ZeroMQ's: 30 s)
        # kept at once: a bind that fails leaves it to ``close`` (a socket left open
        # made the context's term, and the daemon's exit, wait for ever)
        pub = self._pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, self.config.queue_batches)
        pub.setsockopt(zmq.XPUB_NODROP, 1)  # refuse (counted: ``send``), not drop unseen
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.MAXMSGSIZE, _FRAME_BYTES + len(self.topic))
        if self.auth is not None:
            self.auth.secure_events(self._ctx, pub, self.config.endpoint)
        _bind(pub, self.config.endpoint, "events.endpoint")
        self._secure(self.config.endpoint)
        self.endpoints.append(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        if self.config.replay_endpoint:
            replay = self._replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            # one whole answer queued per peer at most (a peer that asks again and again
            # and never reads gets the rest of its answers cut: ``_serve_replays``)
            replay.setsockopt(zmq.SNDHWM, self.config.buffer_steps + 2)
            replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            replay.setsockopt(zmq.MAXMSGSIZE, _FRAME_BYTES)
            if self.auth is not None:
                self.auth.secure_events(self._ctx, replay, self.config.replay_endpoint)
            _bind(replay, self.config.replay_endpoint, "events.replay_endpoint")
            self._secure(self.config.replay_endpoint)
            self.endpoints.append(replay.getsockopt_string(zmq.LAST_ENDPOINT))
            self.ring_steps = self.config.buffer_steps
            self._fds.append(replay.getsockopt(zmq.FD))  # type: ignore[arg-type]
            loop.add_reader(self._fds[-1], _replay_readable, self)
            self._replay_turn = loop.call_soon(self._serve_replays)
        self.store.record_changes(self.changes)

    def _secure(self, endpoint: str) -> None:
        """An ipc socket file 0600 (or the socket group's too), as the daemon's."""
        if self.secure_file is not None and endpoint.startswith("ipc://"):
            self.secure_file(endpoint[len("ipc://"):], 0o600)

    def start(self, restored: bool) -> None:
        """The first batch: all cleared (what a subscriber knew of this daemon is gone),
        then, with the SSD index restored, every block it holds."""
        self.publish([self.maker.cleared()])
        for ns in self.store.namespaces.values():
            self.changes.touch_all(parents_first(ns))  # the key map is not in chain order
        if restored:
            self.flush()

    def close(self) -> None:
        self.flush()
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None
        if self._replay_turn is not None:
            self._replay_turn.cancel()
            self._replay_turn = None
        if self._loop is not None:
            for fd in self._fds:
                self._loop.remove_reader(fd)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            if self.auth is not None:
                self.auth.release(self._ctx)
            self._ctx.term()
        self._pub = self._replay = self._ctx = None

    # -- publishing -----------------------------------------------------------------------
    def _soon(self) -> None:
        # The first change since the last batch (at the end of this loop turn when the
        # interval is 0): every change until the batch goes out joins it, so a busy
        # daemon sends fewer, larger batches.  The first commit ``wait`` on (``interval``,
        # longer under load) sends it at the end of its turn; the quiet timer, ``quiet``
        # on (or twice the wait, if longer: a busy daemon's next commit comes first),
        # only if none came (a wake costs a quiet daemon nothing, but a busy one tens of
        # microseconds a batch).  A batch a commit sends cancels its timer, and the next
        # batch's first change sets one: a busy daemon sets a timer a batch (a couple of
        # microseconds) and is never woken by one, where a timer kept for the batches
        # begun while it ran woke it every ``quiet`` or twice the wait (tens of
        # microseconds a wake, its caches cold: 3 us a request in the benchmark's
        # rounds).  A cancelled timer wakes nobody: the loop drops it from the head of
        # its heap before it waits.  A daemon idle for longer than ``quiet`` since its
        # last batch is not under load: this batch waits ``interval`` again, not a past
        # burst's wait.
        loop = self._loop
        if loop is None:
            return
        if not self.interval:
            if self._turn is None:
                self._turn = loop.call_soon(self.flush)
            return
        if time.monotonic() - self._flushed_at > self.quiet:
            self.wait = self.interval
        self._due = loop.time() + self.wait
        if self._quiet is None:
            self._quiet = loop.call_later(max(self.quiet, 2 * self.wait), self._went_quiet)

    def _more(self) -> None:
        # A commit's changes joined the batch: it goes out at the end of this turn if due,
        # and commits keep coming: the next batch waits twice as long (up to
        # ``busy_interval``), so a loaded daemon sends fewer, larger batches.
        due = self._due
        if due and self._loop is not None and self._loop.time() >= due:
            self._due = 0.0
            self.wait = min(2 * self.wait, self.busy_interval)
            if self._turn is None:
                self._turn = self._loop.call_soon(self.flush)

    def _went_quiet(self) -> None:
        # Set at a batch's first change (or by this timer, early for the batch: the wait
        # grew since).  A batch that waited ``quiet`` (or twice its wait, if longer)
        # with no commit to send it: the load has eased, the next batch waits half as
        # long (down to ``interval``; a pause between bursts does not bring back a
        # burst's many small batches, a longer idle does: see ``_soon``).
        self._quiet = None
        loop = self._loop
        if not self.changes.touched or not self._due or loop is None:
            return  # nothing waits, or a commit's turn sends it
        # (the wait changes only once the batch is sent)
        end = self._due - self.wait + max(self.quiet, 2 * self.wait)
        if loop.time() < end - _TIMER_SLACK:
            self._quiet = loop.call_at(end, self._went_quiet)
            return
        self.wait = max(self.wait / 2, self.interval)
        self.flush()

    def flush(self) -> int:
        """Publish what changed since the last flush as one batch; its sequence number
        (-1: nothing changed)."""
        if self._turn is not None:
            self._turn.cancel()  # called before the turn's end (a snapshot, closing)
            self._turn = None
        if self._quiet is not None:  # sent before its timer: it need not wake the loop
            self._quiet.cancel()
            self._quiet = None
        self._due = 0.0
        if not self.changes.touched:
            return -1
        # Whether anyone subscribes, as last read unless that was a while ago (a read
        # asks ZeroMQ, a syscall's worth a batch).
        now = self._flushed_at = time.monotonic()
        if now - self._read_at >= SUBSCRIPTIONS_EVERY:
            self._read_at = now
            listened = self.listened()
        else:
            listened = bool(self.subscriptions)
        if self._replay is None and not listened:
            # Nobody subscribes and nothing is replayed: the batch is numbered (a
            # snapshot names the last one) but not built, its changes not even listed
            # (commits' runs alone are taken as they are: their bits set as marked).
            if self.changes.drain_runs() is None and not self.changes.settle():
                return -1
            self.unheard += 1
            self.seq += 1
            return self.seq - 1
        runs = self.changes.drain_runs()  # (most batches: commits' runs, nothing else)
        if runs is not None:
            payload, count = self.maker.runs_payload(runs, time.time(), self.rank)
        else:
            changes = self.changes.drain()
            if not changes:
                return -1
            payload, count = self.maker.payload(changes, time.time(), self.rank)
        return self.send(payload, count, listened)

    def publish(self, events: list[Event], listened: bool | None = None) -> int:
        """Number, keep and send one batch of ``events`` (``listened``: whether someone
        subscribes, if the caller has just asked)."""
        batch = KVEventBatch(time.time(), events, self.rank)
        return self.send(self.encoder.encode(batch), len(events), listened)

    def send(self, payload: bytes, count: int, listened: bool | None = None) -> int:
        """Number, keep and send one encoded batch of ``count`` events."""
        seq = self.seq
        self.seq += 1
        ring = self.ring
        ring.append((seq, payload))
        self.ring_bytes += len(payload)
        while len(ring) > 1 and (len(ring) > self.ring_steps
                                 or self.ring_bytes > self.ring_most):
            self.ring_bytes -= len(ring.popleft()[1])
            self.frames.pop(ring[0][0] - 1, None)  # (numbers are consecutive: replayed)
        self.batches += 1
        self.events += count
        pub = self._pub
        if pub is not None:
            limit = self.queue.fit(seq, len(payload))
            if limit:  # shortened (before this batch goes), or lengthened
                pub.setsockopt(zmq.SNDHWM, limit)
            if self.listened() if listened is None else listened:  # else the ring keeps it
                try:  # (once its first frame is taken, ZeroMQ takes the whole message)
                    _send(pub, self.topic, _MORE)
                except zmq.Again:  # a subscriber is full: the others get it all the same
                    self._send_refused(pub, seq, payload)
                else:
                    _send(pub, seq.to_bytes(8, "big"), _MORE)
                    _send(pub, payload, _NOBLOCK)
        return seq

    def _send_refused(self, pub: zmq.Socket[bytes], seq: int, payload: bytes) -> None:
        """Send a batch a full subscriber refused to every subscriber with room: the
        full ones drop it (they see the jump and replay it).

        First the reads ZeroMQ has not counted yet are taken in (it takes them at most
        once a millisecond on a send; reading ``EVENTS`` takes them now): a queue with
        room again takes the batch.  If one is still full, drops are allowed for this
        batch only (the option changes between messages, never within one), so the
        next batch finds out again whether anyone is full.  ZeroMQ passes a subscriber
        it could not give a batch over, uncounted, until it has read half its queue (the
        pipe's low-water mark: libzmq's ``pipe_t::compute_lwm``)."""
        pub.getsockopt(_EVENTS)
        try:
            _send(pub, self.topic, _MORE)
        except zmq.Again:
            pass
        else:
            _send(pub, seq.to_bytes(8, "big"), _MORE)
            _send(pub, payload, _NOBLOCK)
            return
        self.lossy_batches += 1
        pub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            _send(pub, self.topic, _MORE)
            _send(pub, seq.to_bytes(8, "big"), _MORE)
            _send(pub, payload, _NOBLOCK)
        except zmq.ZMQError:  # (a lossy XPUB never refuses: not expected)
            self.dropped += 1
        finally:
            pub.setsockopt(zmq.XPUB_NODROP, 1)

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch published (-1: none yet)."""
        return self.seq - 1

    def listened(self) -> bool:
        """Whether someone subscribes to the stream now."""
        pub = self._pub
        if pub is not None and _readable(pub):
            self.read_subscriptions()
        return bool(self.subscriptions)

    def read_subscriptions(self) -> None:
        """Take in the subscriptions the XPUB passed up: a topic's first subscriber
        (``\\x01topic``) and its last one gone (``\\x00topic``).  Read at most every
        ``SUBSCRIPTIONS_EVERY`` seconds when a batch is due (ZeroMQ registers a
        subscription as it passes it up), so a batch is sent only while someone
        subscribes: a subscriber's first batches within that time may go unsent, as a
        PUB socket's do before a subscription reaches it (replay them by sequence)."""
        pub = self._pub
        while pub is not None and _readable(pub):
            try:
                message = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            topic = message[1:]
            if not self.topic.startswith(topic):
                continue  # no batch of this stream would match it: nobody hears them
            if message[:1] == b"\x01":
                self.subscriptions.add(topic)
            elif message[:1] == b"\x00":
                self.subscriptions.discard(topic)
        self.tokens_wanted = bool(self.subscriptions) or self._replay is not None

    def _serve_replays(self) -> None:
        """Answer replay requests: at most ``_REPLAY_BATCHES_A_TURN`` batches a call, the
        answers under way by turns, each peer's in the order it asked (the rest: the
        next loop turn).  An answer is the ring from the sequence asked to the last batch
        published when the request was read; batches that leave the ring before their
        turn are not sent.  The batches go out by reference (no copy each), without
        waiting: a peer whose queue is full (it asks and does not read) has the rest of
        that answer cut, end included."""
        self._replay_turn = None
        sock = self._replay
        if sock is None:
            return
        budget = _REPLAY_BATCHES_A_TURN
        answers = self._answers
        while budget > 0:
            while self._ranges < _ANSWERS_AT_ONCE and self._read_replay(sock):
                pass
            if not answers:
                return  # nothing under way: the socket's reader calls again
            peer = next(iter(answers))
            ranges = answers.pop(peer)
            sent, ended, rest = _answer(sock, self, peer, ranges[0], budget)
            budget -= max(sent, 1)
            if ended is None:
                ranges[0] = rest
            else:  # sent whole, or cut
                self.cut_replays += not ended
                ranges.popleft()
                self._ranges -= 1
            if ranges:
                answers[peer] = ranges  # to the back: the other peers' turn first
        if self._loop is not None:
            self._replay_turn = self._loop.call_soon(self._serve_replays)

    def _read_replay(self, sock: zmq.Socket[bytes]) -> bool:
        """Take in one replay request, if one waits; whether one did."""
        if not _readable(sock):
            return False
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if len(frames) != 3 or len(frames[2]) != 8:
            self.bad_replays += 1
            if self.bad_replays & (self.bad_replays - 1) == 0:  # 1, 2, 4, 8...: a flood
                log.warning("replay request of %d frames ignored: expected "  # logs little
                            "[identity, empty, 8-byte sequence] (%d so far)",
                            len(frames), self.bad_replays)
            return True
        peer, _, start = frames
        self.replays += 1
        # (past the last batch: the end marker alone; as read, up to 2**64)
        self._answers.setdefault(peer, deque()).append(
            (min(int.from_bytes(start, "big"), self.seq), self.seq - 1))
        self._ranges += 1
        return True

    def stats(self) -> dict[str, int]:
        return {"batches": self.batches, "events": self.events, "dropped": self.dropped,
                "lossy_batches": self.lossy_batches, "unheard": self.unheard,
                "replays": self.replays, "cut_replays": self.cut_replays,
                "bad_replays": self.bad_replays, "last_seq": self.last_seq,
                "buffered": len(self.ring), "buffered_bytes": self.ring_bytes,
                "queue_limit": self.queue.limit}


class QueueBound:
    """A subscriber's queue in batches (ZeroMQ's SNDHWM), kept within ``most_bytes``:
    ``most_bytes`` over the largest of the last ``most_batches`` batches, at most
    ``most_batches``.

    ZeroMQ bounds a queue in messages only, and a queue it shortens keeps what it holds
    and takes nothing more until read (libzmq sets a changed SNDHWM on every pipe:
    ``update_pipe_options``).  The length is set before each batch is sent, that batch
    counted, so a subscriber that stops reading holds the batches it took until then,
    each within the limit of its time: about ``most_bytes`` (a batch larger than that
    alone, one).  Lengthened only once a length twice as long is due, or the cap is, so
    that batches of changing sizes do not set it on every send."""

    def __init__(self, most_bytes: int, most_batches: int) -> None:
        self.most_bytes = most_bytes
        self.most_batches = most_batches
        self.limit = most_batches
        # the window's maxima in order, each smaller than the one before: (seq, bytes)
        self._largest: deque[tuple[int, int]] = deque()

    def fit(self, seq: int, size: int) -> int:
        """Count batch ``seq`` of ``size`` bytes; the queue's new length, if it changes
        (0: it does not)."""
        largest = self._largest
        while largest and largest[-1][1] <= size:
            largest.pop()
        largest.append((seq, size))
        while largest[0][0] <= seq - self.most_batches:
            largest.popleft()  # (the last one is this batch: never empty)
        limit = max(1, min(self.most_batches, self.most_bytes // largest[0][1]))
        now = self.limit
        if limit < now or limit >= 2 * now or (now < limit == self.most_batches):
            self.limit = limit
            return limit
        return 0


def _replay_readable(pub: EventPublisher) -> None:
    """The replay socket's reader: serve replays, unless a turn's serving is set (it reads
    the requests first).  Served from here too, answers under way gained a serving a turn
    each time a request woke the loop, and a turn sent a slice for each (4096 batches)."""
    if pub._replay_turn is None:
        pub._serve_replays()


def _answer(sock: zmq.Socket[bytes], pub: EventPublisher, peer: bytes, asked: tuple[int, int],
            budget: int) -> tuple[int, bool | None, tuple[int, int]]:
    """``_answering``'s answer from ``pub``'s ring; one that fails (a bug) is cut, the
    others still served.

    Each batch goes out as one message kept beside the ring (``EventPublisher.frames``,
    made at its first answer) that every answer shares: sent by reference as bytes,
    pyzmq copies a payload under 64 KiB all the same (its copy threshold), and peers
    that asked for the ring again and again without reading held a copy of it each time
    in their queues (300 peers asking 20 times for a ring of 0.6 MB: 3.6 GiB resident)."""
    try:
        return _answering(sock, pub.ring, pub.frames, pub.seq, peer, asked, budget)
    except Exception:
        log.exception("answering a replay request failed")
        return 0, False, asked


def _answering(sock: zmq.Socket[bytes], ring: deque[tuple[int, bytes]],
               frames: dict[int, zmq.Frame], seq: int, peer: bytes, asked: tuple[int, int],
               budget: int) -> tuple[int, bool | None, tuple[int, int]]:
    """Send ``peer`` up to ``budget`` batches of the ring from ``asked`` (the first and
    last sequence numbers left), with the end marker once all are sent; how many went,
    whether the answer ended (True sent whole, False cut: the peer's queue was full, or
    it left; None: more to send) and what is left of it."""
    first, last = asked
    oldest = ring[0][0] if ring else seq  # (numbers are consecutive with a replay socket)
    at = max(first - oldest, 0)  # (batches that left the ring before their turn: skipped)
    left = max(min(last - oldest + 1, len(ring)) - at, 0)
    take = min(left, budget)
    try:  # (once its first frame is taken, ZeroMQ takes the whole message)
        for number, payload in itertools.islice(ring, at, at + take):
            _send(sock, peer, _MORE)
            _send(sock, b"", _MORE)
            _send(sock, number.to_bytes(8, "big"), _MORE)
            frame = frames.get(number) or frames.setdefault(number, zmq.Frame(payload,
                                                                             copy=False))
            _send(sock, frame, _NOBLOCK, False)  # by reference
        if take < left:
            return take, None, (oldest + at + take, last)
        _send(sock, peer, _MORE)
        _send(sock, b"", _MORE)
        _send(sock, END_SEQ, _MORE)
        _send(sock, b"", _NOBLOCK)
    except zmq.ZMQError:  # full (Again), or gone: the rest of it is cut
        return take, False, asked
    return take, True, asked


def _readable(sock: zmq.Socket[bytes]) -> bool:
    events: int = sock.getsockopt(_EVENTS)  # type: ignore[assignment]
    return bool(events & _POLLIN)


def _bind(sock: zmq.Socket[bytes], endpoint: str, setting: str) -> None:
    """Bind ``endpoint`` (the value of ``setting``) after ``_check_ipc``; ConfigError
    (``bind_error``) when it cannot be bound (in use, say).  An ipc socket that answers
    is another daemon's stream: ZeroMQ would take its path over (a second start that
    failed later left the first daemon's stream with no new subscriber)."""
    _check_ipc(endpoint)
    check_tcp_port(setting, endpoint)
    if endpoint.startswith("ipc://") and socket_alive(endpoint):
        raise ConfigError(f"{setting}: another daemon is serving {endpoint}")
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise bind_error(setting, endpoint, exc) from None


def _check_ipc(endpoint: str) -> None:
    """An ipc endpoint's directory is no other user's to change (``check_socket_directory``:
    a subscriber's ticket and the stream itself go through it)."""
    if endpoint.startswith("ipc://") and not endpoint.startswith(("ipc://@", "ipc://*")):
        check_socket_directory(Path(endpoint[len("ipc://"):]).parent)
