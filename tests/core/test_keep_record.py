"""A namespace's keep record (``core.Dropping``) holds only what an open removal can
still keep by: removals asked one before the last ends (a drop queued behind an evict,
commits going on meanwhile) once left every stamp in place until the last of them
closed, 16k dead stamps for 2,000 overlapping removals of 8 commits each."""

from __future__ import annotations

import random

import pytest

from test_removals_keep_commits import chain, commit, new_store

from kvstore.core import Keeping


def usable(keeping: Keeping) -> int:
    """The stamps some open removal keeps by (stamped at or above the lowest mark)."""
    state = keeping.state
    low = min(state.marks)
    return sum(1 for stamp in state.spare.values() if stamp >= low)


def test_overlapping_removals_leave_no_dead_stamps() -> None:
    store, ns = new_store(256 << 20)
    rng = random.Random(0)
    open_ = store.keep_commits(ns)
    for _ in range(2000):
        commit(store, ns, chain(rng, 8), None)
        following = store.keep_commits(ns)  # asked before the last one ends
        open_.close()
        open_ = following
        state = open_.state
        assert len(state.spare) == usable(open_) <= 8
        assert sum(len(blocks) for _, blocks in state.buckets) <= 8
    assert len(ns.blocks) == 16000
    state = open_.state
    open_.close()
    assert not store.dropping
    # the record is over: a closed claim held on to holds no block
    assert not state.spare and not state.buckets and not state.walks


def test_the_lowest_open_mark_keeps_its_stamps() -> None:
    """Three removals open; closing the newest and the middle one frees nothing the
    oldest keeps by, and each still keeps exactly what was committed after it."""
    store, ns = new_store()
    rng = random.Random(1)
    first = store.keep_commits(ns)
    a = chain(rng, 4)
    commit(store, ns, a, None)
    second = store.keep_commits(ns)
    b = chain(rng, 4)
    commit(store, ns, b, None)
    third = store.keep_commits(ns)
    c = chain(rng, 4)
    commit(store, ns, c, None)
    blocks = ns.blocks
    third.close()
    second.close()
    assert all(first.keeps(blocks[k]) for k in a + b + c)
    assert len(first.state.spare) == 12
    # a fresh removal: the oldest still open, so nothing goes yet
    fourth = store.keep_commits(ns)
    commit(store, ns, d := chain(rng, 4), None)
    assert [fourth.keeps(blocks[k]) for k in a + b + c] == [False] * 12
    assert all(fourth.keeps(blocks[k]) for k in d)
    first.close()  # now only stamps the fourth keeps by remain
    assert set(first.state.spare) == {blocks[k] for k in d}
    fourth.close()
    assert not store.dropping


@pytest.mark.parametrize("later", [0, 4])
def test_a_block_committed_again_keeps_its_newer_stamp(later: int) -> None:
    """A block committed again while removals overlap is stamped anew (``kept`` again,
    as a commit does); the old bucket that still lists it frees only its own stamp
    (whether the dead stamps are most of the record, and the rest is copied out, or
    few, and they are popped: ``later`` commits of the newer stamp)."""
    store, ns = new_store()
    rng = random.Random(2)
    first = store.keep_commits(ns)
    key = chain(rng, 1)
    commit(store, ns, key, None)
    old = ns.blocks[key[0]]
    second = store.keep_commits(ns)
    state = first.state
    state.kept([old])  # committed again after the second was asked for
    commit(store, ns, chain(rng, later), None) if later else None
    assert second.keeps(old) and state.spare[old] == 2
    first.close()  # frees the stamp-1 bucket: not the block's newer stamp
    assert second.keeps(old) and state.spare[old] == 2
    assert len(state.spare) == 1 + later
    second.close()
