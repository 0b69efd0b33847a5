"""The connector pipeline (kvstore.integrations.pipeline) against a real daemon process:
saves on a thread of their own, and one daemon call for a step's loads; CPU torch
tensors stand for an engine's paged cache (the layouts of test_engine_side)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_proc import DaemonProcess
from test_engine_side import KINDS, PAGES, TOKENS, few_keys_daemon, identity, make_pages

from kvstore import AsyncClient, Client
from kvstore.errors import KVStoreError
from kvstore.protocol import ProbeReply
from kvstore.integrations import pipeline
from kvstore.integrations.daemon_link import DaemonLink, DaemonSettings, LoadRates, post_rates
from kvstore.integrations.engine_side import (
    Loaded,
    Rows,
    Stored,
    arena_runs,
    offload_missing,
)
from kvstore.integrations.pipeline import (
    InPages,
    LoadItem,
    LoadWorth,
    SaveJob,
    SaveSender,
    SettledLoads,
    StepLoads,
)
from kvstore.keys import chain_keys


def job(tag: str, kind: str, keys: list[bytes], staged: object,
        parent: bytes | None = None) -> SaveJob:
    return SaveJob(tag, kind, lambda: identity(kind), keys, parent, staged)  # type: ignore[arg-type]


def until(check: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", KINDS)
def test_staged_rows_are_the_canonical_blocks_and_scatter_back(kind: str) -> None:
    source, source_page = make_pages(kind, seed=1)
    staged = source.stage([5, 0, 3])
    assert staged.ready is None  # on the CPU the copy is done on return
    assert [bytes(r.numpy()) for r in staged.rows] == [source_page(p) for p in (5, 0, 3)]
    target, target_page = make_pages(kind, seed=50)
    target.scatter_rows(list(staged.rows), [1, 2, 7])
    assert [target_page(p) for p in (1, 2, 7)] == [source_page(p) for p in (5, 0, 3)]


@pytest.mark.parametrize("kind", ["per_layer", "staged"])
def test_a_save_copies_the_pages_before_submit_returns(daemon: DaemonProcess,
                                                       kind: str) -> None:
    """The pages may be reused as soon as the step ends: what is stored is what they
    held then, even when the daemon answers late (stopped here)."""
    source, source_page = make_pages(kind, seed=1)
    before = [source_page(p) for p in range(3)]
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme", timeout=10.0))
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity(kind))
        keys = ns.keys(range(TOKENS * 3))
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert sender.submit(job("req-1", kind, keys[:2], source.stage([0, 1])))
            assert sender.submit(job("req-1", kind, keys[2:], source.stage([2]), keys[1]))
            assert time.monotonic() - started < 0.5  # never waits for the daemon
            other, _ = make_pages(kind, seed=99)  # the engine reuses the pages at once
            source.scatter_rows(list(other.stage(range(PAGES)).rows), list(range(PAGES)))
            assert source_page(0) != before[0]
            time.sleep(0.3)
            assert sender.pending("req-1") == 2 and sender.take_finished() == set()
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert sender.drain(10)
        assert sender.take_finished({"req-1"}) == {"req-1"}
        assert sender.stats == {"saves": 2, "saved_blocks": 3, "save_failures": 0,
                                "save_dropped": 0}
        assert ns.get(keys) == before
        assert ns.lookup(keys).blocks == 3  # one chain
    sender.close()


@pytest.mark.parametrize("kind", KINDS)
def test_runs_of_pages_copy_as_page_by_page(kind: str) -> None:
    """Rows side by side going to pages side by side move as one run; the result is
    the same bytes as one page at a time (runs broken by a gap in either)."""
    source, source_page = make_pages(kind, seed=1)
    order = [2, 3, 4, 0, 1, 6]
    staged = source.stage(order)
    assert [bytes(r.numpy()) for r in staged.rows] == [source_page(p) for p in order]
    rows = list(staged.rows)
    rows[4] = rows[4].clone()  # not beside its neighbours in memory any more
    target, target_page = make_pages(kind, seed=50)
    untouched = target_page(0)
    target.scatter_rows(rows, [1, 2, 3, 5, 6, 7])
    assert [target_page(p) for p in (1, 2, 3, 5, 6, 7)] == [source_page(p) for p in order]
    assert target_page(0) == untouched


@pytest.mark.parametrize("kind", ["per_layer", "staged"])
def test_a_save_in_pages_is_copied_by_the_sender_and_holds_them_until_done(
        daemon: DaemonProcess, kind: str) -> None:
    """A save of pages still in the engine's cache returns at once; its request is not
    finished (its pages stay held) until the sender copied them into the daemon and
    committed: what is stored is what the pages hold."""
    source, source_page = make_pages(kind, seed=1)
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme", timeout=10.0))
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity(kind))
        keys = ns.keys(range(TOKENS * 4))
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert sender.submit(job("req-1", kind, keys[:3], InPages(source, [5, 6, 7])))
            assert sender.submit(job("req-1", kind, keys[3:], InPages(source, [0]), keys[2]))
            assert time.monotonic() - started < 0.5  # never waits for the daemon
            assert not sender.wait_for({"req-1"}, 0.3)
            assert sender.pending("req-1") == 2 and sender.take_finished() == set()
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert sender.wait_for({"req-1", "other"}, 10)
        assert sender.take_finished({"req-1"}) == {"req-1"}
        assert sender.stats == {"saves": 2, "saved_blocks": 4, "save_failures": 0,
                                "save_dropped": 0}
        assert ns.get(keys) == [source_page(p) for p in (5, 6, 7, 0)]
        assert ns.lookup(keys).blocks == 4  # one chain
    sender.close()


def test_a_save_submitted_after_the_step_starts_at_go_or_once_held_long_enough(
        daemon: DaemonProcess) -> None:
    """Saves handed over at the end of a step wait for the engine's next step (``go``),
    or for the hold at most; waiting for them lets them go."""
    source, source_page = make_pages("per_layer", seed=1)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("per_layer"))
        keys = ns.keys(range(TOKENS * 4))
        sender = SaveSender(DaemonSettings(daemon.endpoint, "acme"), hold_s=60.0)
        assert sender.submit(job("a", "per_layer", keys[:2], InPages(source, [0, 1])),
                             after_step=True)
        until(lambda: sender._queue.empty())  # taken by the thread, which holds it
        time.sleep(0.5)  # far longer than a save of two blocks takes
        assert sender.pending("a") == 1 and ns.lookup(keys).blocks == 0  # held
        sender.go()
        until(lambda: sender.take_finished() == {"a"})
        assert ns.get(keys[:2]) == [source_page(0), source_page(1)]
        assert sender.submit(job("b", "per_layer", keys[2:3], InPages(source, [2]),
                                 keys[1]), after_step=True)
        assert sender.wait_for({"b"}, 10)  # waiting lets it go
        sender.close()
        held = SaveSender(DaemonSettings(daemon.endpoint, "acme"), hold_s=0.1)
        assert held.submit(job("c", "per_layer", keys[3:], InPages(source, [3]), keys[2]),
                           after_step=True)
        until(lambda: held.take_finished() == {"c"})  # no go: the hold ran out
        assert ns.get(keys) == [source_page(p) for p in range(4)]
        held.close()


def test_a_save_held_for_the_next_step_wakes_no_thread_in_the_step_that_submits_it(
        daemon: DaemonProcess) -> None:
    """While steps go on, a save submitted ``after_step`` (in a first token's step)
    wakes the saves thread at the next ``go``, not at its submit (the wake cost that
    step's main thread ~20 us); with no next step it still starts by its deadline, and
    a thread idle since the last step (parked) is woken at once, as before."""
    source, source_page = make_pages("per_layer", seed=3)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("per_layer"))
        keys = ns.keys(range(TOKENS * 3))
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme"), hold_s=0.3)
    puts: list[object] = []
    put = sender._queue.put
    sender._queue.put = lambda item, *a, **k: (puts.append(item), put(item, *a, **k))
    try:
        assert sender.submit(job("a", "per_layer", keys[:1], InPages(source, [0])),
                             after_step=True)
        assert len(puts) == 1  # the thread was idle (parked): woken at once
        sender.go()  # the next step
        until(lambda: sender.take_finished() == {"a"} and not getattr(sender, "_parked", 0))
        assert sender.submit(job("b", "per_layer", keys[1:2], InPages(source, [1]),
                                 keys[0]), after_step=True)
        assert len(puts) == 1  # no wake in the submitting step
        sender.go()
        assert len(puts) == 2
        until(lambda: sender.take_finished() == {"b"})
        assert sender.submit(job("c", "per_layer", keys[2:3], InPages(source, [2]),
                                 keys[1]), after_step=True)
        until(lambda: sender.take_finished() == {"c"})  # no go: its deadline
        with Client(daemon.endpoint, tenant="acme") as client:
            ns = client.namespace(identity("per_layer"))
            assert ns.get(keys) == [source_page(p) for p in range(3)]
    finally:
        sender._queue.put = put  # type: ignore[method-assign]
        sender.close()


def test_each_held_save_has_its_own_deadline_and_go_lets_a_whole_step_go(
        daemon: DaemonProcess) -> None:
    """The hold bounds each job from its own submit, not one after the other; ``go``
    lets go every job submitted before it, even those the next step's jobs queue behind,
    and holds the next step's."""
    source, _ = make_pages("per_layer", seed=1)
    with Client(daemon.endpoint, tenant="acme") as client:
        keys = client.namespace(identity("per_layer")).keys(range(TOKENS * PAGES))
    hold_s, n = 1.0, PAGES
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme"), hold_s=hold_s)
    try:
        started = time.monotonic()
        for i in range(n):  # one step's saves, and no next step
            assert sender.submit(job(f"r{i}", "per_layer", keys[i:i + 1],
                                     InPages(source, [i]), keys[i - 1] if i else None),
                                 after_step=True)
        done: set[str] = set()
        until(lambda: done.update(sender.take_finished()) or len(done) == n)
        assert time.monotonic() - started < n * hold_s / 2  # not one hold after another
    finally:
        sender.close()
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme"), hold_s=60.0)
    try:
        step = [f"s{i}" for i in range(n)]
        for i, tag in enumerate(step):
            assert sender.submit(job(tag, "per_layer", keys[i:i + 1], InPages(source, [i]),
                                     keys[i - 1] if i else None), after_step=True)
        sender.go()  # the next step begins, and ends with a save of its own
        assert sender.submit(job("next", "per_layer", keys[:1], InPages(source, [0])),
                             after_step=True)
        done = set()
        until(lambda: done.update(sender.take_finished()) or done >= set(step))
        time.sleep(0.5)  # far longer than a save of one block takes
        assert sender.pending("next") == 1 and not sender.take_finished()  # held
        sender.go()
        until(lambda: sender.take_finished() == {"next"})
    finally:
        sender.close()


def test_saves_given_up_never_commit_what_their_pages_hold_afterwards(
        daemon: DaemonProcess) -> None:
    """An engine that cannot wait longer (a preempted request's pages to be written)
    gives its saves up: the one copying when it does is aborted, the queued one never
    copies; each is a dropped save, its tag finished; another tag's and a later job of
    the same tag go as usual."""
    source, source_page = make_pages("per_layer", seed=1)
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme", timeout=10.0))
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("per_layer"))
        keys = ns.keys(range(TOKENS * 6))
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            assert sender.submit(job("req-1", "per_layer", keys[:2], InPages(source, [0, 1])))
            assert sender.submit(job("req-1", "per_layer", keys[2:3], InPages(source, [2]),
                                     keys[1]))
            assert sender.submit(job("req-2", "per_layer", keys[4:], InPages(source, [4, 5])))
            assert not sender.wait_for({"req-1"}, 0.3)
            sender.give_up({"req-1"})
            other, _ = make_pages("per_layer", seed=99)  # the engine writes the pages now
            source.scatter_rows(list(other.stage(range(3)).rows), [0, 1, 2])
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert sender.wait_for({"req-1", "req-2"}, 10)
        assert sender.take_finished() == {"req-1", "req-2"}
        assert ns.lookup(keys[:3]).blocks == 0  # nothing of req-1 committed
        assert ns.get(keys[4:]) == [source_page(4), source_page(5)]
        assert sender.stats == {"saves": 1, "saved_blocks": 2, "save_failures": 0,
                                "save_dropped": 2}
        assert sender.submit(job("req-1", "per_layer", keys[:1], InPages(source, [0])))
        assert sender.drain(10) and ns.get(keys[:1]) == [source_page(0)]
    sender.close()


class _Stop(BaseException):
    """What ends a thread (not an Exception)."""


class _StoppingPages:
    """Pages whose copy ends the thread that makes it."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes

    def copy_into(self, page_ids: list[int], rows: list[torch.Tensor]) -> None:
        raise _Stop("the copy ends its thread")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sender_thread_ended_by_a_base_exception_finishes_every_tag(
        daemon: DaemonProcess) -> None:
    """The job under way and the jobs queued behind it are finished (no engine waits
    for their pages for ever), and every later job is dropped at once."""
    source, _ = make_pages("per_layer", seed=1)
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme", timeout=10.0))
    with Client(daemon.endpoint, tenant="acme") as client:
        keys = client.namespace(identity("per_layer")).keys(range(TOKENS * 4))
    stopping = InPages(_StoppingPages(source.block_bytes), [0, 1])  # type: ignore[arg-type]
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert sender.submit(job("a", "per_layer", keys[:2], stopping))
        assert sender.submit(job("b", "per_layer", keys[2:], source.stage([2, 3])))
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert sender.drain(10)
    assert sender.take_finished() == {"a", "b"}
    assert sender.stats == {"saves": 1, "saved_blocks": 0, "save_failures": 1,
                            "save_dropped": 1}
    assert not sender.submit(job("c", "per_layer", keys[2:], source.stage([2, 3])))
    assert sender.take_finished() == {"c"}
    sender.close()


def test_a_tag_is_finished_only_when_all_its_jobs_are(daemon: DaemonProcess) -> None:
    source, _ = make_pages("per_layer", seed=1)
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme"))
    with Client(daemon.endpoint, tenant="acme") as client:
        keys = client.namespace(identity("per_layer")).keys(range(TOKENS * 4))
    assert sender.submit(job("a", "per_layer", keys[:2], source.stage([0, 1])))
    assert sender.drain(10)  # "a" has no job left now...
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)
    try:  # ...until the engine sends another one
        assert sender.submit(job("a", "per_layer", keys[2:], source.stage([2, 3]), keys[1]))
        assert sender.take_finished() == set() and sender.pending("a") == 1
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert sender.drain(10)
    assert sender.take_finished({"b"}) == set()
    assert sender.take_finished({"a", "b"}) == {"a"}
    assert sender.take_finished() == set()  # reported once
    sender.close()


def test_a_full_queue_drops_a_save_and_finishes_its_tag(daemon: DaemonProcess) -> None:
    source, _ = make_pages("per_layer", seed=1)
    staged = source.stage([0, 1])
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme"),
                        max_pending_bytes=staged.rows.numel())
    with Client(daemon.endpoint, tenant="acme") as client:
        keys = client.namespace(identity("per_layer")).keys(range(TOKENS * 4))
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert sender.submit(job("a", "per_layer", keys[:2], staged))
        assert not sender.submit(job("b", "per_layer", keys[2:], source.stage([2, 3])))
        assert sender.take_finished() == {"b"} and sender.stats["save_dropped"] == 1
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert sender.drain(10) and sender.take_finished() == {"a"}
    sender.close()


def _one_save(daemon_factory: Callable[..., DaemonProcess], timeout: float
              ) -> tuple[DaemonProcess, Any, Any, SaveSender, list[bytes]]:
    """A daemon, pages (and their reader), and a sender that saved the first two pages'
    blocks to it ("a")."""
    daemon = daemon_factory()
    source, source_page = make_pages("per_layer", seed=1)
    sender = SaveSender(DaemonSettings(daemon.endpoint, "acme", timeout=timeout))
    with Client(daemon.endpoint, tenant="acme") as client:
        keys = client.namespace(identity("per_layer")).keys(range(TOKENS * 4))
    assert sender.submit(job("a", "per_layer", keys[:2], source.stage([0, 1])))
    assert sender.drain(10) and sender.stats["saved_blocks"] == 2
    return daemon, source, source_page, sender, keys


def test_a_daemon_killed_mid_save_is_a_failed_save_not_a_stall(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, source, _, sender, keys = _one_save(daemon_factory, 0.5)
    daemon.stop(signal.SIGKILL)
    started = time.monotonic()
    sender.submit(job("b", "per_layer", keys[2:], source.stage([2, 3]), keys[1]))
    assert time.monotonic() - started < 0.2
    assert sender.drain(10)
    assert sender.take_finished() == {"a", "b"}
    assert sender.stats["save_failures"] == 1
    # backing off now: the next save is dropped at once
    assert not sender.submit(job("c", "per_layer", keys[2:], source.stage([2, 3])))
    sender.close(timeout=1)


def test_saves_go_on_after_the_daemon_restarts(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon, source, source_page, sender, keys = _one_save(daemon_factory, 2.0)
    daemon.stop(signal.SIGKILL)
    daemon.start()  # on the same endpoint, empty
    assert sender.submit(job("b", "per_layer", keys[:2], source.stage([0, 1])))
    # the old session's "no session": connected again, the save is sent once more
    assert sender.drain(10) and sender.stats["save_failures"] == 0, sender.stats
    assert sender.submit(job("c", "per_layer", keys[:2], source.stage([0, 1])))
    assert sender.drain(10) and sender.take_finished() == {"a", "b", "c"}
    assert sender.stats["saved_blocks"] == 4 and sender.stats["save_failures"] == 0, \
        sender.stats
    sender.close()
    with Client(daemon.endpoint, tenant="acme") as client:
        got = client.namespace(identity("per_layer")).get(keys[:2])
    assert got == [source_page(0), source_page(1)]


def copy(loads: StepLoads, layerwise: bool) -> None:
    """A step's pinned loads copied into the pages, layer by layer or whole."""
    if layerwise:
        loads.start_layers()
        for layer in range(loads.layers()):
            loads.wait_layer(layer)
    else:
        loads.copy_all()


def _stored_requests(daemon: DaemonProcess, kind: str, count: int,
                     ) -> tuple[list[list[bytes]], Callable[[int], bytes]]:
    """``count`` requests sharing a 2-block prefix, each with 2 blocks of its own, stored
    from pages ``[0, 1, 2 + 2i, 3 + 2i]``... of a source cache."""
    source, source_page = make_pages(kind, seed=1)
    requests = []
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity(kind))
        for i in range(count):
            tokens = list(range(TOKENS * 2)) + [1000 * (i + 1) + t for t in range(TOKENS * 2)]
            keys = ns.keys(tokens)
            rows = source.stage([0, 1, 2 + i % 3, 3 + i % 3]).rows
            with ns.reserve(keys) as r:
                for row, slot in zip(rows, r.buffers):
                    torch.frombuffer(slot, dtype=torch.uint8).copy_(row)
                r.commit()
            requests.append(keys)
    return requests, source_page


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("kind", ["per_layer", "staged"])
def test_a_steps_loads_are_one_acquire_whatever_the_requests(
        daemon: DaemonProcess, kind: str, layerwise: bool) -> None:
    requests, source_page = _stored_requests(daemon, kind, 4)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity(kind))
        target, target_page = make_pages(kind, seed=50)
        # 4 requests x 2 blocks each (their own), into pages 0..7
        items = [LoadItem(f"r{i}", keys[2:], [2 * i, 2 * i + 1])
                 for i, keys in enumerate(requests)]
        loads = StepLoads()
        loads.add(ns, target, items)
        assert loads.pin() == {f"r{i}": Loaded(2) for i in range(4)}
        assert loads.calls == 1
        copy(loads, layerwise)
        assert client.stats()["tiers"]["dram"]["pinned_blocks"] == 8
        loads.finish()
        until(lambda: client.stats()["tiers"]["dram"]["pinned_blocks"] == 0)
        for i in range(4):
            assert [target_page(2 * i), target_page(2 * i + 1)] == [
                source_page(2 + i % 3), source_page(3 + i % 3)]


