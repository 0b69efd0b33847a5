"""A peer that asks for get after get and never reads the replies leaves them all unsent,
pinned (within its bytes-in-flight limit: some 15k replies of 64 KiB blocks).  Looking
for sent ones must not walk them all: the daemon looks every millisecond while any are
unsent, and after each pinned reply to anyone (half a core, before, at 15k)."""

from __future__ import annotations

from kvstore.transport import RepliesInFlight


class Tracker:
    """A zmq MessageTracker's ``done``, counting the looks."""

    looks = 0

    def __init__(self, done: bool) -> None:
        self._done = done

    @property
    def done(self) -> bool:
        Tracker.looks += 1
        return self._done


def test_reaping_looks_at_each_peers_first_unsent_reply_only() -> None:
    replies = RepliesInFlight()
    for pin in range(10_000):  # a peer that never reads
        replies.add(b"\0mallory", Tracker(False), pin)  # type: ignore[arg-type]
    for pin in range(10_000, 10_003):  # a reader: two sent, then one not yet
        replies.add(b"\0reader", Tracker(pin < 10_002), pin)  # type: ignore[arg-type]
    released: list[int] = []
    Tracker.looks = 0
    assert replies.reap(released.append) == 2
    assert released == [10_000, 10_001] and len(replies) == 10_001
    assert Tracker.looks <= 4  # each peer's first unsent, and the two sent
    Tracker.looks = 0
    assert replies.reap(released.append, b"\0reader") == 0  # one peer's, if asked
    assert Tracker.looks == 1
    assert len(replies.trackers({10_002, 5})) == 2 and len(replies.trackers()) == 10_001


def test_a_reply_copied_as_it_was_sent_is_not_held_behind_the_peers_big_ones() -> None:
    """pyzmq copies frames under its copy threshold, and their tracker is done at once,
    while a big zero-copy reply queued ahead of it to the same peer is not sent yet: the
    small reply's pin must go at the next reap, not wait behind the big one (for ever,
    if the peer never reads)."""
    import time

    import zmq

    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.setsockopt(zmq.SNDHWM, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.RCVBUF, 4096)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hi")
        rid, _ = router.recv_multipart()
        replies, peer = RepliesInFlight(), b"\0" + rid
        big = router.send_multipart([rid, b"h", memoryview(bytearray(256 << 20))],
                                    copy=False, track=True)
        small = router.send_multipart([rid, b"h", memoryview(bytearray(4096))],
                                      copy=False, track=True)
        assert big is not None and small is not None
        replies.add(peer, big, 1)
        replies.add(peer, small, 2)
        time.sleep(0.2)
        assert not big.done and small.done  # the peer reads nothing
        released: list[int] = []
        assert replies.reap(released.append) == 1
        assert released == [2] and len(replies) == 1
        assert replies.trackers() == [big]
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()
