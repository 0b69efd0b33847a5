"""Token ids as commits carry them and events send them: msgpack integers, laid out.

A block's token ids travel from the client already encoded as the body of a msgpack
array: each id a uint32 (``0xce`` then 4 bytes big-endian) or, when an id of the chain is
out of that range, each an int64 (``0xd3`` then 8 bytes).  The client lays them out
(numpy, once per chain); the daemon checks the layout, keeps the bytes, and an event's
``token_ids`` is an array header and its blocks' bytes joined: no id is decoded into a
Python int or encoded again on the daemon's side.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

from kvstore.errors import MalformedError

_NARROW = np.dtype([("tag", "u1"), ("value", ">u4")])  # 5 bytes an id
_WIDE = np.dtype([("tag", "u1"), ("value", ">i8")])    # 9 bytes an id


def encode_blocks(token_ids: Any, blocks: int, block_tokens: int) -> list[bytes]:
    """The first ``blocks`` full blocks of ``token_ids``, each block's ids laid out as
    msgpack integers (uint32 each, or int64 each if any id is out of that range)."""
    ids = np.asarray(token_ids, dtype=np.int64)[:blocks * block_tokens]
    wide = bool(ids.size) and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 32)
    out = np.empty(ids.size, dtype=_WIDE if wide else _NARROW)
    out["tag"] = 0xd3 if wide else 0xce
    out["value"] = ids
    raw = out.tobytes()
    size = out.itemsize * block_tokens
    return [raw[i * size:(i + 1) * size] for i in range(blocks)]


@cache
def _tags(block_tokens: int) -> tuple[bytes, bytes]:
    return b"\xce" * block_tokens, b"\xd3" * block_tokens


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
