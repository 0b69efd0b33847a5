"""The store's tier changes as plain data: drained after every step of random sequences,
they rebuild exactly what the store holds per tier; and the event encodings in Python."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from hypothesis import settings
from hypothesis.stateful import invariant
from kvtest import make_identity
from test_store_model import StoreMachine

from kvstore.config import EventsConfig
from kvstore.events import BlockStored, EventMaker, KVEventBatch, decoder
from kvstore.keys import chain_keys
from kvstore.store import BlockStore
from kvstore.tier_changes import (TIER_BITS, Removed, Stored, TierChanges, dram_runs,
                                  holdings)
from kvstore.token_ids import SPLIT_BELOW, TokenRun, encode_blocks, encode_chain


class ChangesMachine(StoreMachine):
    """The store machine's random sequences, with a mirror fed only by drained changes."""

    ssd_slots = 8
    dram_slots = 8

    def __init__(self) -> None:
        super().__init__()
        self.firsts = 0
        self.changes = TierChanges(self._first)
        self.store.record_changes(self.changes)
        self.mirror: dict[tuple[bytes, str], bytes | None] = {}  # (key, tier) -> parent
        # every other commit carries its blocks' token ids in one buffer (as a client
        # does while someone listens): runs to count
        commit, reservations = self.store.commit, self.store.leases
        self.commits = 0

        def commit_with_ids(owner: str, rid: int, now: float, checksums: Any = (),
                            tokens: Any = ()) -> Any:
            self.commits += 1
            r = reservations.state(owner).reservations.get(rid)
            if r is not None and self.commits % 2:
                bt = r.ns.identity.block_tokens
                tokens = encode_chain(range(len(r.keys) * bt), len(r.keys), bt)
            return commit(owner, rid, now, checksums, tokens)

        self.store.commit = commit_with_ids  # type: ignore[method-assign]

    def _first(self) -> None:
        self.firsts += 1

    @invariant()
    def each_run_counts_the_blocks_that_name_it(self) -> None:
        named: dict[TokenRun, int] = {}
        for ns in self.store.namespaces.values():
            for b in ns.blocks.values():
                if b.tokens is not None:
                    named[b.tokens] = named.get(b.tokens, 0) + 1
        for run, count in named.items():
            assert run.live == count, f"{run} named by {count} blocks"
            assert count * SPLIT_BELOW >= len(run.keys), f"{run} kept for {count} blocks"

    @invariant()
    def mirror_equals_the_store(self) -> None:
        marked = len(self.changes)
        firsts = self.firsts
        # as the publisher drains: commits' runs alone taken as they are, else a drain
        runs = self.changes.drain_runs()
        for change in self.changes.drain() if runs is None else dram_runs(runs):
            if isinstance(change, Removed):
                for key in change.keys:
                    assert (key, change.tier) in self.mirror, "removed but never stored"
                    del self.mirror[(key, change.tier)]
            else:
                assert isinstance(change, Stored)
                parent = change.blocks[0].parent
                for b in change.blocks:
                    assert b.parent is parent, "a run of blocks that is not one chain"
                    assert (b.key, change.tier) not in self.mirror, "stored twice"
                    self.mirror[(b.key, change.tier)] = parent.key if parent else None
                    parent = b
        assert len(self.changes) == 0
        if marked:
            assert firsts >= 1  # the daemon's hook ran for the first mark
        assert self.held() == self.mirror

    def held(self) -> dict[tuple[bytes, str], bytes | None]:
        held: dict[tuple[bytes, str], bytes | None] = {}
        for ns in self.store.namespaces.values():
            for b in ns.blocks.values():
                bits = holdings(b)
                for tier, bit in TIER_BITS:
                    if bits & bit:
                        held[(b.key, tier)] = b.parent.key if b.parent else None
        return held


TestChangesMachine = ChangesMachine.TestCase
TestChangesMachine.settings = settings(max_examples=80, stateful_step_count=60,
                                       deadline=None)


