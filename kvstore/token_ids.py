"""Token ids as commits carry them and events send them: msgpack integers, laid out.

A commit's token ids travel from the client already encoded as the body of a msgpack
array, every block's after the one before in one buffer: each id a uint32 (``0xce``
then 4 bytes big-endian) or, when an id of the chain is out of that range, each an int64
(``0xd3`` then 8 bytes).  The client lays them out (numpy, once per chain); the daemon
checks the layout and keeps the buffer whole (``TokenRun``, which each of the commit's
blocks names), and an event's ``token_ids`` is an array header and a slice of it (or
of a few, joined): no id is decoded into a Python int, no block's ids are cut out on a
commit, nothing is encoded again on the daemon's side.  Older clients send a list of
each block's bytes instead (``encode_blocks``), which the daemon still takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from kvstore.errors import MalformedError

_NARROW = np.dtype([("tag", "u1"), ("value", ">u4")])  # 5 bytes an id
_WIDE = np.dtype([("tag", "u1"), ("value", ">i8")])    # 9 bytes an id


def encode_chain(token_ids: Any, blocks: int, block_tokens: int) -> bytes:
    """The first ``blocks`` full blocks of ``token_ids`` laid out as msgpack integers
    (uint32 each, or int64 each if any id is out of that range), in one buffer."""
    ids = np.asarray(token_ids, dtype=np.int64)[:blocks * block_tokens]
    wide = bool(ids.size) and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 32)
    out = np.empty(ids.size, dtype=_WIDE if wide else _NARROW)
    out["tag"] = 0xd3 if wide else 0xce
    out["value"] = ids
    return out.tobytes()


def encode_blocks(token_ids: Any, blocks: int, block_tokens: int) -> list[bytes]:
    """As ``encode_chain``, each block's bytes apart (the form older clients send)."""
    raw = encode_chain(token_ids, blocks, block_tokens)
    size = len(raw) // blocks if blocks else 0
    return [raw[i * size:(i + 1) * size] for i in range(blocks)]


class TokenRun:
    """One commit's token ids, kept whole as the client laid them out: ``keys[i]``'s
    block's ids are ``ids[i * size:(i + 1) * size]``.  Each block of the commit names
    the run; an event takes the slice of the blocks it announces.  ``live`` counts the
    blocks of the store's index that name it: when it falls below a quarter of the keys
    (``SPLIT_BELOW``), those blocks get runs of their own stretches
    (``let_go``), so what a block left of a big commit keeps is about its own ids, not
    the whole commit's buffer and key list."""

    __slots__ = ("ids", "keys", "size", "live")

    def __init__(self, ids: bytes, keys: list[bytes], size: int, live: int = 0) -> None:
        self.ids = ids
        self.keys = keys  # (the reservation's list, kept as it is)
        self.size = size
        self.live = live

    def __repr__(self) -> str:
        return (f"TokenRun({len(self.keys)} blocks, {self.size} bytes each, "
                f"{self.live} live)")


SPLIT_BELOW = 4  # a run is split when fewer than 1 in SPLIT_BELOW of its keys name it


def let_go(run: TokenRun, index: Any) -> None:
    """A block of ``index`` (a namespace's blocks, by key) that named ``run`` left it.
    When fewer than a quarter of the run's keys are still named, each stretch of
    consecutive blocks that still name it gets a run of its own (a slice of the ids and
    of the keys), so the commit's buffer and key list can go; O(the run's keys), once
    in the run's life."""
    run.live -= 1
    split_sparse(run, index)


def split_sparse(run: TokenRun, index: Any) -> None:
    """``let_go``'s split, where fewer than a quarter of ``run``'s keys name it: also
    at the commit of a run born sparse (a commit mostly of blocks held already)."""
    keys = run.keys
    if run.live * SPLIT_BELOW >= len(keys):
        return
    size, ids, count = run.size, run.ids, len(keys)
    get = index.get
    start = -1
    for i in range(count + 1):
        block = get(keys[i]) if i < count else None
        if block is not None and block.tokens is run:
            if start < 0:
                start = i
        elif start >= 0:
            own = TokenRun(ids[start * size:i * size], keys[start:i], size, i - start)
            for key in own.keys:
                index[key].tokens = own
            start = -1
    run.live = 0


