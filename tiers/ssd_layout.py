"""What the SSD tier's index holds, and the rules that decide which records survive a restart.

Pure: records and arithmetic only, no files.  The flat byte space of ``capacity_bytes`` is
cut into slabs of ``slab_bytes``; slab ``i`` covers ``[i * slab_bytes, (i + 1) * slab_bytes)``
and, on disk, the same range of the single data file.  A block (with its size-class slot)
lies inside one slab.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, is_
from typing import Any

import msgspec
import numpy as np

from .ssd_closure import children_of, closed_by_levels, parents_in_key_order, walk_order

FORMAT_VERSION = 1
ID_BYTES = 16
IO_ALIGN = 4096  # direct I/O alignment; also covers 512-byte-sector devices
_U64_MAX = (1 << 64) - 1


class BlockRecord(msgspec.Struct, frozen=True, array_like=True):
    """One block on SSD: where its bytes are and how to check them.

    ``checksum`` is xxh3_64 of the bytes; ``write_blocks`` computes it, so callers leave
    it at 0 when they write.  ``size_class`` is the slot size of the block's size class in
    bytes (0: the slot is exactly ``length`` bytes).  New fields go at the end, with defaults.
    """

    namespace: bytes
    key: bytes
    parent: bytes | None
    offset: int
    length: int
    checksum: int = 0
    last_access: float = 0.0
    size_class: int = 0

    @property
    def index_key(self) -> bytes:
        """The LMDB key: namespace id followed by block key."""
        return self.namespace + self.key

    @property
    def span(self) -> int:
        """Bytes of the slot the block occupies."""
        return max(self.length, self.size_class)

    @property
    def end(self) -> int:
        """First offset past the block's slot."""
        return self.offset + self.span


_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(BlockRecord)


def encode_record(record: BlockRecord) -> bytes:
    """The index value of a record."""
    return _record_encoder.encode(record)


# A record from its index value; raises ``msgspec.ValidationError``/``DecodeError``.
decode_record: Callable[[bytes | memoryview], BlockRecord] = _record_decoder.decode