def test_a_held_block_on_another_chain_keeps_the_prefix_its_chain_shares() -> None:
    """A failed promotion read of a root keeps the child that an SSD read below it on
    another chain still needs: a cached key of this chain without its root is then
    right (a sequence the machine found, replayed step by step)."""
    m = ChangesMachine()

    def step(call: Any) -> Any:
        out = call()
        m.each_run_counts_the_blocks_that_name_it()
        m.invariants_hold()
        m.lookup_is_the_longest_cached_prefix()
        m.mirror_equals_the_store()
        m.pinned_blocks_stay_put()
        return out

    r0 = step(lambda: m.reserve(chain=3, extra=0, length=3, owner="a", which=0))
    step(lambda: m.commit(advance=0.0, r=r0))
    step(lambda: m.next_transfers(pattern=[]))
    step(lambda: m.next_transfers(pattern=[False]))
    step(lambda: m.reserve(chain=0, extra=0, length=1, owner="a", which=1))
    r2 = step(lambda: m.reserve(chain=0, extra=0, length=3, owner="a", which=0))
    step(lambda: m.abort(r=r2))
    step(lambda: m.next_transfers(pattern=[False]))
    step(lambda: m.reserve(chain=3, extra=0, length=1, owner="a", which=0))
    root, kept, held = (m.ns[0].blocks[k] for k in m.chains[0][3][:3])
    assert held.ssd_holds and root.ssd_offset is not None
    assert step(lambda: m.acquire(chain=1, length=1, owner="a", which=0)) is None
    # the root's copy failed its read and went; what hangs below it stays while held
    assert not root.present and kept.present and held.present
    assert m.chains[0][2][1] == kept.key  # chain 2 shares the kept block, not the held one
    assert held.key not in m.chains[0][2]


class BatchedChangesMachine(ChangesMachine):
    """The same, drained after every sixth step only: a batch then holds what several
    steps did (a chain committed, evicted and committed again; a commit's run and a
    later change of one of its blocks), as a busy daemon's batches do."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    @invariant()
    def mirror_equals_the_store(self) -> None:
        self.steps += 1
        if self.steps % 6 == 0:
            super().mirror_equals_the_store()


TestBatchedChangesMachine = BatchedChangesMachine.TestCase
TestBatchedChangesMachine.settings = settings(max_examples=80, stateful_step_count=60,
                                              deadline=None)


class SettledChangesMachine(ChangesMachine):
    """The same, every third batch settled rather than drained (nobody subscribes: it
    is not built) and the mirror then set to what the store holds, as a snapshot
    would: the drains after it still rebuild the store exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    @invariant()
    def mirror_equals_the_store(self) -> None:
        self.steps += 1
        if self.steps % 3 == 0:
            if self.changes.drain_runs() is None:  # (as the publisher settles)
                self.changes.settle()
            assert len(self.changes) == 0
            for ns in self.store.namespaces.values():
                for b in ns.blocks.values():
                    assert b.announced == holdings(b), "settled, but not as announced"
            self.mirror = self.held()
        super().mirror_equals_the_store()


TestSettledChangesMachine = SettledChangesMachine.TestCase
TestSettledChangesMachine.settings = settings(max_examples=40, stateful_step_count=60,
                                              deadline=None)


IDENT = make_identity(salt="pepper", adapter="sql-lora")


def _store() -> tuple[BlockStore, TierChanges, list[int]]:
    slot = IDENT.block_bytes
    store = BlockStore(8 * slot, 4 * slot, ssd_capacity=8 * slot, ssd_slab_bytes=4 * slot)
    calls: list[int] = []
    changes = TierChanges(lambda: calls.append(1))
    store.record_changes(changes)
    return store, changes, calls


def test_a_commit_is_one_run_with_its_tokens_and_the_hook_runs_once() -> None:
    store, changes, calls = _store()
    ns = store.open_namespace(IDENT)
    tokens = list(range(3 * IDENT.block_tokens))
    keys = chain_keys(ns.id, tokens, IDENT.block_tokens)
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0,  # type: ignore[union-attr]
                 tokens=encode_blocks(tokens, 3, IDENT.block_tokens))
    assert calls == [1]
    [stored] = changes.drain()
    assert isinstance(stored, Stored) and stored.tier == "dram"
    assert [b.key for b in stored.blocks] == keys
    made = EventMaker(EventsConfig(group_idx=3)).events([stored])[0]
    # the per-block fields go pre-encoded (msgspec.Raw), and decode to what was committed
    event = msgspec.msgpack.decode(msgspec.msgpack.encode(made), type=BlockStored)
    assert event.token_ids == tokens
    assert event.block_hashes == keys and event.parent_block_hash is None
    assert event.block_size == 16
    assert event.lora_name == "sql-lora"
    assert event.extra_keys == [("pepper",)] * 3
    assert event.medium == "CPU" and event.group_idx == 3
    # evicted: one removal of the three keys, nothing stored
    store.evict(ns, keys)
    [removed] = changes.drain()
    assert isinstance(removed, Removed) and sorted(removed.keys) == sorted(keys)
    assert changes.drain() == []