@pytest.mark.parametrize("ahead", [False, True])
def test_steps_copy_on_the_copiers_one_thread_and_start_none(
        daemon: DaemonProcess, ahead: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a ``copier``, every step's copies beside the caller run on its one thread,
    kept across steps: a thread started per step had the step wait until it ran (0.2-1.8
    ms a step on a loaded 2-core host).  The pages hold the blocks all the same."""
    requests, source_page = _stored_requests(daemon, "staged", 3)
    copier = ThreadPoolExecutor(1, thread_name_prefix="copier")
    copier.submit(lambda: None).result()  # its thread, started before the steps
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)
    monkeypatch.setattr(threading.Thread, "start", counted)
    copied_on: set[str] = set()
    copy_layer = StepLoads._copy_layer

    def noted(loads: StepLoads, layer: int) -> None:
        copied_on.add(threading.current_thread().name)
        copy_layer(loads, layer)
    monkeypatch.setattr(StepLoads, "_copy_layer", noted)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("staged"))
        target, target_page = make_pages("staged", seed=50)
        for i, keys in enumerate(requests):  # a step each
            loads = StepLoads(copier)
            loads.add(ns, target, [LoadItem(f"r{i}", keys[2:], [2 * i, 2 * i + 1])])
            if ahead:
                assert loads.start()
            assert loads.pinned() == {f"r{i}": Loaded(2)}
            loads.start_layers()
            for layer in range(loads.layers()):
                loads.wait_layer(layer)
            loads.finish()
            assert [target_page(2 * i), target_page(2 * i + 1)] == [
                source_page(2 + i % 3), source_page(3 + i % 3)]
    copier.shutdown()
    assert started == [] and copied_on == {"copier_0"}, (started, copied_on)


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("kind", ["per_layer", "staged"])
def test_loads_started_ahead_pin_and_copy_on_their_thread(
        daemon: DaemonProcess, kind: str, layerwise: bool) -> None:
    """``start`` pins and copies on a thread while the caller goes on; ``pinned`` gives
    the outcome (a block evicted since the lookup included), and ``finish`` returns
    with every page written and every pin released."""
    requests, source_page = _stored_requests(daemon, kind, 4)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity(kind))
        target, target_page = make_pages(kind, seed=50)
        items = [LoadItem(f"r{i}", keys[2:], [2 * i, 2 * i + 1])
                 for i, keys in enumerate(requests[:3])]
        items.append(LoadItem("gone", [b"\x01" * 16], [7]))  # never stored
        untouched = target_page(7)
        loads = StepLoads()
        loads.add(ns, target, items)
        assert loads.start() and loads.started
        assert not loads.start()  # once
        assert loads.pinned() == {**{f"r{i}": Loaded(2) for i in range(3)},
                                  "gone": Loaded(0)}
        if layerwise:
            loads.start_layers()  # already copying: nothing more
            for layer in range(loads.layers()):
                loads.wait_layer(layer)
        loads.finish()
        until(lambda: client.stats()["tiers"]["dram"]["pinned_blocks"] == 0)
        for i in range(3):
            assert [target_page(2 * i), target_page(2 * i + 1)] == [
                source_page(2 + i % 3), source_page(3 + i % 3)]
        assert target_page(7) == untouched


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_pages_in_falling_or_scattered_order_load_their_blocks(
        daemon: DaemonProcess, kind: str, layerwise: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM hands pages out in falling runs and scattered: each block still lands in its
    own page, and the blocks' runs in the arena are worked out once for the step, not
    once per layer."""
    requests, source_page = _stored_requests(daemon, kind, 2)
    found: list[int] = []

    def counted(*args: Any) -> list[Rows]:
        runs = arena_runs(*args)
        found.append(len(runs))
        return runs
    monkeypatch.setattr(pipeline, "arena_runs", counted)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity(kind))
        target, target_page = make_pages(kind, seed=50)
        untouched = target_page(1)
        pages = {"falling": [7, 6, 5, 4], "scattered": [3, 0, 2]}
        loads = StepLoads()
        loads.add(ns, target, [LoadItem(name, keys[:len(pages[name])], pages[name])
                               for name, keys in zip(pages, requests)])
        assert loads.pin() == {"falling": Loaded(4), "scattered": Loaded(3)}
        copy(loads, layerwise)
        loads.finish()
        assert [target_page(p) for p in pages["falling"]] == [
            source_page(p) for p in (0, 1, 2, 3)]
        assert [target_page(p) for p in pages["scattered"]] == [
            source_page(p) for p in (0, 1, 3)]
        assert target_page(1) == untouched
    assert len(found) == 1  # one namespace: its runs found once, whatever the layers


