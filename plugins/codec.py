"""The stored form of a block value, shared by every backend: a small header, then the payload.

Header, little-endian, 32 bytes::

    magic b"KVSB" | format version u8 | flags u8 | reserved u16 | payload length u64
    | name tag u64 | payload checksum u64

The name tag is xxh3_64 over the namespace id and the block key; the checksum is xxh3_64
of the payload alone.  With a tag secret (``remote.tag_secret_file``, shared by the
daemons), the tag is keyed instead (flag 1): BLAKE2b keyed with the secret over
namespace id, key and checksum, so that whoever can write to the store but lacks the
secret cannot plant a value any daemon takes, and a daemon with a secret takes only
values tagged with it (BLAKE2b is hashlib's keyed hash; one call per value, under a
microsecond).  A value that is torn, truncated, bit-flipped, from another format,
or stored under another name reads as a miss instead of wrong KV data.  The checksum is
the one the daemon keeps for a block in DRAM (and clients verify), so a value read from a
backend is hashed once, not twice (format 1 mixed the name into the payload's hash).
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import xxhash

from .base import BytesLike

MAGIC = b"KVSB"
FORMAT_VERSION = 2
HEADER = struct.Struct("<4sBBHQQQ")
HEADER_BYTES = HEADER.size
FLAG_KEYED = 1  # the name tag is keyed with the daemons' tag secret


class Header(NamedTuple):
    length: int
    name_tag: int
    checksum: int
    keyed: bool = False


def name_tag(namespace: bytes, key: bytes, digest: int = 0,
             secret: bytes | None = None) -> int:
    """Binds a value to the name it is stored under: xxh3_64 of namespace id and block
    key; with ``secret``, BLAKE2b keyed with it over those and the payload's checksum
    ``digest`` (only a holder of the secret makes a tag a daemon takes)."""
    if secret is None:
        return xxhash.xxh3_64_intdigest(namespace + key)
    mac = hashlib.blake2b(namespace + key + digest.to_bytes(8, "little"),
                          key=secret, digest_size=8)
    return int.from_bytes(mac.digest(), "little")


def checksum(payload: BytesLike) -> int:
    """xxh3_64 of the payload (as the daemon computes it for a block in DRAM)."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(namespace: bytes, key: bytes, payload: BytesLike,
                  digest: int | None = None, secret: bytes | None = None) -> bytes:
    """The header that goes in front of ``payload`` when stored under ``(namespace, key)``.

    ``digest``: the payload's checksum as the daemon checked it (the block's commit);
    bytes changed since then read back as damaged.  None: hashed here.  ``secret``: the
    tag secret, if the daemons have one."""
    length = memoryview(payload).nbytes
    if digest is None:
        digest = checksum(payload)
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0 if secret is None else FLAG_KEYED, 0, length,
                       name_tag(namespace, key, digest, secret), digest)


def encode_value(namespace: bytes, key: bytes, payload: BytesLike,
                 digest: int | None = None, secret: bytes | None = None) -> bytes:
    """Header and payload as one bytes object (one copy of the payload)."""
    return b"".join((encode_header(namespace, key, payload, digest, secret), payload))


def read_header(data: BytesLike) -> Header | None:
    """The header at the start of ``data``, or None if it is no header of this format."""
    if memoryview(data).nbytes < HEADER_BYTES:
        return None
    magic, version, flags, reserved, length, tag, digest = HEADER.unpack_from(data)
    # Unknown flags could change what the payload means: refuse them, like a new version.
    if magic != MAGIC or version != FORMAT_VERSION or flags & ~FLAG_KEYED or reserved:
        return None
    return Header(length, tag, digest, bool(flags))


def verified_checksum(
    namespace: bytes, key: bytes, header: Header, payload: BytesLike,
    secret: bytes | None = None,
) -> int | None:
    """The payload's checksum if it has the length, name and checksum ``header`` promises
    (its tag keyed with ``secret``, if given; unkeyed if not); None if not."""
    if (memoryview(payload).nbytes != header.length or header.keyed != (secret is not None)
            or name_tag(namespace, key, header.checksum, secret) != header.name_tag):
        return None
    digest = checksum(payload)
    return digest if digest == header.checksum else None


def payload_matches(
    namespace: bytes, key: bytes, header: Header, payload: BytesLike,
    secret: bytes | None = None,
) -> bool:
    """Whether ``payload`` has the length, name and checksum that ``header`` promises."""
    return verified_checksum(namespace, key, header, payload, secret) is not None


def decode_checked(namespace: bytes, key: bytes, stored: BytesLike, out: memoryview,
                   secret: bytes | None = None) -> int | None:
    """Check a stored value and copy its payload into ``out``; the payload's checksum, or
    None (``out`` untouched) if the header, the length (which must be ``out.nbytes``), the
    name or the checksum is wrong."""
    header = read_header(stored)
    if header is None or header.length != out.nbytes:
        return None
    payload = memoryview(stored)[HEADER_BYTES:]
    digest = verified_checksum(namespace, key, header, payload, secret)
    if digest is None:
        return None
    out[:] = payload
    return digest


def decode_into(namespace: bytes, key: bytes, stored: BytesLike, out: memoryview,
                secret: bytes | None = None) -> bool:
    """As :func:`decode_checked`, whether it succeeded."""
    return decode_checked(namespace, key, stored, out, secret) is not None
