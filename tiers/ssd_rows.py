"""A warm restart's index records as columns, and the plan that keeps or drops them.

``plan_load`` (``ssd_layout``) decides over ``BlockRecord`` objects: at ten million
records those cost about 350 bytes each while the restart runs (the struct, three ids
as ``bytes``, four ints and a float) and a Python call each to check.  Here the index is
read a chunk at a time into numpy columns (ids as pairs of 64-bit words, offsets,
lengths, checksums), each chunk's records let go as soon as its columns are taken, and
the same rules run over the columns: records that do not fit the layout are dropped,
and those whose prefix does not reach a root.  Only the block keys stay objects (a
restored block keeps its key).

The columns cover the common case, an index as the daemon writes it.  Where slots
overlap (a crash between a write and the index's removal of the copy it replaced), or
a key is there twice, the plan is None and the caller takes ``plan_load``'s path,
which settles those record by record: the two give the same survivors in the same
order (tests hold them to it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, is_

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .ssd_index import decode_chunk
from .ssd_layout import ID_BYTES, BlockRecord, SlabLayout, closed_rows

_NO_ID = bytes(ID_BYTES)
_namespace = attrgetter("namespace")
_key = attrgetter("key")
_parent = attrgetter("parent")
_offset = attrgetter("offset")
_length = attrgetter("length")
_checksum = attrgetter("checksum")
_size_class = attrgetter("size_class")


@dataclass
class Rows:
    """Index records as columns, one row each; ``spaces`` are the namespace ids, in the
    order first seen, and ``space`` each row's place among them.  The ids' words
    (``key_words``, ``parent_words``, ``roots``) are emptied once a plan is made of them:
    the plan's ``keys`` and parent rows say the same."""

    spaces: list[bytes] = field(default_factory=list)
    space: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    key_words: np.ndarray = field(default_factory=lambda: np.empty((0, 2), np.uint64))
    parent_words: np.ndarray = field(default_factory=lambda: np.empty((0, 2), np.uint64))
    roots: np.ndarray = field(default_factory=lambda: np.empty(0, bool))
    offset: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    length: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    checksum: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))
    size_class: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def __len__(self) -> int:
        return len(self.offset)


@dataclass
class RowsPlan:
    """What a warm restart keeps, in columns: ``order`` the surviving rows, parents
    before children (``plan_load``'s order), ``parent`` each row's parent row (-1: a
    root); ``invalid`` and ``orphans`` the index keys dropped, by reason; ``keys`` the
    block keys of ``order``'s rows, in its order (made in the order the restore makes
    its blocks: each one's key is then next in memory to the one before, where made in
    the index's order and picked out by ``order`` each was a cache miss, a fifth of a
    warm restart's CPU outside its blocks)."""

    rows: Rows
    order: np.ndarray
    parent: np.ndarray
    invalid: list[bytes]
    orphans: list[bytes]
    keys: list[bytes] = field(default_factory=list)

    @property
    def dropped_keys(self) -> list[bytes]:
        return self.invalid + self.orphans


# The builder's columns: namespace place, key words, parent words, roots, offset,
# length, checksum, size class (``decode_values``'s, the namespace ids made places).
_COLUMNS = ((np.int64, ()), (np.uint64, (2,)), (np.uint64, (2,)), (bool, ()),
            (np.int64, ()), (np.int64, ()), (np.uint64, ()), (np.int64, ()))


