"""The pure rules of the SSD layout: fitting, overlaps, prefix closure."""

from __future__ import annotations

from hypothesis import given, strategies as st

from kvstore.tiers import ssd_layout
from kvstore.tiers.ssd_layout import (
    BlockRecord,
    SlabLayout,
    decode_record,
    encode_record,
    overlapping_groups,
    plan_load,
    prefix_closed,
)

NS = b"n" * 16
LAYOUT = SlabLayout(capacity_bytes=1 << 20, slab_bytes=1 << 16)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_record_round_trips_through_the_index_encoding() -> None:
    record = BlockRecord(NS, key(1), key(0), 4096, 100, 2**64 - 1, 1.5, 8192)
    assert decode_record(encode_record(record)) == record


def test_problems() -> None:
    assert LAYOUT.problem(BlockRecord(NS, key(1), None, 0, 4096)) is None
    assert "crosses" in (LAYOUT.problem(BlockRecord(NS, key(1), None, 65000, 4096)) or "")
    assert "outside" in (LAYOUT.problem(BlockRecord(NS, key(1), None, 1 << 20, 1)) or "")
    assert "size class" in (LAYOUT.problem(BlockRecord(NS, key(1), None, 0, 9, size_class=8)) or "")
    slot = BlockRecord(NS, key(1), None, 65536 - 4096, 10, size_class=8192)
    assert "crosses" in (LAYOUT.problem(slot) or "")


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=30))
def test_overlapping_groups_match_brute_force(spans: list[tuple[int, int]]) -> None:
    records = [BlockRecord(NS, key(i), None, o, n) for i, (o, n) in enumerate(spans)]
    grouped = {r.key for group in overlapping_groups(records) for r in group}
    clashing = {
        a.key
        for a in records
        for b in records
        if a is not b and a.offset < b.end and b.offset < a.end
    }
    assert grouped == clashing


@given(
    parents=st.lists(st.integers(-1, 40), min_size=1, max_size=40),
    missing=st.sets(st.integers(0, 39)),
)
def test_prefix_closure_keeps_exactly_the_rooted_chains(
    parents: list[int], missing: set[int]
) -> None:
    # record i has parent parents[i] (-1: a root); parents may point forward, so cycles happen
    present = [i for i in range(len(parents)) if i not in missing]
    records = [
        BlockRecord(NS, key(i), None if parents[i] < 0 else key(parents[i]), i * 16, 16)
        for i in present
    ]
    closed, orphans = prefix_closed(records)

    def rooted(i: int) -> bool:
        seen: set[int] = set()
        while parents[i] >= 0:
            if i in seen or i in missing or parents[i] >= len(parents):
                return False
            seen.add(i)
            i = parents[i]
        return i not in missing

    assert {r.key for r in closed} == {key(i) for i in present if rooted(i)}
    assert len(closed) + len(orphans) == len(records)
    seen_keys: set[bytes] = set()
    for r in closed:
        assert r.parent is None or r.parent in seen_keys
        seen_keys.add(r.key)


def test_plan_load_verifies_only_overlaps() -> None:
    verified: list[bytes] = []

    def verify(record: BlockRecord) -> bool:
        verified.append(record.key)
        return record.key == key(2)

    records = [
        BlockRecord(NS, key(1), None, 0, 4096, last_access=5.0),
        BlockRecord(NS, key(2), None, 0, 4096, last_access=1.0),
        BlockRecord(NS, key(3), key(1), 8192, 4096),
        BlockRecord(NS, key(4), key(2), 12288, 4096),
    ]
    plan = plan_load(records, LAYOUT, verify, invalid_keys=[b"junk"])
    assert sorted(verified) == [key(1), key(2)]
    assert [r.key for r in plan.survivors] == [key(2), key(4)]
    assert [r.key for r in plan.overlapping] == [key(1)]
    assert [r.key for r in plan.orphans] == [key(3)]
    assert plan.invalid == [b"junk"]


@given(
    parents=st.lists(st.integers(-1, 60), min_size=2, max_size=60),
    spaces=st.lists(st.integers(0, 2), min_size=60, max_size=60),
    twice=st.booleans(),
)
def test_prefix_closure_in_arrays_is_the_walk_in_its_order(
    parents: list[int], spaces: list[int], twice: bool
) -> None:
    # a warm restart's closure in arrays: the same records and order as the walk gives
    # (the walk's order is the order of the SSD eviction order's restored blocks)
    records = [
        BlockRecord(bytes([spaces[i]]) * 16, key(i), None if p < 0 else key(p), i * 16, 16)
        for i, p in enumerate(parents)
    ]
    if twice:  # a key twice in a namespace: the walk decides
        records.append(records[0])
    arrays = ssd_layout._closed_in_arrays(records)
    walk = ssd_layout._closed_by_walk(records)
    assert (arrays is None) == twice
    assert arrays is None or arrays == walk
    assert prefix_closed(records) == walk
