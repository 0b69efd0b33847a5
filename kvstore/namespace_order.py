"""The store's namespaces in the order they were made, for walks that go through them
a few at a time across loop turns (a paged snapshot's): such a walk keeps only the
serial number of the last one it reached, never a copy of them all.

Each paged snapshot under way held a list of every namespace of the daemon (8 bytes
each), as many as 4 a session, and a tenant may hold 4096 sessions: 2000 such walks
begun and never finished at 20k namespaces held 307 MiB.  Forgotten namespaces stay in
the order, skipped, until they are as many as those the store knows: then it is
rebuilt without them (at a namespace's making, so amortized O(1) a namespace).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

from kvstore.blocks import Namespace

_SLACK = 64  # forgotten namespaces kept at the least before a rebuild


class NamespaceOrder:
    """Namespaces by serial number (1, 2, ...: the order they were made in)."""

    def __init__(self, spaces: Iterable[Namespace] = ()) -> None:
        self.serials: list[int] = []
        self.spaces: list[Namespace] = []
        self.last = 0  # the serial of the newest
        for ns in spaces:
            self.add(ns, 0)

    def __repr__(self) -> str:
        return f"NamespaceOrder(kept={len(self.spaces)}, last={self.last})"

    def add(self, ns: Namespace, known: int) -> None:
        """``ns`` is new, the store knowing ``known`` namespaces (``ns`` among them)."""
        if len(self.spaces) >= 2 * known + _SLACK:
            kept = [at for at, each in enumerate(self.spaces) if not each.forgotten]
            self.serials = [self.serials[at] for at in kept]
            self.spaces = [self.spaces[at] for at in kept]
        self.last += 1
        self.serials.append(self.last)
        self.spaces.append(ns)

    def after(self, serial: int) -> tuple[int, Namespace | None]:
        """The first namespace made after ``serial`` that the order still holds, with
        its serial (forgotten since, perhaps); ``(last, None)`` if there is none."""
        at = bisect_right(self.serials, serial)
        if at == len(self.serials):
            return self.last, None
        return self.serials[at], self.spaces[at]
