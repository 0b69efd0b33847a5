"""Attacks on the KV event stream's sockets: the PUB socket and the replay ROUTER.

Without credentials anyone who reaches the endpoints is a peer (bind them where only the
routers reach); with credentials only ``events.readers`` are.  Either way a peer must not
make the daemon read frames of any size, build batches nobody hears, or hold every
tenant's requests behind replays.  Real daemon processes and real ZeroMQ sockets; the
replay's turns are counted on a publisher driven by a loop of the test's own.
"""

from __future__ import annotations

import asyncio
import select
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_proc import DaemonProcess, free_port
from kvtest import make_identity

from kvstore import Client, events
from kvstore.config import EventsConfig
from kvstore.events import _REPLAY_BATCHES_A_TURN, END_SEQ, EventPublisher
from kvstore.store import BlockStore

IDENT = make_identity(tenant="acme")
TOPIC = "kv@pod-a@tiny-llama"


def events_daemon(factory: Any, replay: bool = True) -> tuple[DaemonProcess, str, str]:
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    env = {"KVSTORE_EVENTS_ENDPOINT": pub, "KVSTORE_EVENTS_TOPIC": TOPIC}
    if replay:
        env["KVSTORE_EVENTS_REPLAY_ENDPOINT"] = rep
    return factory(env=env), pub, rep


def disconnected(sock: zmq.Socket[bytes], send: Any, ask: Any, seconds: float = 20.0) -> bool:
    """Watch ``sock`` (connected) while ``send()`` goes: True once the daemon cuts it,
    False once ``ask()`` says the daemon read what was sent, or time is up."""
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        send()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if monitor.poll(100):
                return True
            if ask():
                return False
        return False
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def test_a_frame_larger_than_any_request_is_refused_before_it_is_read(
        daemon_factory: Any) -> None:
    # A replay request is 8 bytes and a subscription a topic's prefix, but both sockets
    # read frames of any size whole: a peer's 1 GiB frame cost the daemon 1 GiB.
    d, pub, rep = events_daemon(daemon_factory)
    ctx = zmq.Context()
    big, sub, asker = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        with Client(d.endpoint, tenant="acme") as c:
            def read() -> bool:
                return bool(c.stats()["events"]["bad_replays"])
            big.connect(rep)
            assert disconnected(big, lambda: big.send_multipart([b"", b"x" * (1 << 20)]),
                                read), "the daemon read a 1 MiB replay request"
            assert c.stats()["events"]["bad_replays"] == 0
            sub.connect(pub)
            assert disconnected(
                sub, lambda: sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode() + b"x" * (1 << 16)),
                lambda: False), "the daemon read a 64 KiB subscription"
            asker.connect(rep)  # a request of the right size is answered
            asker.send_multipart([b"", (0).to_bytes(8, "big")])
            assert asker.poll(10_000), "no replay answer"
            frames = asker.recv_multipart()
            assert frames[1] == (0).to_bytes(8, "big")  # the first batch: all cleared
    finally:
        for sock in (big, sub, asker):
            sock.close(linger=0)
        ctx.term()


def test_a_subscription_to_another_topic_makes_no_one_a_listener(
        daemon_factory: Any) -> None:
    # A subscriber to a topic no batch matches heard nothing, yet it made the daemon
    # build every batch and ask every writer for its token ids; and each distinct topic
    # was kept in the daemon's set.
    d, pub, _ = events_daemon(daemon_factory, replay=False)
    ctx = zmq.Context()
    stranger, router = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    try:
        stranger.setsockopt(zmq.SUBSCRIBE, b"kv@pod-b@")
        stranger.connect(pub)
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            base = 0

            def put() -> None:
                nonlocal base
                keys = ns.keys(list(range(base, base + IDENT.block_tokens)))
                base += IDENT.block_tokens
                ns.put(keys, [b"\1" * IDENT.block_bytes])
                time.sleep(0.06)  # its batch reads the subscriptions

            for _ in range(10):
                put()
            assert not c.tokens_wanted, "token ids asked for a stream nobody hears"
            assert c.stats()["events"]["batches"] == 1  # the first (all cleared) only
            router.setsockopt(zmq.SUBSCRIBE, b"kv@pod-a")  # a prefix of the topic
            router.connect(pub)
            deadline = time.monotonic() + 20
            while not c.tokens_wanted:  # (the control: subscriptions are read)
                assert time.monotonic() < deadline, "a matching subscriber went unheard"
                put()
    finally:
        stranger.close(linger=0)
        router.close(linger=0)
        ctx.term()


