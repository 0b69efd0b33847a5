"""A duel's sampled references taken by its miniatures, at once or a slice a turn.

Each sampled reference (``Duel._sample``) costs each miniature a reference of its own,
room made first: about 9 us of CPU a sampled key with ``auto``'s four candidates, a
cache of 64k blocks (``benchmarks/evict_hold.py``).  A commit of 4096 new blocks is 512
of them, 4.8 of the 7.5 ms such a commit held the daemon's loop (its events off).  The
daemon's store takes a request's first ``Backlogs.allowance`` sampled references at
once (every request of a replay: its decisions are its simulator's) and keeps the rest
in the duel's backlog, in order, for the loop's next turns (``Backlogs.catch_up``, a
slice a turn, each after the request's reply is sent); whatever the duel is asked
meanwhile, its miniatures take the references in the order they came, with the tick,
the cache's size and count, whether it had evicted yet and the parent they had then,
so they end as they would have at once: only the elections they hold come a turn or a
few later.  ``BACKLOG_MOST`` bounds a backlog (past it, the oldest reference is taken at
once).  Without ``Backlogs`` (the simulator, an in-process store) every reference is
taken at once; a duel leaving charge (a change of policy) takes each at once again.

Pure: the duel's attributes are read by name (``kvstore.scheduler.dueling`` imports
this module, not the other way round).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvstore.scheduler.sharded import ShardedDict

# A backlog's most references (past it the oldest is taken at once): about 37 ms of
# miniatures' work at 9 us each, should requests of thousands of sampled blocks come
# faster than the loop's turns take them.
BACKLOG_MOST = 4096
# Sampled references a request takes at once, and a turn of the loop takes of the
# backlogs after it (about 0.6 ms at 9 us each): a commit of up to 512 new blocks at
# one key in eight (more in a bigger cache, sampled more thinly), a lookup of 512 keys,
# never wait a turn.  At 128, a commit of 4096 blocks at 64k held the loop 5.1-5.3 ms
# with events on (7.5-8.7 taking all 512 at once; ``evict_hold.py``).
A_TURN = 64

ASK = object()  # ``refer``'s parent: the item's, asked for at once
# a reference kept: key, parent, hit, tick, the cache's most items, its items, evicted yet
Kept = tuple[int, Any, bool, int, int, int, bool]


class Backlogs:
    """The store's duels with sampled references still to take, and how many more a
    request may take at once (``allowance``, given again after each request)."""

    __slots__ = ("waiting", "allowance", "taken")

    def __init__(self) -> None:
        self.waiting: dict[Any, None] = {}  # duels (``Duel``) with a backlog, oldest first
        self.allowance = A_TURN
        self.taken = 0  # references taken from backlogs so far (a figure)

    def __len__(self) -> int:
        return sum(len(duel._backlog) for duel in self.waiting)

    def next_request(self) -> None:
        """A request is done: the next one takes ``A_TURN`` at once again."""
        self.allowance = A_TURN

    def catch_up(self, most: int = A_TURN) -> bool:
        """Take up to ``most`` backlogged references, duel by duel in the order they
        were kept; whether any are still waiting."""
        waiting = self.waiting
        while most > 0 and waiting:
            duel = next(iter(waiting))
            try:
                taken = duel.catch_up(most)
            except BaseException:  # (a bug) its references go, the others' are taken on
                duel._backlog.clear()
                del waiting[duel]
                raise
            most -= taken
            self.taken += taken
            if not duel._backlog:
                del waiting[duel]
        return bool(waiting)


def refer(duel: Any, key: int, item: Any, parent: Any, hit: bool, tick: int,
          size: int, count: int, evicted: bool) -> None:
    """The miniatures of ``duel`` take a reference to the sampled ``key`` (its item, or
    the item's ``parent`` as it was, ``hit``: whether the real cache held it), made at
    ``tick`` in a cache of ``size`` items at most so far, ``count`` now, that had
    ``evicted`` one or not yet (an election it ends reads them)."""
    nodes = duel._nodes
    shard = nodes.shards[hash(key) % nodes.modulus]  # ``nodes``' get and set, inline
    node = shard.get(key)
    if node is None:
        node = shard[key] = duel._node(key, tick)
        nodes.grown(1)
        if hit:
            duel.reality.ahead += 1  # the first miniature holds no key without a node
    elif node.last == tick:
        return  # the same hit reported again (lookup, then acquire)
    else:
        node.last = tick
        if hit != (node.m0_kids is not None):
            if hit:
                duel.reality.ahead += 1
            else:
                duel.reality.behind += 1
    if duel._lingering:
        duel._lingering = forget(duel._lingering, nodes, tick)
    minis = duel._minis
    if node.held == len(minis):
        # every miniature holds it (a hit in each: no room made, no parent asked for),
        # their ``reference`` inline
        for mini in minis:
            mini.hits += 1
            mini.touch((node,))
        duel._sampled += 1
        if duel._sampled >= duel.epoch:
            duel._elect(size, count, evicted)
        return
    # The miniatures hold a 2**-shift sample of a cache of ``size`` items.
    capacity = max(1, size >> duel.sample_shift)
    if parent is ASK:
        parent = duel.parent_of_item(item)
    if parent is None:
        parent_node = None
    else:
        # a tracked parent's state names it: out of the sample (most), it has no node
        state = duel._items.get(parent)
        if state is None:
            parent_node = nodes.get(duel.name_hash(duel.ghost_key(parent)))
        elif state is True or state is False:
            parent_node = None
        else:
            parent_node = nodes.get(state >> 1)
    dropped: list[Any] = []
    duel._reference(minis, node, parent_node, capacity, nodes, dropped)
    for gone in dropped:
        if not gone.held:  # no miniature holds it: no node, unless stamped this tick
            if gone.last == tick:
                duel._lingering.append(gone)
            else:
                del nodes[gone.key]
    duel._sampled += 1
    if duel._sampled >= duel.epoch:
        duel._elect(size, count, evicted)


def keep(duel: Any, backlogs: Backlogs, key: int, item: Any, hit: bool) -> None:
    """A sampled reference kept in ``duel``'s backlog, with its parent as it is now;
    past ``BACKLOG_MOST`` the oldest kept is taken at once."""
    backlog: deque[Kept] = duel._backlog
    if not backlog:
        backlogs.waiting[duel] = None
    backlog.append((key, duel.parent_of_item(item), hit, duel._tick, duel._size,
                    len(duel._items), duel._evicted))
    if len(backlog) > BACKLOG_MOST:
        key, *then = backlog.popleft()
        refer(duel, key, None, *then)


def kept_whole(duel: Any) -> bool:
    """Whether the duel's next sampled reference waits, taking none now (so it holds no
    election: the callers' runs of items go on past it)."""
    backlogs = duel._backlogs
    return (backlogs is not None and (bool(duel._backlog) or backlogs.allowance <= 0)
            and len(duel._backlog) < BACKLOG_MOST)


def take(duel: Any, most: int) -> int:
    """Up to ``most`` of ``duel``'s backlog taken, oldest first: how many."""
    backlog = duel._backlog
    taken = 0
    while backlog and taken < most:
        key, *then = backlog.popleft()
        refer(duel, key, None, *then)
        taken += 1
    return taken


def forget(lingering: list[Any], nodes: ShardedDict[int, Any], tick: int) -> list[Any]:
    """Drop the keys no miniature holds whose dedup stamp has passed: those left."""
    for node in lingering:
        key = node.key
        if not node.held and node.last != tick and nodes.get(key) is node:
            del nodes[key]
    return [node for node in lingering if node.last == tick and not node.held]
