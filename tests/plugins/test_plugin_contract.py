"""The contract every storage backend keeps, run against each built-in backend.

memory, fs, a real standalone redis-server and a real 3-node Redis Cluster.
"""

from __future__ import annotations

import os
import random

import pytest

from kvstore.plugins import GuardedBackend
from kvstore.plugins.codec import HEADER_BYTES, encode_value

from plugin_cases import BackendCase

MiB = 1 << 20


def new_keys(count: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(count)]


def random_bytes(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def buffers_for(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(size)) for size in sizes]


def test_round_trip_of_random_bytes(backend_case: BackendCase) -> None:
    sizes = [1, 17, 4096, 65_537, 2 * MiB, 2 * MiB]
    namespace, keys = os.urandom(16), new_keys(len(sizes))
    values = [random_bytes(size, seed) for seed, size in enumerate(sizes)]

    async def scenario(backend: GuardedBackend) -> None:
        assert await backend.put(namespace, keys, values) == [True] * len(keys)
        buffers = buffers_for(sizes)
        assert await backend.get_into(namespace, keys, buffers) == [True] * len(keys)
        assert [bytes(b) for b in buffers] == values

    backend_case.run(scenario)


def test_many_large_blocks_in_one_batch(backend_case: BackendCase) -> None:
    namespace, keys = os.urandom(16), new_keys(12)
    values = [random_bytes(2 * MiB, seed) for seed in range(len(keys))]

    async def scenario(backend: GuardedBackend) -> None:
        # memoryviews over bytearrays, as the daemon passes slots of its arena
        views = [memoryview(bytearray(v)) for v in values]
        assert await backend.put(namespace, keys, views) == [True] * len(keys)
        buffers = buffers_for([2 * MiB] * len(keys))
        assert await backend.get_into(namespace, keys, buffers) == [True] * len(keys)
        assert all(bytes(b) == v for b, v in zip(buffers, values))

    backend_case.run(scenario)


def test_exists_counts_the_leading_run(backend_case: BackendCase) -> None:
    namespace, keys = os.urandom(16), new_keys(5)

    async def scenario(backend: GuardedBackend) -> None:
        assert await backend.exists(namespace, keys) == 0
        assert await backend.exists(namespace, []) == 0
        present = [keys[0], keys[1], keys[3], keys[4]]
        await backend.put(namespace, present, [b"v"] * len(present))
        assert await backend.exists(namespace, keys) == 2
        assert await backend.exists(namespace, keys[3:]) == 2
        assert await backend.exists(namespace, keys[2:]) == 0
        assert await backend.exists(namespace, [keys[4], keys[0]]) == 2

    backend_case.run(scenario)


def test_exists_across_many_keys(backend_case: BackendCase) -> None:
    namespace, keys = os.urandom(16), new_keys(300)

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(namespace, keys[:257], [b"x"] * 257)
        assert await backend.exists(namespace, keys) == 257

    backend_case.run(scenario)


def test_namespaces_are_isolated(backend_case: BackendCase) -> None:
    first, second = os.urandom(16), os.urandom(16)
    (key,) = new_keys(1)

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(first, [key], [b"first" * 10])
        assert await backend.exists(second, [key]) == 0
        assert await backend.get_into(second, [key], buffers_for([50])) == [False]
        await backend.put(second, [key], [b"other" * 10])
        buffers = buffers_for([50, 50])
        assert await backend.get_into(first, [key], buffers[:1]) == [True]
        assert await backend.get_into(second, [key], buffers[1:]) == [True]
        assert bytes(buffers[0]) == b"first" * 10 and bytes(buffers[1]) == b"other" * 10
        assert await backend.delete(second, [key]) == 1
        assert await backend.exists(first, [key]) == 1

    backend_case.run(scenario)


def test_results_are_per_key_with_missing_keys(backend_case: BackendCase) -> None:
    namespace, keys = os.urandom(16), new_keys(5)
    values = {0: b"a" * 64, 2: b"c" * 64, 3: b"d" * 64}

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(namespace, [keys[i] for i in values], list(values.values()))
        buffers = buffers_for([64] * 5)
        found = await backend.get_into(namespace, keys, buffers)
        assert found == [True, False, True, True, False]
        for index, value in values.items():
            assert bytes(buffers[index]) == value
        assert backend.counters.corrupt_values == 0

    backend_case.run(scenario)


def test_checksums_of_what_was_read(backend_case: BackendCase) -> None:
    """get_into_checksums: each found payload's xxh3_64 (what the daemon keeps for the
    block), None for a miss or a damaged value."""
    import xxhash

    namespace, keys = os.urandom(16), new_keys(4)
    values = {0: os.urandom(4096), 1: os.urandom(4096), 3: os.urandom(4096)}

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(namespace, [keys[i] for i in values], list(values.values()))
        buffers = buffers_for([4096] * 4)
        sums = await backend.get_into_checksums(namespace, keys, buffers)
        assert sums == [xxhash.xxh3_64_intdigest(values[0]),
                        xxhash.xxh3_64_intdigest(values[1]), None,
                        xxhash.xxh3_64_intdigest(values[3])]
        assert [bytes(buffers[i]) for i in values] == list(values.values())

    backend_case.run(scenario)


