"""The connector pipeline, with no engine imports: saves that never block a step, and
one daemon call for a step's loads.

- ``SaveSender``: a thread of its own, with a daemon link of its own, that stores the
  blocks an engine step copied out of its pages (``EnginePages.stage``), or copies them
  out itself, straight into the daemon's slots (``InPages``: pages in host memory that
  the engine keeps unwritten until the job is done): one reserve and one commit per
  job, no lookup (the caller knows what the store lacks).  A job submitted
  ``after_step`` waits for ``go`` (the engine's next step), or ``HOLD_S`` from its submit
  at most (each job its own deadline), so that its Python does not contend for the
  interpreter with the rest of the step that produced it (on an engine's host cores,
  its first token).  ``submit``
  never waits for the daemon: a job that does not fit the bounded queue, or meets a
  daemon that is gone, is dropped and counted (a later cache miss).  Jobs carry a tag
  (the engine's request id); ``take_finished`` names the tags whose jobs are all done,
  which is when an engine may let their pages go.
- ``StepLoads``: the loads of one engine step, all namespaces and requests together:
  one acquire per namespace for every request's keys (a lookup and acquire per request
  only when a block went missing in between), then the copies into the engine's pages,
  all layers at once (``copy_all``) or layer by layer (``start_layers`` / ``wait_layer``:
  on the CPU a thread copies the layers in order while the model computes the first
  ones); on the CPU ``start`` pins and copies on a thread from when the acquires go
  out, so that the copies overlap whatever the engine does before its forward pass.
  ``finish`` releases the pins once every copy is done.  That thread is the caller's
  ``copier`` where it hands one (a thread kept across steps): a thread started per
  step had the step wait for it to run, 0.2-1.8 ms a step on a loaded 2-core host.
- ``LoadWorth``: which cached blocks are worth loading rather than recomputing;
  ``LoadRates`` (in ``daemon_link``) keeps its per-tier rates to the daemon's.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import torch

from kvstore.client import Held, Namespace
from kvstore.errors import KVStoreError, NoSessionError, NotFoundError, UnavailableError
from kvstore.identity import Identity
from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings
from kvstore.integrations.engine_side import (
    EnginePages,
    Loaded,
    SplitRows,
    Staged,
    Stored,
    acquire_prefix,
    arena_runs,
    release_all,
    slot_rows,
    store_missing,
)

logger = logging.getLogger(__name__)

MAX_PENDING_BYTES = 1 << 30   # staged bytes a sender holds before it drops new jobs
HOLD_S = 0.05                 # the longest a job submitted ``after_step`` waits for ``go``
PARK_S = 1.0                  # no ``go`` for this long: the saves thread sleeps till a submit


# ========================================================================================
# what is worth loading
# ========================================================================================

LOAD_GBPS = {"gpu": 50.0, "dram": 10.0, "ssd": 1.5, "remote": 1.0}
T = TypeVar("T")


@dataclass(frozen=True)
class LoadWorth:
    """Whether a cached block is worth loading rather than recomputing: its bytes' time
    to load from its tier (``load_gbps``, GB/s per tier) against its tokens' time to
    prefill (``prefill_tokens_per_s``; 0 offers every cached block)."""

    block_bytes: int
    block_tokens: int
    prefill_tokens_per_s: float = 0.0
    load_gbps: tuple[tuple[str, float], ...] = tuple(LOAD_GBPS.items())

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], block_bytes: int,
                   block_tokens: int) -> LoadWorth:
        gbps = dict(LOAD_GBPS)
        configured = extra.get("load_gbps", {})
        if not isinstance(configured, dict):
            raise ValueError(f"load_gbps must map tiers to GB/s, not {configured!r}")
        for tier, value in configured.items():
            if float(value) <= 0:
                raise ValueError(f"load_gbps[{tier!r}] must be positive, not {value!r}")
            gbps[str(tier)] = float(value)
        rate = float(extra.get("prefill_tokens_per_s", 0) or 0)
        if rate < 0:
            raise ValueError(f"prefill_tokens_per_s must be >= 0, not {rate}")
        return cls(block_bytes, block_tokens, rate, tuple(gbps.items()))

    def with_rates(self, bytes_per_s: Mapping[str, float]) -> LoadWorth:
        """These figures with the tiers' rates in ``bytes_per_s`` (the daemon's, bytes
        a second) taking the place of the configured ones; other tiers keep theirs."""
        gbps = dict(self.load_gbps)
        gbps.update((tier, rate / 1e9) for tier, rate in bytes_per_s.items() if rate > 0)
        return replace(self, load_gbps=tuple(gbps.items()))

    def blocks(self, tiers: Sequence[str]) -> int:
        """How many leading blocks of a cached prefix, in ``tiers``, are worth loading."""
        if not self.prefill_tokens_per_s:
            return len(tiers)
        recompute_s = self.block_tokens / self.prefill_tokens_per_s
        gbps = dict(self.load_gbps)
        for i, tier in enumerate(tiers):
            if self.block_bytes / (gbps.get(tier, 1.0) * 1e9) >= recompute_s:
                return i
        return len(tiers)


# ========================================================================================
# saves
# ========================================================================================

def fill_rows(rows: torch.Tensor) -> Callable[[Sequence[memoryview], int], None]:
    """``store_missing``'s ``fill`` for blocks staged as rows (``rows[i]``: key i)."""
    def fill(slots: Sequence[memoryview], first: int) -> None:
        for row, slot in zip(rows[first:], slots):
            torch.frombuffer(slot, dtype=torch.uint8).copy_(row)
    return fill


