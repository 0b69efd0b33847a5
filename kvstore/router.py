"""Cache-aware routing: ask several daemons at once where a request's prefix is cached.

``Router`` holds one connection per daemon (one per worker or host).  ``route(keys)``
sends each a ``probe`` of the request's key chain in parallel and waits until all have
answered or the deadline passed: a daemon that has not answered by then is ranked last
and never waited on (its late answer is dropped); so is one that refused the router's
hello, which is not greeted again until a back-off that doubles with each refusal in a
row has passed (its refusal reported at once meanwhile, with no hello and no probe), and
one that takes no message from the router (its handshake refused, or ``PROBES_QUEUED``
messages queued toward it untaken: down or stopped).  A probe the daemon refuses (too
many keys, a rate limit) ranks it last for that route only.  A router's
credentials are its own: new ones are a new ``Router``, which greets every daemon at once.
Each answer gives the longest cached prefix per tier, the daemon's wait ahead of a new
transfer and its load bandwidth per tier, from which the router estimates the cost of
serving the request there:

    C = queue + prefill(P - H) + transfer(X)

with ``P`` the request's tokens, ``H`` the cached prefix's tokens, ``prefill(n)`` the
time to compute ``n`` tokens at the configured prefill rate, and ``transfer(X)`` the
time to load the cached blocks ``X`` from their tiers.  The cheapest comes first.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgspec
import zmq

from kvstore import protocol as p
from kvstore.client_wire import CurveKeys, _tenant, _token, make_socket
from kvstore.errors import (
    LeaseExpiredError,
    MalformedError,
    NoSessionError,
    UnavailableError,
    error_from_code,
)
from kvstore.tiers.arena_fds import tcp_credentials

DEFAULT_PREFILL_RATE = 10_000.0  # tokens a second a worker prefills, unless told
REFUSED_S = 1.0       # no hello to a daemon for this long after it refused one,
REFUSED_MAX_S = 60.0  # doubled with each refusal in a row, up to this
HELLO_WAIT_S = 3.0    # a hello unanswered this long is lost: the peer connects again
_READS_A_POLL = 64  # messages read of one peer between the deadline's checks
_STOPPING = UnavailableError.code  # what a daemon stopping answers every request
# the refusals that say the connection has no session there (or will not, stopping)
_NO_SESSION = (NoSessionError, LeaseExpiredError, UnavailableError)
# Messages queued toward one daemon that has not taken them (down, stopped, or slow):
# past it a probe is not sent and the daemon ranks last.  Unbounded, 3000 routes to a
# daemon that was down held 210 MiB, delivered whole once it was back.
PROBES_QUEUED = 16
# Routers a client keeps, one per set of endpoints, the least recently used closed past
# it (each a ZeroMQ context, its thread, and a session at every daemon: 232 sets of
# endpoints held 464 threads and 13.7k descriptors)
ROUTERS_KEPT = 8


@dataclass
class RouteResult:
    """One daemon's answer (or silence), and the estimated cost of sending it there."""

    endpoint: str
    answered: bool
    hits: int = 0                         # leading keys cached, in any tier
    tiers: dict[str, int] = field(default_factory=dict)  # of those, how many per tier
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    transfer_seconds: float = 0.0
    cost: float = math.inf                # seconds; inf when it did not answer
    error: str = ""                       # why it did not answer, when it refused

    @property
    def hit_tokens(self) -> int:
        return self.hits


class _Peer:
    """One daemon's connection: its socket, whether its hello came back, the probe
    awaited, and the back-off from its refusals of the hello."""

    def __init__(self, endpoint: str, sock: Any) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.greeted = False
        self.hello_rid = 0  # of the hello sent last (0: none awaited)
        self.hello_at = 0.0  # when (the router's clock)
        self.heard = False  # whether the daemon ever answered (it is there, or was)
        self.waiting = 0  # rid of the probe this route waits for (0: none)
        self.refused = ""  # why it gave this route no answer
        self.refusal = ""  # the daemon's refusal of the last hello
        self.refusals = 0  # in a row
        self.backoff_s = 0.0
        self.backoff_until = 0.0  # no hello before (the router's clock)