def test_events_slice_each_commits_buffer_of_token_ids() -> None:
    store, changes, _ = _store()
    ns = store.open_namespace(IDENT)
    bt = IDENT.block_tokens
    tokens = [*range(3 * bt), *range(1 << 40, (1 << 40) + 2 * bt)]  # the 2nd commit's: wide
    keys = chain_keys(ns.id, tokens, bt)
    maker = EventMaker(EventsConfig())

    def token_ids(stored: Stored) -> list[int]:
        made = maker.events([stored])[0]
        return msgspec.msgpack.decode(msgspec.msgpack.encode(made), type=BlockStored).token_ids

    for part, parent in ((slice(0, 3), None), (slice(3, 5), keys[2])):
        r = store.reserve("o", ns, keys[part], parent, 0.0)
        ids = encode_chain(tokens[part.start * bt:part.stop * bt], part.stop - part.start, bt)
        store.commit("o", r.id, 0.0, tokens=ids)  # type: ignore[union-attr]
    [stored] = changes.drain()  # the two commits' runs, one chain: one run of five
    assert [b.key for b in stored.blocks] == keys
    assert token_ids(stored) == tokens
    # a run across the two commits' middle (as a tier's copies are announced)
    blocks = stored.blocks
    assert token_ids(Stored("ssd", ns, blocks[1:4])) == tokens[bt:4 * bt]
    assert token_ids(Stored("ssd", ns, blocks[4:])) == tokens[4 * bt:]
    # a block of an older client's commit with no ids for it: the run has none
    more = [*range(5 * bt, 7 * bt)]
    keys2 = chain_keys(ns.id, more, bt, parent=keys[-1])
    r = store.reserve("o", ns, keys2, keys[-1], 0.0)
    store.commit("o", r.id, 0.0,  # type: ignore[union-attr]
                 tokens=[encode_blocks(more, 2, bt)[0], b""])
    [stored] = changes.drain()
    assert token_ids(stored) == []
    assert token_ids(Stored("ssd", ns, [*blocks, stored.blocks[0]])) == tokens + more[:bt]


def test_a_copy_that_comes_and_goes_in_one_turn_is_never_announced() -> None:
    store, changes, _ = _store()
    ns = store.open_namespace(IDENT)
    keys = chain_keys(ns.id, list(range(32)), IDENT.block_tokens)
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
    store.evict(ns, keys)
    assert changes.drain() == []
    # and one evicted then cached again in one turn: removed first, then stored
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
    changes.drain()
    store.evict(ns, keys)
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
    kinds = [type(c).__name__ for c in changes.drain()]
    assert kinds == ["Removed", "Stored"]


def test_both_encodings_decode_as_vllm_lays_them_out() -> None:
    store, changes, _ = _store()
    ns = store.open_namespace(IDENT)
    keys = chain_keys(ns.id, list(range(32)), IDENT.block_tokens)
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
    drained = changes.drain()
    for encoding in ("map", "array"):
        maker = EventMaker(EventsConfig(encoding=encoding))
        batch = KVEventBatch(1.5, [maker.cleared(), *maker.events(drained)])
        raw = msgspec.msgpack.encode(batch)
        plain = msgspec.msgpack.decode(raw)
        assert plain[0] == 1.5
        cleared, stored = plain[1]
        if encoding == "map":
            assert cleared == {"type": "AllBlocksCleared"}
            assert stored["type"] == "BlockStored" and stored["block_hashes"] == keys
            assert stored["parent_block_hash"] is None and stored["token_ids"] == []
            assert stored["medium"] == "CPU" and stored["lora_name"] == "sql-lora"
        else:
            assert cleared == ["AllBlocksCleared"]
            assert stored[:8] == ["BlockStored", keys, None, [], 16, None, "CPU", "sql-lora"]
        typed = decoder(encoding).decode(raw)
        assert [type(e).__name__.replace("Array", "") for e in typed.events] == [
            "AllBlocksCleared", "BlockStored"]


