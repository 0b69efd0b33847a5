"""What a client remembers of the chains its ``keys()`` laid out: each key's parent, so
that reserve and put can name a chain's parent, and each block's token ids, sent with
its commit while the daemon publishes events that carry them.  Bounded: the oldest are
forgotten first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvstore import protocol as p
from kvstore.token_ids import encode_chain

_PARENT_MEMORY = 1 << 20  # chain links remembered per namespace, for reserve/put parents
_TOKEN_MEMORY = 1 << 18   # token ids remembered per namespace, for the daemon's events


class Chains:
    """Parents remembered from ``keys()`` so that reserve/put can name a chain's parent."""

    def __init__(self) -> None:
        self._parents: OrderedDict[bytes, bytes | None] = OrderedDict()
        # each key's block's token ids: its chain's ids laid out, and where its are
        self._tokens: OrderedDict[bytes, tuple[bytes, int, int]] = OrderedDict()

    def remember(self, keys: list[bytes], parent: bytes | None) -> None:
        for key in keys:
            self._parents[key] = parent
            parent = key
        while len(self._parents) > _PARENT_MEMORY:
            self._parents.popitem(last=False)

    def parent_of(self, first_key: bytes) -> bytes | None:
        return self._parents.get(first_key)

    def remember_tokens(self, keys: list[bytes], token_ids: Sequence[int] | Any,
                        block_tokens: int) -> None:
        """Each block's token ids, to send with its commit (the daemon publishes events
        that carry them): laid out once for the chain, each key's place in it kept."""
        if not keys:
            return
        raw = encode_chain(token_ids, len(keys), block_tokens)
        size = len(raw) // len(keys)
        tokens = self._tokens
        for i, key in enumerate(keys):
            tokens[key] = (raw, i * size, (i + 1) * size)
        most = max(1, _TOKEN_MEMORY // block_tokens)
        while len(tokens) > most:
            tokens.popitem(last=False)

    def tokens_of(self, keys: Sequence[bytes], one_buffer: bool) -> tuple[list[bytes], bytes]:
        """The keys' blocks' token ids as a commit or put carries them: ``([], buffer)``,
        one after another in one buffer (a slice of their chain's when they were laid out
        together), where the daemon takes that (``one_buffer``) and all are remembered;
        else ``(each block's, b"")``, b"" where one is not; ``([], b"")`` when none is, or
        when they would crowd the request's header."""
        if not keys:
            return [], b""
        tokens = self._tokens
        first, last = tokens.get(keys[0]), tokens.get(keys[-1])
        if one_buffer and first is not None and last is not None:
            raw, start, end = first
            if last[0] is raw and last[1] - start == (len(keys) - 1) * (end - start):
                out = raw[start:last[2]]  # one chain's, as laid out
                return ([], out) if len(out) <= p.MAX_HEADER_BYTES // 2 else ([], b"")
        found = [tokens.get(key) for key in keys]
        each = [f[0][f[1]:f[2]] if f is not None else b"" for f in found]
        if not any(each):
            return [], b""
        if one_buffer and all(each) and len(set(map(len, each))) == 1:
            out = b"".join(each)  # of several chains, all of one width
            return ([], out) if len(out) <= p.MAX_HEADER_BYTES // 2 else ([], b"")
        if sum(map(len, each)) > p.MAX_HEADER_BYTES // 2:
            return [], b""
        return each, b""
