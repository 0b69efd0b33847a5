"""vLLM's KV events, field for field, and kvstore's tier changes encoded as them.

The structs are vLLM's (``vllm/distributed/kv_events.py``): ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` in a ``KVEventBatch``, as maps tagged ``type``
(vLLM's encoding today) or positional arrays tagged first (the older one).
``EventMaker`` turns the store's changes (``kvstore.tier_changes``) into them, or
straight into an encoded batch from each event's layout: ids and bytes only, no socket
(the publisher, ``kvstore.events``, sends the batches).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any, TypeGuard, Union

import msgspec

from kvstore.blocks import DRAM, SSD, Block, Namespace
from kvstore.config import EventsConfig
from kvstore.tier_changes import GPU, REMOTE, Change, Removed, dram_runs
from kvstore.token_ids import TokenRun, array_header, run_bytes, run_parts

# tier -> (medium, locality)
MEDIA: dict[str, tuple[str, str | None]] = {
    GPU: ("GPU", None),
    DRAM: ("CPU", None),
    SSD: ("STORAGE", "LOCAL"),
    REMOTE: ("STORAGE", "REMOTE"),
}


# -- the events, field for field as vLLM defines them (vllm/distributed/kv_events.py) -----

class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """An event, encoded as a map with a ``type`` key naming it."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# The older encoding: the same events as arrays, their tag first.
class BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class KVEventBatchArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStoredArray, BlockRemovedArray, AllBlocksClearedArray]]
    data_parallel_rank: int | None = None


_EMPTY: Any = msgspec.Raw(b"\x90")  # an empty array
# Stand-ins for an event's per-event fields in its layout's encoding (``EventMaker``),
# found again by their bytes: 0xc1 is no msgpack type and never in UTF-8.
_MARKS = tuple(b"\xc1kvstore event field %d\xc1" % i for i in range(4))
_FLOAT = struct.Struct(">Bd")  # a float as msgspec encodes it: float 64


def decoder(encoding: str = "map") -> msgspec.msgpack.Decoder[Any]:
    """A decoder of batches in ``encoding`` (for subscribers written in Python)."""
    return msgspec.msgpack.Decoder(KVEventBatch if encoding == "map" else KVEventBatchArray)