def test_a_batch_encoded_from_its_layouts_is_the_events_encoded_byte_for_byte() -> None:
    # the publisher encodes batches from each event's layout (no event objects); the
    # events as objects, encoded in a KVEventBatch, are the oracle: every kind of run
    # (a whole commit, a stretch of one, across two commits, without ids, wide ids),
    # removals, each tier, with a salt and an adapter and without, both encodings, a
    # group index and a rank or none
    plain = make_identity(model="other")
    slot = IDENT.block_bytes
    store = BlockStore(64 * slot, 4 * slot, ssd_capacity=8 * slot, ssd_slab_bytes=4 * slot)
    changes = TierChanges()
    store.record_changes(changes)
    bt = IDENT.block_tokens
    drained: list[Any] = []
    for ident in (IDENT, plain):
        ns = store.open_namespace(ident)
        tokens = [*range(3 * bt), *range(1 << 40, (1 << 40) + 2 * bt)]
        keys = chain_keys(ns.id, tokens, bt)
        for part, parent in ((slice(0, 3), None), (slice(3, 5), keys[2])):
            r = store.reserve("o", ns, keys[part], parent, 0.0)
            ids = encode_chain(tokens[part.start * bt:part.stop * bt],
                               part.stop - part.start, bt)
            store.commit("o", r.id, 0.0, tokens=ids)  # type: ignore[union-attr]
        more = chain_keys(ns.id, list(range(7, 7 + 2 * bt)), bt)
        r = store.reserve("o", ns, more, None, 0.0)
        store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
        drained += changes.drain()
        blocks = [ns.blocks[k] for k in keys]
        drained += [Stored("ssd", ns, blocks[1:4]), Stored("remote", ns, blocks[4:]),
                    Stored("gpu", ns, blocks[:1])]
        store.evict(ns, more)
        drained += changes.drain()
    assert {type(c).__name__ for c in drained} == {"Stored", "Removed"}
    for encoding in ("map", "array"):
        for group_idx, rank in ((-1, None), (2, 0), (0, 7)):
            maker = EventMaker(EventsConfig(encoding=encoding, group_idx=group_idx))
            for changes_ in ([], drained[:1], drained):
                payload, count = maker.payload(changes_, 1234.5, rank)
                expected = msgspec.msgpack.encode(
                    KVEventBatch(1234.5, maker.events(changes_), rank))
                assert payload == expected and count == len(changes_)
            batch = decoder(encoding).decode(payload)
            assert len(batch.events) == len(drained) and batch.data_parallel_rank == rank


def _committed(shape: str) -> tuple[BlockStore, TierChanges]:
    """A store whose changes since the last drain are commits' runs of ``shape``."""
    plain = make_identity(model="other")
    slot = IDENT.block_bytes
    store = BlockStore(64 * slot, 4 * slot)
    changes = TierChanges()
    store.record_changes(changes)
    bt = IDENT.block_tokens
    for n, ident in enumerate((IDENT, plain)):
        ns = store.open_namespace(ident)
        tokens = [*range(n, n + 3 * bt), *range(1 << 40, (1 << 40) + 2 * bt)]
        keys = chain_keys(ns.id, tokens, bt)
        parts = ((slice(0, 3), None), (slice(3, 5), keys[2]))  # one chain, two commits
        if shape == "chunks":  # one chain, a commit a block: five runs, one event
            parts = tuple((slice(i, i + 1), keys[i - 1] if i else None) for i in range(5))
        if shape == "separate":  # (the second commit a chain of its own)
            keys[3:] = chain_keys(ns.id, tokens[3 * bt:], bt)
            parts = ((slice(0, 3), None), (slice(3, 5), None))
        for part, parent in parts:
            r = store.reserve("o", ns, keys[part], parent, 0.0)
            size = part.stop - part.start
            ids: Any = encode_chain(tokens[part.start * bt:part.stop * bt], size, bt)
            if shape == "older client":
                ids = encode_blocks(tokens[part.start * bt:part.stop * bt], size, bt)
            elif shape == "no ids" and part.start:
                ids = b""
            store.commit("o", r.id, 0.0, tokens=ids)  # type: ignore[union-attr]
    return store, changes


