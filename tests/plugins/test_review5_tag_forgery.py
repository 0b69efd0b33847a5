"""The keyed tag bound a value's name to the xxh3_64 of its payload, not to the payload:
xxh3 is no cryptographic hash, and whoever can write to the store could replace a validly
tagged value's payload with bytes of its own choosing that hash the same (``xxh3_forge``:
most of the first KiB chosen, the rest fixed up, in well under a second), header kept, and every
daemon with the secret took it.  The keyed tag now covers the payload itself."""

from __future__ import annotations

import os
import random

import xxhash
from xxh3_forge import forge_xxh3

from kvstore.plugins import GuardedBackend
from kvstore.plugins.codec import HEADER_BYTES

from plugin_cases import BackendCase


def test_an_xxh3_second_preimage_is_cheap() -> None:
    """The premise: a payload of chosen bytes with another's xxh3_64."""
    rng = random.Random(5)
    for _ in range(8):
        honest = os.urandom(64 << 10)
        forged = forge_xxh3(honest, rng)
        assert forged != honest
        assert xxhash.xxh3_64_intdigest(forged) == xxhash.xxh3_64_intdigest(honest)


def test_a_payload_swapped_for_one_of_the_same_xxh3_is_a_miss(
        backend_case: BackendCase) -> None:
    """A writer without the secret keeps a validly tagged value's header and swaps its
    payload for chosen bytes of the same xxh3: a daemon with the secret must not take it."""
    namespace, key = os.urandom(16), os.urandom(16)
    honest = os.urandom(64 << 10)
    forged = forge_xxh3(honest, random.Random(7))

    async def scenario(backend: GuardedBackend) -> None:
        backend.key_tags(bytes(range(32)))
        assert await backend.put(namespace, [key], [honest]) == [True]
        stored = backend_case.read_raw(backend.inner, namespace, key)
        assert stored is not None and stored[HEADER_BYTES:] == honest
        backend_case.write_raw(backend.inner, namespace, key, stored[:HEADER_BYTES] + forged)
        before = backend.counters.corrupt_values
        out = memoryview(bytearray(len(honest)))
        assert await backend.get_into_checksums(namespace, [key], [out]) == [None]
        assert backend.counters.corrupt_values == before + 1

    backend_case.run(scenario)


def test_a_keyed_batch_past_the_loops_share_round_trips(backend_case: BackendCase) -> None:
    """A keyed batch too big to hash on the daemon's loop (Redis hashes it on a thread)
    round-trips, and a value swapped within it is still a miss."""
    namespace, keys = os.urandom(16), [os.urandom(16) for _ in range(8)]
    values = [os.urandom(512 << 10) for _ in keys]   # 4 MiB: 1 MiB a connection at least

    async def scenario(backend: GuardedBackend) -> None:
        backend.key_tags(bytes(range(32)))
        assert await backend.put(namespace, keys, values) == [True] * 8
        stored = backend_case.read_raw(backend.inner, namespace, keys[3])
        assert stored is not None
        backend_case.write_raw(backend.inner, namespace, keys[3], stored[:HEADER_BYTES]
                               + forge_xxh3(values[3], random.Random(9)))
        out = [memoryview(bytearray(512 << 10)) for _ in keys]
        got = await backend.get_into_checksums(namespace, keys, out)
        assert got == [xxhash.xxh3_64_intdigest(v) if i != 3 else None
                       for i, v in enumerate(values)]
        assert all(bytes(out[i]) == values[i] for i in range(8) if i != 3)

    backend_case.run(scenario)
