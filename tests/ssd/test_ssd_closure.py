"""A warm restart's prefix closure over rows in the index's key order (``ssd_closure``)
keeps and orders exactly what the record-by-record walk does: with keys that share
their first 8 bytes (the order's lookup then stands aside), a missing parent whose
first 8 bytes another row has, orphans, cycles, several namespaces, and forests too
deep for levels (the doubling decides); and the plan's overlap check over slots
aligned to their size (a mark a slot) finds a slot twice as the sort does."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers import ssd_closure, ssd_layout
from kvstore.tiers.ssd_layout import BlockRecord
from kvstore.tiers.ssd_rows import Rows, _any_overlap


def _records(keys: list[tuple[bytes, bytes]], parents: list[int]) -> list[BlockRecord]:
    """Records of (namespace, key) ``keys`` in the index's order (by namespace, then
    key), record i's parent the key of ``keys[parents[i]]`` (a negative: a root; past
    the keys: a key no record has)."""
    records = []
    for i, ((ns, k), p) in enumerate(zip(keys, parents)):
        parent = None if p < 0 else keys[p][1] if p < len(keys) else bytes([0xEE]) * 16
        records.append(BlockRecord(ns, k, parent, i * 16, 16))
    return sorted(records, key=lambda r: r.index_key)


def _columns(records: list[BlockRecord]) -> tuple[np.ndarray, ...]:
    n = len(records)

    def words(ids: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(ids), dtype=np.uint64).reshape(n, 2)

    spaces = list(dict.fromkeys(r.namespace for r in records))
    return (words([r.namespace for r in records]), words([r.key for r in records]),
            words([r.parent or bytes(16) for r in records]),
            np.array([r.parent is None for r in records]),
            np.array([spaces.index(r.namespace) for r in records]))


def _as_walk(records: list[BlockRecord]) -> tuple[list[BlockRecord], list[BlockRecord]] | None:
    """``closed_rows`` of the records' columns, as the walk's lists."""
    ns_words, key_words, parent_words, roots, rank = _columns(records)
    one = len(set(rank.tolist())) == 1
    split = ssd_layout.closed_rows(ns_words, key_words, parent_words, roots,
                                   None if one else rank)
    if split is None:
        return None
    order, closed, parent = split
    for row, up in enumerate(parent.tolist()):  # each parent row found, or none
        record = records[row]
        if up >= 0:
            assert records[up].key == record.parent and records[up].namespace == record.namespace
    return [records[i] for i in order.tolist()], [r for r, c in zip(records, closed) if not c]


@settings(max_examples=150, deadline=None)
@given(parents=st.lists(st.integers(-2, 50), min_size=2, max_size=48),
       spaces=st.lists(st.integers(0, 2), min_size=48, max_size=48),
       shared=st.integers(0, 3), seed=st.integers(0, 2**32))
def test_closure_in_key_order_is_the_walk(
        parents: list[int], spaces: list[int], shared: int, seed: int) -> None:
    # random keys, some sharing their first 8 bytes (``shared`` groups of them), forward
    # parents (cycles, a row its own parent), missing parents, up to three namespaces
    rng = random.Random(seed)
    heads = [rng.randbytes(8) for _ in range(shared)]
    keys = []
    for i in range(len(parents)):
        head = heads[i % len(heads)] if heads and rng.random() < 0.5 else rng.randbytes(8)
        keys.append((bytes([spaces[i]]) * 16, head + rng.randbytes(8)))
    records = _records(keys, parents)
    walk = ssd_layout._closed_by_walk(records)
    assert _as_walk(records) == walk
    assert ssd_layout.prefix_closed(records) == walk


def test_a_missing_parent_whose_first_bytes_a_row_has_is_missing() -> None:
    # the parent's first 8 bytes are those of a row that is not it: an orphan
    root, other = b"\x10" * 16, b"\x20" * 8 + b"\x01" * 8
    lost = b"\x20" * 8 + b"\x02" * 8
    ns = b"n" * 16
    records = sorted([BlockRecord(ns, root, None, 0, 16), BlockRecord(ns, other, root, 16, 16),
                      BlockRecord(ns, b"\x30" * 16, lost, 32, 16)], key=lambda r: r.index_key)
    ns_words, key_words, parent_words, roots, _ = _columns(records)
    found = ssd_closure.parents_in_key_order(key_words, parent_words, roots, None)
    assert found is not None  # the rows' own first 8 bytes all differ: the order decides
    assert found[0].tolist() == [-1, 0, -1]
    assert _as_walk(records) == ssd_layout._closed_by_walk(records)
    assert [r.key for r in _as_walk(records)[1]] == [b"\x30" * 16]  # type: ignore[index]


def test_keys_sharing_their_first_bytes_leave_it_to_the_fingerprints() -> None:
    ns, head = b"n" * 16, b"\x42" * 8
    records = [BlockRecord(ns, head + bytes([i]) * 8, None if i == 0 else head + bytes([i - 1]) * 8,
                           16 * i, 16) for i in range(4)]
    _, key_words, parent_words, roots, _ = _columns(records)
    assert ssd_closure.parents_in_key_order(key_words, parent_words, roots, None) is None
    assert _as_walk(records) == ssd_layout._closed_by_walk(records)


@settings(max_examples=20, deadline=None)
@given(chains=st.lists(st.integers(1, 400), min_size=1, max_size=4), seed=st.integers(0, 2**32))
def test_deep_forests_are_doubled_and_wide_ones_levelled(chains: list[int], seed: int) -> None:
    # a few long chains (past the levels' reach: the doubling decides) or many short
    # ones, branching, an orphaned chain among them: the walk's lists either way
    rng = random.Random(seed)
    keys, parents = [], []
    for length in chains + [rng.randint(1, 5) for _ in range(300)]:
        start = len(keys)
        for j in range(length):
            keys.append((b"n" * 16, rng.randbytes(16)))
            up = -1 if j == 0 else start + j - 1
            if j == 0 and keys[:-1] and rng.random() < 0.3:
                up = rng.randrange(len(keys) - 1)  # a branch off a block there
            parents.append(up)
    parents[-1] = len(keys)  # the last a key no record has
    records = _records(keys, parents)
    assert _as_walk(records) == ssd_layout._closed_by_walk(records)
    _, key_words, parent_words, roots, _ = _columns(records)
    found = ssd_closure.parents_in_key_order(key_words, parent_words, roots, None)
    assert found is not None
    levelled = ssd_closure.closed_by_levels(roots, found[1], found[2])
    closed = ssd_layout._closed_by_walk(records)[0]
    depth: dict[bytes, int] = {}
    for r in closed:  # parents before children
        depth[r.key] = 1 if r.parent is None else depth[r.parent] + 1
    # fewer rows than 256 a level: past 64 levels given up (deep and narrow)
    assert (levelled is None) == (max(depth.values()) > 64)


@given(st.lists(st.integers(0, 7), min_size=1, max_size=200), st.integers(0, 2**32))
def test_the_packed_sort_is_the_stable_argsort(tops: list[int], seed: int) -> None:
    # values that agree in their top bits and differ below (the packed sort's ties)
    rng = random.Random(seed)
    values = np.array([(t << 61) | rng.choice([0, 1, rng.getrandbits(40)]) for t in tops],
                      dtype=np.uint64)
    words = np.zeros((len(values), 2), dtype=np.uint64)
    words[:, 0] = values.byteswap()  # the first 8 bytes, read big-endian, are the values
    words[:, 1] = np.arange(len(values), dtype=np.uint64)
    by, ordered, numbers = ssd_closure._sorted_by(words)
    expected = np.argsort(values, kind="stable")
    assert by.tolist() == expected.tolist()
    assert (ordered == words[expected]).all() and (numbers == values[expected]).all()


@given(st.lists(st.integers(0, 40), min_size=2, max_size=30), st.sampled_from([0, 16, 24, 4096]),
       st.booleans())
def test_overlap_of_aligned_slots_is_a_slot_twice(slots: list[int], size: int, off: bool) -> None:
    # slots aligned to their one size (marked, no sort), or one of them not (sorted);
    # rows of no extent never overlap (a size of 0 is no power of two to shift by)
    rows = Rows()
    rows.offset = np.array([s * size for s in slots], dtype=np.int64)
    if off:
        rows.offset[0] += size // 2
    rows.length = rows.size_class = np.full(len(slots), size, dtype=np.int64)
    ends = sorted(rows.offset.tolist())
    assert _any_overlap(rows) == any(b - a < size for a, b in zip(ends, ends[1:]))


def test_many_small_namespaces_leave_it_to_the_fingerprints() -> None:
    # 100 namespaces of a two-block chain each: the per-namespace loop would cost more
    # than the fingerprints' one pass; the result is the walk's either way
    rng = random.Random(7)
    keys, parents = [], []
    for space in range(100):
        ns = space.to_bytes(2, "big") * 8
        keys += [(ns, rng.randbytes(16)), (ns, rng.randbytes(16))]
        parents += [-1, len(keys) - 2]
    records = _records(keys, parents)
    _, key_words, parent_words, roots, rank = _columns(records)
    assert ssd_closure.parents_in_key_order(key_words, parent_words, roots, rank) is None
    assert _as_walk(records) == ssd_layout._closed_by_walk(records)
    few = [r for r in records if r.namespace[:2] < (3).to_bytes(2, "big")]  # 3 namespaces
    _, key_words, parent_words, roots, rank = _columns(few)
    assert ssd_closure.parents_in_key_order(key_words, parent_words, roots, rank) is not None