def test_a_batch_of_commits_runs_alone_is_built_as_drained_byte_for_byte() -> None:
    # a busy daemon's batch (commits' runs, nothing else marked) is built from the runs
    # without a drain; the same commits drained and encoded are the oracle, whether the
    # runs continue each other (one event), are chains of their own, or lack ids
    for shape in ("separate", "one chain", "chunks", "no ids", "older client"):
        for encoding in ("map", "array"):
            maker = EventMaker(EventsConfig(encoding=encoding, group_idx=1))
            _, changes = _committed(shape)
            expected = maker.payload(changes.drain(), 99.5, 3)
            _, changes = _committed(shape)
            runs = changes.drain_runs()
            assert runs is not None and len(changes) == 0, shape
            assert maker.runs_payload(runs, 99.5, 3) == expected, (shape, encoding)
            assert changes.drain() == [] and changes.drain_runs() is None
    # a block marked alone since (evicted): the batch needs the drain, marks kept
    store, changes = _committed("separate")
    ns = next(iter(store.namespaces.values()))
    gone = next(iter(ns.blocks.values())).key
    store.evict(ns, [gone])
    marks = len(changes)
    assert changes.drain_runs() is None and len(changes) == marks
    drained = changes.drain()  # (a copy that came and went unannounced: left out)
    stored = [b.key for c in drained if isinstance(c, Stored) for b in c.blocks]
    assert stored and gone not in stored


def test_bad_events_settings_are_refused_by_name() -> None:
    import pytest

    from kvstore.config import load_config
    from kvstore.errors import ConfigError

    for env, field in (({"KVSTORE_EVENTS_ENCODING": "json"}, "events.encoding"),
                       ({"KVSTORE_EVENTS_ENDPOINT": "udp://x"}, "events.endpoint"),
                       ({"KVSTORE_EVENTS_REPLAY_ENDPOINT": "tcp://*:1"},
                        "events.replay_endpoint"),
                       ({"KVSTORE_EVENTS_ENDPOINT": "tcp://*:1",
                         "KVSTORE_EVENTS_BUFFER_STEPS": "0"}, "events.buffer_steps"),
                       ({"KVSTORE_EVENTS_GROUP_IDX": "-2"}, "events.group_idx"),
                       ({"KVSTORE_EVENTS_SSD_BANDWIDTH": "0"}, "events.ssd_bandwidth")):
        with pytest.raises(ConfigError, match=field):
            load_config(env=env)
    config = load_config(env={"KVSTORE_EVENTS_ENDPOINT": "tcp://*:5557",
                              "KVSTORE_EVENTS_TOPIC": "kv@pod@model"})
    assert config.events.endpoint == "tcp://*:5557" and config.events.topic == "kv@pod@model"
    assert load_config(env={}).events.endpoint == ""  # off by default


def test_token_ids_are_laid_out_once_and_checked_by_layout() -> None:
    import pytest

    from kvstore.errors import MalformedError
    from kvstore.token_ids import array_header, check_blocks, run_of

    bt = 4
    narrow = encode_blocks(list(range(8)), 2, bt)
    assert [len(b) for b in narrow] == [5 * bt] * 2
    wide = encode_blocks([1, 2, 3, -1, 1 << 40, 6, 7, 8, 9], 2, bt)  # the 9th: not a block
    assert [len(b) for b in wide] == [9 * bt] * 2
    for blocks, ids in ((narrow, list(range(8))), (wide, [1, 2, 3, -1, 1 << 40, 6, 7, 8])):
        check_blocks(blocks, 2, bt)
        raw = array_header(len(ids)) + b"".join(blocks)
        assert msgspec.msgpack.decode(raw) == ids
    check_blocks([narrow[0], b""], 2, bt)  # one not known
    check_blocks([narrow[0], wide[1]], 2, bt)  # widths may differ by block
    bad = [narrow[:1],                                   # too few blocks
           [narrow[0], narrow[1][:-1]],                  # a block cut short
           [narrow[0], b"\xcc" * (5 * bt)],              # not uint32 tags
           [narrow[0], np.arange(bt, dtype="<i8").tobytes()],  # raw int64: the old form
           [narrow[0], b"\xd3" + narrow[1] + b"\x00" * (4 * bt - 1)]]  # tags misplaced
    for tokens in bad:
        with pytest.raises(MalformedError, match="msgpack integers"):
            check_blocks(tokens, 2, bt)
    # one buffer for a commit's blocks: each block's bytes as encode_blocks lays them out
    assert encode_chain(range(8), 2, bt) == b"".join(narrow)
    keys = [b"a", b"b"]
    [run] = run_of(encode_chain(range(8), 2, bt), keys, bt)
    assert run.ids == b"".join(narrow) and run.size == 5 * bt and run.keys is keys
    assert run_of(b"", keys, bt) == []
    one = b"".join(narrow)
    for ids in (one[:-1], one + b"\xce", one[:5 * bt], b"\xd3" + one[1:],
                b"".join(wide) + one[:1], np.arange(2 * bt, dtype="<i8").tobytes()):
        with pytest.raises(MalformedError, match="one buffer"):
            run_of(ids, keys, bt)


