"""A capacity refusal looks again at the unsent get replies without waiting for any: a
peer that asks for many gets and never reads them leaves as many replies unsent, and a
wait for them on the loop (per reply, then 5 ms a refusal) was a stall it could ask for
again and again (attack reviews found 2 s, then 0.6 s)."""

from __future__ import annotations

from typing import Any

from kvstore.transport import Transport


class Tracker:
    def __init__(self, done: bool) -> None:
        self.done = done

    def wait(self, timeout: float) -> None:
        raise AssertionError("a wait on the loop")


class Shell:
    """What ``reap_some`` uses of a transport: its replies in flight, and their reaping."""

    def __init__(self, trackers: list[Any]) -> None:
        self._in_flight = [(t, i) for i, t in enumerate(trackers)]

    def reap_sends(self) -> None:
        self._in_flight = [(t, i) for t, i in self._in_flight if not t.done]


def test_sent_replies_are_reaped_and_none_is_waited_for() -> None:
    shell = Shell([Tracker(True)] * 3 + [Tracker(False)] * 4000)
    assert Transport.reap_some(shell)  # type: ignore[arg-type]
    assert len(shell._in_flight) == 4000
    assert not Transport.reap_some(shell)  # type: ignore[arg-type]  (nothing more went)


def test_nothing_in_flight_is_nothing_reaped() -> None:
    assert not Transport.reap_some(Shell([]))  # type: ignore[arg-type]
