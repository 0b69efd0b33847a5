"""A capacity refusal waits for unsent get replies briefly in all, not per reply: a peer
that asks for many gets and never reads them leaves as many replies unsent, and a wait
for each held the daemon's loop for seconds (an attack review found 2 s stalls)."""

from __future__ import annotations

from typing import Any

import zmq

from kvstore.transport import Transport


class Unsent:
    """A reply zmq never sends: its wait takes the time it is given, then NotDone."""

    def __init__(self, waits: list[float]) -> None:
        self.waits = waits
        self.done = False

    def wait(self, timeout: float) -> None:
        self.waits.append(timeout)
        raise zmq.NotDone


class Sent(Unsent):
    def wait(self, timeout: float) -> None:
        self.waits.append(timeout)


class Shell:
    """What ``wait_for_sends`` uses of a transport."""

    def __init__(self, trackers: list[Any]) -> None:
        self._in_flight = [(t, i) for i, t in enumerate(trackers)]
        self.reaped = 0

    def reap_sends(self) -> None:
        self.reaped += 1


def test_the_wait_is_bounded_in_all_and_stops_at_the_first_unsent_reply() -> None:
    waits: list[float] = []
    shell = Shell([Sent(waits)] * 3 + [Unsent(waits)] * 4000)
    assert Transport.wait_for_sends(shell, 0.005)  # type: ignore[arg-type]
    assert len(waits) == 4  # three sent, one unsent: the other 3999 not waited on
    assert sum(waits) <= 0.005 * 4 and all(w <= 0.005 for w in waits)
    assert shell.reaped == 1


def test_nothing_in_flight_is_no_wait() -> None:
    shell = Shell([])
    assert not Transport.wait_for_sends(shell, 0.005)  # type: ignore[arg-type]
    assert shell.reaped == 0