def test_settled_loads_keep_their_pins_until_the_next_steps_settle_or_release(
        daemon: DaemonProcess) -> None:
    """A step's copies are done when ``settle`` returns; its pins go at the next step's
    (or ``release``), not in the step whose output they would delay."""
    requests, source_page = _stored_requests(daemon, "staged", 2)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("staged"))

        def pinned() -> int:
            return int(client.stats()["tiers"]["dram"]["pinned_blocks"])
        target, target_page = make_pages("staged", seed=50)
        settled = SettledLoads()
        for keys, pages in zip(requests, ([0, 1, 2, 3], [4, 5, 6, 7])):
            loads = StepLoads()
            loads.add(ns, target, [LoadItem("r", keys, pages)])
            loads.pin()
            loads.copy_all()
            settled.settle(loads)
            until(lambda: pinned() == 4)  # this step's; the step before's went
        assert [target_page(p) for p in range(8)] == [
            source_page(p) for p in (0, 1, 2, 3, 0, 1, 3, 4)]
        assert settled.release() and not settled.release()
        until(lambda: pinned() == 0)


def test_arena_runs_follow_the_offsets_and_refuse_rows_past_the_arena() -> None:
    arena = torch.arange(64, dtype=torch.uint8)
    runs = arena_runs(arena, [8, 16, 24, 0, 40], [5, 4, 9, 1, 2], 8)
    assert [(r.rows.shape[0], list(r.page_ids)) for r in runs] == [
        (3, [5, 4, 9]), (1, [1]), (1, [2])]
    assert runs[0].rows.data_ptr() == arena.data_ptr() + 8  # a view, not a copy
    assert bytes(runs[2].rows.numpy()) == bytes(range(40, 48))
    with pytest.raises(ValueError, match="arena of 64"):
        arena_runs(arena, [60], [0], 8)
    with pytest.raises(ValueError, match="page ids"):
        arena_runs(arena, [0, 8], [0], 8)


