"""The stored-value codec: header layout, and that damage of any kind reads as a miss."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

import xxhash

from kvstore.plugins import codec

NS = bytes(range(16))
KEY = bytes(range(16, 32))


def test_header_layout() -> None:
    stored = codec.encode_value(NS, KEY, b"payload")
    magic, version, flags, reserved, length, tag, digest = struct.unpack_from(
        "<4sBBHQQQ", stored)
    assert (magic, version, flags, reserved, length) == (b"KVSB", 2, 0, 0, 7)
    assert tag == xxhash.xxh3_64_intdigest(NS + KEY) == codec.name_tag(NS, KEY)
    assert digest == xxhash.xxh3_64_intdigest(b"payload") == codec.checksum(b"payload")
    assert codec.HEADER_BYTES == 32
    assert stored[32:] == b"payload"
    assert codec.read_header(stored) == (7, tag, digest, False)


def test_a_good_value_yields_the_checksum_the_daemon_keeps() -> None:
    out = bytearray(7)
    stored = codec.encode_value(NS, KEY, b"payload")
    assert codec.decode_checked(NS, KEY, stored, memoryview(out)) == \
        xxhash.xxh3_64_intdigest(b"payload")
    assert codec.decode_checked(NS, bytes(16), stored, memoryview(bytearray(7))) is None


def test_a_version_1_value_is_refused() -> None:
    old = struct.pack("<4sBBHQQ", b"KVSB", 1, 0, 0, 7, 0) + b"payload"
    assert codec.read_header(old) is None
    assert not codec.decode_into(NS, KEY, old, memoryview(bytearray(7)))


def test_round_trip_into_a_buffer() -> None:
    out = bytearray(5)
    assert codec.decode_into(NS, KEY, codec.encode_value(NS, KEY, b"hello"), memoryview(out))
    assert out == b"hello"


def test_empty_payload() -> None:
    out = bytearray()
    assert codec.decode_into(NS, KEY, codec.encode_value(NS, KEY, b""), memoryview(out))


def test_the_checksum_binds_namespace_and_key() -> None:
    stored = codec.encode_value(NS, KEY, b"hello")
    out = bytearray(5)
    assert not codec.decode_into(bytes(16), KEY, stored, memoryview(out))
    assert not codec.decode_into(NS, bytes(16), stored, memoryview(out))
    assert out == bytes(5), "a failed decode leaves the buffer untouched"


def test_unknown_versions_and_flags_are_refused() -> None:
    stored = bytearray(codec.encode_value(NS, KEY, b"hello"))
    for offset, step in ((4, 1), (5, 2), (6, 1)):  # version, an unknown flag, reserved
        changed = bytearray(stored)
        changed[offset] += step
        assert codec.read_header(changed) is None
    assert codec.read_header(stored[:31]) is None


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(min_size=0, max_size=512), data=st.data())
def test_any_single_byte_change_is_detected(payload: bytes, data: st.DataObject) -> None:
    stored = bytearray(codec.encode_value(NS, KEY, payload))
    index = data.draw(st.integers(0, len(stored) - 1), label="index")
    stored[index] ^= data.draw(st.integers(1, 255), label="xor")
    out = bytearray(len(payload))
    assert not codec.decode_into(NS, KEY, stored, memoryview(out))


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(min_size=1, max_size=512), cut=st.integers(1, 600))
def test_truncation_is_detected(payload: bytes, cut: int) -> None:
    stored = codec.encode_value(NS, KEY, payload)
    out = bytearray(len(payload))
    assert not codec.decode_into(NS, KEY, stored[: max(0, len(stored) - cut)], memoryview(out))


SECRET = bytes(range(32))


def test_keyed_tags_take_only_values_tagged_with_the_secret() -> None:
    """With the daemons' tag secret, a value is tagged by an HMAC keyed with it over the
    name and the checksum: one planted by a writer without the secret (an unkeyed tag,
    or one keyed with another secret) is a miss, and so is a keyed value read without it
    or with its checksum and payload both changed."""
    keyed = codec.encode_value(NS, KEY, b"payload", secret=SECRET)
    assert keyed[5] == codec.FLAG_KEYED
    out = memoryview(bytearray(7))
    assert codec.decode_checked(NS, KEY, keyed, out, SECRET) == codec.checksum(b"payload")
    assert bytes(out) == b"payload"
    planted = [codec.encode_value(NS, KEY, b"planted"),
               codec.encode_value(NS, KEY, b"planted", secret=bytes(32))]
    for value in planted:
        assert codec.decode_checked(NS, KEY, value, memoryview(bytearray(7)), SECRET) is None
    assert codec.decode_checked(NS, KEY, keyed, memoryview(bytearray(7))) is None
    assert codec.decode_checked(NS, bytes(16), keyed, memoryview(bytearray(7)), SECRET) is None
    forged = bytearray(codec.encode_value(NS, KEY, b"planted", secret=SECRET))
    forged[32:] = b"payload"              # the payload swapped, its checksum with it:
    forged[24:32] = codec.checksum(b"payload").to_bytes(8, "little")  # the tag no longer fits
    assert codec.decode_checked(NS, KEY, bytes(forged), memoryview(bytearray(7)), SECRET) is None
