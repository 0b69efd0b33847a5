"""The SSD tier's directory removed under the daemon: its copies are dropped a slice a
loop turn (``LostCopies``), not in one walk of every block that held the loop for as
long as the store is big; the store stays whole between slices, no copy not yet dropped
is a hit or read, a second finding starts no second drop, and a stop mid-drop ends it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from kvtest import make_identity
from ssd_helpers import restoring_mover

from kvstore import protocol as p
from kvstore.auth import Auth
from kvstore.config import Config
from kvstore.routing import RoutingVerbs
from kvstore.sessions import Session
from kvstore.ssd_lost import LostCopies
from kvstore.store import BlockStore, Namespace, Reservation

IDENT = make_identity()
SLOT = IDENT.block_bytes
CHAINS, LENGTH = 12, 1000  # 12k SSD copies: three slices of 4096 entries at least


def _restored(store: BlockStore, ns: Namespace) -> list[list[bytes]]:
    """``CHAINS`` chains of ``LENGTH`` blocks on SSD only, as a warm restart finds them."""
    chains = []
    for c in range(CHAINS):
        keys = [os.urandom(16) for _ in range(LENGTH)]
        first = c * LENGTH * SLOT
        assert all(store.ssd_copies.restore_columns(
            ns, keys, [0] + [1] * (LENGTH - 1),
            [first + i * SLOT for i in range(LENGTH)], [0] * LENGTH))
        chains.append(keys)
    return chains


def _commit(store: BlockStore, ns: Namespace, keys: list[bytes], parent: bytes | None) -> None:
    r = store.reserve("w", ns, keys, parent, 0.0)
    assert isinstance(r, Reservation)
    store.commit("w", r.id, 0.0)


def _store() -> BlockStore:
    return BlockStore(64 * SLOT, 16 * SLOT, ssd_capacity=CHAINS * LENGTH * SLOT,
                      ssd_slab_bytes=LENGTH * SLOT)


def test_the_lost_copies_go_in_slices_the_store_whole_between_them() -> None:
    """Before, one call dropped all 12k copies (and would 400k); now each slice goes
    through at most its budget of entries, the invariants hold after each, no copy left
    is a hit meanwhile, and what hung only from them (a DRAM chain below one) goes too."""
    store = _store()
    ns = store.open_namespace(IDENT)
    other = store.open_namespace(make_identity(tenant="other"))
    chains = _restored(store, ns)
    below = [os.urandom(16) for _ in range(8)]
    _commit(store, ns, below, chains[3][500])  # in DRAM, below an SSD-only block
    kept = [os.urandom(16) for _ in range(8)]
    _commit(store, other, kept, None)
    store.check_invariants()
    copies = store.ssd_committed_slots
    assert copies == CHAINS * LENGTH
    drop = LostCopies(store)
    assert store.lookup(ns, chains[0]) == []  # off from the first moment: no ssd hit
    assert store.lookup(ns, chains[3][:501] + below) == []
    slices = 0
    while not drop.step(budget=1000):
        slices += 1
        assert drop.largest <= 1000 + 32, drop
        store.check_invariants()
        assert store.ssd_committed_slots + drop.dropped == copies
        assert store.lookup(ns, chains[slices % CHAINS]) == []
    assert slices >= copies // 1000, slices
    assert store.ssd_committed_slots == 0 and drop.dropped == copies
    assert len(ns.blocks) == 0  # what hung from them went with them
    assert len(store.lookup(other, kept)) == len(kept)
    store.check_invariants()


def test_the_mover_drops_in_loop_turns_once_and_stops_cleanly(tmp_path: Path) -> None:
    """``SsdMover.lose``: its first slice at once, the rest a slice a loop turn; a second
    finding starts no second drop; a read of a copy not yet dropped is a miss (never
    the files read); ``close`` mid-drop runs no further slice."""
    store, mover = restoring_mover(tmp_path / "ssd", CHAINS * LENGTH * SLOT, LENGTH * SLOT)
    ns = store.open_namespace(IDENT)
    chains = _restored(store, ns)
    copies = store.ssd_committed_slots

    async def lost() -> int:
        mover.lose("the directory was removed")
        drop = mover.dropping
        assert drop is not None and drop.slices == 1 and drop.dropped < copies
        mover.lose("the directory was removed")  # the check again: the same drop
        assert mover.dropping is drop and drop.slices == 1
        left = next(keys for keys in chains if all(
            (b := ns.blocks.get(k)) is not None and b.ssd_offset is not None
            for k in keys[:4]))  # not dropped yet
        t = store.ssd_copies.begin_promotion([ns.blocks[k] for k in left[:4]])
        await mover.read(t)  # type: ignore[arg-type]
        assert all(b.offset is None for b in t.blocks)  # type: ignore[union-attr]
        turns = 0
        while mover.dropping is not None:
            store.check_invariants()
            await asyncio.sleep(0)
            turns += 1
        return max(turns, drop.slices)

    try:
        assert asyncio.run(lost()) >= copies // 4096
        assert store.ssd_committed_slots == 0 and len(ns.blocks) == 0
        assert mover.stats()["healthy"] == 0
    finally:
        mover.close()


def test_a_stop_mid_drop_runs_no_further_slice(tmp_path: Path) -> None:
    store, mover = restoring_mover(tmp_path / "ssd", CHAINS * LENGTH * SLOT, LENGTH * SLOT)
    ns = store.open_namespace(IDENT)
    _restored(store, ns)

    async def stopped() -> int:
        mover.lose("the directory was removed")
        left = store.ssd_committed_slots
        assert left > 0 and mover.dropping is not None
        mover.close()
        for _ in range(20):
            await asyncio.sleep(0)
        assert mover.dropping is None
        return left

    assert asyncio.run(stopped()) == store.ssd_committed_slots
    store.check_invariants()


class _Daemon:
    """What the routing verbs use of the daemon, without its sockets."""

    def __init__(self, store: BlockStore) -> None:
        self.config = Config()
        self.store = store
        self.auth = Auth(self.config)
        self.ssd = None
        self.transfers = None
        self.events = None
        self.max_keys = self.config.server.max_keys_per_request


def test_a_probe_finds_no_copy_left_to_drop() -> None:
    """A router's probe, as a lookup: once the tier is lost, a copy not dropped yet is
    not cached (before, the probe reported the SSD blocks until they were gone)."""
    store = _store()
    ns = store.open_namespace(IDENT)
    chains = _restored(store, ns)
    verbs = RoutingVerbs(_Daemon(store))  # type: ignore[arg-type]

    def probed(keys: list[bytes]) -> list[tuple[str, int]]:
        reply, _ = verbs.table()[p.Probe](Session("s", IDENT.tenant), p.Probe(1, keys), [])
        assert isinstance(reply, p.ProbeReply)
        return reply.tier_runs

    assert probed(chains[0][:10]) == [("ssd", 10)]
    drop = LostCopies(store)
    assert not drop.step(budget=100)
    assert all(probed(keys[:10]) == [] for keys in chains)