class InPages(NamedTuple):
    """Blocks still in an engine's pages (in host memory), ``page_ids[i]`` holding block
    i: the sender copies them straight into the daemon's slots, so the engine must not
    write those pages until the job is done (vLLM: the request's blocks stay held until
    ``take_finished`` names it; a preempted request's are waited for, ``wait_for``)."""

    pages: EnginePages
    page_ids: list[int]


def job_bytes(source: Staged | InPages) -> int:
    if isinstance(source, InPages):
        return len(source.page_ids) * source.pages.block_bytes
    return source.rows.numel()


def _fill_from_pages(source: InPages, slots: Sequence[memoryview], first: int) -> None:
    source.pages.copy_into(source.page_ids[first:first + len(slots)], slot_rows(slots))


class SaveJob(NamedTuple):
    """Blocks to store: ``keys[i]`` is block i of ``source`` (copied out of the engine's
    pages, ``Staged``, or still in them, ``InPages``); ``parent`` the key before
    ``keys[0]`` (None: the chain's root); the namespace opened under ``ns_key`` from
    ``identity()``; ``tag`` the request they belong to."""

    tag: str
    ns_key: Hashable
    identity: Callable[[], Identity]
    keys: list[bytes]
    parent: bytes | None
    source: Staged | InPages


class _Held(NamedTuple):
    """A job submitted ``after_step``: held until ``go`` is called more than ``step``
    times, or until ``deadline`` (``time.monotonic``)."""

    step: int
    deadline: float


class _Queued(NamedTuple):
    number: int
    job: SaveJob
    held: _Held | None


class _GivenUp(Exception):
    """A job given up (``SaveSender.give_up``) while it copied: its slots are aborted."""