def _token_ids(ns_stored: Stored) -> list[int]:
    made = EventMaker(EventsConfig()).events([ns_stored])[0]
    return msgspec.msgpack.decode(msgspec.msgpack.encode(made), type=BlockStored).token_ids


def _chain_committed(count: int, more: int = 0) -> tuple[BlockStore, TierChanges, Any,
                                                           list[int], list[bytes]]:
    """A store recording changes (room for twice ``count + more`` blocks), and a chain of
    ``count + more`` blocks' tokens and keys whose first ``count`` are committed with
    their ids in one buffer."""
    slot, bt = IDENT.block_bytes, IDENT.block_tokens
    room = 2 * (count + more) * slot
    store = BlockStore(room, room)
    changes = TierChanges(lambda: None)
    store.record_changes(changes)
    ns = store.open_namespace(IDENT)
    tokens = list(range((count + more) * bt))
    keys = chain_keys(ns.id, tokens, bt)
    r = store.reserve("o", ns, keys[:count], None, 0.0)
    store.commit("o", r.id, 0.0, tokens=encode_chain(tokens, count, bt))  # type: ignore[union-attr]
    return store, changes, ns, tokens, keys


def test_a_block_left_of_a_big_commit_keeps_about_its_own_token_ids() -> None:
    count = 64
    store, changes, ns, tokens, keys = _chain_committed(count)
    bt = IDENT.block_tokens
    run = ns.blocks[keys[0]].tokens
    assert run is not None and run.live == count
    store.index.evict(ns, keys[20:])  # still a quarter and more of it: the run stays whole
    assert all(ns.blocks[k].tokens is run for k in keys[:20]) and run.live == 20
    store.index.evict(ns, keys[3:20])  # fewer than a quarter: the three get their own
    kept = [ns.blocks[k] for k in keys[:3]]
    own = kept[0].tokens
    assert own is not run and own is not None
    assert all(b.tokens is own for b in kept) and own.live == 3
    assert own.keys == keys[:3] and len(own.ids) == 3 * own.size
    changes.drain()
    assert _token_ids(Stored("ssd", ns, kept)) == tokens[:3 * bt]
    store.index.evict(ns, keys[1:3])  # a run of under four blocks stays whole
    assert kept[0].tokens is own and own.live == 1


def test_a_commit_mostly_of_blocks_held_already_keeps_no_more_than_its_new_ids() -> None:
    count = 64
    store, changes, ns, tokens, keys = _chain_committed(count, 2)
    bt = IDENT.block_tokens
    # another writer's commit of the same prefix and two more blocks: a run born sparse
    r = store.reserve("o", ns, keys, None, 0.0)
    result = store.commit("o", r.id, 0.0,  # type: ignore[union-attr]
                          tokens=encode_chain(tokens, count + 2, bt))
    assert result.created == 2
    new = [ns.blocks[k] for k in keys[count:]]
    own = new[0].tokens
    assert own is not None and new[1].tokens is own
    assert own.keys == keys[count:] and len(own.ids) == 2 * own.size and own.live == 2
    changes.drain()
    assert _token_ids(Stored("ssd", ns, new)) == tokens[count * bt:]
    # a key named twice in one commit is one block: counted once
    store.index.evict(ns, keys)
    tokens2 = list(range(1000, 1000 + 2 * bt))
    keys2 = chain_keys(ns.id, tokens2, bt)
    sent = tokens2 + tokens2[bt:] * 4
    r = store.reserve("o", ns, keys2 + [keys2[1]] * 4, None, 0.0)
    store.commit("o", r.id, 0.0, tokens=encode_chain(sent, 6, bt))  # type: ignore[union-attr]
    run = ns.blocks[keys2[0]].tokens
    assert run is not None and ns.blocks[keys2[1]].tokens is run and run.live == 2