class EventMaker:
    """Changes of the store into events, in one encoding.

    A run's per-block fields go out pre-encoded (``msgspec.Raw`` in place of the lists
    they encode): the token ids as the client laid them out (``kvstore.token_ids``: a
    commit's run announced whole is its buffer as it came), and the extra keys as one
    encoded item repeated.  No Python object is made
    per block but the list of its keys.

    ``payload`` encodes a batch without the event objects: each event is its layout's
    bytes (the encoding of an event of its namespace and tier, cut where the per-event
    fields go, made once) around its keys, parent and token ids, joined once for the
    whole batch; byte for byte what ``events`` encoded in a ``KVEventBatch`` gives."""

    def __init__(self, config: EventsConfig) -> None:
        array = config.encoding == "array"
        self.stored: type[BlockStored] = BlockStoredArray if array else BlockStored
        self.removed: type[BlockRemoved] = BlockRemovedArray if array else BlockRemoved
        self.cleared: type[AllBlocksCleared] = (AllBlocksClearedArray if array
                                                else AllBlocksCleared)
        self.group_idx = config.group_idx if config.group_idx >= 0 else None
        self._extra: dict[str, bytes] = {}  # salt -> its extra keys' item, encoded
        # (block_tokens, adapter, salt, tier) -> a BlockStored's layout; tier -> a
        # BlockRemoved's
        self._stored: dict[tuple[int, str | None, str, str], tuple[bytes, ...]] = {}
        self._removed: dict[str, tuple[bytes, ...]] = {}
        self._batch: dict[int | None, tuple[bytes, ...]] = {}  # rank -> a batch's layout
        self._encode = msgspec.msgpack.Encoder().encode

    def events(self, changes: Iterable[Change]) -> list[Event]:
        out: list[Event] = []
        for change in changes:
            medium, locality = MEDIA[change.tier]
            if isinstance(change, Removed):
                out.append(self.removed(change.keys, medium, self.group_idx, locality))
            else:
                out.append(self.store_event(change.ns, change.blocks, medium, locality))
        return out

    def store_event(self, ns: Namespace, blocks: list[Block], medium: str,
                    locality: str | None) -> BlockStored:
        """One run's event, ready to encode (its per-block fields encoded already: a
        ``msgspec.Raw`` encodes as the list it holds, so it stands in for one)."""
        identity = ns.identity
        first = blocks[0]
        parent = first.parent
        count = len(blocks)
        run = first.tokens
        keys: list[bytes]
        raw: bytes | None
        if _whole(run, first, blocks[-1], count):  # a commit's blocks, all of them: its
            keys, raw = run.keys, run.ids           # keys' list and token ids as they came
        else:
            keys, raw = [b.key for b in blocks], run_bytes(blocks)
        tokens: Any = _EMPTY  # not sent by a writer (or restored from SSD): none
        if raw is not None:
            tokens = msgspec.Raw(array_header(count * identity.block_tokens) + raw)
        extra: Any = None
        salt = identity.salt
        if salt:
            item = self._extra.get(salt)
            if item is None:
                item = self._extra[salt] = msgspec.msgpack.encode((salt,))
            extra = msgspec.Raw(array_header(count) + item * count)
        return self.stored(
            keys, parent.key if parent is not None else None, tokens,
            identity.block_tokens, None, medium, identity.adapter, extra, self.group_idx,
            None, None, locality)


    def payload(self, changes: Iterable[Change], ts: float, rank: int | None
                ) -> tuple[bytes, int]:
        """A batch of ``changes``' events at ``ts``, encoded; and how many events."""
        encode = self._encode
        parts: list[bytes | memoryview] = []
        add = parts.append
        count = 0
        for change in changes:
            count += 1
            if isinstance(change, Removed):
                head, tail = self._removed.get(change.tier) or self._removed_layout(
                    change.tier)
                parts += (head, encode(change.keys), tail)
                continue
            blocks = change.blocks
            identity = change.ns.identity
            layout = self._stored.get(
                (identity.block_tokens, identity.adapter, identity.salt, change.tier))
            if layout is None:
                layout = self._stored_layout(identity.block_tokens, identity.adapter,
                                             identity.salt, change.tier)
            first = blocks[0]
            n = len(blocks)
            run = first.tokens
            if _whole(run, first, blocks[-1], n):  # a commit's blocks, all of them
                keys = run.keys
                ids: list[bytes | memoryview] | None = [run.ids]
            else:
                keys = [b.key for b in blocks]
                ids = run_parts(blocks)
            parent = first.parent
            add(layout[0])
            add(encode(keys))
            add(layout[1])
            add(b"\xc0" if parent is None else encode(parent.key))
            add(layout[2])
            if ids is None:
                add(b"\x90")
            else:
                add(array_header(n * identity.block_tokens))
                parts += ids
            add(layout[3])
            if len(layout) > 4:  # the salt's extra keys, one item a block
                add(array_header(n))
                add(self._extra[identity.salt] * n)
                add(layout[4])
        batch = self._batch.get(rank) or self._batch_layout(rank)
        return b"".join((batch[0], _FLOAT.pack(0xcb, ts), batch[1], array_header(count),
                         *parts, batch[2])), count

    def runs_payload(self, runs: list[list[Block]], ts: float, rank: int | None
                     ) -> tuple[bytes, int]:
        """``payload`` of commits' runs (``TierChanges.drain_runs``: each gained its DRAM
        copies), byte for byte, built straight from the runs: one event a run, read
        from the run's first and last blocks and its token ids as the commit kept them.
        Runs that continue each other (one event for them) take ``_chain_payload``'s
        way, and a run that lost part of its commit's token ids ``payload``'s."""
        encode = self._encode
        layouts = self._stored
        parts: list[bytes | memoryview] = []
        last: Block | None = None
        for blocks in runs:
            first = blocks[0]
            parent = first.parent
            end = blocks[-1]
            run = first.tokens
            n = len(blocks)
            if (run is None or len(run.keys) != n or run.keys[0] is not first.key
                    or run.keys[-1] is not end.key):  # (``_whole``, inline: every run)
                return self.payload(dram_runs(runs), ts, rank)
            if parent is last and last is not None:
                return self._chain_payload(runs, ts, rank)
            last = end
            identity = first.ns.identity
            layout = layouts.get((identity.block_tokens, identity.adapter, identity.salt,
                                  DRAM))
            if layout is None:
                layout = self._stored_layout(identity.block_tokens, identity.adapter,
                                             identity.salt, DRAM)
            parts += (layout[0], encode(run.keys), layout[1],
                      b"\xc0" if parent is None else encode(parent.key), layout[2],
                      array_header(n * identity.block_tokens), run.ids, layout[3])
            if len(layout) > 4:  # the salt's extra keys, one item a block
                parts += (array_header(n), self._extra[identity.salt] * n, layout[4])
        batch = self._batch.get(rank) or self._batch_layout(rank)
        return b"".join((batch[0], _FLOAT.pack(0xcb, ts), batch[1], array_header(len(runs)),
                         *parts, batch[2])), len(runs)

    def _chain_payload(self, runs: list[list[Block]], ts: float, rank: int | None
                       ) -> tuple[bytes, int]:
        """``runs_payload`` where runs continue each other (a prompt committed in chunks,
        say): one event for each stretch of them, its keys the runs' keys and its token
        ids the commits' buffers, one after another."""
        encode = self._encode
        layouts = self._stored
        parts: list[bytes | memoryview] = []
        i, count, events = 0, len(runs), 0
        while i < count:
            blocks = runs[i]
            first = blocks[0]
            end = blocks[-1]
            run = first.tokens
            n = len(blocks)
            if not _whole(run, first, end, n):
                return self.payload(dram_runs(runs), ts, rank)
            keys, ids = run.keys, run.ids
            more: list[bytes] | None = None  # the token ids of the runs that continue it
            i += 1
            while i < count and runs[i][0].parent is end:  # one event for them all
                blocks = runs[i]
                end = blocks[-1]
                run = blocks[0].tokens
                if not _whole(run, blocks[0], end, len(blocks)):
                    return self.payload(dram_runs(runs), ts, rank)
                if more is None:
                    keys, more = keys.copy(), []
                keys += run.keys
                more.append(run.ids)
                n += len(blocks)
                i += 1
            events += 1
            parent = first.parent
            identity = first.ns.identity
            layout = layouts.get((identity.block_tokens, identity.adapter, identity.salt,
                                  DRAM))
            if layout is None:
                layout = self._stored_layout(identity.block_tokens, identity.adapter,
                                             identity.salt, DRAM)
            parts += (layout[0], encode(keys), layout[1],
                      b"\xc0" if parent is None else encode(parent.key), layout[2],
                      array_header(n * identity.block_tokens), ids, *(more or ()),
                      layout[3])
            if len(layout) > 4:  # the salt's extra keys, one item a block
                parts += (array_header(n), self._extra[identity.salt] * n, layout[4])
        batch = self._batch.get(rank) or self._batch_layout(rank)
        return b"".join((batch[0], _FLOAT.pack(0xcb, ts), batch[1], array_header(events),
                         *parts, batch[2])), events

    def _batch_layout(self, rank: int | None) -> tuple[bytes, ...]:
        marks: list[Any] = [msgspec.Raw(m) for m in _MARKS]
        layout = self._batch[rank] = _cut(
            msgspec.msgpack.encode(KVEventBatch(marks[0], marks[1], rank)), 2)
        return layout

    def _stored_layout(self, block_tokens: int, adapter: str | None, salt: str,
                       tier: str) -> tuple[bytes, ...]:
        medium, locality = MEDIA[tier]
        marks: list[Any] = [msgspec.Raw(m) for m in _MARKS]  # (each encodes as is)
        if len(self._stored) >= _LAYOUTS_KEPT:  # salts per user or request: made again
            self._stored.clear()
            self._extra.clear()
        if salt and salt not in self._extra:
            self._extra[salt] = msgspec.msgpack.encode((salt,))
        event = self.stored(marks[0], marks[1], marks[2], block_tokens, None, medium,
                            adapter, marks[3] if salt else None, self.group_idx, None,
                            None, locality)
        layout = self._stored[(block_tokens, adapter, salt, tier)] = _cut(
            msgspec.msgpack.encode(event), 4 if salt else 3)
        return layout

    def _removed_layout(self, tier: str) -> tuple[bytes, ...]:
        medium, locality = MEDIA[tier]
        mark: Any = msgspec.Raw(_MARKS[0])
        event = self.removed(mark, medium, self.group_idx, locality)
        layout = self._removed[tier] = _cut(msgspec.msgpack.encode(event), 1)
        return layout


_LAYOUTS_KEPT = 4096  # BlockStored layouts (and salts' items) kept at most


def _whole(run: TokenRun | None, first: Block, last: Block, count: int
           ) -> TypeGuard[TokenRun]:
    """Whether ``run`` holds the token ids of exactly the blocks ``first`` to ``last``,
    ``count`` of them: a commit's blocks, all of them (its first and last key objects
    are the blocks' own: each block between is the one the commit made, in order)."""
    return (run is not None and len(run.keys) == count and run.keys[0] is first.key
            and run.keys[-1] is last.key)


def _cut(encoded: bytes, fields: int) -> tuple[bytes, ...]:
    """``encoded`` cut at the first ``fields`` marks (each found once, in order)."""
    parts: list[bytes] = []
    rest = encoded
    for mark in _MARKS[:fields]:
        head, found, rest = rest.partition(mark)
        assert found and encoded.count(mark) == 1, f"an event's layout lost field {mark!r}"
        parts.append(head)
    parts.append(rest)
    return tuple(parts)
