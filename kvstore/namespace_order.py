"""The store's namespaces in the order they were made, for walks that go through them
a few at a time across loop turns (a paged snapshot's): such a walk keeps only the
serial number of the last one it reached, never a copy of them all.

Each paged snapshot under way held a list of every namespace of the daemon (8 bytes
each), as many as 4 a session, and a tenant may hold 4096 sessions: 2000 such walks
begun and never finished at 20k namespaces held 307 MiB.  Forgotten namespaces stay in
the order, skipped, until they are as many as those the store knows: then it is
rebuilt without them (amortized O(1) a namespace).  That was looked at only when a
namespace was made: 50 sessions of 1000 namespaces that ended left all 50k in the order
(and their blocks' maps: most of the 75 MiB they took) until the tenant opened another;
it is looked at as each is forgotten too, and the order holds each by a weak reference,
so that a namespace forgotten goes at once, a slice of closes at a time, and a rebuild
only lets go of those references.
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from collections.abc import Iterable

from kvstore.blocks import Namespace

_SLACK = 64  # forgotten namespaces kept at the least before a rebuild


class NamespaceOrder:
    """Namespaces by serial number (1, 2, ...: the order they were made in)."""

    def __init__(self, spaces: Iterable[Namespace] = ()) -> None:
        self.serials: list[int] = []
        self.spaces: list[weakref.ref[Namespace]] = []  # (a dead one: forgotten)
        self.last = 0  # the serial of the newest
        for ns in spaces:
            self.add(ns, 0)

    def __repr__(self) -> str:
        return f"NamespaceOrder(kept={len(self.spaces)}, last={self.last})"

    def add(self, ns: Namespace, known: int) -> None:
        """``ns`` is new, the store knowing ``known`` namespaces (``ns`` among them)."""
        self._prune(known)
        self.last += 1
        self.serials.append(self.last)
        self.spaces.append(weakref.ref(ns))

    def forgot(self, ns: Namespace, known: int) -> None:
        """The store forgot ``ns`` and knows ``known`` namespaces now."""
        ns.forgotten = True
        self._prune(known)

    def _prune(self, known: int) -> None:
        """Rebuilt without the forgotten once they are most of it."""
        if len(self.spaces) >= 2 * known + _SLACK:
            kept = [(serial, each) for serial, each in zip(self.serials, self.spaces)
                    if (ns := each()) is not None and not ns.forgotten]
            self.serials = [serial for serial, _ in kept]
            self.spaces = [each for _, each in kept]

    def after(self, serial: int) -> tuple[int, Namespace | None]:
        """The first namespace made after ``serial`` that the order still holds, with
        its serial (forgotten since, perhaps); ``(last, None)`` if there is none."""
        at = bisect_right(self.serials, serial)
        while at < len(self.serials):  # (past those gone, at most as many as there are)
            ns = self.spaces[at]()
            if ns is not None:
                return self.serials[at], ns
            at += 1
        return self.last, None