def test_a_block_gone_since_the_lookup_fails_only_its_request(daemon: DaemonProcess) -> None:
    requests, source_page = _stored_requests(daemon, "per_layer", 3)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("per_layer"))
        ns.evict([requests[1][3]])  # request 1's last block
        target, target_page = make_pages("per_layer", seed=50)
        untouched = target_page(7)
        loads = StepLoads()
        loads.add(ns, target, [LoadItem(f"r{i}", keys, [4 * i + j for j in range(4)])
                               for i, keys in enumerate(requests[:2])])
        assert loads.pin() == {"r0": Loaded(4), "r1": Loaded(3)}
        loads.copy_all()
        loads.finish()
        assert [target_page(p) for p in range(4)] == [source_page(p) for p in (0, 1, 2, 3)]
        assert [target_page(p) for p in range(4, 7)] == [source_page(p) for p in (0, 1, 3)]
        assert target_page(7) == untouched  # recomputed by the engine, never written


def test_a_request_over_the_key_limit_loads_its_prefix_in_pieces(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    # a block gone since the lookup: each request pins its own prefix, which was one
    # acquire of all its keys, refused whole past the limit (the request loaded nothing)
    daemon = few_keys_daemon(daemon_factory, tmp_path, 2)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("per_layer"))
        source, source_page = make_pages("per_layer", seed=40)
        keys = chain_keys(ns.id, list(range(4 * TOKENS)), TOKENS)
        assert offload_missing(ns, source, [0, 1, 2, 3], keys) == Stored(4, 4)
        ns.evict([keys[3]])
        target, target_page = make_pages("per_layer", seed=50)
        loads = StepLoads()
        loads.add(ns, target, [LoadItem("r", keys, [4, 5, 6, 7])])
        assert loads.pin() == {"r": Loaded(3)}
        loads.copy_all()
        loads.finish()
        assert [target_page(p) for p in (4, 5, 6)] == [source_page(p) for p in (0, 1, 2)]
        until(lambda: client.stats()["tiers"]["dram"]["pinned_blocks"] == 0)