def test_put_checksummed_stores_the_checksum_given(backend_case: BackendCase) -> None:
    """put_checksummed: a value goes with the checksum the daemon checked (the block's
    commit), not one made as it is encoded; bytes that no longer match it read back as a
    counted miss, and None leaves the hashing to the backend."""
    import xxhash

    namespace, keys = os.urandom(16), new_keys(3)
    values = [os.urandom(4096) for _ in keys]
    sums: list[int | None] = [xxhash.xxh3_64_intdigest(values[0]),
                              xxhash.xxh3_64_intdigest(b"other bytes"), None]

    async def scenario(backend: GuardedBackend) -> None:
        before = backend.counters.corrupt_values
        assert await backend.put_checksummed(namespace, keys, values, sums) == [True] * 3
        buffers = buffers_for([4096] * 3)
        got = await backend.get_into_checksums(namespace, keys, buffers)
        assert got == [sums[0], None, xxhash.xxh3_64_intdigest(values[2])]
        assert bytes(buffers[0]) == values[0] and bytes(buffers[2]) == values[2]
        assert backend.counters.corrupt_values == before + 1

    backend_case.run(scenario)


def test_keyed_tags_refuse_planted_values(backend_case: BackendCase) -> None:
    """With the daemons' tag secret, values round-trip, and one planted in the store by a
    writer without the secret (a well-formed, unkeyed value) is a counted miss."""
    namespace, keys = os.urandom(16), new_keys(2)
    values = [os.urandom(4096) for _ in keys]

    async def scenario(backend: GuardedBackend) -> None:
        backend.key_tags(bytes(range(32)))
        assert await backend.put(namespace, keys, values) == [True, True]
        backend_case.write_raw(backend.inner, namespace, keys[1],
                               encode_value(namespace, keys[1], b"\x66" * 4096))
        before = backend.counters.corrupt_values
        buffers = buffers_for([4096] * 2)
        assert await backend.get_into(namespace, keys, buffers) == [True, False]
        assert bytes(buffers[0]) == values[0]
        assert backend.counters.corrupt_values == before + 1

    backend_case.run(scenario)


def test_put_replaces_a_value(backend_case: BackendCase) -> None:
    namespace, keys = os.urandom(16), new_keys(1)

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(namespace, keys, [b"old" * 100])
        assert await backend.put(namespace, keys, [b"new" * 100]) == [True]
        buffers = buffers_for([300])
        assert await backend.get_into(namespace, keys, buffers) == [True]
        assert bytes(buffers[0]) == b"new" * 100

    backend_case.run(scenario)


def _flip(data: bytes, index: int) -> bytes:
    flipped = bytearray(data)
    flipped[index] ^= 0x40
    return bytes(flipped)


CORRUPTIONS = {
    "payload_byte": lambda stored: _flip(stored, HEADER_BYTES + 1000),
    "last_byte": lambda stored: _flip(stored, len(stored) - 1),
    "magic": lambda stored: _flip(stored, 0),
    "length_field": lambda stored: _flip(stored, 8),
    "checksum_field": lambda stored: _flip(stored, 16),
    "truncated": lambda stored: stored[:-1],
    "extended": lambda stored: stored + b"\0",
    "header_only": lambda stored: stored[:HEADER_BYTES],
    "empty": lambda stored: b"",
    "no_header": lambda stored: stored[HEADER_BYTES:],
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_value_is_a_counted_miss(backend_case: BackendCase, corruption: str) -> None:
    namespace, keys = os.urandom(16), new_keys(3)
    values = [random_bytes(4096, seed) for seed in range(3)]

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(namespace, keys, values)
        stored = backend_case.read_raw(backend.inner, namespace, keys[1])
        assert stored is not None and len(stored) == HEADER_BYTES + 4096
        backend_case.write_raw(backend.inner, namespace, keys[1], CORRUPTIONS[corruption](stored))
        buffers = buffers_for([4096] * 3)
        assert await backend.get_into(namespace, keys, buffers) == [True, False, True]
        assert bytes(buffers[0]) == values[0] and bytes(buffers[2]) == values[2]
        assert backend.counters.corrupt_values == 1

    backend_case.run(scenario)


def test_a_value_stored_under_another_key_is_a_miss(backend_case: BackendCase) -> None:
    namespace, keys = os.urandom(16), new_keys(2)

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(namespace, keys, [b"a" * 100, b"b" * 100])
        # a well-formed value, but encoded for the other key
        backend_case.write_raw(backend.inner, namespace, keys[1],
                               encode_value(namespace, keys[0], b"a" * 100))
        assert await backend.get_into(namespace, keys, buffers_for([100, 100])) == [True, False]
        assert backend.counters.corrupt_values == 1

    backend_case.run(scenario)


def test_a_buffer_of_the_wrong_size_is_a_miss(backend_case: BackendCase) -> None:
    namespace, keys = os.urandom(16), new_keys(1)

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(namespace, keys, [b"z" * 100])
        assert await backend.get_into(namespace, keys, buffers_for([99])) == [False]
        assert await backend.get_into(namespace, keys, buffers_for([101])) == [False]
        assert backend.counters.corrupt_values == 2

    backend_case.run(scenario)


def test_delete_counts_what_was_stored(backend_case: BackendCase) -> None:
    namespace, keys = os.urandom(16), new_keys(4)

    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(namespace, keys[:3], [b"v" * 10] * 3)
        assert await backend.delete(namespace, [keys[0], keys[3], keys[2]]) == 2
        assert await backend.get_into(namespace, keys[:3], buffers_for([10] * 3)) == [
            False, True, False
        ]
        assert await backend.delete(namespace, keys[:1]) == 0
        assert await backend.delete(namespace, []) == 0
        assert backend_case.read_raw(backend.inner, namespace, keys[0]) is None

    backend_case.run(scenario)


def test_health_reports_ok(backend_case: BackendCase) -> None:
    async def scenario(backend: GuardedBackend) -> None:
        await backend.put(os.urandom(16), new_keys(1), [b"x" * 1000])
        health = await backend.health()
        assert health.ok, health.detail
        assert health.detail
        assert health.used_bytes is None or health.used_bytes > 0
        if health.capacity_bytes is not None and health.used_bytes is not None:
            assert health.used_bytes <= health.capacity_bytes

    backend_case.run(scenario)
