"""The KV event stream, the snapshot and the routing query, against real daemons.

A subscriber rebuilds an index from the events alone (decoded with no schema, as any
msgpack reader would) and must agree with the daemon's own lookups and its snapshot
after a random mix of stores, evictions, demotions, promotions and restarts.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from daemon_proc import DaemonProcess, free_port
from events_sub import Mix, Subscriber
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import MalformedError
from kvstore.events import EventPublisher, decoder

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, salt="s1")  # 64 KiB blocks
BT = IDENT.block_tokens


def content(key: bytes) -> bytes:
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (IDENT.block_bytes // 32 + 1))[:IDENT.block_bytes]


def events_env(pub: int, replay: int, **more: str) -> dict[str, str]:
    env = {"KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
           "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
           "KVSTORE_EVENTS_TOPIC": "kv@pod-a@tiny-llama"}
    env.update(more)
    return env


def start_daemon(factory: Any, pub: int, replay: int, *, ssd: str = "4MiB",
                 **more: str) -> DaemonProcess:
    d: DaemonProcess = factory(dram_capacity="2MiB", ssd_capacity=ssd,
                               extra=["--slab-size", "1MiB"],
                               env=events_env(pub, replay, **more))
    return d


def synced(client: Client, sub: Subscriber) -> Any:
    """The daemon's snapshot, with the subscriber caught up to it."""
    snap = client.snapshot()
    sub.until(snap.seq)
    return snap


def test_events_rebuild_the_daemons_index_through_a_random_mix(daemon_factory: Any) -> None:
    pub, replay = free_port(), free_port()
    d = start_daemon(daemon_factory, pub, replay)
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    mix = Mix(d, sub, IDENT, seed=19, tenant="acme")
    try:
        mix.check()
        assert sub.index.tiers == {}  # a cold start: all cleared, nothing stored
        for step in range(60):
            mix.step()
            if step % 5 == 4:
                mix.check()
        mix.check()
        stats = mix.client.stats()
        assert stats["tiers"]["ssd"]["committed"] > 0, "the mix never reached the ssd tier"
        assert stats["events"]["dropped"] == 0
        assert mix.restarts >= 2, "the mix restarted the daemon too seldom"
        assert sub.topics == {b"kv@pod-a@tiny-llama"}
        # every block stored carried the tokens its writer sent (restored ones had none)
        for key, ids in sub.index.tokens.items():
            assert mix.tokens[key] == ids
        assert sub.index.tokens
        # every batch decodes with the typed decoder too, fields as vLLM names them
        typed = decoder("map")
        for seq, payload in sub.payloads:
            if seq < 0:
                continue
            for e in typed.decode(payload).events:
                if type(e).__name__ == "BlockStored":
                    assert e.block_size == BT and e.extra_keys is not None
                    assert e.medium in ("CPU", "STORAGE")
    finally:
        mix.close()
        sub.close()


def test_array_encoding_and_the_replay_end_marker(daemon_factory: Any) -> None:
    pub, replay = free_port(), free_port()
    d = start_daemon(daemon_factory, pub, replay, ssd="0",
                     KVSTORE_EVENTS_ENCODING="array", KVSTORE_EVENTS_GROUP_IDX="2")
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            keys = ns.keys(list(range(BT * 3)))
            ns.put(keys, [content(k) for k in keys])
            snap = synced(c, sub)
            assert snap.seq == 1  # all cleared at start, then one batch for the put
            raw = [msgspec.msgpack.decode(pl) for _, pl in sub.replay(0)]
            cleared, stored = raw[0][1][0], raw[1][1][0]
            assert cleared == ["AllBlocksCleared"]
            assert stored[0] == "BlockStored" and stored[1] == keys
            assert stored[2] is None and stored[3] == list(range(BT * 3))
            assert stored[4] == BT and stored[6] == "CPU" and stored[9] == 2
            assert stored[8] == [["s1"]] * 3
            assert sub.replay(5) == []  # past the end: only the end marker
            bad = sub.ctx.socket(zmq.DEALER)  # a malformed request is ignored
            bad.connect(f"tcp://127.0.0.1:{replay}")
            bad.send_multipart([b"", b"short"])
            bad.close(linger=1000)
            assert [s for s, _ in sub.replay(0)] == [0, 1]  # still serving
            typed = decoder("array").decode(sub.replay(1)[0][1])
            assert typed.events[0].block_hashes == keys
            assert ns.evict(keys[1:]) == 2
            snap = synced(c, sub)
            assert sub.index.lookup(keys) == ["dram"]
            removed = msgspec.msgpack.decode(sub.payloads[-1][1])[1][0]
            assert removed[0] == "BlockRemoved" and set(removed[1]) == set(keys[1:])
    finally:
        sub.close()


