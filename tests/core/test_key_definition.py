"""The block key's definition pinned against the documented formula, written out here
on its own: ``key_j = BLAKE2b-128(person="kvstore.key.v1"; namespace, key_{j-1},
tokens of block j as little-endian int64)``, ``key_{-1}`` the parent or the namespace.
Keys are stored and shared between processes and hosts: a faster ``chain_keys`` must
give exactly these bytes."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest

from kvstore.keys import chain_keys


def reference(namespace: bytes, tokens: list[int], block: int,
              parent: bytes | None) -> list[bytes]:
    keys, previous = [], parent if parent is not None else namespace
    for j in range(len(tokens) // block):
        data = struct.pack(f"<{block}q", *tokens[j * block:(j + 1) * block])
        previous = hashlib.blake2b(namespace + previous + data, digest_size=16,
                                   person=b"kvstore.key.v1").digest()
        keys.append(previous)
    return keys


@pytest.mark.parametrize("seed", range(6))
def test_keys_are_the_documented_formula(seed: int) -> None:
    rng = random.Random(seed)
    namespace = rng.randbytes(16)
    block = rng.choice([1, 3, 16, 32])
    tokens = [rng.randrange(-(1 << 40), 1 << 40) for _ in range(rng.randrange(0, 200))]
    parent = rng.choice([None, rng.randbytes(16)])
    want = reference(namespace, tokens, block, parent)
    assert chain_keys(namespace, tokens, block, parent) == want
    assert chain_keys(namespace, np.array(tokens, dtype=np.int64), block, parent) == want
    assert len(want) == len(tokens) // block


KNOWN_FIRST = "3f2699e7d43cf163ff7e0f600e3bf987"  # computed once: what stored keys hold


def test_a_known_key_is_unchanged() -> None:
    keys = chain_keys(bytes(range(16)), list(range(8)), 4)
    assert keys == reference(bytes(range(16)), list(range(8)), 4, None)
    assert keys[0].hex() == KNOWN_FIRST



@pytest.mark.parametrize("namespace, parent", [
    ("n" * 16, None),              # a str of the right length, not bytes
    (b"n" * 15, None),
    (b"n" * 16, "p" * 16),
    (b"n" * 16, b"p" * 8),
])
def test_a_namespace_or_parent_not_16_bytes_is_malformed_even_without_blocks(
        namespace: object, parent: object) -> None:
    from kvstore.errors import MalformedError
    for tokens in ([], list(range(32))):
        with pytest.raises(MalformedError):
            chain_keys(namespace, tokens, 16, parent)  # type: ignore[arg-type]
