"""A warm restart's prefix closure over columns, level by level from the roots.

``ssd_layout.closed_rows`` decides which index rows reach a root and in what order the
restore makes them.  Two steps here do that work in O(rows) array passes where the
rows allow:

- Each row's parent row, found by the keys' order.  The index is an LMDB database
  keyed by namespace + key, read in key order: within a namespace the keys' first 8
  bytes, read big-endian, rise (where they rise strictly, no key is there twice and
  an 8-byte prefix names one row).  So one sort of the parents' prefixes and a
  ``searchsorted`` into the rows' own find every parent, with no sort of the rows and
  no random binary search (at 5M rows the fingerprint path's sort of the rows and its
  lookups were a third of the closure); the full 16 bytes are compared on a match.
  The same sort groups the children by parent row: the closure's child lists.
- The closure itself, by levels: the roots, their children, theirs, ... each a few
  array operations over one level's rows; a row never reached (its parent missing, or
  in a cycle) is not closed.  Depth is the level; a row's first position among its
  subtree (the walk's order, ``closed_rows``) is gathered back up the levels by one
  ``minimum.reduceat`` each.  The pointer doubling it replaces read and wrote every
  row about ten times in random order (rounds of log2 of the depth); this touches
  each row a few times.  Deep, narrow forests (a chain of a million) would take a
  level's overhead per row: past ``_LEVELS_FREE`` levels averaging fewer than
  ``_ROWS_A_LEVEL`` rows, it gives up (None) and the doubling decides.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_LEVELS_FREE = 64
_ROWS_A_LEVEL = 256
# Parents are found one namespace at a time (a sort and a search, some 15 array calls):
# past ``_SPACES_FREE`` namespaces averaging fewer than ``_ROWS_A_SPACE`` rows, the
# fingerprints' one pass over all rows is cheaper (1M rows in 500k namespaces: 11.5 s
# by namespaces, 0.6 s by fingerprints; even at about 100 rows a namespace).
_SPACES_FREE = 64
_ROWS_A_SPACE = 128


def parents_in_key_order(
    key_words: np.ndarray, parent_words: np.ndarray, roots: np.ndarray,
    rank: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Each row's parent row (-1: a root, or a parent not there), with the children
    grouped by parent (``kids``, and ``kid_parent`` each one's parent row, never falling), for
    rows in key order (by namespace ``rank``, then key, no 8-byte key prefix twice in a
    namespace); None for rows not so (the caller finds the parents by fingerprint)."""
    n = len(roots)
    if n < 2:
        return None
    # the keys' first 8 bytes as big-endian numbers: their order is the bytes' order
    prefix = key_words[:, 0].byteswap()
    rising = prefix[1:] > prefix[:-1]
    if rank is None:
        if not rising.all():
            return None
        bounds = [0, n]
    else:
        step = np.diff(rank)
        if not ((step > 0) | ((step == 0) & rising)).all():
            return None
        bounds = [0, *(np.flatnonzero(step) + 1).tolist(), n]
        if len(bounds) > _SPACES_FREE and n < _ROWS_A_SPACE * (len(bounds) - 1):
            return None  # many small namespaces: the loop below is ~25 us a namespace
    del rising
    parent_row = np.full(n, -1, dtype=np.int64)
    kids_parts, parents_parts = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):  # one namespace's rows at a time
        by, asked, asked_prefix = _sorted_by(parent_words[a:b])
        spot = np.searchsorted(prefix[a:b], asked_prefix)
        del asked_prefix
        np.minimum(spot, b - a - 1, out=spot)
        spot += a
        by += a
        # a match only where all 16 bytes agree, and the row is no root
        found = key_words[spot]
        same = (found[:, 0] == asked[:, 0]) & (found[:, 1] == asked[:, 1]) & ~roots[by]
        del found, asked
        kids, above = by[same], spot[same]
        parent_row[kids] = above
        kids_parts.append(kids)
        parents_parts.append(above)
    kids = np.concatenate(kids_parts)
    kid_parent = np.concatenate(parents_parts)
    return parent_row, kids, kid_parent