def batches_sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A count of the batches the replay sends, counted as it sends them (in ``[0]``):
    what a loop turn sent, where the peers' reads would count what ZeroMQ's I/O threads
    had carried by then (several turns' worth on a loaded machine)."""
    sent = [0]
    answer_of = events._answer

    def counted(*args: Any) -> Any:
        answer = answer_of(*args)
        sent[0] += answer[0]
        return answer

    monkeypatch.setattr(events, "_answer", counted)
    return sent


def ring_publisher(tmp_path: Path, ring: int) -> tuple[EventPublisher,
                                                     asyncio.AbstractEventLoop, EventsConfig]:
    """A publisher with a replay socket, on a loop of its own (turned by hand), that has
    sent ``ring`` batches (``b"batch N"``) to nobody: all in its ring."""
    config = EventsConfig(endpoint=f"ipc://{tmp_path}/pub.sock",
                          replay_endpoint=f"ipc://{tmp_path}/replay.sock")
    pub = EventPublisher(config, BlockStore(1 << 20, 1 << 20))
    loop = asyncio.new_event_loop()
    pub.open(loop)
    for seq in range(ring):
        assert pub.send(b"batch %d" % seq, 1, listened=False) == seq
    return pub, loop, config


def test_replay_answers_go_out_a_slice_a_loop_turn_whole_and_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Peers asking from the ring's first batch were answered whole, 16 requests a
    # call: with a ring of 1500 batches four peers held every client's reply up to
    # 170 ms; with 10000 and 16 peers, seconds.
    ring, sent = 3000, batches_sent(monkeypatch)
    pub, loop, config = ring_publisher(tmp_path, ring)
    ctx = zmq.Context()
    peers = [ctx.socket(zmq.DEALER) for _ in range(3)]
    try:
        for peer in peers:
            peer.connect(config.replay_endpoint)
            peer.send_multipart([b"", (0).to_bytes(8, "big")])
            peer.send_multipart([b"", (ring - 2).to_bytes(8, "big")])
        got: list[list[int]] = [[] for _ in peers]
        deadline = time.monotonic() + 60
        most = 0
        while sum(len(g) for g in got) < len(peers) * (ring + 4):
            assert time.monotonic() < deadline, [len(g) for g in got]
            sent[0] = 0
            loop.call_soon(loop.stop)
            loop.run_forever()  # one turn of the loop
            most = max(most, sent[0])
            time.sleep(0.005)  # (ZeroMQ's I/O threads carry what the turn sent)
            for peer, seqs in zip(peers, got):
                while peer.poll(0):
                    _, seq, payload = peer.recv_multipart()
                    seqs.append(int.from_bytes(seq, "big", signed=True))
                    assert seq == END_SEQ or payload == b"batch %d" % seqs[-1]
        whole = [*range(ring), -1, ring - 2, ring - 1, -1]
        assert got == [whole] * len(peers)  # each its two answers, one after the other
        assert most == _REPLAY_BATCHES_A_TURN, f"{most} batches in one loop turn"
        assert pub.replays == 2 * len(peers) and pub.cut_replays == 0
    finally:
        for peer in peers:
            peer.close(linger=0)
        ctx.term()
        pub.close()
        loop.close()


def test_a_request_read_while_an_answer_goes_out_adds_no_slice_to_a_turn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The replay socket's reader served replays too, and each serving set the next turn's:
    # a request arriving while an answer was under way (the socket woke the loop) added a
    # serving to every later turn, until the answers ran out: with peers asking again
    # while the ring went out, a turn sent 4096 batches, not 256.
    ring, sent = 3000, batches_sent(monkeypatch)
    pub, loop, config = ring_publisher(tmp_path, ring)
    ctx = zmq.Context()
    reader, asker = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        reader.connect(config.replay_endpoint)
        asker.connect(config.replay_endpoint)
        reader.send_multipart([b"", (0).to_bytes(8, "big")])
        deadline = time.monotonic() + 10
        while not events._readable(pub._replay):  # type: ignore[arg-type]
            assert time.monotonic() < deadline, "the request never arrived"
            time.sleep(0.001)
        turns, asked = [], 0
        deadline = time.monotonic() + 30
        while sum(turns) < ring + asked:  # the ring, then a batch a request
            assert time.monotonic() < deadline, turns
            if turns and asked < 6:  # another request: the socket wakes the loop with it
                asker.send_multipart([b"", (ring - 1).to_bytes(8, "big")])
                asked += 1
                # (the wake may be another's: ZeroMQ's commands wake it too, and a
                # request in a queue read since wakes nobody: it is read in a turn)
                select.select([pub._fds[-1]], [], [], 1)
            sent[0] = 0
            loop.call_soon(loop.stop)
            loop.run_forever()  # one turn of the loop
            turns.append(sent[0])
            if not sent[0]:
                time.sleep(0.001)  # (a request on its way)
        assert max(turns) == _REPLAY_BATCHES_A_TURN, turns
        assert sum(turns) == ring + asked, turns
    finally:
        for sock in (reader, asker):
            sock.close(linger=0)
        ctx.term()
        pub.close()
        loop.close()


def test_requests_past_every_sequence_number_leave_the_replay_serving(
        daemon_factory: Any) -> None:
    # A request's 8 bytes read as a number up to 2**64: past 2**63 a slice of the ring
    # failed, and each such request kept one of the 16 answers under way for ever;
    # sixteen of them and nobody was answered again until a restart.
    d, _, rep = events_daemon(daemon_factory)
    ctx = zmq.Context()
    attacker, router = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        attacker.connect(rep)
        for n in range(40):
            attacker.send_multipart([b"", (2**64 - 1 - n).to_bytes(8, "big")])
        # each is answered with the end marker alone (nothing after the last batch)
        for _ in range(40):
            assert attacker.poll(10_000), "a request past the last batch went unanswered"
            assert attacker.recv_multipart()[1] == END_SEQ
        with Client(d.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            ns.put(ns.keys(range(64)), [bytes(ns.block_bytes)] * 4)
            router.connect(rep)
            router.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while True:
                assert router.poll(10_000), "the replay stopped answering"
                frames = router.recv_multipart()
                if frames[1] == END_SEQ:
                    break
                seqs.append(int.from_bytes(frames[1], "big"))
            assert seqs and seqs[0] == 0
            assert c.stats()["events"]["replays"] == 41
        assert d.alive()
    finally:
        for sock in (attacker, router):
            sock.close(linger=0)
        ctx.term()


def test_a_second_start_leaves_the_first_daemons_ipc_stream_alone(
        daemon_factory: Any, tmp_path: Path) -> None:
    # A second daemon of the same configuration (a start by mistake, a restart racing)
    # bound the event socket's path before it found the first serving and gave up:
    # ZeroMQ took the path over, and the first daemon's stream reached no new subscriber.
    stream = f"ipc://{tmp_path}/events.sock"
    first = daemon_factory(env={"KVSTORE_EVENTS_ENDPOINT": stream})
    second = DaemonProcess(tmp_path / "second", env={"KVSTORE_EVENTS_ENDPOINT": stream})
    try:
        with pytest.raises(RuntimeError, match="exited early"):
            second.start()
    finally:
        assert second.stop() == 2  # a configuration error
    assert "events.endpoint: another daemon is serving" in second.log()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(stream)
        time.sleep(0.5)  # the subscription reaches the daemon
        with Client(first.endpoint, tenant="acme") as c:
            ns = c.namespace(IDENT)
            ns.put(ns.keys(range(64)), [bytes(ns.block_bytes)] * 4)
        assert sub.poll(5_000), "the first daemon's stream reached no new subscriber"
    finally:
        sub.close(linger=0)
        ctx.term()
