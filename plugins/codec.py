"""The stored form of a block value, shared by every backend: a small header, then the payload.

Header, little-endian, 32 bytes::

    magic b"KVSB" | format version u8 | flags u8 | reserved u16 | payload length u64
    | name tag u64 | payload checksum u64

The name tag is xxh3_64 over the namespace id and the block key; the checksum is xxh3_64
of the payload alone.  With a tag secret (``remote.tag_secret_file``, shared by the
daemons), the tag is keyed instead (flag 1): HMAC-SHA256 keyed with the secret over the
namespace id and key (each after its length), the checksum and the payload itself, cut
to 8 bytes, so that whoever can write to the store but lacks the secret cannot plant a
value any daemon takes, and a daemon with a secret takes only values tagged with it.  It
covers the payload, not only its checksum: xxh3 is no cryptographic hash, and bytes of
an attacker's choosing with a given xxh3_64 take milliseconds to make (a first version
tagged the checksum alone, and a payload swapped so was taken).  It costs a pass over
the payload at each write and read, about 34 us per 64 KiB here (SHA extensions), where
the checksum's costs 1 us; only with a secret.  A value that is torn, truncated,
bit-flipped, from another format, or stored under another name reads as a miss instead
of wrong KV data.  The checksum is
the one the daemon keeps for a block in DRAM (and clients verify), so a value read from a
backend is hashed once, not twice (format 1 mixed the name into the payload's hash).
"""

from __future__ import annotations

import hashlib
import hmac
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


def name_tag(namespace: bytes, key: bytes) -> int:
    """xxh3_64 of namespace id and block key: binds a value to the name it is stored
    under (unkeyed: anyone can make it)."""
    return xxhash.xxh3_64_intdigest(namespace + key)


def keyed_tag(secret: bytes, namespace: bytes, key: bytes, digest: int,
              payload: BytesLike) -> bytes:
    """The keyed tag (8 bytes): HMAC-SHA256 keyed with ``secret`` over the namespace id
    and key, each after its length (no two names run together alike), the payload's
    checksum ``digest`` and the payload; only a holder of the secret makes one a daemon
    takes, and it fits no other name or payload."""
    mac = hmac.new(secret, struct.pack("<BB", len(namespace), len(key)) + namespace + key
                   + digest.to_bytes(8, "little"), hashlib.sha256)
    mac.update(payload)
    return mac.digest()[:8]


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
    if secret is None:
        return HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, length, name_tag(namespace, key),
                           digest)
    tag = int.from_bytes(keyed_tag(secret, namespace, key, digest, payload), "little")
    return HEADER.pack(MAGIC, FORMAT_VERSION, FLAG_KEYED, 0, length, tag, digest)


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
    (its tag keyed with ``secret`` over them and the payload, if given; unkeyed if not);
    None if not."""
    if memoryview(payload).nbytes != header.length or header.keyed != (secret is not None):
        return None
    if secret is None:
        if name_tag(namespace, key) != header.name_tag:
            return None
    digest = checksum(payload)
    if digest != header.checksum:
        return None
    if secret is not None and not hmac.compare_digest(
            keyed_tag(secret, namespace, key, digest, payload),
            header.name_tag.to_bytes(8, "little")):
        return None
    return digest


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