def _sorted_by(words: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids (rows of two 64-bit words) in the order of their first 8 bytes read
    big-endian, ties by row: (the rows, as ``argsort(kind="stable")`` gives them,
    the ids in that order, and their first 8 bytes as those numbers).  A sort of the
    numbers with each one's row in its low bits (their top bits kept) is 2.5 times as
    fast as an argsort; rows whose numbers agree in the top bits but not below come
    out of order, and are put right by the argsort's timsort, which takes a nearly
    sorted array in about one pass.  The ids are gathered whole in one random read a
    row (the match needs both words)."""
    n = len(words)
    values = words[:, 0].byteswap()
    low = max(1, (n - 1).bit_length())
    mask = np.uint64((1 << low) - 1)
    packed = values & ~mask
    del values
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    packed &= mask
    by = packed.astype(np.int64)
    del packed
    ordered = words[by]
    numbers = ordered[:, 0].byteswap()
    if n > 1 and not (numbers[1:] >= numbers[:-1]).all():
        fix = np.argsort(numbers, kind="stable")
        by, ordered, numbers = by[fix], ordered[fix], numbers[fix]
    return by, ordered, numbers


def children_of(parent_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``parents_in_key_order``'s child lists from the parent rows alone: (children
    grouped by parent row, each one's parent row, rising)."""
    kids = np.flatnonzero(parent_row >= 0)
    kids = kids[np.argsort(parent_row[kids], kind="stable")]
    return kids, parent_row[kids]


def closed_by_levels(
    roots: np.ndarray, kids: np.ndarray, kid_parent: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The rows reached from the roots by child links: (closed mask, each closed
    row's depth, and its first position among its subtree and itself); None where
    the forest is too deep for levels to pay (the caller doubles)."""
    n = len(roots)
    index: np.dtype[Any] = np.dtype(np.int32 if n < 2**31 else np.int64)
    counts = np.bincount(kid_parent, minlength=n)
    start = np.cumsum(counts) - counts
    frontier = np.flatnonzero(roots)
    levels = [frontier]
    # per level below the roots: the rows of the level above with children, and
    # where each one's children start in this level (the reduceat's segments)
    above: list[tuple[np.ndarray, np.ndarray]] = []
    reached = len(frontier)
    while len(frontier):
        count = counts[frontier]
        has = np.flatnonzero(count)
        if not len(has):
            break
        up, count = frontier[has], count[has]
        ends = np.cumsum(count)
        begins = ends - count
        # each parent's run of children: its start in ``kids`` plus 0, 1, ...
        spots = np.repeat(start[up] - begins, count)
        spots += np.arange(int(ends[-1]))
        frontier = kids[spots]
        levels.append(frontier)
        above.append((up, begins))
        reached += len(frontier)
        if len(levels) > _LEVELS_FREE and reached < len(levels) * _ROWS_A_LEVEL:
            return None
    depth = np.zeros(n, dtype=index)
    for d, rows in enumerate(levels, 1):
        depth[rows] = d
    first = np.arange(n, dtype=index)
    for rows, (up, begins) in zip(reversed(levels[1:]), reversed(above)):
        first[up] = np.minimum(first[up], np.minimum.reduceat(first[rows], begins))
    return depth > 0, depth, first


def walk_order(closed: np.ndarray, depth: np.ndarray, first: np.ndarray) -> np.ndarray:
    """The closed rows by first position, then depth (``closed_rows``' order), with
    no sort.  The rows whose first position is ``g`` are a path: row ``g`` and its
    ancestors below the first whose subtree holds an earlier row (that one not among
    them); so each path's length is a count of its rows, where each path starts in the
    order is a running sum of those, and a row's place in its path is its depth below
    the path's top."""
    kept = np.flatnonzero(closed)
    lead = first[kept]
    size = np.bincount(lead, minlength=len(closed))
    start = np.cumsum(size) - size
    # a row's place: its path's start, plus its depth less the depth of the path's top
    # (the path's last row, ``g`` itself, is ``size - 1`` below it)
    place = start[lead] + (depth[kept] - depth[lead]) + (size[lead] - 1)
    order = np.empty(len(kept), dtype=np.int64)
    order[place] = kept
    return order
