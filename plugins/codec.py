"""The stored form of a block value, shared by every backend: a small header, then the payload.

Header, little-endian, 24 bytes::

    magic b"KVSB" | format version u8 | flags u8 | reserved u16 | payload length u64 | checksum u64

The checksum is xxh3_64 over the namespace id, the block key and the payload, so a value
that is torn, truncated, bit-flipped, from another format, or stored under another name
reads as a miss instead of wrong KV data.
"""

from __future__ import annotations

import struct

import xxhash

from .base import BytesLike

MAGIC = b"KVSB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBHQQ")
HEADER_BYTES = HEADER.size


def checksum(namespace: bytes, key: bytes, payload: BytesLike) -> int:
    """xxh3_64 of namespace id, block key and payload."""
    digest = xxhash.xxh3_64(namespace)
    digest.update(key)
    digest.update(payload)
    return digest.intdigest()


def encode_header(namespace: bytes, key: bytes, payload: BytesLike) -> bytes:
    """The header that goes in front of ``payload`` when stored under ``(namespace, key)``."""
    length = memoryview(payload).nbytes
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, length, checksum(namespace, key, payload))


def encode_value(namespace: bytes, key: bytes, payload: BytesLike) -> bytes:
    """Header and payload as one bytes object (one copy of the payload)."""
    return b"".join((encode_header(namespace, key, payload), payload))


def read_header(data: BytesLike) -> tuple[int, int] | None:
    """``(payload length, checksum)`` from the start of ``data``, or None if it is no header."""
    if memoryview(data).nbytes < HEADER_BYTES:
        return None
    magic, version, flags, reserved, length, digest = HEADER.unpack_from(data)
    # Unknown flags could change what the payload means: refuse them, like a new version.
    if magic != MAGIC or version != FORMAT_VERSION or flags or reserved:
        return None
    return length, digest


def payload_matches(
    namespace: bytes, key: bytes, header: tuple[int, int], payload: BytesLike
) -> bool:
    """Whether ``payload`` has the length and checksum that ``header`` promises."""
    length, digest = header
    return (
        memoryview(payload).nbytes == length and checksum(namespace, key, payload) == digest
    )


def decode_into(namespace: bytes, key: bytes, stored: BytesLike, out: memoryview) -> bool:
    """Check a stored value and copy its payload into ``out``; False (``out`` untouched) if
    the header, the length (which must be ``out.nbytes``) or the checksum is wrong."""
    header = read_header(stored)
    if header is None or header[0] != out.nbytes:
        return False
    payload = memoryview(stored)[HEADER_BYTES:]
    if not payload_matches(namespace, key, header, payload):
        return False
    out[:] = payload
    return True
