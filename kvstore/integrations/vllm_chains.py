"""Finding a vLLM request's kvstore keys again from the chains of earlier requests (no
engine imports: testable without vLLM)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from kvstore.keys import chain_keys

SECURE_HASHES = ("sha256", "sha256_cbor")  # vLLM's block hashes that tell prefixes apart
KNOWN_KEYS = 1 << 20  # keys remembered at most, every chain together (~57 B each)


class KnownChains:
    """The keys of recent requests' chains, found again by vLLM's own block hashes.

    A conversation's next request starts with the tokens of the one before; vLLM has
    hashed its blocks already (chained, as kvstore's keys are, with the adapter and salt
    in), so the leading blocks whose vLLM hash matches a remembered chain's take its keys
    over instead of being hashed again.  Only with a collision-resistant hash (sha256):
    two equal hashes mean equal token prefixes, as two equal kvstore keys do.  A chain
    is remembered by where it ends now, once (remembered again as it grows, it moves);
    bounded by keys: past ``max_keys`` in all, the least recent chains are forgotten."""

    def __init__(self, enabled: bool, max_keys: int = KNOWN_KEYS) -> None:
        self.enabled = enabled
        self._max_keys = max_keys
        self._keys = 0  # keys remembered, as counted when each chain was remembered
        # (space, vLLM hash of a chain's last block) -> the chain, its length then
        self._ends: OrderedDict[tuple[Hashable, bytes], tuple[list[bytes], int]] = (
            OrderedDict())
        self._end_of: dict[int, tuple[Hashable, bytes]] = {}  # id(chain) -> its end

    @property
    def keys(self) -> int:
        """Keys remembered (every chain together)."""
        return self._keys

    def __len__(self) -> int:
        """Chains remembered."""
        return len(self._ends)

    @classmethod
    def of(cls, cache_config: Any, wanted: bool = True) -> KnownChains:
        """For an engine of vLLM's ``cache_config``: enabled where ``wanted`` and its
        prefix cache hashes blocks with a collision-resistant hash."""
        return cls(wanted and bool(cache_config.enable_prefix_caching)
                   and cache_config.prefix_caching_hash_algo in SECURE_HASHES)

    def hashes(self, request: Any, block_tokens: int) -> Sequence[bytes]:
        """vLLM's hash of each full block of ``request`` (none unless they are one a
        block of ``block_tokens``)."""
        hashes: Sequence[bytes] | None = (getattr(request, "block_hashes", None)
                                          if self.enabled else None)
        if not hashes or len(hashes) != request.num_tokens // block_tokens:
            return ()
        return hashes

    def prefix(self, space: Hashable, hashes: Sequence[bytes], blocks: int) -> list[bytes]:
        """The keys of the longest prefix of the first ``blocks`` blocks that ends a
        remembered chain."""
        for j in range(min(blocks, len(hashes)) - 1, -1, -1):
            found = self._ends.get((space, hashes[j]))
            if found is not None:
                self._ends.move_to_end((space, hashes[j]))
                return found[0][:j + 1]
        return []

    def remember(self, space: Hashable, hashes: Sequence[bytes], keys: list[bytes]) -> None:
        """Remember ``keys`` (the chain's, growing later) as ending where they end now."""
        if not keys or len(hashes) < len(keys):
            return
        before = self._end_of.get(id(keys))
        if before is not None:  # remembered by where it ended then: it ends further now
            self._forget(before)
        end = (space, hashes[len(keys) - 1])
        if end in self._ends:  # another chain with the same prefix: this one instead
            self._forget(end)
        self._ends[end] = (keys, len(keys))
        self._end_of[id(keys)] = end
        self._keys += len(keys)
        while self._keys > self._max_keys:
            self._forget(next(iter(self._ends)))

    def _forget(self, end: tuple[Hashable, bytes]) -> None:
        keys, counted = self._ends.pop(end)
        del self._end_of[id(keys)]
        self._keys -= counted

    def extend(self, space: Hashable, request: Any, keys: list[bytes], blocks: int,
               block_tokens: int, namespace_id: Callable[[], bytes]) -> None:
        """Extend ``keys``, the request's chain so far, to its first ``blocks`` keys:
        a remembered prefix taken over (when ``keys`` is empty), the rest hashed from
        the request's tokens in ``namespace_id()``; the chain remembered."""
        if len(keys) >= blocks:
            return
        hashes = self.hashes(request, block_tokens)
        if not keys:
            keys.extend(self.prefix(space, hashes, blocks))
        if len(keys) < blocks:
            b = block_tokens
            keys.extend(chain_keys(namespace_id(), request.all_token_ids[len(keys) * b:
                                                                         blocks * b],
                                   b, keys[-1] if keys else None))
        self.remember(space, hashes, keys)
