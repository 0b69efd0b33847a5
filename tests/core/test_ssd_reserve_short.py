"""An SSD reservation that evicts some copies and then finds no more room."""
from __future__ import annotations

import random

import pytest

from kvtest import make_identity
from kvstore.errors import CapacityError
from kvstore.store import BlockStore, Reservation


def test_copies_evicted_before_the_room_ran_out_are_listed_for_withdrawal() -> None:
    # Found by the restart harness: a write-through batch evicted cold SSD copies one
    # by one, ran out of allowed victims and raised, and the copies already evicted
    # never left the SSD index.  A clean stop then synced their records (12-25 a run),
    # over slots written again since, and the restart dropped the blocks below them as
    # orphans.  Every copy gone must be listed for the index (``dropped_ssd``).
    store = BlockStore(64 << 20, 1 << 20, ssd_capacity=1 << 20, ssd_slab_bytes=1 << 20)
    ns = store.open_namespace(make_identity(num_layers=1, num_kv_heads=1, head_dim=8))
    rng = random.Random(3)
    keys = [rng.randbytes(16) for _ in range(400)]
    for key in keys:
        r = store.reserve("w", ns, [key], None, 0.0)
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)
    on_ssd: list[bytes] = []
    for key in keys:  # fill the tier, one copy a write
        try:
            t, removed = store.ssd_copies.reserve([ns.blocks[key]], evict=False)
        except CapacityError:
            break
        assert not removed
        store.ssd_copies.finish_write(t, [object()])
        on_ssd.append(key)
    assert 8 < len(on_ssd) < len(keys) - 40
    assert not store.dropped_ssd
    may_go = set(on_ssd[:5])  # the only copies the write may trade
    wanted = [ns.blocks[k] for k in keys[len(on_ssd):len(on_ssd) + 40]]
    with pytest.raises(CapacityError):
        store.ssd_copies.reserve(wanted, evict=lambda b: b.key in may_go)
    gone = {key for key in on_ssd if ns.blocks[key].ssd_offset is None}
    assert gone == may_go  # evicted before the error...
    assert {key for _, key in store.dropped_ssd} == gone  # ...and each listed for the index
    assert all(b.ssd_offset is None for b in wanted)
    store.check_invariants()
