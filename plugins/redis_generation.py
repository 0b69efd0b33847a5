"""A Redis Cluster's generation (``StorageBackend.generation``): a token on every primary.

The token lived under one key, so on the one primary serving its slot: another primary
that came back empty (restarted without its data, failed over to an empty replica) lost
its share of the blocks and left the token standing, so the daemons kept their marks of
those blocks and let DRAM drop them unwritten.  So each primary holds a token of its own:
the first under ``key_prefix + "generation"``, as on one server, and each other primary's
under that key and a hash tag of its slots (the smallest number whose slot it serves, the
same for every daemon of the cluster).  The generation is those tokens together: it
changes when any primary lost its token, and also when the primaries or their slots
changed so that the keys are others (a resharding reads as one loss: the marks are
forgotten and what DRAM holds written again; nothing is dropped unwritten).  A prefix
with a hash tag of its own puts every key on one slot: one token, as before.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster

TAGS_TRIED = 1 << 16  # hash tags tried for the primaries' tokens, at most (a few, as a rule)


def has_hash_tag(key: bytes) -> bool:
    """Whether Redis hashes ``key`` by a tag (a ``{...}`` with something in it, first)."""
    start = key.find(b"{")
    return start >= 0 and key.find(b"}", start + 1) > start + 1


class ClusterTokens:
    """The keys of the primaries' tokens (found again when the primaries change), and the
    generation read from them."""

    def __init__(self) -> None:
        self._primaries: frozenset[str] = frozenset()
        self._keys: list[bytes] = []

    def __repr__(self) -> str:
        return f"ClusterTokens({len(self._keys)} keys, {len(self._primaries)} primaries)"

    def keys(self, client: RedisCluster, base: bytes) -> list[bytes]:
        """``base``, then a key for each other primary that serves none of those before."""
        primaries = frozenset(node.name for node in client.get_primaries())
        if primaries == self._primaries and self._keys and self._keys[0] == base:
            return self._keys
        keys = [base]
        node = client.get_node_from_key(base)  # type: ignore[arg-type]  # (takes bytes)
        left = set(primaries) - {node.name if node is not None else ""}
        if has_hash_tag(base):
            left.clear()  # (every key is on base's slot)
        for number in range(TAGS_TRIED):
            if not left:
                break
            key = b"%s{%d}" % (base, number)
            node = client.get_node_from_key(key)  # type: ignore[arg-type]
            if node is not None and node.name in left:
                left.discard(node.name)
                keys.append(key)
        self._primaries, self._keys = primaries, keys
        return keys

    async def generation(self, client: RedisCluster, base: bytes) -> bytes:
        """The tokens read (those missing made, SET NX, as on one server), as one: the
        token itself where there is one key; b"" where a primary would not take one
        (full, noeviction).  Raises the library's errors."""
        await client.initialize()
        keys = self.keys(client, base)
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        tokens: list[object] = list(await pipe.execute(raise_on_error=False))
        missing = [i for i, token in enumerate(tokens) if token is None]
        if missing:
            pipe = client.pipeline(transaction=False)
            for i in missing:
                pipe.set(keys[i], os.urandom(16).hex().encode(), nx=True)
                pipe.get(keys[i])
            replies = await pipe.execute(raise_on_error=False)
            for i, token in zip(missing, replies[1::2], strict=True):
                tokens[i] = token
        for token in tokens:
            if isinstance(token, Exception):
                raise token
        if not all(isinstance(token, bytes) and token for token in tokens):
            return b""
        if len(tokens) == 1:
            return tokens[0]  # type: ignore[return-value]  # (bytes: checked above)
        joined = b"\0".join(tokens)  # type: ignore[arg-type]
        return hashlib.blake2b(joined, digest_size=16).hexdigest().encode()


Known = tuple[bytes, tuple[str, int] | None]  # a token read, and its server's state then


async def server_token(client: Any, key: bytes,
                       known: Known | None) -> tuple[object, tuple[str, int] | None]:
    """One server's token under ``key`` (``RedisBackend.generation``: the token last read,
    ``known``, put back where the server's own eviction took it, else another made), and
    the server's state (run_id, evicted_keys); the token as the server answered: bytes,
    None (gone, and the server took no other), or the error it replied."""
    pipe = client.pipeline(transaction=False)
    pipe.get(key)
    pipe.info("server")
    pipe.info("stats")
    replies = await pipe.execute(raise_on_error=False)
    token, server = replies[0], _server_state(replies[1:])
    if isinstance(token, Exception):
        raise token
    if known is not None and token == known[0]:
        return known[0], server or known[1]
    taken = (known is not None and token is None and server is not None
             and known[1] is not None and server[0] == known[1][0]
             and server[1] > known[1][1])  # by the server's own eviction
    if token is None:
        made = known[0] if taken and known is not None and known[0] else (
            os.urandom(16).hex().encode())
        pipe = client.pipeline(transaction=False)
        pipe.set(key, made, nx=True)
        pipe.get(key)
        _, token = await pipe.execute(raise_on_error=False)
    return token, server


def _server_state(replies: Sequence[object]) -> tuple[str, int] | None:
    """(run_id, evicted_keys) from the replies of INFO server and INFO stats; None where
    they are not there (a cluster, INFO refused)."""
    if len(replies) != 2 or not all(isinstance(r, dict) for r in replies):
        return None
    server, stats = cast(list[dict[str, object]], list(replies))
    run_id, evicted = server.get("run_id"), stats.get("evicted_keys")
    if not isinstance(run_id, str) or not isinstance(evicted, int):
        return None
    return run_id, evicted