def test_token_ids_are_not_kept_with_no_event_stream() -> None:
    slot = IDENT.block_bytes
    store = BlockStore(8 * slot, 8 * slot)
    ns = store.open_namespace(IDENT)
    bt = IDENT.block_tokens
    tokens = list(range(2 * bt))
    keys = chain_keys(ns.id, tokens, bt)
    for ids in (encode_chain(tokens, 2, bt), encode_blocks(tokens, 2, bt)):
        r = store.reserve("o", ns, keys, None, 0.0)
        store.commit("o", r.id, 0.0, tokens=ids)  # type: ignore[union-attr]
        assert [ns.blocks[k].tokens for k in keys] == [None, None]


def _small_chain(blocks: int, ids: bool) -> tuple[BlockStore, TierChanges, Any,
                                                  list[int], list[bytes]]:
    """``_store``'s store and a chain of ``blocks`` blocks committed to it, with their
    token ids in one buffer or (``ids`` False: nobody heard) without."""
    store, changes, _ = _store()
    ns = store.open_namespace(IDENT)
    bt = IDENT.block_tokens
    tokens = list(range(blocks * bt))
    keys = chain_keys(ns.id, tokens, bt)
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0,  # type: ignore[union-attr]
                 tokens=encode_chain(tokens, blocks, bt) if ids else b"")
    return store, changes, ns, tokens, keys


def test_a_block_stored_with_no_ids_takes_them_from_a_later_commit() -> None:
    store, changes, ns, tokens, keys = _small_chain(3, ids=False)
    bt = IDENT.block_tokens
    changes.drain()
    r = store.reserve("o", ns, keys, None, 0.0)
    result = store.commit("o", r.id, 0.0,  # type: ignore[union-attr]
                          tokens=encode_chain(tokens, 3, bt))
    assert result.created == 0
    blocks = [ns.blocks[k] for k in keys]
    assert _token_ids(Stored("ssd", ns, blocks)) == tokens
    run = blocks[0].tokens
    assert run is not None and run.live == 3


def test_run_bytes_searches_each_runs_keys_once_however_runs_alternate() -> None:
    from types import SimpleNamespace

    from kvstore.token_ids import TokenRun, run_bytes

    class Keys(list[bytes]):
        searched = 0

        def index(self, *args: object) -> int:  # type: ignore[override]
            Keys.searched += 1
            return super().index(*args)  # type: ignore[arg-type]

    bt, count = 4, 400
    tokens = list(range(count * bt))
    keys = [i.to_bytes(4, "big") for i in range(count)]
    ids = encode_chain(tokens, count, bt)
    size = len(ids) // count
    # the chain's blocks 100.. named alternately by two runs of the same ids (two
    # commits), and the last block by a run of its own
    a = TokenRun(ids[100 * size:], Keys(keys[100:]), size)
    b = TokenRun(ids[50 * size:], Keys(keys[50:]), size)
    last = TokenRun(ids[-size:], Keys(keys[-1:]), size)
    blocks = [SimpleNamespace(key=keys[i], tokens=(a, b)[i % 2]) for i in range(100, count)]
    blocks[-1].tokens = last
    for part in (blocks, blocks[1:], blocks[7:-3], blocks[-2:]):
        Keys.searched = 0
        first = keys.index(part[0].key)
        assert run_bytes(part) == ids[first * size:(first + len(part)) * size]
        assert Keys.searched <= 3
    # a stretch of one run, its last block named by another: one slice, one search
    Keys.searched = 0
    tail = [SimpleNamespace(key=keys[i], tokens=b) for i in range(60, count)]
    tail[-1].tokens = last
    assert run_bytes(tail[1:]) == ids[61 * size:]
    assert Keys.searched <= 2