class SaveSender:
    """Stores ``SaveJob``s on a thread of its own (see the module doc).  ``stats`` counts
    ``saves``, ``saved_blocks`` (new in the store), ``save_failures`` and
    ``save_dropped`` (jobs not sent: queue full, daemon backing off, given up, or the
    thread gone)."""

    def __init__(self, settings: DaemonSettings, *,
                 max_pending_bytes: int = MAX_PENDING_BYTES, hold_s: float = HOLD_S) -> None:
        self._link = DaemonLink(settings)
        self._hold_s = hold_s
        self._steps = 0  # ``go`` calls so far: a job held for the step after its own
        self._stepped = threading.Condition(threading.Lock())
        self._max_pending = max_pending_bytes
        self._queue: queue.Queue[_Queued | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending_bytes = 0
        self._pending: dict[str, int] = defaultdict(int)  # tag -> jobs not done
        self._finished: set[str] = set()                   # tags with every job done
        self._submitted = 0                    # jobs submitted: the next one's number
        # held jobs the thread has not been woken for: it takes them at ``go`` or their
        # deadline (it looks every hold while steps go on), never woken in the step that
        # submits them (a wake cost that step ~20 us); when parked, a submit wakes it
        self._deferred: list[_Queued] = []
        self._parked = True
        self._last_go = -PARK_S
        self._given_up: dict[str, int] = {}    # tag -> its jobs numbered below are given up
        self._stopped = False                  # the thread ended: every job is dropped
        self.stats: dict[str, int] = dict.fromkeys(
            ("saves", "saved_blocks", "save_failures", "save_dropped"), 0)
        self._thread = threading.Thread(target=self._run, name="kvstore-saves", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob, *, after_step: bool = False) -> bool:
        """Queue a job (False: dropped, and its tag counts it done); ``after_step``: the
        thread starts it at the next ``go``, or ``hold_s`` from now at the latest (each
        job its own deadline, however many are held)."""
        size = job_bytes(job.source)
        held = None
        if after_step:  # the step it waits to follow; a job that goes at once has none
            with self._stepped:
                held = _Held(self._steps, time.monotonic() + self._hold_s)
        with self._lock:
            self._finished.discard(job.tag)
            self._pending[job.tag] += 1
            if (self._stopped or self._pending_bytes + size > self._max_pending
                    or not self._link.available()):
                self.stats["save_dropped"] += 1
                self._done(job.tag)
                return False
            self._pending_bytes += size
            item = _Queued(self._submitted, job, held)
            if held is not None and not self._parked:
                self._deferred.append(item)
            else:
                self._queue.put(item)
            self._submitted += 1
        return True

    def go(self) -> None:
        """Let the jobs submitted ``after_step`` so far start."""
        with self._stepped:
            self._steps += 1
            self._stepped.notify_all()
        with self._lock:
            deferred, self._deferred = self._deferred, []
            self._last_go = time.monotonic()
        for item in deferred:
            self._queue.put(item)

    def pending(self, tag: str) -> int:
        with self._lock:
            return self._pending.get(tag, 0)

    def take_finished(self, tags: set[str] | None = None) -> set[str]:
        """The tags (of ``tags``, or any) whose jobs are all done, forgotten hereafter."""
        with self._lock:
            done = set(self._finished) if tags is None else self._finished & tags
            self._finished -= done
            return done

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job is done (False: ``timeout`` seconds passed)."""
        self.go()
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def wait_for(self, tags: set[str], timeout: float | None) -> bool:
        """Wait until every job of ``tags`` is done (False: ``timeout`` seconds passed;
        None: no limit)."""
        self.go()
        with self._idle:
            return self._idle.wait_for(lambda: not tags & self._pending.keys(), timeout)

    def give_up(self, tags: set[str]) -> None:
        """Give up the jobs of ``tags`` submitted so far: once this returns, none of them
        stores what it reads of its pages (none starts a copy; one copying now has its
        copy thrown away, its slots aborted, never committed), so the engine may write
        them; each is a dropped save, its tag finished as it ends.  Jobs submitted later
        go as usual."""
        with self._lock:
            for tag in tags & self._pending.keys():
                self._given_up[tag] = self._submitted

    def _is_given_up(self, number: int, tag: str) -> bool:
        with self._lock:
            return number < self._given_up.get(tag, 0)

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued jobs (for at most ``timeout`` seconds), then stop."""
        self.drain(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        self._link.close()

    def _done(self, tag: str) -> None:  # under the lock
        self._pending[tag] -= 1
        if self._pending[tag] <= 0:
            del self._pending[tag]
            self._given_up.pop(tag, None)
            self._finished.add(tag)
            self._idle.notify_all()  # drain and wait_for

    def _run(self) -> None:
        try:
            while (queued := self._next()) is not None:
                number, job, held = queued
                if held is not None:
                    self._hold(held)
                created, outcome = 0, "save_failures"
                try:
                    created, outcome = self._store(number, job)
                except Exception:  # a bug must not stop the thread: the save is a miss
                    logger.exception("kvstore: a background save failed")
                finally:  # what ends the thread too (below) ends its job first
                    self._end(job, created, outcome)
        except BaseException:
            logger.exception("kvstore: the background saves stopped; saves are dropped")
            self._stop()
            raise

    def _next(self) -> _Queued | None:
        """The next job queued, or deferred past its deadline (see ``_deferred``)."""
        while True:
            with self._lock:
                now = time.monotonic()
                due = [q for q in self._deferred if q.held and q.held.deadline <= now]
                self._deferred = [q for q in self._deferred if q not in due]
                for item in due:
                    self._queue.put(item)
                wait = min([q.held.deadline - now for q in self._deferred if q.held]
                           + [self._hold_s])
                self._parked = not self._deferred and now - self._last_go > PARK_S
            try:
                return self._queue.get(timeout=None if self._parked else wait)
            except queue.Empty:
                continue

    def _hold(self, held: _Held) -> None:
        """Wait for the step after the job's (a ``go``), or for its deadline."""
        with self._stepped:
            while self._steps == held.step:
                left = held.deadline - time.monotonic()
                if left <= 0:
                    return
                self._stepped.wait(left)

    def _end(self, job: SaveJob, created: int, outcome: str) -> None:
        with self._lock:
            self._pending_bytes -= job_bytes(job.source)
            self.stats["saves"] += outcome != "save_dropped"
            self.stats["saved_blocks"] += created
            if outcome:
                self.stats[outcome] += 1
            self._done(job.tag)

    def _stop(self) -> None:
        """The thread is ending: every job still queued is dropped (its tag finished,
        so that no engine waits for it), and so is every job submitted from now on."""
        with self._lock:
            self._stopped = True
            for deferred in self._deferred:
                self._queue.put(deferred)
            self._deferred = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self._pending_bytes -= job_bytes(item.job.source)
                    self.stats["save_dropped"] += 1
                    self._done(item.job.tag)

    def _store(self, number: int, job: SaveJob) -> tuple[int, str]:
        """Store a job: blocks created, and the stat it counts in ("" for a save)."""
        source = job.source
        fill: Callable[[Sequence[memoryview], int], None]
        if isinstance(source, InPages):
            if self._is_given_up(number, job.tag):
                return 0, "save_dropped"
            fill = functools.partial(self._fill_from_pages, number, job.tag, source)
        else:
            if source.ready is not None:
                source.ready()
            fill = fill_rows(source.rows)
        try:
            stored = self._store_in(job, fill)
            if stored is not None and isinstance(stored.error, NoSessionError):
                # the daemon restarted since this link's last call: the first call finds
                # no session.  The link connects again, and the save goes once more (the
                # pages are still held), rather than be lost.
                self._link.failed(f"save for {job.tag}", stored.error)
                stored = self._store_in(job, fill)
        except _GivenUp:  # the reservation aborted: the copy may have met new writes
            return 0, "save_dropped"
        if stored is None:
            return 0, "save_failures"
        if stored.error is not None:
            self._link.failed(f"save for {job.tag}", stored.error)
            return stored.created, "save_failures"
        return stored.created, ""

    def _store_in(self, job: SaveJob,
                  fill: Callable[[Sequence[memoryview], int], None]) -> Stored | None:
        """Store a job's blocks in its namespace (None: it cannot be opened)."""
        ns = self._link.namespace(job.ns_key, job.identity)
        if ns is None:
            return None
        return store_missing(ns, job.keys, fill, parent=job.parent, lookup=False)

    def _fill_from_pages(self, number: int, tag: str, source: InPages,
                         slots: Sequence[memoryview], first: int) -> None:
        if self._is_given_up(number, tag):  # given up while the slots were reserved
            raise _GivenUp(tag)
        _fill_from_pages(source, slots, first)
        if self._is_given_up(number, tag):  # or while copying: the copy is thrown away
            raise _GivenUp(tag)

    def __repr__(self) -> str:
        return f"SaveSender({self._link!r}, pending={dict(self._pending)}, stats={self.stats})"


# ========================================================================================
# loads
# ========================================================================================

class LoadItem(NamedTuple):
    """One request's blocks to load: ``keys[i]`` into page ``page_ids[i]``."""

    tag: str
    keys: list[bytes]
    page_ids: list[int]


@dataclass
class _Pinned:
    """One namespace's share of a step's loads, once pinned: the blocks at byte
    ``offsets`` of the namespace's arena go to pages ``page_ids``."""

    pages: EnginePages
    arena: torch.Tensor | None = None   # the arena, as a 1-D uint8 tensor
    pins: list[Held] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    _split: list[SplitRows] | None = None

    def take(self, held: Held, page_ids: Sequence[int]) -> int:
        """Hold a pin whose blocks go to ``page_ids`` (the leading ones: as many as it
        pinned); how many."""
        self.pins.append(held)
        self.add(held, held.offsets, page_ids)
        return len(held.offsets)

    def add(self, held: Held, offsets: Sequence[int], page_ids: Sequence[int]) -> None:
        if self.arena is None and offsets:
            self.arena = _arena(held)
        self.offsets.extend(offsets)
        self.page_ids.extend(page_ids[:len(offsets)])

    def split(self) -> list[SplitRows]:
        """The blocks' runs in the arena split per target: worked out once, whatever
        the layers copied."""
        if self._split is None:
            self._split = ([] if self.arena is None else self.pages.split(arena_runs(
                self.arena, self.offsets, self.page_ids, self.pages.block_bytes)))
        return self._split

    def copy(self, groups: Sequence[int] | None) -> None:
        """Copy the blocks into their pages: every layer group, or just ``groups``."""
        if self.arena is None:
            return
        if self.pages.device.type != "cuda":
            self.pages.scatter_split(self.split(), groups)
            return
        size = self.pages.block_bytes
        rows = [self.arena.narrow(0, offset, size) for offset in self.offsets]
        self.pages.scatter_rows(rows, self.page_ids, groups)


def _arena(held: Held) -> torch.Tensor:
    """The pinned blocks' arena as one uint8 tensor (so that blocks side by side in it
    copy as one run).  Writable, because torch cannot alias read-only memory; nothing
    writes to it."""
    ns = held.ns
    return torch.frombuffer(ns.client._arena_view(ns.arena), dtype=torch.uint8)


def _raise(exc: KVStoreError) -> Held:
    raise exc


def wait_all(waits: Sequence[Callable[[], T]],
             undo: Callable[[T], object] | None = None) -> list[T]:
    """Every reply waited for (a daemon that is gone ends it), then the first error,
    after ``undo`` of each result already had (the pins of a batch that failed in part
    released: all or none)."""
    results: list[T] = []
    error: KVStoreError | None = None
    for wait in waits:
        try:
            results.append(wait())
        except UnavailableError as exc:  # the daemon is gone: no other reply comes
            error = error or exc
            break
        except KVStoreError as exc:
            error = error or exc
    if error is not None:
        if undo is not None:
            for result in results:
                undo(result)
        raise error
    return results


class StepLoads:
    """The loads of one engine step (see the module doc).  ``add`` the items of each
    namespace, ``pin`` them (the daemon calls), copy, ``finish``.  The copies on a
    thread run on ``copier``'s (one thread, kept across steps), else on a thread
    started for the step."""

    def __init__(self, copier: Executor | None = None) -> None:
        self._todo: list[tuple[Namespace, EnginePages, list[LoadItem]]] = []
        self._pinned: list[_Pinned] = []
        self._copier = copier
        self._job: Callable[[], object] | None = None  # waits for the thread's copies
        self._layer_done: list[threading.Event] = []
        self._layer_error: BaseException | None = None
        self._sent: list[tuple[list[bytes], list[Callable[[], Held]]]] | None = None
        self._pinned_early: threading.Event | None = None  # ``start``: pin() returned
        self._outcome: dict[str, Loaded] = {}
        self.calls = 0   # acquires and lookups sent to the daemon
        self.waited_s = 0.0  # time ``pin`` waited for the daemon's replies

    def add(self, ns: Namespace, pages: EnginePages, items: list[LoadItem]) -> None:
        self._todo.append((ns, pages, items))

    def post(self) -> None:
        """Send every namespace's acquires now, without waiting: ``pin`` waits for the
        replies, so the round trip overlaps whatever the caller does in between.  No
        page is read before ``pin`` returned the pins."""
        if self._sent is not None:
            return
        self._sent = []
        for ns, _, items in self._todo:
            keys = list(dict.fromkeys(k for item in items for k in item.keys))
            per = max(1, ns.client.max_keys)
            waits: list[Callable[[], Held]] = []
            for start in range(0, len(keys), per):
                try:
                    waits.append(ns._send_acquire(keys[start:start + per]))
                except KVStoreError as exc:
                    waits.append(functools.partial(_raise, exc))
                    break
                self.calls += 1
            self._sent.append((keys, waits))

    def start(self) -> bool:
        """Pin and copy every layer on a thread of its own, from now (False: the pages
        are on a GPU, nothing started): ``pinned`` waits for the pins, ``wait_layer``
        for a layer, ``finish`` for all.  The caller leaves the namespaces' clients
        alone until ``pinned`` returned."""
        if self._job is not None or any(p.device.type == "cuda" for _, p, _ in self._todo):
            return False
        self.post()
        count = max((len(p.layer_targets()) for _, p, _ in self._todo), default=0)
        self._layer_done = [threading.Event() for _ in range(count)]
        self._pinned_early = threading.Event()
        self._job = self._on_thread(self._pin_and_copy)
        return True

    def _on_thread(self, work: Callable[[], None]) -> Callable[[], object]:
        """Run ``work`` on the copier's thread (or one of its own): the call that waits
        for it to end."""
        if self._copier is not None:
            return self._copier.submit(work).result
        thread = threading.Thread(target=work, name="kvstore-loads", daemon=True)
        thread.start()
        return thread.join

    def _pin_and_copy(self) -> None:
        assert self._pinned_early is not None, "started by start()"
        try:
            self._outcome = self.pin()
        except BaseException as exc:  # handed to the waiter, who raises it
            self._layer_error = exc
            for done in self._layer_done:
                done.set()
            return
        finally:
            self._pinned_early.set()
        self._copy_layers()

    @property
    def started(self) -> bool:
        """Whether ``start`` pins and copies every layer on its thread."""
        return self._pinned_early is not None

    def pinned(self) -> dict[str, Loaded]:
        """``pin``'s outcome: waited for where ``start`` pins on its thread."""
        if self._pinned_early is None:
            return self.pin()
        self._pinned_early.wait()
        if self._layer_error is not None:
            raise self._layer_error
        return self._outcome

    def pin(self) -> dict[str, Loaded]:
        """Pin every item's blocks (sending the acquires unless ``post`` did): per tag,
        the leading blocks pinned (the rest must be recomputed) and the daemon's error,
        if any."""
        self.post()
        sent, self._sent = self._sent or [], []
        outcome: dict[str, Loaded] = {}
        for (ns, pages, items), (keys, waits) in zip(self._todo, sent):
            pinned = _Pinned(pages)
            self._pinned.append(pinned)
            started = time.perf_counter()
            try:
                held = wait_all(waits, Held.release)
            except NotFoundError:  # evicted since the lookup: each request on its own
                self._pin_each(ns, items, pinned, outcome)
                continue
            except KVStoreError as exc:
                outcome.update((item.tag, Loaded(0, exc)) for item in items)
                continue
            finally:
                self.waited_s += time.perf_counter() - started
            pinned.pins.extend(held)
            offsets = dict(zip(keys, (o for h in held for o in h.offsets)))
            for item in items:
                if held:
                    pinned.add(held[0], [offsets[k] for k in item.keys], item.page_ids)
                outcome[item.tag] = Loaded(len(item.keys))
        return outcome

    def _pin_each(self, ns: Namespace, items: list[LoadItem], pinned: _Pinned,
                  outcome: dict[str, Loaded]) -> None:
        for item in items:
            try:
                self.calls += 2
                # (in acquires of at most ``max_keys``: more were refused whole)
                parts = acquire_prefix(ns, item.keys)
            except KVStoreError as exc:
                outcome[item.tag] = Loaded(0, exc)
                continue
            outcome[item.tag] = Loaded(sum(pinned.take(held, item.page_ids[start:])
                                           for start, held in parts))

    def copy_all(self) -> None:
        """Copy every pinned block into its page, all layers."""
        for p in self._pinned:
            p.copy(None)

    def layers(self) -> int:
        return max((len(p.pages.layer_targets()) for p in self._pinned), default=0)

    def start_layers(self) -> None:
        """Start copying layer by layer (on a thread where the pages are on the CPU;
        queued in ``wait_layer`` on a GPU, ahead of the layer's attention)."""
        if self._job is not None:  # ``start``ed: copying already
            return
        count = self.layers()
        self._layer_done = [threading.Event() for _ in range(count)]
        if any(p.pages.device.type == "cuda" for p in self._pinned):
            return
        self._job = self._on_thread(self._copy_layers)

    def _copy_layers(self) -> None:
        try:
            for layer, done in enumerate(self._layer_done):
                self._copy_layer(layer)
                done.set()
        except BaseException as exc:  # handed to the waiter, who raises it
            self._layer_error = exc
            for done in self._layer_done:
                done.set()

    def _copy_layer(self, layer: int) -> None:
        for p in self._pinned:
            if layer < len(p.pages.layer_targets()):
                p.copy([layer])

    def wait_layer(self, layer: int) -> None:
        """Return once layer ``layer`` is in the pages (or queued before its use)."""
        if layer >= len(self._layer_done):
            return
        done = self._layer_done[layer]
        if self._job is None:
            if not done.is_set():
                self._copy_layer(layer)
                done.set()
            return
        done.wait()
        if self._layer_error is not None:
            raise self._layer_error

    def finish(self) -> None:
        """Make sure every copy is done, then release the pins (those of acquires
        posted and never waited for too)."""
        try:
            self.settle()
        finally:
            self.release()

    def settle(self) -> None:
        """Return once every copy is done (the pages hold the blocks): the pins may go
        from then on, ``release``, at a time the caller finds cheaper."""
        if self._job is not None:
            job, self._job = self._job, None
            job()
            if self._layer_error is not None:  # no page may be read as loaded
                raise self._layer_error
        elif self._sent:
            self.pin()
        for layer in range(len(self._layer_done)):  # a thread's are done by now
            self.wait_layer(layer)
        if any(p.pages.device.type == "cuda" for p in self._pinned):
            torch.cuda.current_stream().synchronize()

    def release(self) -> None:
        """Release the pins (posted: no round trip); only once the copies are done
        (``settle``), or will never be made."""
        release_all(held for p in self._pinned for held in p.pins)
        self._pinned = []
        self._todo = []


class SettledLoads:
    """A step's loads whose copies are done, their pins kept to be released later (at
    the next step's start: not in the step whose output, a first token, they would
    delay).  Posted releases cost no round trip, but their Python does."""

    def __init__(self) -> None:
        self._loads: StepLoads | None = None

    def settle(self, loads: StepLoads) -> None:
        """Wait for ``loads``'s copies (an error releases its pins at once and is
        raised); the pins of the loads settled before go now."""
        try:
            loads.settle()
        except BaseException:
            loads.release()
            raise
        self.release()
        self._loads = loads

    def release(self) -> bool:
        """Release the pins kept, if any (whether there were)."""
        loads, self._loads = self._loads, None
        if loads is None:
            return False
        loads.release()
        return True