def test_a_daemon_killed_before_the_load_loads_nothing(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory()
    requests, _ = _stored_requests(daemon, "per_layer", 2)
    client = Client(daemon.endpoint, tenant="acme")
    ns = client.namespace(identity("per_layer"))
    client.timeout = 0.5  # (after the hello and open: a loaded machine may take longer)
    target, target_page = make_pages("per_layer", seed=50)
    before = [target_page(p) for p in range(PAGES)]
    daemon.stop(signal.SIGKILL)
    loads = StepLoads()
    loads.add(ns, target, [LoadItem(f"r{i}", keys, [4 * i + j for j in range(4)])
                           for i, keys in enumerate(requests)])
    outcome = loads.pin()
    assert [o.blocks for o in outcome.values()] == [0, 0]
    assert all(o.error is not None for o in outcome.values())
    loads.copy_all()
    loads.finish()
    assert [target_page(p) for p in range(PAGES)] == before
    client.close()


def test_only_blocks_faster_to_load_than_to_recompute_are_worth_it() -> None:
    # 1 MB blocks of 32 tokens at 3200 prefill tokens/s: 10 ms to recompute a block;
    # 0.1 ms to load from DRAM (10 GB/s), 20 ms from a 0.05 GB/s remote store.
    worth = LoadWorth.from_extra({"prefill_tokens_per_s": 3200,
                                  "load_gbps": {"remote": 0.05}}, 1_000_000, 32)
    assert worth.blocks(["dram", "dram", "ssd"]) == 3
    assert worth.blocks(["dram", "remote", "dram"]) == 1  # a prefix: stops at the first
    assert worth.blocks([]) == 0
    assert LoadWorth.from_extra({}, 1_000_000, 32).blocks(["remote"] * 4) == 4  # no rate
    for bad in ({"load_gbps": {"ssd": 0}}, {"load_gbps": 3}, {"prefill_tokens_per_s": -1}):
        with pytest.raises(ValueError):
            LoadWorth.from_extra(bad, 1_000_000, 32)


class Posted:
    """A ``PostedRates`` stand-in: its reply ``answer``, in once ``arrived``."""

    def __init__(self, answer: dict[str, float] | None) -> None:
        self.answer, self.arrived, self.dropped = answer, False, False

    def ready(self) -> bool:
        return self.arrived

    def take(self) -> dict[str, float] | None:
        assert self.arrived, "taken before its reply came: a wait"
        return self.answer

    def drop(self) -> None:
        self.dropped = True


def test_the_daemons_rates_replace_the_configured_ones_at_most_every_refresh() -> None:
    # 1 MB blocks of 32 tokens at 3200 tokens/s: 10 ms to recompute; SSD configured at
    # 1.5 GB/s (0.7 ms a block) until the daemon says 50 MB/s (20 ms: not worth it).
    configured = LoadWorth.from_extra({"prefill_tokens_per_s": 3200}, 1_000_000, 32)
    now = [0.0]
    posts: list[Posted] = []

    def post(answer: dict[str, float] | None) -> Callable[[], Posted]:
        def sent() -> Posted:
            posts.append(Posted(answer))
            return posts[-1]
        return sent

    rates = LoadRates(configured, refresh_s=10, clock=lambda: now[0])
    assert configured.blocks(["dram", "ssd"]) == 2
    rates.ask(post({"ssd": 50e6}))
    assert rates.current().blocks(["dram", "ssd"]) == 2   # its reply not in: configured
    posts[-1].arrived = True
    assert rates.current().blocks(["dram", "ssd"]) == 1   # the daemon's rate
    now[0] = 9.0
    rates.ask(post(None))
    assert rates.current().blocks(["dram", "ssd"]) == 1 and len(posts) == 1  # not yet
    now[0] = 10.0
    rates.ask(post(None))
    posts[-1].arrived = True
    assert rates.current().blocks(["dram", "ssd"]) == 2   # no answer: configured
    now[0] = 20.0
    rates.ask(post({"ssd": 3e9}))
    rates.ask(post({"ssd": 1.0}))  # one in flight at a time
    assert len(posts) == 3
    now[0] = 30.0
    assert rates.current().blocks(["dram", "ssd"]) == 2 and posts[-1].dropped  # too late
    rates.ask(post({"ssd": 3e9}))
    posts[-1].arrived = True
    assert rates.current().blocks(["dram", "ssd"]) == 2   # a faster SSD measured
    assert rates.refreshes == 2 and rates.measured == {"ssd": 3e9}
    never = LoadRates(configured, refresh_s=0, clock=lambda: now[0])
    never.ask(post(None))
    assert never.current().blocks(["ssd"]) == 1 and len(posts) == 4
    no_rate = LoadRates(LoadWorth.from_extra({}, 1_000_000, 32), clock=lambda: now[0])
    no_rate.ask(post(None))
    assert no_rate.current().blocks(["ssd"]) == 1 and len(posts) == 4
    with pytest.raises(ValueError):
        LoadRates(configured, refresh_s=-1)


def test_a_probe_without_keys_gives_the_daemons_load_rates(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    slow = daemon_factory(ssd_capacity="64MiB",
                          env={"KVSTORE_EVENTS_SSD_BANDWIDTH": "50MB"})
    with Client(slow.endpoint) as client:
        reply = client.probe()
        assert reply.tier_runs == [] and reply.bandwidth["ssd"] == 50e6
        worth = LoadWorth.from_extra({"prefill_tokens_per_s": 3200}, 1_000_000, 32)
        rates = LoadRates(worth)
        link = DaemonLink(DaemonSettings(slow.endpoint, tenant="acme"))
        rates.ask(lambda: post_rates(link))
        ns = link.namespace("ns", lambda: identity("per_layer"))
        assert ns is not None
        ns.lookup([b"k" * 16])  # its wait reads the probe's reply, sent before it
        assert rates.current().blocks(["dram", "ssd"]) == 1
        link.close()
        assert rates.measured["ssd"] == 50e6

    async def probe_async() -> ProbeReply:
        async with AsyncClient(slow.endpoint) as aclient:
            return await aclient.probe()

    assert asyncio.run(probe_async()).bandwidth["ssd"] == 50e6


def test_posted_acquires_are_waited_for_only_in_pin_and_never_leak(
        daemon: DaemonProcess) -> None:
    requests, source_page = _stored_requests(daemon, "per_layer", 2)
    with Client(daemon.endpoint, tenant="acme") as client:
        ns = client.namespace(identity("per_layer"))
        target, target_page = make_pages("per_layer", seed=50)
        before = [target_page(p) for p in range(PAGES)]
        loads = StepLoads()
        loads.add(ns, target, [LoadItem(f"r{i}", keys, [4 * i + j for j in range(4)])
                               for i, keys in enumerate(requests)])
        loads.post()  # the acquire is out; the caller goes on meanwhile
        assert ns.lookup(requests[0]).blocks == 4  # its reply is kept for pin
        assert [target_page(p) for p in range(PAGES)] == before  # nothing read yet
        assert loads.pin() == {"r0": Loaded(4), "r1": Loaded(4)}
        assert loads.calls == 1
        loads.copy_all()
        loads.finish()
        assert [target_page(p) for p in range(8)] == [source_page(p)
                                                      for p in (0, 1, 2, 3, 0, 1, 3, 4)]
        until(lambda: client.stats()["tiers"]["dram"]["pinned_blocks"] == 0)

        abandoned = StepLoads()  # posted, and the step never came to load
        abandoned.add(ns, target, [LoadItem("r0", requests[0], [0, 1, 2, 3])])
        abandoned.post()
        abandoned.finish()
        until(lambda: client.stats()["tiers"]["dram"]["pinned_blocks"] == 0)
        assert not client._early  # its reply was read, not left behind


def test_a_lookup_sent_ahead_is_read_when_waited_for_and_a_closed_client_says_so(
        daemon: DaemonProcess) -> None:
    requests, _ = _stored_requests(daemon, "per_layer", 2)
    client = Client(daemon.endpoint, tenant="acme")
    ns = client.namespace(identity("per_layer"))
    first = ns._send_lookup(requests[0])
    second = ns._send_lookup(requests[1][:2] + [b"\0" * 16])
    assert ns.lookup(requests[1]).blocks == 4  # replies to the sent ones are kept meanwhile
    assert second().blocks == 2 and first().blocks == 4
    assert not client._early
    late = ns._send_lookup(requests[0])
    client.close()
    with pytest.raises(KVStoreError, match="closed"):
        late()