def test_bad_token_ids_are_refused_and_leave_nothing(daemon_factory: Any) -> None:
    from kvstore import protocol as p

    pub, replay = free_port(), free_port()
    d = start_daemon(daemon_factory, pub, replay, ssd="0")
    with Client(d.endpoint, tenant="acme") as c:
        assert c.hello is not None and c.hello.events
        ns = c.namespace(IDENT)
        keys = ns.keys(list(range(BT * 2)))
        before = c.stats()["tiers"]["dram"]
        bad = p.Put(c._next_rid(), ns.id, keys, None, [], [bytes(8 * 3), b""])
        reply = c._call(bad, [content(k) for k in keys])[0]
        assert isinstance(reply, p.ErrorReply) and reply.code == MalformedError.code
        assert "token ids" in reply.message
        after = c.stats()["tiers"]["dram"]
        assert after["committed"] == before["committed"]
        assert after["reserved"] == before["reserved"]
        # the one buffer of every block's ids: cut short, or of the wrong tag
        good = ns._chains.tokens_of(keys, True)[1]
        assert len(good) == 2 * 5 * BT
        for ids in (good[:-1], good[:5 * BT], b"\xcc" + good[1:]):
            bad = p.Put(c._next_rid(), ns.id, keys, None, [], [], ids)
            reply = c._call(bad, [content(k) for k in keys])[0]
            assert isinstance(reply, p.ErrorReply) and reply.code == MalformedError.code
            assert "one buffer" in reply.message
            reserved = c._call(p.Reserve(c._next_rid(), ns.id, keys))[0]
            assert isinstance(reserved, p.ReserveReply)
            reply = c._call(p.Commit(c._next_rid(), reserved.reservation, [], [], ids))[0]
            assert isinstance(reply, p.ErrorReply) and reply.code == MalformedError.code
            after = c.stats()["tiers"]["dram"]
            assert after["committed"] == before["committed"]  # nothing published
            c._call(p.Abort(c._next_rid(), reserved.reservation))
            after = c.stats()["tiers"]["dram"]
            assert after["reserved"] == before["reserved"]  # a refused commit: still
            # the writer's to abort (or commit right)
        assert ns.lookup(keys).blocks == 0