def run_of(tokens: bytes | Sequence[bytes], keys: list[bytes],
           block_tokens: int) -> list[TokenRun | None]:
    """Token ids as a commit of ``keys`` carried them, checked: one run for all the keys
    (one buffer: ``[run]``), or one per key (a list of each block's bytes, as older
    clients send them: None where b"", not known); [] for none.  Refused
    (``MalformedError``) unless laid out as ``encode_chain`` lays them out."""
    count = len(keys)
    if isinstance(tokens, bytes):
        if not tokens:
            return []
        n5, n9 = 5 * block_tokens, 9 * block_tokens
        size = len(tokens)
        # each id's tag counted where it should be: nothing made or kept that is sized
        # by what the commit claims (a size alone once made and cached tags that large)
        if (size == n5 * count and tokens[::5].count(0xCE) == size // 5
                or size == n9 * count and tokens[::9].count(0xD3) == size // 9):
            return [TokenRun(tokens, keys, size // count)]
        raise MalformedError(
            f"token ids must come as msgpack integers, {block_tokens} per block for each "
            f"of the {count} keys, in one buffer (each id 0xce and 4 bytes, or each 0xd3 "
            f"and 8 bytes: {n5 * count} or {n9 * count} bytes; got {size}); "
            f"kvstore.token_ids.encode_chain lays them out")
    if not tokens:
        return []
    check_blocks(tokens, count, block_tokens)
    return [TokenRun(t, [key], len(t), 1) if t else None for key, t in zip(keys, tokens)]


def run_bytes(blocks: Sequence[Any]) -> bytes | None:
    """The token ids of ``blocks`` (``Block``s of one chain, each the parent of the next,
    each naming its ``TokenRun`` in ``tokens``) laid out one after another; None if a
    block's are not known."""
    parts = run_parts(blocks)
    if parts is None:
        return None
    return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


def run_parts(blocks: Sequence[Any]) -> list[bytes | memoryview] | None:
    """``run_bytes``' ids as the pieces that lie one after another: a run's whole buffer,
    or a view of a slice of it (nothing copied: the event's encoding joins them once).
    A stretch of consecutive blocks of one run is one piece; each run's keys are
    searched once (a run's keys are a stretch of the chain, so a block's place in them
    is the first found's plus how far along the chain it is): O(the blocks) however the
    runs alternate."""
    parts: list[bytes | memoryview] = []
    shift: dict[TokenRun, int] = {}  # a run's first key found: its place less the block's
    i, count = 0, len(blocks)
    while i < count:
        block = blocks[i]
        run: TokenRun | None = block.tokens
        if run is None:
            return None
        keys = run.keys
        at = i + shift.get(run, -i)
        if not (0 <= at < len(keys) and keys[at] == block.key):
            at = keys.index(block.key)
            shift[run] = at - i
        # as far as the run and the blocks go together: the blocks are a chain, so if
        # the last of them is the run's block there, every one between is too
        end = min(len(keys) - at, count - i)
        last = blocks[i + end - 1]
        if last.tokens is run and keys[at + end - 1] == last.key:
            n = end
        else:
            n = 1
            while n < end and blocks[i + n].tokens is run and keys[at + n] == blocks[i + n].key:
                n += 1
        size = run.size
        if n == len(keys):
            parts.append(run.ids)
        else:
            parts.append(memoryview(run.ids)[at * size:(at + n) * size])
        i += n
    return parts


@lru_cache(maxsize=16)
def _tags(ids: int) -> tuple[bytes, bytes]:
    """The tags of ``ids`` token ids, narrow and wide."""
    return b"\xce" * ids, b"\xd3" * ids


def check_blocks(tokens: Sequence[bytes], blocks: int, block_tokens: int) -> None:
    """Refuse token ids that are not, for each of ``blocks`` blocks, ``block_tokens``
    msgpack integers as ``encode_blocks`` lays them out (b"": not known)."""
    narrow, wide = _tags(block_tokens)
    n5, n9 = 5 * block_tokens, 9 * block_tokens
    if len(tokens) == blocks:
        sizes = set(map(len, tokens))
        if len(sizes) == 1:  # all of one width (as a client sends them): checked at once
            joined = b"".join(tokens)
            if (n5 in sizes and joined[::5] == narrow * blocks
                    or n9 in sizes and joined[::9] == wide * blocks or 0 in sizes):
                return
        for t in tokens:
            size = len(t)
            if not (size == n5 and t[::5] == narrow or size == n9 and t[::9] == wide
                    or not size):
                break
        else:
            return
    raise MalformedError(
        f"token ids must come as msgpack integers, {block_tokens} per block (each 0xce and "
        f"4 bytes, or each 0xd3 and 8 bytes: {n5} or {n9} bytes a block, b'' if not "
        f"known), for each of the {blocks} keys; kvstore.token_ids.encode_blocks lays "
        f"them out")


def array_header(count: int) -> bytes:
    """The msgpack header of an array of ``count`` items (as msgspec writes it)."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")