class RowsBuilder:
    """Takes an index scan's entries a chunk at a time into columns, with the index
    keys of records that do not fit ``layout`` set apart (as ``plan_load`` would)."""

    def __init__(self, layout: SlabLayout, expected: int = 0) -> None:
        """``expected``: entries the scan will likely give (the columns are made that
        long at once, and filled in place: no chunk's arrays kept to be joined)."""
        self.layout = layout
        self.invalid: list[bytes] = []
        self._spaces: dict[bytes, int] = {}
        self._n = 0
        self._columns = tuple(np.empty((expected, *shape), dtype=dtype)
                              for dtype, shape in _COLUMNS)

    def add(self, index_keys: Sequence[bytes], values: Sequence[bytes],
            bad: list[bytes]) -> None:
        """One chunk of the scan, in index order (``SSDIndex.scan_into``'s ``take``):
        in arrays where the values allow, else record by record."""
        columns = decode_values(index_keys, values)
        if columns is not None:
            columns = self._fitting(columns, lambda lost: list(
                itertools.compress(index_keys, lost.tolist())))
        else:
            columns = self._records(decode_chunk(index_keys, values, bad))
        self._put((self._space(columns[0]), *columns[1:]))

    def add_mapped(self, buf: np.ndarray, key_at: np.ndarray, lens: np.ndarray,
                   bad: list[bytes]) -> None:
        """``add`` of a chunk of entries read in place (``SSDIndex.scan_mapped``'s
        ``take``): each one's index key at ``key_at`` in ``buf``, its value of ``lens``
        bytes right after it.  Decoded there where the values allow, else made
        ``bytes`` and taken as ``add`` takes them."""
        columns = decode_mapped(buf, key_at, lens)
        if columns is None:
            self.add(_mapped_bytes(buf, key_at, 2 * ID_BYTES),
                     _mapped_bytes(buf, key_at + 2 * ID_BYTES, lens), bad)
            return
        columns = self._fitting(columns, lambda lost: _mapped_bytes(
            buf, key_at[lost], 2 * ID_BYTES))
        self._put((self._space(columns[0]), *columns[1:]))

    def _fitting(self, columns: tuple[np.ndarray, ...],
                 keys_of: Callable[[np.ndarray], list[bytes]]) -> tuple[np.ndarray, ...]:
        """The rows of ``columns`` that fit the layout; the index keys of the others
        (``keys_of`` a mask of them) set apart."""
        fits = self._fits(columns)
        if fits.all():
            return columns
        self.invalid.extend(keys_of(~fits))
        return tuple(c[fits] for c in columns)

    def _put(self, columns: tuple[np.ndarray, ...]) -> None:
        start, end = self._n, self._n + len(columns[0])
        if end > len(self._columns[0]):  # more than expected: room for as many again
            self._columns = tuple(
                np.concatenate([c[:start], np.empty((max(end, 2 * start), *c.shape[1:]),
                                                    dtype=c.dtype)])
                for c in self._columns)
        for mine, chunk in zip(self._columns, columns):
            mine[start:end] = chunk
        self._n = end

    def _records(self, records: list[BlockRecord]) -> tuple[np.ndarray, ...]:
        """The columns of the records that fit the layout, the others' keys set apart."""
        layout, kept = self.layout, []
        for record in records:
            if layout.fits(record) or layout.problem(record) is None:
                kept.append(record)
            else:
                self.invalid.append(record.index_key)
        m = len(kept)
        parents = list(map(_parent, kept))
        return (
            _words(map(_namespace, kept), m), _words(map(_key, kept), m),
            _words((_NO_ID if p is None else p for p in parents), m),
            np.fromiter(map(is_, parents, itertools.repeat(None)), dtype=bool, count=m),
            np.fromiter(map(_offset, kept), dtype=np.int64, count=m),
            np.fromiter(map(_length, kept), dtype=np.int64, count=m),
            np.fromiter(map(_checksum, kept), dtype=np.uint64, count=m),
            np.fromiter(map(_size_class, kept), dtype=np.int64, count=m))

    def _fits(self, columns: tuple[np.ndarray, ...]) -> np.ndarray:
        """``SlabLayout.fits`` of each row (ids are 16 bytes and numbers in range
        already: ``decode_values``)."""
        offset, length, size = columns[4], columns[5], columns[7]
        cap, slab = self.layout.capacity_bytes, self.layout.slab_bytes
        # bounded first, so that the end below cannot wrap
        fits = (length > 0) & (length <= cap) & (size >= 0) & (size <= cap)
        fits &= (size == 0) | (length <= size)
        fits &= (offset >= 0) & (offset <= cap)
        end = offset + np.maximum(length, size)
        fits &= (end <= cap) & (offset // slab == (end - 1) // slab)
        return fits

    def _space(self, ns_words: np.ndarray) -> np.ndarray:
        """Each row's namespace as its place among those seen, first seen first."""
        m = len(ns_words)
        if m == 0:
            return np.empty(0, dtype=np.int64)
        if (ns_words == ns_words[0]).all():  # one namespace (the common case): no sort
            one = self._spaces.setdefault(ns_words[0].tobytes(), len(self._spaces))
            return np.full(m, one, dtype=np.int64)
        raw = np.ascontiguousarray(ns_words).view(f"V{ID_BYTES}").ravel()
        seen, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
        spaces = self._spaces
        place = np.empty(len(seen), dtype=np.int64)
        for i in np.argsort(first, kind="stable").tolist():
            place[i] = spaces.setdefault(seen[i].tobytes(), len(spaces))
        return place[inverse.ravel()]

    def rows(self) -> Rows:
        """The columns taken (the builder is spent)."""
        n, columns = self._n, self._columns
        self._columns = ()
        rows = Rows(spaces=list(self._spaces))
        (rows.space, rows.key_words, rows.parent_words, rows.roots, rows.offset,
         rows.length, rows.checksum, rows.size_class) = (c[:n] for c in columns)
        return rows


def _keys_of(key_words: np.ndarray, rows: np.ndarray | None = None) -> list[bytes]:
    """The keys of ``key_words``' rows (or of those ``rows`` picks, in their order), as
    ``bytes``; a chunk at a time, so that no copy of all the words is made.  Made by
    ``tolist`` of the rows as 16-byte voids (each a ``bytes`` of all 16, trailing zeros
    kept, unlike the ``S16`` type's), in C: 2.5 times as fast as slicing a ``bytes``."""
    keys: list[bytes] = []
    count = len(key_words) if rows is None else len(rows)
    for start in range(0, count, _KEYS_CHUNK):
        part = slice(start, start + _KEYS_CHUNK)
        words = np.ascontiguousarray(key_words[part] if rows is None else key_words[rows[part]])
        keys += words.view(f"V{ID_BYTES}").ravel().tolist()
    return keys


_KEYS_CHUNK = 1 << 16


def _mapped_bytes(buf: np.ndarray, at: np.ndarray, lens: np.ndarray | int) -> list[bytes]:
    """The bytes of ``buf`` at each of ``at``, ``lens`` long (each, or all alike)."""
    ends = (at + lens).tolist()
    return [buf[a:b].tobytes() for a, b in zip(at.tolist(), ends)]


def _words(ids: Iterator[bytes], m: int) -> np.ndarray:
    """16-byte ids as rows of two 64-bit words."""
    return np.frombuffer(b"".join(ids), dtype=np.uint64).reshape(m, 2)


# -- the index values, decoded in arrays ---------------------------------------------------
# ``encode_record`` writes a record as a msgpack array of its 8 fields: ids as bin 8 of
# 16 bytes, the parent nil or such an id, ints in the shortest unsigned form, the time
# a float 64.  Values in that shape are read here in arrays; any other (an older field
# count, a signed int, a value past 2**62 where a signed 64-bit column is wanted) is
# left to msgspec, which accepts all that this does, with the same values.
_UINT_WIDTH = np.zeros(256, dtype=np.int64)  # bytes an unsigned int takes, by its tag
_UINT_WIDTH[:0x80] = 1
_UINT_WIDTH[[0xCC, 0xCD, 0xCE, 0xCF]] = [2, 3, 5, 9]
_BIG = np.uint64(1 << 62)
_HEAD = 55  # bytes of the array tag, the ids with their bin tags, and the parent


def decode_values(index_keys: Sequence[bytes], values: Sequence[bytes],
                  ) -> tuple[np.ndarray, ...] | None:
    """The columns of a chunk of index entries: (namespace words, key words, parent
    words, roots, offset, length, checksum, size class); None unless every value is in
    ``encode_record``'s shape and sits under its own key (namespace + key)."""
    m = len(values)
    if m == 0 or set(map(len, index_keys)) != {2 * ID_BYTES}:
        return None
    lens = np.fromiter(map(len, values), dtype=np.int64, count=m)
    buf = np.frombuffer(b"".join(values) + bytes(_PAD), dtype=np.uint8)
    columns = _decode(buf, np.cumsum(lens) - lens, lens)
    if columns is None:
        return None
    index = np.frombuffer(b"".join(index_keys), dtype=np.uint8).reshape(m, 2 * ID_BYTES)
    return _under_own_keys(index, columns)


def decode_mapped(buf: np.ndarray, key_at: np.ndarray,
                  lens: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """``decode_values`` of entries read in place (``ssd_pages``): each one's index key
    at ``key_at`` in ``buf``, its value of ``lens`` bytes right after it.  None also
    where a value lies too near the end of ``buf`` for the reads past it."""
    if not len(key_at) or int(key_at.max()) + 2 * ID_BYTES + _PAD > len(buf):
        return None
    columns = _decode(buf, key_at + 2 * ID_BYTES, lens)
    if columns is None:
        return None
    return _under_own_keys(sliding_window_view(buf, 2 * ID_BYTES)[key_at], columns)


def _under_own_keys(index: np.ndarray,
                    columns: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...] | None:
    """``columns`` where each row's index key (rows of 32 bytes) is its namespace and
    key, else None."""
    ids, keys = columns[0], columns[1]
    if not ((index[:, :ID_BYTES] == ids).all() and (index[:, ID_BYTES:] == keys).all()):
        return None
    return (ids.view(np.uint64), keys.view(np.uint64), *columns[2:])


_PAD = 128  # bytes a value's decoding may read past its start and its end


def _decode(buf: np.ndarray, at: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """The values of ``lens`` bytes at ``at`` in ``buf`` (which goes on ``_PAD``
    bytes past each): (namespace ids, keys, parent ids as rows of 16 bytes, roots,
    offset, length, checksum, size class); None unless each is in
    ``encode_record``'s shape."""
    ok = (lens >= 51) & (buf[at] == 0x98) & (buf[at + 1] == 0xC4) & (buf[at + 2] == 16)
    ok &= (buf[at + 19] == 0xC4) & (buf[at + 20] == 16)
    at = np.where(ok, at, 0)  # a short value's reads stay inside the buffer
    # the three ids and the tags around them, in one read: the rows of a window over
    # the buffer (a view), each row copied whole, where a byte-by-byte index of
    # 55 columns a row was a third of the decoding
    head = sliding_window_view(buf, _HEAD)[at]
    roots = head[:, 37] == 0xC0
    ok &= roots | ((head[:, 37] == 0xC4) & (head[:, 38] == 16))
    ids = np.ascontiguousarray(head[:, 3:19])
    keys = np.ascontiguousarray(head[:, 21:37])
    parents = np.ascontiguousarray(head[:, 39:55])
    parents[roots] = 0
    if not ok.all():
        return None
    pos = at + np.where(roots, 38, 55)
    numbers = []
    for _ in range(3):
        value, pos, good = _uint(buf, pos)
        ok &= good
        numbers.append(value)
    ok &= buf[pos] == 0xCB  # last_access: a float 64, not kept
    size, pos, good = _uint(buf, pos + 9)
    ok &= good & (pos == at + lens)
    offset, length, checksum = numbers
    ok &= (offset < _BIG) & (length < _BIG) & (size < _BIG)
    if not ok.all():
        return None
    return (ids, keys, parents.view(np.uint64), roots, offset.astype(np.int64),
            length.astype(np.int64), checksum, size.astype(np.int64))


def _uint(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The unsigned msgpack ints at ``pos``: values, the positions after them, and
    which were unsigned ints at all."""
    tag = buf[pos]
    width = _UINT_WIDTH[tag]
    # the 8 bytes after the tag, big-endian: an int of fewer is their top bytes
    tail = sliding_window_view(buf, 8)[pos + 1].view(">u8").ravel()
    value = tail >> (8 * (9 - np.maximum(width, 2))).astype(np.uint64)
    value = np.where(width == 1, tag.astype(np.uint64), value)
    return value, pos + np.maximum(width, 1), width > 0


def plan_rows(rows: Rows) -> RowsPlan | None:
    """``plan_load`` over the columns of records that fit the layout: None where slots
    overlap or a key is there twice (``plan_load`` settles those)."""
    n = len(rows)
    if _any_overlap(rows):
        return None
    if n == 0:
        empty = np.empty(0, np.int64)
        return RowsPlan(rows, empty, empty, [], [], [])
    spaces = np.frombuffer(b"".join(rows.spaces), dtype=np.uint64).reshape(-1, 2)
    if len(rows.spaces) > 1:
        rank, ns_words = rows.space, spaces[rows.space]
    else:  # the one namespace's words, not a copy a row
        rank, ns_words = None, np.broadcast_to(spaces[0], (n, 2))
    split = closed_rows(ns_words, rows.key_words, rows.parent_words, rows.roots, rank)
    del ns_words
    if split is None:
        return None
    order, closed, parent = split
    orphans: list[bytes] = []
    if len(order) < n:
        lost = np.flatnonzero(~closed)
        orphans = [rows.spaces[s] + key for s, key in zip(
            rows.space[lost].tolist(), _keys_of(rows.key_words, lost))]
    keys = _keys_of(rows.key_words, order)
    # the ids' words are done with: let them go before the restore makes its blocks
    rows.key_words = rows.parent_words = np.empty((0, 2), dtype=np.uint64)
    rows.roots = np.empty(0, dtype=bool)
    return RowsPlan(rows, order, parent, [], orphans, keys)


def _any_overlap(rows: Rows) -> bool:
    """``ssd_layout._any_overlap`` over the columns."""
    if len(rows) < 2:
        return False
    extent = np.maximum(rows.length, rows.size_class)
    if extent.min() == extent.max() > 0:  # one slot size (the common case)
        size, n = int(extent[0]), len(rows)
        if size & (size - 1):
            slot, rest = np.divmod(rows.offset, size)
        else:  # (a power of two, as slots mostly are: no division)
            slot, rest = rows.offset >> (size.bit_length() - 1), rows.offset & (size - 1)
        if not rest.any() and int(slot.max()) < 4 * n + (1 << 20):
            # every slot aligned to the size: they overlap only where one is there
            # twice, which a mark a slot finds with no sort
            seen = np.zeros(int(slot.max()) + 1, dtype=bool)
            seen[slot] = True
            return int(np.count_nonzero(seen)) < n
        return bool(np.any(np.diff(np.sort(rows.offset)) < size))
    order = np.argsort(rows.offset, kind="stable")
    starts = rows.offset[order]
    furthest = np.maximum.accumulate(starts + np.maximum(rows.length, rows.size_class)[order])
    return bool(np.any(starts[1:] < furthest[:-1]))


def rows_of(records: Sequence[BlockRecord], layout: SlabLayout) -> RowsPlan:
    """The survivors ``plan_load`` decided, as a plan of rows in their order (each
    parent there before its children, in the same namespace)."""
    builder = RowsBuilder(layout, len(records))
    columns = builder._records(list(records))
    builder._put((builder._space(columns[0]), *columns[1:]))
    rows = builder.rows()
    where: dict[tuple[int, bytes], int] = {}
    parent = np.full(len(rows), -1, dtype=np.int64)
    for i, (s, record) in enumerate(zip(rows.space.tolist(), records)):
        if record.parent is not None:
            parent[i] = where[s, record.parent]
        where[s, record.key] = i
    return RowsPlan(rows, np.arange(len(rows), dtype=np.int64), parent, [], [],
                    list(map(_key, records)))