def test_a_daemon_without_events_asks_for_no_tokens(daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme") as c:
        assert c.hello is not None and not c.hello.events
        ns = c.namespace(IDENT)
        keys = ns.keys(list(range(BT)))
        assert ns._chains.tokens_of(keys, True) == ([], b"")  # nothing remembered for it
        ns.put(keys, [content(k) for k in keys])
        assert "events" not in c.stats()
        assert c.snapshot().seq == -1


def test_a_slow_subscriber_never_slows_the_daemon(daemon_factory: Any,
                                                   tmp_path: Path) -> None:
    """A subscriber that stops reading: the daemon sends past it (the batches it
    refused counted, in the metrics too) instead of waiting; the subscriber sees the
    jump and replays it."""
    import urllib.request

    pub = f"ipc://{tmp_path / 'events.sock'}"
    replay = f"ipc://{tmp_path / 'replay.sock'}"
    metrics_port = free_port()
    d = daemon_factory(dram_capacity="8MiB", ssd_capacity="0",
                       extra=["--slab-size", "1MiB", "--metrics-port", str(metrics_port)],
                       env={"KVSTORE_EVENTS_ENDPOINT": pub,
                            "KVSTORE_EVENTS_REPLAY_ENDPOINT": replay,
                            "KVSTORE_EVENTS_QUEUE_BATCHES": "1",
                            "KVSTORE_EVENTS_BUFFER_STEPS": "100000"})
    sub = Subscriber(pub, replay)
    sub.sub.close(linger=0)
    stalled = sub.ctx.socket(zmq.SUB)  # subscribes, then reads nothing for a while
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(pub)
    sub.sub = stalled
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            time.sleep(0.3)  # the subscription reaches the daemon
            puts = 0
            while c.stats()["events"]["lossy_batches"] == 0 and puts < 4000:
                for _ in range(50):
                    keys = ns.keys([puts] * BT * 8)
                    ns.put(keys, [content(k) for k in keys])
                    puts += 1
            stats = c.stats()["events"]
            assert stats["lossy_batches"] > 0, "a stalled subscriber never filled its queue"
            assert stats["dropped"] == 0  # the batches it refused went out all the same
            snap = c.snapshot()
            sub.until(snap.seq)  # reads the backlog, meets the jump, replays the gap
            assert sub.gaps >= 1
            assert [s for s, _ in sub.payloads] == list(range(snap.seq + 1))
            assert sub.index.entries() == set(snap.blocks)
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
            lossy = [line for line in text.splitlines()
                     if line.startswith("kvstore_events_lossy_batches_total")]
            assert lossy and float(lossy[0].split()[-1]) >= stats["lossy_batches"]
            assert "\nkvstore_events_dropped_total 0.0" in text
    finally:
        sub.close()


def test_a_restart_announces_what_the_ssd_index_brought_back(daemon_factory: Any) -> None:
    pub, replay = free_port(), free_port()
    d: DaemonProcess = daemon_factory(
        dram_capacity="2MiB", ssd_capacity="4MiB",
        extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-through"],
        env=events_env(pub, replay))
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            keys = ns.keys(list(range(BT * 4)))
            ns.put(keys, [content(k) for k in keys])
            for _ in range(100):  # written through to SSD in the background
                if c.stats()["tiers"]["ssd"]["committed"] == 4:
                    break
                time.sleep(0.05)
            synced(c, sub)
            assert sub.index.lookup(keys) == ["dram"] * 4
            assert all(sub.index.tiers[k] == {"dram", "ssd"} for k in keys)
        d.stop()
        sub.restart()
        d.start()
        with Client(d.endpoint, tenant="acme") as c:
            snap = synced(c, sub)
            first = [msgspec.msgpack.decode(pl)[1] for _, pl in sub.replay(0)][:2]
            assert first[0] == [{"type": "AllBlocksCleared"}]
            [stored] = first[1]
            assert stored["block_hashes"] == keys and stored["medium"] == "STORAGE"
            assert stored["locality"] == "LOCAL" and stored["token_ids"] == []
            assert sub.index.lookup(keys) == ["ssd"] * 4
            assert sub.index.entries() == set(snap.blocks)
            # a namespace dropped: every copy of it removed
            ns = c.namespace(IDENT)
            assert ns.drop() == 4
            synced(c, sub)
            assert sub.index.tiers == {}
            removed = msgspec.msgpack.decode(sub.payloads[-1][1])[1]
            assert [(e["type"], e["medium"], sorted(e["block_hashes"])) for e in removed] == [
                ("BlockRemoved", "STORAGE", sorted(keys))]
    finally:
        sub.close()


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_BATCH"), reason="Linux only")
def test_the_streams_io_thread_runs_as_a_batch_thread(tmp_path: Path) -> None:
    """ZeroMQ's I/O thread of the stream runs as a batch thread: woken by a batch's send,
    it waits for the daemon's loop to yield rather than take the CPU from it."""
    import asyncio
    import os

    from kvstore.config import EventsConfig
    from kvstore.store import BlockStore

    def io_threads() -> set[int]:
        # (ZeroMQ's thread names itself once it has set its scheduling)
        found: set[int] = set()
        for task in Path("/proc/self/task").iterdir():
            try:
                if (task / "comm").read_text().startswith("ZMQbg/IO"):
                    found.add(int(task.name))
            except (FileNotFoundError, ProcessLookupError):
                pass  # a thread that ended as it was listed (an earlier test's)
        return found

    before = io_threads()
    store = BlockStore(16 * IDENT.block_bytes, 16 * IDENT.block_bytes)
    pub = EventPublisher(EventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock"), store)
    loop = asyncio.new_event_loop()
    pub.open(loop)
    try:
        deadline = time.monotonic() + 10
        while not io_threads() - before:
            assert time.monotonic() < deadline, "no I/O thread of the stream's context"
            time.sleep(0.01)
        started = io_threads() - before
        assert {os.sched_getscheduler(tid) for tid in started} == {os.SCHED_BATCH}
        assert os.sched_getscheduler(0) != os.SCHED_BATCH  # the loop's thread: as it was
    finally:
        pub.close()
        loop.close()


_IDLE_PUBLISHER = """
import asyncio, os, sys
from kvstore.config import EventsConfig
from kvstore.events import EventPublisher
from kvstore.store import BlockStore
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # as under `chrt -i 0`
store = BlockStore(1 << 20, 1 << 20)
pub = EventPublisher(EventsConfig(endpoint=sys.argv[1]), store)
loop = asyncio.new_event_loop()
pub.open(loop)
pub.close()
loop.close()
print("open and closed")
"""


def test_a_process_started_idle_opens_its_event_stream(tmp_path: Path) -> None:
    """Leaving SCHED_IDLE needs CAP_SYS_NICE, and ZeroMQ aborts the process when its I/O
    thread cannot take the policy it was given: the stream then keeps the process's."""
    import os
    import shutil
    import subprocess
    import sys

    command = [sys.executable, "-c", _IDLE_PUBLISHER, f"ipc://{tmp_path}/pub.sock"]
    if os.geteuid() == 0:  # root may leave SCHED_IDLE unless it gives up the capability
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root, and no setpriv to give up CAP_SYS_NICE")
        command = [setpriv, "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "open and closed" in done.stdout


def test_batches_go_out_only_while_someone_subscribes(tmp_path: Path) -> None:
    """Without a replay socket, a batch nobody subscribes to is numbered but not built;
    a subscriber gets every batch from its subscription on, and changes within the
    interval go out as one batch."""
    import asyncio

    from kvstore.config import EventsConfig
    from kvstore.keys import chain_keys
    from kvstore.store import BlockStore
    from kvstore.token_ids import encode_blocks

    endpoint = f"ipc://{tmp_path}/pub.sock"
    store = BlockStore(64 * IDENT.block_bytes, 16 * IDENT.block_bytes)
    pub = EventPublisher(EventsConfig(endpoint=endpoint, interval_ms=50.0), store)
    loop = asyncio.new_event_loop()
    pub.open(loop)
    ns = store.open_namespace(IDENT)

    def commit(first: int) -> list[bytes]:
        tokens = list(range(first, first + 2 * BT))
        keys = chain_keys(ns.id, tokens, BT)
        r = store.reserve("o", ns, keys, None, 0.0)
        store.commit("o", r.id, 0.0,  # type: ignore[union-attr]
                     tokens=encode_blocks(tokens, 2, BT))
        return keys

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        commit(0)
        assert pub.flush() == 0 and pub.unheard == 1 and not pub.ring  # nobody: not built
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        deadline = time.monotonic() + 5
        while not pub.listened():
            assert time.monotonic() < deadline, "the subscription never arrived"
            time.sleep(0.01)
        keys = commit(100)
        assert pub.flush() == 1 and pub.batches == 1
        assert sub.poll(5000), "the subscriber got nothing"
        topic, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == 1
        [stored] = decoder().decode(payload).events
        assert stored.block_hashes == keys
        assert stored.token_ids == list(range(100, 100 + 2 * BT))
        # two commits within the interval: one batch, once it has passed
        commit(200)
        commit(300)
        loop.run_until_complete(asyncio.sleep(0.2))
        assert pub.batches == 2 and pub.seq == 3
        assert sub.poll(5000)
        last = sub.recv_multipart()[2]
        assert len(decoder().decode(last).events) == 2
        # no replay socket: nobody can ask for an older batch, the ring keeps the last
        assert list(pub.ring) == [(2, last)] and pub.ring_bytes == len(last)
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()
        loop.close()


def test_the_ring_keeps_buffer_steps_batches_only_for_a_replay_socket(
        tmp_path: Path) -> None:
    """With a replay socket the ring keeps the last ``buffer_steps`` batches; without
    one, only the last (the memory of the one before is reused)."""
    import asyncio

    from kvstore.config import EventsConfig
    from kvstore.keys import chain_keys
    from kvstore.store import BlockStore
    from kvstore.token_ids import encode_chain

    kept = {}
    for replay in (True, False):
        store = BlockStore(64 * IDENT.block_bytes, 16 * IDENT.block_bytes)
        config = EventsConfig(
            endpoint=f"ipc://{tmp_path}/pub-{replay}.sock", buffer_steps=3,
            replay_endpoint=f"ipc://{tmp_path}/replay-{replay}.sock" if replay else "")
        pub = EventPublisher(config, store)
        loop = asyncio.new_event_loop()
        pub.open(loop)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(config.endpoint)
            deadline = time.monotonic() + 5
            while not pub.listened():  # (without one, no batch would be built)
                assert time.monotonic() < deadline, "the subscription never arrived"
                time.sleep(0.01)
            ns = store.open_namespace(IDENT)
            payloads = []
            for i in range(5):
                tokens = list(range(i * 100, i * 100 + 2 * BT))
                keys = chain_keys(ns.id, tokens, BT)
                r = store.reserve("o", ns, keys, None, 0.0)
                store.commit("o", r.id, 0.0,  # type: ignore[union-attr]
                             tokens=encode_chain(tokens, 2, BT))
                assert pub.flush() == i
                payloads.append(pub.ring[-1][1])
                assert decoder().decode(payloads[-1]).events[0].block_hashes == keys
            kept[replay] = list(pub.ring)
            assert pub.ring_bytes == sum(len(p) for _, p in pub.ring)
            assert pub.stats()["buffered"] == len(pub.ring)
            for payload in payloads:  # every batch went out all the same
                assert sub.poll(5000) and sub.recv_multipart()[2] == payload
        finally:
            sub.close(linger=0)
            ctx.term()
            pub.close()
            loop.close()
        expect = [(seq, payloads[seq]) for seq in range(5 - (3 if replay else 1), 5)]
        assert kept[replay] == expect


def test_a_due_batch_goes_out_with_the_next_commit_not_a_timer(tmp_path: Path) -> None:
    """A batch waits for changes until ``interval_ms`` has passed; then the next commit
    sends it at the end of its loop turn, and the next batch waits twice as long (commits
    keep coming: a loaded daemon sends fewer batches), up to ``busy_interval_ms``.  No
    timer sends it at ``interval_ms``; the timer for a quiet daemon (``quiet_ms``), set
    at a batch's first change, is cancelled when a commit sends the batch (a busy daemon
    is never woken by it), and once it sends a batch no commit sent, the next batch
    waits half as long, down to ``interval_ms``.  Under load the timer
    waits at least twice the batch's wait, so that the next commit, not the timer,
    sends a due batch."""
    import asyncio

    from kvstore.config import EventsConfig
    from kvstore.keys import chain_keys
    from kvstore.store import BlockStore

    store = BlockStore(64 * IDENT.block_bytes, 16 * IDENT.block_bytes)
    loop = asyncio.new_event_loop()
    pub = EventPublisher(EventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock",
                                      interval_ms=1.0, quiet_ms=1000.0,
                                      busy_interval_ms=3.0), store)
    pub.open(loop)
    ns = store.open_namespace(IDENT)

    def commit(first: int) -> None:
        keys = chain_keys(ns.id, list(range(first, first + 2 * BT)), BT)
        r = store.reserve("o", ns, keys, None, 0.0)
        store.commit("o", r.id, 0.0)  # type: ignore[union-attr]

    def turn() -> None:
        loop.run_until_complete(asyncio.sleep(0))  # one turn: timers due and calls soon

    try:
        commit(0)
        time.sleep(0.01)  # past the interval
        turn()
        quiet = pub._quiet
        assert pub.last_seq == -1 and quiet is not None  # waits for a commit
        commit(100)
        turn()
        assert pub.last_seq == 0 and pub._turn is None  # due: out with the commit
        assert not pub.changes.touched
        assert pub.wait == 0.002  # sent by a commit: the next batch waits twice as long
        assert quiet.cancelled() and pub._quiet is None  # and its timer is gone
        before = loop.time()
        commit(200)  # a new batch: its first change sets a timer
        assert before + 0.002 <= pub._due <= loop.time() + 0.002
        turn()
        quiet = pub._quiet
        assert pub.last_seq == 0 and quiet is not None and not quiet.cancelled()
        pub._went_quiet()  # (what the timer runs; early for this batch: set for it again)
        again = pub._quiet
        assert pub.last_seq == 0 and again is not None and again is not quiet
        time.sleep(0.01)
        commit(300)  # due: out with this commit, and the next waits up to 3 ms
        turn()
        assert pub.last_seq == 1 and pub.wait == 0.003
        commit(400)
        again.cancel()
        pub._due -= 2.0  # (as if this batch had waited ``quiet_ms`` with no commit)
        pub._went_quiet()
        assert pub.last_seq == 2 and not pub.changes.touched and pub._quiet is None
        assert pub.wait == 0.0015  # quiet: the next batch waits half as long
        commit(500)  # the next batch's first change sets a timer again
        assert pub._quiet is not None
        pub._due -= 2.0
        pub._went_quiet()
        assert pub.last_seq == 3 and pub.wait == 0.001  # not below ``interval_ms``
        pub.quiet, pub.wait = 1.0, 3.0  # (a quiet_ms below twice a busy wait)
        before = loop.time()
        commit(600)
        timer = pub._quiet
        assert timer is not None and timer.when() >= before + 6.0
        pub._went_quiet()  # (early: set again for twice the wait, not for ``quiet``)
        again = pub._quiet
        assert pub.last_seq == 3 and pub.changes.touched
        assert again is not None and again is not timer
        assert again.when() == pytest.approx(pub._due + pub.wait)  # first change + 6 s
    finally:
        pub.close()
        loop.close()


def test_the_quiet_timer_on_uvloop_sends_its_batch_without_spinning(tmp_path: Path) -> None:
    """The daemon's loop is uvloop's, whose clock and timers run in milliseconds: a
    timer set for a batch's quiet time runs up to a millisecond before it by the loop's
    clock.  The timer sends the batch then, rather than setting itself again for the
    fraction left, which uvloop runs at once, again and again until its clock ticks (a
    few microseconds each: tens of wakes a batch, 8 us a request of a daemon whose
    batches the timer sent)."""
    import asyncio

    import uvloop

    from kvstore.config import EventsConfig
    from kvstore.keys import chain_keys
    from kvstore.store import BlockStore

    store = BlockStore(64 * IDENT.block_bytes, 16 * IDENT.block_bytes)
    loop = uvloop.new_event_loop()
    pub = EventPublisher(EventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock",
                                      interval_ms=1.0, quiet_ms=3.0,
                                      busy_interval_ms=1.0), store)
    pub.open(loop)
    ns = store.open_namespace(IDENT)
    wakes = 0
    went_quiet = pub._went_quiet

    def counted() -> None:
        nonlocal wakes
        wakes += 1
        went_quiet()
    pub._went_quiet = counted  # type: ignore[method-assign]
    try:
        for first in range(0, 2000, 100):  # a batch each, its timer's to send
            keys = chain_keys(ns.id, list(range(first, first + 2 * BT)), BT)
            r = store.reserve("o", ns, keys, None, 0.0)
            store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
            seq = pub.last_seq
            loop.run_until_complete(asyncio.sleep(0.006))  # past the quiet time
            assert pub.last_seq == seq + 1 and not pub.changes.touched
        assert wakes <= 2 * 20, f"{wakes} wakes of the quiet timer for 20 batches"
    finally:
        pub.close()
        loop.close()


def test_a_batch_after_an_idle_spell_waits_the_interval_again(tmp_path: Path) -> None:
    """A burst doubles the batches' wait up to ``busy_interval_ms``; once the daemon has
    sent nothing for longer than ``quiet_ms``, the next batch waits ``interval_ms``
    again, and its quiet timer is set for ``quiet_ms``, not twice the burst's wait."""
    import asyncio

    from kvstore.config import EventsConfig
    from kvstore.keys import chain_keys
    from kvstore.store import BlockStore

    store = BlockStore(64 * IDENT.block_bytes, 16 * IDENT.block_bytes)
    loop = asyncio.new_event_loop()
    pub = EventPublisher(EventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock",
                                      interval_ms=1.0, quiet_ms=50.0,
                                      busy_interval_ms=50.0), store)
    pub.open(loop)
    ns = store.open_namespace(IDENT)

    def commit(first: int) -> None:
        keys = chain_keys(ns.id, list(range(first, first + 2 * BT)), BT)
        r = store.reserve("o", ns, keys, None, 0.0)
        store.commit("o", r.id, 0.0)  # type: ignore[union-attr]

    try:
        first = 0
        while pub.wait < pub.busy_interval:  # a burst: each due batch out with a commit
            commit(first)
            time.sleep(pub.wait + 0.001)
            commit(first + 100)
            loop.run_until_complete(asyncio.sleep(0))
            first += 200
        assert pub.wait == 0.05 and pub.last_seq >= 5 and not pub.changes.touched
        loop.run_until_complete(asyncio.sleep(0.2))  # idle (the quiet timer runs, idle)
        assert pub._quiet is None
        before = loop.time()
        commit(first)
        after = loop.time()
        timer = pub._quiet
        assert pub.wait == 0.001
        assert before + 0.001 <= pub._due <= after + 0.001
        assert timer is not None and timer.when() <= after + 0.05
    finally:
        pub.close()
        loop.close()