class Router:
    """Connections to a set of daemons, and routing queries over them."""

    def __init__(self, endpoints: Sequence[str], *, tenant: str | None = None,
                 token: str | None = None, curve: CurveKeys | None = None,
                 prefill_rate: float = DEFAULT_PREFILL_RATE,
                 refused_s: tuple[float, float] = (REFUSED_S, REFUSED_MAX_S),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not endpoints:
            raise MalformedError("route: name at least one daemon endpoint")
        if not prefill_rate > 0:
            raise MalformedError("route: prefill_rate must be a positive number of tokens "
                                 "a second")
        self.prefill_rate = prefill_rate
        self._refused_s = refused_s  # the first back-off after a refused hello, the longest
        self._clock = clock
        self._tenant = _tenant(tenant, token)
        self._token = _token(token)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._rids = itertools.count(1)
        # tcp daemons with a token secret check the token in the handshake
        self._peers: list[_Peer] = []
        self._socket: Callable[[str], Any] = lambda e: make_socket(
            self._ctx, e, curve, tcp_credentials(e, self._token, self._tenant,
                                                 curve is not None), send_hwm=PROBES_QUEUED)
        try:
            for e in endpoints:
                self._peers.append(_Peer(e, self._socket(e)))
        except BaseException:  # (an endpoint refused: nothing left open)
            self.close()
            raise
        self._poller = zmq.Poller()
        self._by_sock: dict[Any, _Peer] = {}
        for peer in self._peers:
            self._poller.register(peer.sock, zmq.POLLIN)
            self._by_sock[peer.sock] = peer
            self._hello(peer)

    def _hello(self, peer: _Peer) -> None:
        rid = next(self._rids)
        if _send(peer.sock, p.encoder.encode(
                p.Hello(rid, p.PROTOCOL_VERSION, self._tenant, self._token))):
            peer.hello_rid, peer.hello_at = rid, self._clock()

    def _connect_again(self, peer: _Peer) -> None:
        """A new connection for a peer whose hello went unanswered: lost (sent as the
        daemon stopped), or dropped (a daemon started again drops a sessionless peer's
        messages past the first few, and the probes queued while it was down were
        those): before, the router waited for it for good, the daemon never answering."""
        self._poller.unregister(peer.sock)
        del self._by_sock[peer.sock]
        peer.sock.close(linger=0)
        peer.sock = self._socket(peer.endpoint)
        self._poller.register(peer.sock, zmq.POLLIN)
        self._by_sock[peer.sock] = peer
        peer.greeted, peer.hello_rid = False, 0

    def _refuse(self, peer: _Peer, refusal: str) -> None:
        """Back off from a daemon that refused the hello: twice the last back-off after
        a refusal in a row, the first one else."""
        first, longest = self._refused_s
        peer.backoff_s = min(longest, peer.backoff_s * 2) if peer.refusals else first
        peer.refusals += 1
        peer.refusal = refusal
        peer.backoff_until = self._clock() + peer.backoff_s

    def _backing_off(self, peer: _Peer, now: float) -> str:
        """Why the peer is not asked now (a refusal it is backing off from), or ""."""
        if not peer.refusals or now >= peer.backoff_until:
            return ""
        return (f"{peer.refusal} (refused {peer.refusals} time(s) in a row; not greeted "
                f"again for {peer.backoff_until - now:.1f}s)")

    def route(self, keys: Sequence[bytes], *, deadline: float = 0.05,
              tokens: int | None = None, block_tokens: int | None = None,
              prefill_rate: float | None = None) -> list[RouteResult]:
        """Every daemon's answer for the key chain, cheapest first; those that did not
        answer within ``deadline`` seconds last.  ``tokens`` is the request's length
        (default: the keys' blocks, full), ``block_tokens`` the tokens of a block
        (default: as the daemons that cache the chain say)."""
        keys, rate = checked(keys, self.prefill_rate if prefill_rate is None else prefill_rate)
        return rank(self.answers(keys, deadline=deadline), len(keys), tokens,
                    block_tokens, rate)

    def answers(self, keys: list[bytes], *, deadline: float = 0.05
                ) -> list[tuple[str, p.ProbeReply | None, str]]:
        """Each daemon's probe of the chain, asked of all at once: (endpoint, its answer,
        or None and why there is none within ``deadline`` seconds), in their order."""
        answers: dict[str, p.ProbeReply] = {}
        # One probe, encoded once, to every daemon (each on its own connection: one
        # request id serves them all), all sent before any answer is awaited.
        rid = next(self._rids)
        probe = p.encoder.encode(p.Probe(rid, keys))
        now = self._clock()
        pending = 0
        for peer in self._peers:
            peer.waiting = 0
            peer.refused = self._backing_off(peer, now)
            if peer.refused:
                continue  # no hello, no probe: ranked last, not waited on
            if peer.heard and peer.hello_rid and now - peer.hello_at > HELLO_WAIT_S:
                self._connect_again(peer)
            if not peer.greeted and not peer.hello_rid:
                self._hello(peer)
            # the daemon serves a connection's requests in order: no wait for the hello
            if not _send(peer.sock, probe):
                peer.refused = ("takes no message (down or stopped, with its queue full, or "
                                "its handshake refused this router)")
                continue
            peer.waiting = rid
            pending += 1
        end = time.monotonic() + deadline
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            for sock, _ in self._poller.poll(math.ceil(left * 1000)):
                pending -= self._read(self._by_sock[sock], answers)
        return [(peer.endpoint, answers.get(peer.endpoint),
                 peer.refused or "no answer within the deadline") for peer in self._peers]

    def _read(self, peer: _Peer, answers: dict[str, p.ProbeReply]) -> int:
        """Read what the peer sent, at most ``_READS_A_POLL`` messages (the rest after
        the next poll: a peer sending without pause held the route past its deadline);
        1 when its awaited probe's answer (or refusal) came."""
        done = 0
        for _ in range(_READS_A_POLL):
            try:
                frames = peer.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return done
            try:
                reply = p.reply_decoder.decode(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError,
                    IndexError):
                continue  # a peer that is not a kvstore daemon (its answer too deep, too)
            peer.heard = True
            if reply.rid == peer.hello_rid:
                peer.hello_rid = 0
                peer.greeted = isinstance(reply, p.HelloReply)
                if peer.greeted:
                    peer.refusals = 0
                elif isinstance(reply, p.ErrorReply) and reply.code == _STOPPING:
                    # a daemon stopping refuses every request: no refusal of this router
                    # (backed off from, it was ranked last long after it came back)
                    peer.refused = f"{reply.code}: {reply.message}"
                elif isinstance(reply, p.ErrorReply):
                    self._refuse(peer, f"{reply.code}: {reply.message}")
                    if peer.waiting:
                        peer.refused = peer.refusal
                continue
            if (isinstance(reply, p.ErrorReply) and not peer.hello_rid
                    and isinstance(error_from_code(reply.code, reply.message), _NO_SESSION)):
                peer.greeted = False  # (a late probe's too: this connection has none there)
            if reply.rid != peer.waiting:
                continue  # a probe's answer that came after its deadline
            peer.waiting = 0
            done = 1
            if isinstance(reply, p.ProbeReply):
                answers[peer.endpoint] = reply
            elif isinstance(reply, p.ErrorReply):
                peer.refused = peer.refused or f"{reply.code}: {reply.message}"
                # no session there (the daemon restarted, or the lease ran out): greet
                # again, at the next query (unless backing off from a refused hello); a
                # hello of ours would have been answered before this.  Any other refusal
                # (a chain too long, a rate limit) is this probe's alone: a hello on a
                # connection that has its session was refused, and backed off from,
                # so one refused probe left the daemon ranked last for good
                if isinstance(error_from_code(reply.code, reply.message), _NO_SESSION):
                    peer.greeted, peer.hello_rid = False, 0  # (stopping: its session goes)
        return done

    @property
    def closed(self) -> bool:
        return self._ctx.closed

    def close(self) -> None:
        if self._ctx.closed:
            return
        for peer in self._peers:
            peer.sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def checked(keys: Sequence[bytes], rate: float) -> tuple[list[bytes], float]:
    """A route's key chain and prefill rate, or MalformedError saying what is wrong."""
    if not rate > 0:
        raise MalformedError("route: prefill_rate must be a positive number of tokens "
                             "a second")
    keys = list(keys)
    if not keys:
        raise MalformedError("route: the key chain is empty")
    if set(map(len, keys)) != {p.KEY_BYTES}:
        raise MalformedError(f"route: keys are {p.KEY_BYTES} bytes each")
    return keys, rate


def rank(answers: Sequence[tuple[str, p.ProbeReply | None, str]], blocks: int,
         tokens: int | None, block_tokens: int | None, rate: float) -> list[RouteResult]:
    """Each daemon's answer to a chain of ``blocks`` keys (endpoint, its probe's answer
    or None, why there is none), costed, cheapest first; those with none last."""
    bt = block_tokens or next((a.block_tokens for _, a, _ in answers
                               if a is not None and a.block_tokens), 1)
    total = tokens if tokens is not None else blocks * bt
    out: list[RouteResult] = []
    for endpoint, a, why in answers:
        if a is None:
            out.append(RouteResult(endpoint, False, error=why))
            continue
        tiers: dict[str, int] = {}
        for tier, count in a.tier_runs:
            tiers[tier] = tiers.get(tier, 0) + count
        hits = sum(tiers.values())
        slowest = min(a.bandwidth.values(), default=1.0) or 1.0
        transfer = sum(n * a.block_bytes / (a.bandwidth.get(t) or slowest)
                       for t, n in tiers.items())
        prefill = max(0, total - hits * bt) / rate
        out.append(RouteResult(endpoint, True, hits, tiers, a.queue_seconds,
                               prefill, transfer, a.queue_seconds + prefill + transfer))
    # (a cost that is not a number, from an answer of NaNs, would leave the others
    # out of order: such a daemon ranks after every cost that is one)
    out.sort(key=lambda r: (not r.answered, r.cost if r.cost == r.cost else math.inf))
    return out


def _send(sock: Any, message: bytes) -> bool:
    """Send without waiting; False when the socket has no connection to queue it on (a
    handshake the daemon refused: a route never waits on it)."""
    try:
        sock.send(message, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


# a token id's text is a few bytes: this holds millions of them, more than any request
MAX_TOKENS_FILE_BYTES = 64 << 20


def read_tokens(path: str) -> list[int]:
    """Token ids from a file: a JSON list, or integers split by spaces, commas or lines
    (``-``: standard input), of ``MAX_TOKENS_FILE_BYTES`` at most.  (Read whole, a file
    such as /dev/zero grew the command's memory until the host killed it.)"""
    import json
    import sys

    from kvstore.errors import ConfigError
    from kvstore.files import read_regular_file

    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_TOKENS_FILE_BYTES + 1)
            if len(raw) > MAX_TOKENS_FILE_BYTES:
                raise MalformedError(f"standard input holds more than {MAX_TOKENS_FILE_BYTES} "
                                     "bytes of token ids")
        else:
            # (a pipe or a terminal is read too, as ``--tokens <(...)`` gives one)
            raw, _ = read_regular_file(path, "--tokens", MAX_TOKENS_FILE_BYTES, streams=True)
        text = raw.decode("utf-8")
    except ConfigError as exc:
        raise MalformedError(f"cannot read token ids: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MalformedError(f"cannot read token ids from {path!r}: {exc}") from None
    try:
        value = json.loads(text) if text.lstrip().startswith("[") else [
            int(t) for t in text.replace(",", " ").split()]
    except (ValueError, RecursionError) as exc:  # (a file of 100k nested lists: the latter)
        raise MalformedError(f"{path!r} holds no list of token ids: {exc}") from None
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise MalformedError(f"{path!r} holds no list of integer token ids")
    return value


def format_routes(results: Sequence[RouteResult], blocks: int) -> str:
    """A table of the answers, cheapest first."""
    lines = [f"{'endpoint':<40} {'cached':>11}  {'per tier':<24} {'cost ms':>9}"]
    for r in results:
        if not r.answered:
            lines.append(f"{r.endpoint:<40} {'-':>11}  {r.error:<24} {'inf':>9}")
            continue
        tiers = " ".join(f"{t}={n}" for t, n in r.tiers.items()) or "-"
        cached = f"{r.hits}/{blocks}"
        lines.append(f"{r.endpoint:<40} {cached:>11}  {tiers:<24} {r.cost * 1e3:>9.3f}")
    return "\n".join(lines)


def route(keys: Sequence[bytes], endpoints: Sequence[str], *, deadline: float = 0.05,
          prefill_rate: float = DEFAULT_PREFILL_RATE, tokens: int | None = None,
          block_tokens: int | None = None, tenant: str | None = None,
          token: str | None = None) -> list[RouteResult]:
    """One routing query over fresh connections (see ``Router`` to keep them)."""
    with Router(endpoints, tenant=tenant, token=token, prefill_rate=prefill_rate) as r:
        # a fresh connection's hello comes first: allow it the deadline as well
        return r.route(keys, deadline=deadline, tokens=tokens, block_tokens=block_tokens)
