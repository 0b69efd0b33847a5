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
