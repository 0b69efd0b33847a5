"""The SSD index's block entries read in place: LMDB's B-tree walked over a read-only
map of its data file, each entry given as where its key sits there and how long its
value is, in key order, a chunk of leaf pages at a time.

Why: a warm restart reads every entry once.  By cursors each entry became two
``bytes`` (its key and its value), made one at a time by Python calls, only to be
joined again for the arrays that decode them.  Here the pages are parsed by array
operations and the values decoded from copies of the pages (``ssd_rows.decode_mapped``):
10M entries scanned into columns in 3.4-4.1 s of CPU, by cursors 6.9-7.8.

Only an index whose every page on the way checks out is read so: the meta page of the
reading transaction's snapshot, a main database of one leaf naming ``blocks``, pages
of the kind their level wants with their own number in their header, slot and node
bounds inside their page, no flags on a leaf entry (no overflow page, no duplicates),
32-byte keys, and page and entry counts equal to those LMDB keeps.  Anything else is
None, and the caller scans by cursors, which read (or refuse with LMDB's reason) what
they always did.  The snapshot is pinned by the caller's read transaction, so no page
read here is reused while it reads; the map shares the kernel's page cache with
LMDB's writes (the index is not opened with a writable map).

Layout (LMDB 0.9, 64-bit, little-endian): a page's header is its number (8 bytes),
2 bytes of padding, its flags, and the ends of its slot array and of its free space
(2 bytes each); the slots follow (2 bytes each: a node's place in the page).  A node is
two 16-bit halves of its value's size, its flags and its key's size (2 bytes each),
then the key and the value; a branch's node has its child's page number in place of
the size, its bits 32-47 in the flags' place.  ``ssd_index._truncated`` reads the meta pages the same way.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KEY_BYTES = 32  # an index key: namespace id and block key
_HEADER = 16  # a page's header, where its slots start
_NODE = 8  # a node's header, where its key starts
_KINDS = 0x7F  # the flags that say what a page is: branch, leaf, overflow, meta, ...
_BRANCH, _LEAF, _META = 0x01, 0x02, 0x08
_SUBDATA = 0x02  # a main database node naming a database
_MAGIC, _VERSION = 0xBEEFC0DE, 1
_DB_BYTES = 48  # an MDB_db record
PAD = 128  # bytes past a run's pages in its buffer: reads past a value's end stay in it


@dataclass
class Leaves:
    """The data file mapped (``buf``, its bytes) and the ``blocks`` database's leaf
    pages in key order, with each one's entry count (already checked against its
    page's bounds)."""

    buf: np.ndarray
    page_bytes: int
    pages: np.ndarray
    counts: np.ndarray

    def chunks(self, entries: int,
               ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """For runs of leaf pages of about ``entries`` entries: the run's pages copied
        into one buffer (``PAD`` bytes more past them), each entry's key place in it,
        and its value's length; None for a run whose nodes do not check out (the
        caller gives up on the pages then).  The buffer is the same for every run
        (what is kept of one is copied from it before the next).  Copied, for the
        entries' reads then land in a few MB, not all over gigabytes of mapped 4 KiB
        pages: decoding 10M entries where they lie in the map took 4.3-4.6 s of CPU,
        from the copies 3.1 (the copies included)."""
        ends = np.cumsum(self.counts)
        cuts = [0, *np.searchsorted(ends, np.arange(entries, int(ends[-1]), entries),
                                    "right").tolist(), len(self.pages)]
        runs = [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
        size = self.page_bytes
        most = max(b - a for a, b in runs)
        scratch = np.zeros(most * size + PAD, dtype=np.uint8)
        whole = self.buf[: len(self.buf) // size * size].reshape(-1, size)
        for first, last in runs:
            k = last - first
            np.take(whole, self.pages[first:last], axis=0, mode="clip",
                    out=scratch[: k * size].reshape(k, size))
            found = _entries(scratch, size, self.counts[first:last])
            yield None if found is None else (scratch, *found)


def _entries(buf: np.ndarray, size: int,
             counts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Each entry's key place in ``buf`` (leaf pages one after another, ``counts``
    entries each) and its value's length; None where a node is outside its page, has
    flags, or a key of another size."""
    half = buf[: len(buf) & ~1].view("<u2")
    base = np.arange(len(counts), dtype=np.int64) * size
    total = int(counts.sum())
    # each entry's slot: its page's slots' start, plus two bytes a place in them
    first = np.repeat(np.cumsum(counts) - counts, counts)
    slot = np.repeat(base + _HEADER, counts) + 2 * (np.arange(total) - first)
    del first
    at = half[slot >> 1].astype(np.int64)  # the node's place in its page
    del slot
    upper = np.repeat(half[(base + 14) >> 1], counts)
    ok = (at >= upper) & (at & 1 == 0) & (at + _NODE + KEY_BYTES <= size)
    if not ok.all():
        return None
    node = np.repeat(base, counts) + at
    word = node >> 1
    lens = half[word].astype(np.int64) | (half[word + 1].astype(np.int64) << 16)
    ok = (half[word + 2] == 0) & (half[word + 3] == KEY_BYTES)
    ok &= at + _NODE + KEY_BYTES + lens <= size
    if not ok.all():
        return None
    return node + _NODE, lens


@contextmanager
def mapped_leaves(data_file: Path, txn_id: int, stat: Mapping[str, object],
                  name: bytes = b"blocks") -> Iterator[Leaves | None]:
    """The leaf pages of database ``name`` in the snapshot of transaction ``txn_id``
    (held open by the caller for as long as this is), ``stat`` its LMDB figures
    (``Transaction.stat``); None where the file is not one this reads in place."""
    if sys.byteorder != "little" or stat["entries"] == 0 or stat["overflow_pages"]:
        yield None
        return
    try:
        fd = os.open(data_file, os.O_RDONLY)
    except OSError:
        yield None
        return
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
    except (OSError, ValueError):
        mapped = None
    finally:
        os.close(fd)
    if mapped is None:
        yield None
        return
    buf: Any = np.frombuffer(mapped, dtype=np.uint8)
    try:
        yield _leaves(buf, txn_id, stat, name)
    finally:
        del buf
        try:
            mapped.close()
        except BufferError:  # an array still looks at it: the map goes with the array
            pass


def _leaves(buf: np.ndarray, txn_id: int, stat: Mapping[str, object],
            name: bytes) -> Leaves | None:
    size = stat["psize"]
    if (not isinstance(size, int) or size < 512 or size > 65536 or size & (size - 1)
            or len(buf) < 2 * size):
        return None
    pages = len(buf) // size
    meta = next((at for at in (0, size) if _u64(buf, at + 144) == txn_id
                 and _u32(buf, at + 16) == _MAGIC and _u32(buf, at + 20) == _VERSION
                 and _u16(buf, at + 10) & _KINDS == _META and _u32(buf, at + 40) == size),
                None)
    if meta is None:
        return None
    main_root = _u64(buf, meta + 128)
    if _u16(buf, meta + 94) != 1 or not 2 <= main_root < pages:  # one leaf: the names
        return None
    db = _named(buf, main_root * size, size, name)
    if db is None:
        return None
    flags, depth = _u16(buf, db + 4), _u16(buf, db + 6)
    figures = [_u64(buf, db + at) for at in (8, 16, 24, 32, 40)]
    branches, leaves, overflows, entries, root = figures
    if (flags or depth != stat["depth"] or branches != stat["branch_pages"]
            or leaves != stat["leaf_pages"] or overflows or entries != stat["entries"]
            or not 2 <= root < pages):
        return None
    level = np.array([root], dtype=np.int64)
    seen = 0
    for _ in range(depth - 1):
        counts = _counts(buf, level, size, _BRANCH, pages)
        if counts is None or not counts.all():
            return None
        seen += len(level)
        below = _children(buf, level, counts, size, pages)
        if below is None or len(below) > branches + leaves:  # (never grown past them)
            return None
        level = below
    counts = _counts(buf, level, size, _LEAF, pages)
    if (counts is None or seen != branches or len(level) != leaves
            or int(counts.sum()) != entries):
        return None
    return Leaves(buf, size, level, counts)


def _counts(buf: np.ndarray, level: np.ndarray, size: int, kind: int,
            pages: int) -> np.ndarray | None:
    """Each page's slot count, where every page of ``level`` is a page of ``kind``
    holding its own number, with its slots and free space inside it; else None."""
    if len(level) and not ((level >= 2) & (level < pages)).all():
        return None
    base = level * size
    half = buf[: len(buf) & ~1].view("<u2")
    number = buf[: len(buf) & ~7].view("<u8")[base >> 3]
    lower, upper = half[(base + 12) >> 1], half[(base + 14) >> 1]
    ok = (number == level.astype(np.uint64)) & (half[(base + 10) >> 1] & _KINDS == kind)
    ok &= (lower >= _HEADER) & (lower & 1 == 0) & (lower <= upper) & (upper <= size)
    if not ok.all():
        return None
    counts: np.ndarray = (lower.astype(np.int64) - _HEADER) >> 1
    return counts


def _children(buf: np.ndarray, level: np.ndarray, counts: np.ndarray, size: int,
              pages: int) -> np.ndarray | None:
    """The pages the branch pages of ``level`` point to, in order; None where a node
    is outside its page."""
    half = buf[: len(buf) & ~1].view("<u2")
    base = level * size
    total = int(counts.sum())
    first = np.repeat(np.cumsum(counts) - counts, counts)
    slot = np.repeat(base + _HEADER, counts) + 2 * (np.arange(total) - first)
    at = half[slot >> 1].astype(np.int64)
    upper = np.repeat(half[(base + 14) >> 1], counts)
    if not ((at >= upper) & (at & 1 == 0) & (at + _NODE <= size)).all():
        return None
    word = (np.repeat(base, counts) + at) >> 1
    child: np.ndarray = (half[word].astype(np.int64) | (half[word + 1].astype(np.int64) << 16)
             | (half[word + 2].astype(np.int64) << 32))
    if not ((child >= 2) & (child < pages)).all():
        return None
    return child


def _named(buf: np.ndarray, page: int, size: int, name: bytes) -> int | None:
    """Where the main database's leaf page at ``page`` keeps database ``name``'s
    record (an MDB_db), or None."""
    if _u64(buf, page) != page // size or _u16(buf, page + 10) & _KINDS != _LEAF:
        return None
    lower, upper = _u16(buf, page + 12), _u16(buf, page + 14)
    if lower < _HEADER or lower > upper or upper > size:
        return None
    for slot in range(page + _HEADER, page + lower, 2):
        node = page + _u16(buf, slot)
        key_size = _u16(buf, node + 6)
        if node + _NODE + key_size + _DB_BYTES > page + size:
            return None
        if buf[node + _NODE:node + _NODE + key_size].tobytes() == name:
            data = _u16(buf, node) | _u16(buf, node + 2) << 16
            if _u16(buf, node + 4) != _SUBDATA or data != _DB_BYTES:
                return None
            return node + _NODE + key_size
    return None


def _u16(buf: np.ndarray, at: int) -> int:
    return int.from_bytes(buf[at:at + 2].tobytes(), "little")


def _u32(buf: np.ndarray, at: int) -> int:
    return int.from_bytes(buf[at:at + 4].tobytes(), "little")


def _u64(buf: np.ndarray, at: int) -> int:
    return int.from_bytes(buf[at:at + 8].tobytes(), "little")