def test_token_ids_travel_only_while_someone_hears_and_a_stale_reply_loses_no_event(
        daemon_factory: Any) -> None:
    """Without a replay socket, the daemon's replies tell writers whether to send token
    ids: not while nobody subscribes (commits are then as small as with events off), and
    again once it has read a subscription.  A write told "not wanted" before that read
    is still announced, with empty ``token_ids`` (as vLLM's own offloading connectors
    send blocks whose token ids they lack); the writes told after it carry them."""
    pub = free_port()
    d = daemon_factory(dram_capacity="2MiB", ssd_capacity="0", extra=["--slab-size", "1MiB"],
                       env={"KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    typed = decoder()

    def stored_event(keys: list[bytes], wait: float = 5.0) -> Any:
        """The BlockStored event of ``keys`` (one run), read off the stream (None if it
        did not come within ``wait`` seconds)."""
        while sub.poll(int(wait * 1000)):
            for e in typed.decode(sub.recv_multipart()[2]).events:
                if type(e).__name__ == "BlockStored" and e.block_hashes == keys:
                    return e
        return None

    def chain(first: int, blocks: int = 1) -> tuple[list[bytes], list[int]]:
        tokens = list(range(first, first + BT * blocks))
        return ns.keys(tokens), tokens

    def until(condition: Any, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    with Client(d.endpoint, tenant="acme") as c:
        assert c.hello is not None and c.hello.events
        ns = c.namespace(IDENT)
        keys, _ = chain(0, 2)
        with ns.reserve(keys) as r:
            assert not c.tokens_wanted  # nobody subscribes
            for buffer, k in zip(r.buffers, keys):
                buffer[:] = content(k)
            request = r._commit_request()
            assert request.tokens == [] and request.token_ids == b""
            c._call(request)  # the commit, as sent
        assert ns.lookup(keys).blocks == 2
        ns.put(keys, [content(k) for k in keys])  # present: nothing new
        assert not c.tokens_wanted
        until(lambda: c.stats()["events"]["unheard"] >= 1, "the batch never went")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pub}")
        stale, _ = chain(1000, 2)
        r = ns.reserve(stale)
        assert not c.tokens_wanted  # no batch since: the subscription is not read yet
        # writes until one is heard: its batch read the subscription
        for i in range(100):
            other, _ = chain(2000 + i * BT)
            ns.put(other, [content(k) for k in other])
            heard = stored_event(other, wait=0.2)
            if heard is not None:
                break
        assert heard is not None, "the subscription never reached the daemon"
        assert heard.token_ids == []  # told "not wanted" before the read
        r.commit()  # told "not wanted" before the read, committed after it
        late = stored_event(stale)
        assert late is not None and late.token_ids == []  # announced all the same
        fresh, fresh_tokens = chain(5000, 2)
        with ns.reserve(fresh) as r2:
            assert c.tokens_wanted  # someone hears: token ids wanted
            r2.commit()
        told = stored_event(fresh)
        assert told is not None and told.token_ids == fresh_tokens
        # the subscriber goes: once the daemon has read that, token ids are not wanted
        sub.close(linger=0)
        gone = iter(range(6000, 10**6, BT))

        def unwanted() -> bool:
            keys, _ = chain(next(gone))
            ns.put(keys, [content(k) for k in keys])
            time.sleep(0.06)  # its batch reads the subscriptions
            return not c.tokens_wanted  # as the put's reply said: read by the next
        until(unwanted, "token ids still wanted with nobody subscribed")
        assert c.stats()["events"]["dropped"] == 0
    ctx.term()


def test_the_replay_ring_is_bounded_by_bytes_and_a_peer_that_never_reads_is_cut_off(
        daemon_factory: Any) -> None:
    # batches of token ids fill a ring of 10000 by count alone to gigabytes; a replay
    # request of 8 bytes resent it all, copied, into an unbounded queue per request
    pub, replay = free_port(), free_port()
    d: DaemonProcess = daemon_factory(env=events_env(
        pub, replay, KVSTORE_EVENTS_BUFFER_BYTES="4KiB", KVSTORE_EVENTS_BUFFER_STEPS="8"))
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    ctx = zmq.Context()
    hog = ctx.socket(zmq.DEALER)  # asks again and again, reads nothing
    hog.setsockopt(zmq.RCVHWM, 1)
    hog.setsockopt(zmq.RCVBUF, 4096)
    hog.connect(f"tcp://127.0.0.1:{replay}")
    try:
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            time.sleep(0.3)  # the subscription reaches the daemon
            for i in range(40):  # a batch of 8 blocks each: about 1 KiB
                keys = ns.keys(list(range(i * 1000, i * 1000 + 8 * BT)))
                ns.put(keys, [content(k) for k in keys])
                time.sleep(0.06)  # (its own batch)
            events = c.stats()["events"]
            assert events["buffered_bytes"] <= 4 << 10 and events["buffered"] < 8
            last = events["last_seq"]
            kept = sub.replay(0)  # from the first: only what the ring keeps
            assert [s for s, _ in kept] == list(range(last - len(kept) + 1, last + 1))
            for _ in range(200):
                for _ in range(50):
                    hog.send_multipart([b"", (0).to_bytes(8, "big")])
                if c.stats()["events"]["cut_replays"]:
                    break
            assert c.stats()["events"]["cut_replays"] > 0
            started = time.perf_counter()
            c.ping()  # (the daemon answers others meanwhile)
            assert time.perf_counter() - started < 5
            assert [s for s, _ in sub.replay(last)] == [last]  # another peer is answered
    finally:
        hog.close(linger=0)
        ctx.term()
        sub.close()