@dataclass(frozen=True)
class SlabLayout:
    """The flat offset space that the daemon's slab pool addresses."""

    capacity_bytes: int
    slab_bytes: int

    @property
    def slabs(self) -> int:
        """Number of slabs."""
        return self.capacity_bytes // self.slab_bytes

    def slabs_of(self, record: BlockRecord) -> range:
        """Slab numbers the record's slot touches (one, for a record that fits)."""
        return range(record.offset // self.slab_bytes, (record.end - 1) // self.slab_bytes + 1)

    def fits(self, record: BlockRecord) -> bool:
        """True for a record that ``problem`` passes, in one expression (a warm restart
        asks it of every record; False may also mean ``problem`` should say why)."""
        offset, length, size_class = record.offset, record.length, record.size_class
        end = offset + (length if length > size_class else size_class)
        parent = record.parent
        return (len(record.namespace) == ID_BYTES and len(record.key) == ID_BYTES
                and (parent is None or len(parent) == ID_BYTES)
                and 0 < length and (size_class == 0 or 0 < length <= size_class)
                and 0 <= record.checksum <= _U64_MAX and 0 <= offset
                and end <= self.capacity_bytes
                and offset // self.slab_bytes == (end - 1) // self.slab_bytes)

    def problem(self, record: BlockRecord) -> str | None:
        """Why the record cannot be in this layout, or None when it fits."""
        if len(record.namespace) != ID_BYTES or len(record.key) != ID_BYTES:
            return "namespace and key must be 16 bytes"
        if record.parent is not None and len(record.parent) != ID_BYTES:
            return "parent key must be 16 bytes"
        if record.length <= 0:
            return f"length {record.length} is not positive"
        if record.size_class < 0 or (record.size_class and record.length > record.size_class):
            return f"length {record.length} does not fit size class {record.size_class}"
        if not 0 <= record.checksum <= _U64_MAX:
            return "checksum is not a 64-bit unsigned integer"
        if record.offset < 0 or record.end > self.capacity_bytes:
            return (
                f"slot [{record.offset}, {record.end}) is outside capacity {self.capacity_bytes}"
            )
        if len(self.slabs_of(record)) != 1:
            return f"slot [{record.offset}, {record.end}) crosses a slab boundary"
        return None


def overlapping_groups(records: Iterable[BlockRecord]) -> list[list[BlockRecord]]:
    """Groups of two or more records whose slots overlap (transitively)."""
    records = records if isinstance(records, list) else list(records)
    if not _any_overlap(records):  # the common case, in arrays: a fifth of the walk's time
        return []
    groups: list[list[BlockRecord]] = []
    current: list[BlockRecord] = []
    current_end = -1
    for record in sorted(records, key=_offset):
        # ``record.end``, inline: a warm restart runs this for every record
        offset, length, size_class = record.offset, record.length, record.size_class
        end = offset + (length if length > size_class else size_class)
        if offset < current_end:
            current.append(record)
            if end > current_end:
                current_end = end
            continue
        if len(current) > 1:
            groups.append(current)
        current, current_end = [record], end
    if len(current) > 1:
        groups.append(current)
    return groups


_offset = attrgetter("offset")
_key = attrgetter("key")
_length = attrgetter("length")
_size_class = attrgetter("size_class")


def _any_overlap(records: list[BlockRecord]) -> bool:
    """Whether any two records' slots overlap (sorted by offset, each starts before the
    furthest end of those before it)."""
    n = len(records)
    if n < 2:
        return False
    offsets = np.fromiter(map(_offset, records), dtype=np.int64, count=n)
    spans = np.maximum(np.fromiter(map(_length, records), dtype=np.int64, count=n),
                       np.fromiter(map(_size_class, records), dtype=np.int64, count=n))
    order = np.argsort(offsets, kind="stable")
    starts = offsets[order]
    furthest = np.maximum.accumulate(starts + spans[order])
    return bool(np.any(starts[1:] < furthest[:-1]))


def settle_overlap(
    group: Sequence[BlockRecord], verify: Callable[[BlockRecord], bool]
) -> tuple[list[BlockRecord], list[BlockRecord]]:
    """Split an overlapping group into (kept, dropped): keep records whose bytes verify,
    most recently used first, as long as they do not overlap one already kept."""
    kept: list[BlockRecord] = []
    dropped: list[BlockRecord] = []
    for record in sorted(group, key=lambda r: r.last_access, reverse=True):
        clashes = any(record.offset < k.end and k.offset < record.end for k in kept)
        if not clashes and verify(record):
            kept.append(record)
        else:
            dropped.append(record)
    return kept, dropped


def prefix_closed(records: Iterable[BlockRecord]) -> tuple[list[BlockRecord], list[BlockRecord]]:
    """Split records into (closed, orphans).

    ``closed`` holds every record whose chain of parents, in its namespace, reaches a root
    (parent None), parents before children; ``orphans`` the rest, cycles included.
    O(records): in arrays (``_closed_in_arrays``) where they allow, else one walk up
    from each record to the first ancestor already decided (``_closed_by_walk``); the
    two give the same lists in the same order.
    """
    everything = list(records)
    split = _closed_in_arrays(everything)
    return split if split is not None else _closed_by_walk(everything)


def _closed_by_walk(
    everything: list[BlockRecord],
) -> tuple[list[BlockRecord], list[BlockRecord]]:
    """``prefix_closed`` record by record: the order is that of this walk."""
    by_ns: dict[bytes, dict[bytes, BlockRecord]] = {}
    for record in everything:
        keyed = by_ns.get(record.namespace)
        if keyed is None:
            keyed = by_ns[record.namespace] = {}
        keyed[record.key] = record
    closed: list[BlockRecord] = []
    rooted: dict[bytes, dict[bytes, bool]] = {}
    extend = closed.extend
    for ns, keyed in by_ns.items():
        state = rooted[ns] = {}  # key -> whether its chain reaches a root
        known_of, above_of = state.get, keyed.get  # bound once: this runs per record
        for key, record in keyed.items():
            if key in state:
                continue
            path = [record]
            state[key] = False  # until decided: a walk that comes back is a cycle
            parent = record.parent
            while True:
                if parent is None:
                    good = True
                    break
                known = known_of(parent)
                if known is not None:
                    good = known
                    break
                above = above_of(parent)
                if above is None:
                    good = False
                    break
                path.append(above)
                state[parent] = False
                parent = above.parent
            if good:
                state.update(dict.fromkeys(map(_key, path), True))
                path.reverse()
                extend(path)  # parents before children
    if len(closed) == len(everything):  # every record reached: none is an orphan
        return closed, []
    orphans = [r for r in everything if not rooted[r.namespace][r.key]]
    return closed, orphans


_namespace = attrgetter("namespace")
_parent = attrgetter("parent")


def _closed_in_arrays(
    everything: list[BlockRecord],
) -> tuple[list[BlockRecord], list[BlockRecord]] | None:
    """``prefix_closed`` in arrays, for records of 16-byte ids with no (namespace, key)
    twice (None otherwise): the same split, in the same order as its walk, at a warm
    restart's scale.

    Each record's ancestor 2, 4, 8... steps up is found by doubling (a record whose
    parent is missing points at DEAD, a root at ROOT; one that reaches neither within
    as many doublings as it takes to pass every record is in a cycle): a record is
    closed when it reaches ROOT.  The walk lists a record after its parent, in the
    group of the first record (in input order) below it, nearest the root first: so
    the order is by namespace (first seen first), then by the first position among the
    record's descendants and itself (a minimum gathered up by the same doubling), then
    by depth.
    """
    n = len(everything)
    spaces = list(map(_namespace, everything))
    keys = list(map(_key, everything))
    parents = list(map(_parent, everything))
    joined = b"".join(spaces), b"".join(keys), b"".join([_NO_ID if p is None else p
                                                           for p in parents])
    if n < 2 or any(len(j) != n * ID_BYTES for j in joined):
        return None
    ns_words, key_words, parent_words = (
        np.frombuffer(j, dtype=np.uint64).reshape(n, 2) for j in joined)
    roots = np.fromiter(map(is_, parents, itertools.repeat(None)), dtype=bool, count=n)
    ranks = dict.fromkeys(spaces)
    rank = None
    if len(ranks) > 1:
        rank_of = {ns: i for i, ns in enumerate(ranks)}
        rank = np.fromiter(map(rank_of.__getitem__, spaces), dtype=np.int64, count=n)
    split = closed_rows(ns_words, key_words, parent_words, roots, rank)
    if split is None:
        return None
    order, closed, _ = split
    survivors = list(map(everything.__getitem__, order.tolist()))
    if len(survivors) == n:
        return survivors, []
    return survivors, list(itertools.compress(everything, (~closed).tolist()))


def closed_rows(
    ns_words: np.ndarray, key_words: np.ndarray, parent_words: np.ndarray,
    roots: np.ndarray, rank: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``_closed_in_arrays`` over columns: rows of (namespace, key, parent) as pairs of
    64-bit words, which rows are roots, and each row's namespace rank (None: one
    namespace).  Returns the closed rows in the walk's order, the mask of closed rows
    and each row's parent row (-1 for a root or a missing parent); None where a
    (namespace, key) is there twice, or two fingerprints are alike (the walk decides).

    Rows in the index's key order (a warm restart's) find their parents by that order,
    others by fingerprint; the closure goes level by level from the roots, or, in a
    forest too deep for that, by doubling (``ssd_closure``).  Each way gives the same.
    """
    n = len(roots)
    found = parents_in_key_order(key_words, parent_words, roots, rank)
    if found is not None:
        parent_row, kids, kid_parent = found
    else:
        by_print = _parents_by_print(ns_words, key_words, parent_words, roots, rank)
        if by_print is None:
            return None
        parent_row = by_print
        kids, kid_parent = children_of(parent_row)
    split = closed_by_levels(roots, kids, kid_parent)
    del kids, kid_parent
    if split is None:
        split = _closed_by_doubling(parent_row, roots)
    closed, depth, first = split
    if rank is None or found is not None:  # (in key order, namespaces' rows are apart)
        order = walk_order(closed, depth, first)
    else:
        kept = np.flatnonzero(closed)
        order = kept[np.lexsort((depth[kept], first[kept], rank[kept]))]
    return order, closed, parent_row


def _parents_by_print(
    ns_words: np.ndarray, key_words: np.ndarray, parent_words: np.ndarray,
    roots: np.ndarray, rank: np.ndarray | None,
) -> np.ndarray | None:
    """Each row's parent row (-1: a root or a parent not there) for rows in any order,
    by a sort of fingerprints of (namespace, key); None where two are alike."""
    n = len(roots)
    mine = _fingerprint(ns_words, key_words)
    by_print = np.argsort(mine, kind="stable")
    prints = mine[by_print]
    if n > 1 and not np.all(prints[1:] != prints[:-1]):
        return None  # a key twice, or two fingerprints alike: the walk decides
    # where each parent's fingerprint would be (looked up in order: a third of the time
    # of looking up at random); its record if the ids match exactly
    wanted = _fingerprint(ns_words, parent_words)
    by_wanted = np.argsort(wanted)
    spot = np.empty(n, dtype=np.int64)
    spot[by_wanted] = np.searchsorted(prints, wanted[by_wanted])
    at = by_print[np.minimum(spot, n - 1)]
    found = key_words[at]
    same = (found[:, 0] == parent_words[:, 0]) & (found[:, 1] == parent_words[:, 1])
    del found
    if rank is not None:  # (one namespace: every row's is the same)
        same &= (ns_words[at] == ns_words).all(axis=1)
    same &= ~roots
    return np.where(same, at, -1)


def _closed_by_doubling(
    parent_row: np.ndarray, roots: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``ssd_closure.closed_by_levels`` for any forest, deep ones too: each row's
    ancestor 2, 4, 8... steps up found by doubling (a row whose parent is missing
    points at DEAD, a root at ROOT; one that reaches neither within as many doublings
    as it takes to pass every row is in a cycle), its first position gathered up by
    the same doubling.  (closed mask, depth, first position.)"""
    n = len(roots)
    root, dead = n, n + 1
    # rows as 32-bit ints where they fit: the doubling's gathers are random reads over
    # these arrays, and at millions of rows half the bytes is fewer cache misses (the
    # closure at 5M rows was 1.5 us a row against 0.9 at 1M)
    index: np.dtype[np.signedinteger[Any]] = np.dtype(np.int32 if n + 2 < 2**31 else np.int64)
    up = np.full(n + 2, dead, dtype=index)
    has = parent_row >= 0
    up[:n][has] = parent_row[has]
    up[:n][roots] = root
    up[root] = root
    depth = np.ones(n + 2, dtype=index)
    depth[root:] = 0
    first = np.arange(n + 2, dtype=index)  # the first position in each one's subtree
    # the rows still climbing, and where each has got to: a row leaves once it reaches
    # the root or a dead end, so each round looks only at those still on their way
    rows = np.flatnonzero(up[:n] < root).astype(index)
    above = up[rows]
    for _ in range(n.bit_length() + 1):
        if not len(rows):
            break
        # ``first`` covers descendants less than 2**k below; those 2**k to 2**(k+1)
        # below are covered by the one 2**k below that is their ancestor
        np.minimum.at(first, above, first[rows])
        depth[rows] += depth[above]
        above = up[above]
        up[rows] = above
        climbing = above < root
        rows, above = rows[climbing], above[climbing]
    return up[:n] == root, depth[:n], first[:n]


_NO_ID = bytes(ID_BYTES)


def _fingerprint(ns_words: np.ndarray, key_words: np.ndarray) -> np.ndarray:
    """A 64-bit mix of each (namespace, key) pair's four words (equal ids, equal prints)."""
    mixed: np.ndarray = ns_words[:, 0] * np.uint64(0x9E3779B97F4A7C15) + ns_words[:, 1]
    mixed = mixed * np.uint64(0xBF58476D1CE4E5B9) + key_words[:, 0]
    mixed = mixed * np.uint64(0x94D049BB133111EB) + key_words[:, 1]
    mixed ^= mixed >> np.uint64(31)
    return mixed


@dataclass
class LoadPlan:
    """What a warm restart keeps and drops, by reason."""

    survivors: list[BlockRecord] = field(default_factory=list)
    invalid: list[bytes] = field(default_factory=list)
    overlapping: list[BlockRecord] = field(default_factory=list)
    orphans: list[BlockRecord] = field(default_factory=list)

    @property
    def dropped_keys(self) -> list[bytes]:
        """Index keys of every dropped record."""
        return (
            self.invalid
            + [r.index_key for r in self.overlapping]
            + [r.index_key for r in self.orphans]
        )


def plan_load(
    records: Iterable[BlockRecord],
    layout: SlabLayout,
    verify: Callable[[BlockRecord], bool],
    invalid_keys: Iterable[bytes] = (),
) -> LoadPlan:
    """Decide which index records survive: those that fit the layout, do not overlap
    (or, where they do, whose bytes verify), and whose prefix is all there.

    ``verify`` reads a record's bytes and checks them; it is called only for overlaps.
    """
    plan = LoadPlan(invalid=list(invalid_keys))
    fitting: list[BlockRecord] = []
    fits = layout.fits
    for record in records:
        if fits(record) or layout.problem(record) is None:
            fitting.append(record)
        else:
            plan.invalid.append(record.index_key)
    losers: set[bytes] = set()
    for group in overlapping_groups(fitting):
        _, dropped = settle_overlap(group, verify)
        plan.overlapping.extend(dropped)
        losers.update(r.index_key for r in dropped)
    if losers:
        fitting = [r for r in fitting if r.index_key not in losers]
    plan.survivors, plan.orphans = prefix_closed(fitting)
    return plan