def test_a_block_back_from_ssd_keeps_its_ids_unless_its_commit_brings_some() -> None:
    store, changes, ns, tokens, keys = _small_chain(2, ids=True)
    bt = IDENT.block_tokens
    blocks = [ns.blocks[k] for k in keys]
    first = blocks[0].tokens

    def only_on_ssd() -> None:
        plan = store.ssd_copies.writeback_plan(high=0.0, low=0.0, batch=4)
        if plan:
            t, _ = store.ssd_copies.reserve(plan)
            store.ssd_copies.finish_write(t, [object()] * len(t.blocks))
        for b in blocks:
            store.drop_dram_copy(b)
        assert all(b.offset is None and b.ssd_offset is not None for b in blocks)

    only_on_ssd()
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0)  # type: ignore[union-attr]  # its DRAM copies, no ids
    assert all(b.tokens is first for b in blocks) and first is not None and first.live == 2
    only_on_ssd()
    r = store.reserve("o", ns, keys, None, 0.0)
    store.commit("o", r.id, 0.0, tokens=encode_chain(tokens, 2, bt))  # type: ignore[union-attr]
    second = blocks[0].tokens
    assert second is not first and second is not None
    assert all(b.tokens is second for b in blocks) and second.live == 2
    changes.drain()
    assert _token_ids(Stored("ssd", ns, blocks)) == tokens


def test_a_commits_claimed_size_makes_nothing_that_large() -> None:
    # a commit's token ids checked against what it claims (its blocks' tokens) made
    # tags of that size, and kept them, before looking at the size it sent
    import tracemalloc

    import pytest

    from kvstore.errors import MalformedError
    from kvstore.token_ids import run_of

    keys = [bytes([i]) * 16 for i in range(32)]
    tracemalloc.start()
    try:
        for _ in range(3):
            with pytest.raises(MalformedError, match="one buffer"):
                run_of(b"\x01", keys, 1 << 20)  # claims 32 Mi token ids; sends one byte
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_the_layouts_of_many_salts_are_kept_within_a_bound() -> None:
    # salts per user or per request: a layout (and an item) each, made again once the
    # bound is passed, the batches the same bytes as the events encoded
    from kvstore.kv_events_batch import _LAYOUTS_KEPT

    slot = IDENT.block_bytes
    store = BlockStore(8 * slot, 4 * slot)
    changes = TierChanges()
    store.record_changes(changes)
    maker = EventMaker(EventsConfig())
    for i in range(_LAYOUTS_KEPT + 100):
        ns = store.open_namespace(make_identity(salt=f"user-{i}"))
        keys = chain_keys(ns.id, list(range(IDENT.block_tokens)), IDENT.block_tokens)
        r = store.reserve("o", ns, keys, None, 0.0)
        store.commit("o", r.id, 0.0)  # type: ignore[union-attr]
        drained = changes.drain()
        payload, count = maker.payload(drained, 1.0, None)
        if i % 512 == 0 or i >= _LAYOUTS_KEPT - 2:
            assert payload == msgspec.msgpack.encode(
                KVEventBatch(1.0, maker.events(drained), None))
        store.evict(ns, keys)
        store.close_namespace(ns)
        changes.drain()
    assert len(maker._stored) <= _LAYOUTS_KEPT and len(maker._extra) <= _LAYOUTS_KEPT


def test_token_ids_larger_than_their_blocks_are_not_kept() -> None:
    # they live outside every tier's capacity: an identity of tiny blocks and many
    # tokens a block made them most of the daemon's memory
    tiny = make_identity(model="tiny", num_layers=1, num_kv_heads=1, head_dim=1)
    assert 5 * tiny.block_tokens > tiny.block_bytes  # its ids outweigh its blocks
    for ident, kept in ((IDENT, True), (tiny, False)):
        store = BlockStore(64 * IDENT.block_bytes, 16 * IDENT.block_bytes)
        changes = TierChanges()
        store.record_changes(changes)
        ns = store.open_namespace(ident)
        bt = ident.block_tokens
        keys = chain_keys(ns.id, list(range(2 * bt)), bt)
        r = store.reserve("o", ns, keys, None, 0.0)
        ids = encode_chain(range(2 * bt), 2, bt)
        store.commit("o", r.id, 0.0, tokens=ids)  # type: ignore[union-attr]
        assert all((ns.blocks[k].tokens is not None) == kept for k in keys)
