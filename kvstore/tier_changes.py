"""Tier changes as plain data: which copies blocks gained and lost, for the event stream.

The store marks each block whose copies changed (``TierChanges.touch``: a commit, a
write to SSD, a promotion, a copy dropped, a remote mark, a GPU copy); the daemon drains
the marks once per loop turn and gets, per block, the tiers it gained and lost since the
last drain, compared with what was announced (``Block.announced``, a bit per tier).
Copies that came and went within one turn are never announced, and a block that is
touched twice is announced once.  Nothing here does I/O: the daemon's publisher
(``kvstore.events``) turns the changes into vLLM's KV events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore.blocks import ANNOUNCED, DRAM, REMOTE_MARK, SSD, Block, Namespace

REMOTE = "remote"
GPU = "gpu"

# One bit per tier, and the tiers fastest first (a lookup reports the fastest).
TIER_BITS: tuple[tuple[str, int], ...] = ((GPU, 8), (DRAM, 1), (SSD, 2), (REMOTE, 4))
# The tiers of each combination of bits, fastest first (drain runs once per loop turn
# over every block that changed: it looks them up rather than test four bits).
_TIERS_OF: tuple[tuple[str, ...], ...] = tuple(
    tuple(tier for tier, bit in TIER_BITS if bits & bit) for bits in range(16))


def holdings(block: Block) -> int:
    """The tiers (bits of ``TIER_BITS``) the block has a copy in now; 0 once it left
    the store."""
    if block.ns.blocks.get(block.key) is not block:
        return 0
    bits = 0
    if block.offset is not None:
        bits |= 1
    if block.ssd_offset is not None:
        bits |= 2
    if block.marks & REMOTE_MARK:
        bits |= 4
    if block.gpu_offset is not None:
        bits |= 8
    return bits


@dataclass(eq=False)
class Stored:
    """Blocks of one chain that gained a copy in ``tier``: each block's parent is the
    one before it (the first's is ``blocks[0].parent``)."""

    tier: str
    ns: Namespace
    blocks: list[Block]


@dataclass(eq=False)
class Removed:
    """Keys of one namespace whose copy in ``tier`` went."""

    tier: str
    ns: Namespace
    keys: list[bytes]


Change = Stored | Removed


class TierChanges:
    """The blocks whose copies changed since the last drain.

    ``on_first`` runs when the first block is marked after a drain: the daemon uses it
    to schedule the drain (a plain callable, so the store stays free of the loop);
    ``on_more`` when a commit's run joins marks already there (the daemon drains then if
    the batch is due: no wake of its own while commits keep coming).
    """

    def __init__(self, on_first: Callable[[], None] | None = None,
                 on_more: Callable[[], None] | None = None) -> None:
        # Marks in order: a block, or a commit's run of blocks (a list, one mark for them
        # all), a block marked twice listed twice: the drain's second look finds nothing
        # new.  A list, not a set: blocks are distinct by identity, and a key dropped and cached
        # again in one turn is two entries.
        self.touched: list[Block | list[Block]] = []
        self.runs: list[list[Block]] = []  # of the marks, commits' runs
        # Of the runs, by id, the blocks that were announced in DRAM already when the run
        # was marked (each lost its DRAM copy since the last drain, and the commit gave it
        # back): rare, and their DRAM bit was not set by the mark.
        self.kept: dict[int, list[Block]] = {}
        # the blocks marked alone (a drain unfolds the runs they overlap, if any), but for
        # those marked together (a restored index's, at start: no set of them all)
        self.singles: set[Block] = set()
        self.unlisted = False  # blocks were marked together since the last drain
        self.on_first = on_first
        self.on_more = on_more
        # The removals to announce of those drained (``kvstore.shared_keys``, set as the
        # store starts counting its keys): none of a key another namespace holds there
        self.sieve: Callable[[Iterable[Removed]], list[Removed]] | None = None

    def touch(self, block: Block) -> None:
        touched = self.touched
        if not touched and self.on_first is not None:
            self.on_first()
        touched.append(block)
        self.singles.add(block)

    def touch_all(self, blocks: Iterable[Block]) -> None:
        touched = self.touched
        if not touched:
            if self.on_first is not None:
                self.on_first()
        elif self.on_more is not None:  # a commit's blocks marked one by one
            self.on_more()
        touched.extend(blocks)
        self.unlisted = True

    def touch_run(self, blocks: list[Block]) -> None:
        """Blocks of one chain, each the parent of the next, that have just gained their
        DRAM copy (a commit's): one mark for all of them, kept by reference (the caller
        leaves the list as it is).

        Their DRAM bit of ``announced`` is set now, while the commit has them in the
        CPU's caches, not by the drain, which would read each block again a loop turn
        or more later (a batch's drain walked every block of every commit in it: the
        most of its cost in a daemon whose caches other work filled meanwhile).  Until
        the drain the bit is provisional: a run unfolded (a block of it marked alone
        since) has it cleared again (``_unfold_overlaps``), so its blocks compare with
        what was announced."""
        if not blocks:
            return
        touched = self.touched
        if not touched:
            if self.on_first is not None:
                self.on_first()
        elif self.on_more is not None:
            self.on_more()
        kept: list[Block] | None = None
        for b in blocks:  # (``marks``, not the properties: a call a block less)
            marks = b.marks
            if marks & 1:  # announced in DRAM (the low bits are ``announced``'s)
                if kept is None:
                    kept = self.kept[id(blocks)] = []
                kept.append(b)
            else:
                b.marks = marks | 1
        touched.append(blocks)
        self.runs.append(blocks)

    def __len__(self) -> int:
        """How many marks (a commit's run is one)."""
        return len(self.touched)

    def drain(self) -> list[Change]:
        """What changed since the last drain, removals first (a key dropped and cached
        again in one turn ends up cached), then stores in the order blocks were marked,
        as runs of one chain, one tier and one namespace.

        Once per batch over every block marked, so the common marks take short paths: a
        commit's run that nothing else marked since gained exactly its DRAM copies (any
        later change of one of its blocks marks that block), announced with a bit set
        per block; a block marked alone is compared with what was announced."""
        touched, self.touched = self.touched, []
        runs, self.runs = self.runs, []
        singles, self.singles = self.singles, set()
        unlisted, self.unlisted = self.unlisted, False
        kept, self.kept = self.kept, {}
        if runs and (unlisted or singles and not all(map(singles.isdisjoint, runs))):
            touched = _unfold_overlaps(touched, None if unlisted else singles, kept)
        removed: dict[tuple[str, int], Removed] = {}
        stored: list[Stored] = []
        last: dict[str, Stored] = {}  # per tier but DRAM, the run the next may extend
        dram: list[Block] = []        # the DRAM run the next block may extend
        dram_last: Block | None = None
        dram_gone: list[bytes] = []   # the keys of the last namespace's DRAM removals
        gone_ns: Namespace | None = None
        tiers_of = _TIERS_OF
        for block in touched:
            if isinstance(block, list):  # a commit's run, untouched since: its DRAM copies
                # (their bits set as the run was marked)
                first = block[0]
                if first.parent is dram_last and dram_last is not None:
                    dram.extend(block)
                else:
                    dram = block.copy()
                    stored.append(Stored(DRAM, first.ns, dram))
                dram_last = block[-1]
                continue
            marks = block.marks  # (``announced`` and ``remote``, read without a call)
            before = marks & ANNOUNCED
            # What the block holds now.  An entry out of the map holds no copy but may
            # keep its remote mark: looked up only then.
            now = 0 if block.offset is None else 1
            if block.ssd_offset is not None:
                now |= 2
            rare = block.rare  # ``Block.gpu_offset``, inline: most blocks have no record
            if rare is not None and rare.gpu_offset is not None:
                now |= 8
            if marks & REMOTE_MARK:
                key = block.key
                entries = block.ns.blocks  # ``BlockMap.get``, inline
                if entries.shards[hash(key) & entries.mask].get(key) is block:
                    now |= 4
            if now == before:
                continue
            block.marks = marks ^ before | now  # (``announced = now``)
            new = now & ~before
            if new == 1:  # the common case, a DRAM copy gained (a block's parent is of
                # its namespace: one chain is one namespace)
                if block.parent is dram_last and dram_last is not None:
                    dram.append(block)
                else:
                    dram = [block]
                    stored.append(Stored(DRAM, block.ns, dram))
                dram_last = block
            elif new:
                for tier in tiers_of[new]:
                    if tier == DRAM:
                        if block.parent is dram_last and dram_last is not None:
                            dram.append(block)
                        else:
                            dram = [block]
                            stored.append(Stored(DRAM, block.ns, dram))
                        dram_last = block
                        continue
                    s = last.get(tier)
                    if s is not None and block.parent is s.blocks[-1]:
                        s.blocks.append(block)
                    else:
                        s = last[tier] = Stored(tier, block.ns, [block])
                        stored.append(s)
            gone = before & ~now
            if gone == 1 and block.ns is gone_ns:  # the common case: evicted from DRAM
                dram_gone.append(block.key)
            elif gone:
                ns = block.ns
                for tier in tiers_of[gone]:
                    run = removed.get((tier, id(ns)))
                    if run is None:
                        run = removed[(tier, id(ns))] = Removed(tier, ns, [])
                    run.keys.append(block.key)
                    if tier == DRAM:
                        dram_gone, gone_ns = run.keys, ns
        if removed and self.sieve is not None:
            return [*self.sieve(removed.values()), *stored]
        return [*removed.values(), *stored]

    def drain_runs(self) -> list[list[Block]] | None:
        """The commits' runs marked since the last drain, taken as drained, when they
        are all that was marked (a busy daemon's common batch: nothing evicted, copied
        or marked alone since); None, the marks left as they are, otherwise (or none).

        What ``drain`` would make of them, without walking them: each run gained its
        DRAM copies (their bits set as it was marked), and a run that continues the one
        before joins its event (``dram_runs``).  The batch is then built straight from
        the runs, with no ``Stored`` made or list copied a run."""
        runs = self.runs
        if not runs or self.singles or self.unlisted or len(runs) != len(self.touched):
            return None
        self.touched, self.runs, self.kept = [], [], {}
        return runs

    def settle(self) -> bool:
        """Take what changed since the last drain as announced without building it (a
        batch nobody hears: numbered, never built); whether anything changed.  The bits
        end as ``drain`` leaves them, so the next batch compares with the same."""
        touched, self.touched = self.touched, []
        runs, self.runs = self.runs, []
        singles, self.singles = self.singles, set()
        unlisted, self.unlisted = self.unlisted, False
        kept, self.kept = self.kept, {}
        if runs and (unlisted or singles and not all(map(singles.isdisjoint, runs))):
            touched = _unfold_overlaps(touched, None if unlisted else singles, kept)
        changed = False
        for block in touched:
            if isinstance(block, list):  # a commit's run: its DRAM copies, new (their
                changed = True               # bits set as the run was marked)
                continue
            rare, marks = block.rare, block.marks
            now = holdings(block) if marks & REMOTE_MARK else (
                (block.offset is not None) | (block.ssd_offset is not None) << 1
                | (rare is not None and rare.gpu_offset is not None) << 3)
            if now != marks & ANNOUNCED:
                block.marks = marks & ~ANNOUNCED | now  # (``announced = now``)
                changed = True
        return changed


def dram_runs(runs: list[list[Block]]) -> list[Change]:
    """Commits' runs (``drain_runs``) as ``drain`` lists them: one ``Stored`` in DRAM a
    run, a run that continues the one before joined to it."""
    stored: list[Change] = []
    dram: list[Block] = []
    last: Block | None = None
    for run in runs:
        first = run[0]
        if first.parent is last and last is not None:
            dram.extend(run)
        else:
            dram = run.copy()
            stored.append(Stored(DRAM, first.ns, dram))
        last = run[-1]
    return stored


def _unfold_overlaps(touched: list[Block | list[Block]], singles: set[Block] | None,
                     kept: dict[int, list[Block]]) -> list[Block | list[Block]]:
    """The marks with each commit's run that a block marked alone (of ``singles``; None:
    found here) overlaps (a copy it gained or lost since) as its blocks, marked one by
    one, their provisional DRAM bits cleared (but for the run's ``kept``: announced in
    DRAM before the run was marked)."""
    if singles is None:
        singles = {b for b in touched if not isinstance(b, list)}
    out: list[Block | list[Block]] = []
    for mark in touched:
        if isinstance(mark, list) and not singles.isdisjoint(mark):
            before = kept.get(id(mark), ())
            for b in mark:
                if b not in before:
                    b.marks &= ~1  # (``announced``'s DRAM bit)
            out.extend(mark)
        else:
            out.append(mark)
    return out
