"""Bytes of one's choosing with a given xxh3_64: how cheaply XXH3 (no cryptographic hash)
yields second preimages, for the tests of what keys the remote store's tags."""

from __future__ import annotations

import math
import random
import struct

# the first 128 bytes of XXH3's default secret (public: ``XXH3_kSecret`` in xxhash.h)
_XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364")
_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1
_STRIPES = 9  # stripes of the first 1 KiB block whose secret words are above


def _word(data: bytes | bytearray, offset: int) -> int:
    return int(struct.unpack_from("<Q", data, offset)[0])


def _product(x: int) -> int:
    return (x & _M32) * (x >> 32)


def forge_xxh3(honest: bytes, rng: random.Random) -> bytes:
    """Bytes that differ from ``honest`` (longer than 1088) in 576 of its first 1024,
    384 of them chosen at random, with the same xxh3_64.  Within a 1 KiB block XXH3 only
    adds each 8-byte lane's word, and the product of its halves xor a secret word, into
    two accumulators; three words per lane set to cancel what the others changed leave
    both sums, so the hash, as they were."""
    out = bytearray(honest)
    for lane in range(8):
        k = [_word(_XXH3_SECRET, 8 * s + 8 * lane) for s in range(_STRIPES)]
        d = [_word(out, 64 * s + 8 * lane) for s in range(_STRIPES)]
        new = d[:3] + [rng.getrandbits(64) for _ in range(3, _STRIPES)]
        total = (sum(d) - sum(new[3:])) & _M64
        products = (sum(_product(d[s] ^ k[s]) - _product(new[s] ^ k[s])
                        for s in range(3, _STRIPES)) + sum(_product(d[s] ^ k[s])
                                                          for s in range(3))) & _M64
        new[:3] = _fix_up(k, total, products, rng)
        for s in range(_STRIPES):
            struct.pack_into("<Q", out, 64 * s + 8 * lane, new[s])
    return bytes(out)


def _fix_up(k: list[int], total: int, products: int, rng: random.Random) -> list[int]:
    """Words for stripes 0 to 2 whose sum is ``total`` and whose products sum to
    ``products``: the first's low half xor its secret word is 0 (no product), the other
    two's low halves are picked, and their high halves solve a linear equation."""
    while True:
        low_t = rng.getrandbits(32) | 1
        low_u = (((total & _M32) - (k[0] & _M32) - (low_t ^ (k[1] & _M32))) & _M32) \
            ^ (k[2] & _M32)
        g = math.gcd(low_t, low_u) if low_u else 0
        for target in (products, products + (1 << 64)):
            if not g or target % g:
                continue
            a, b, t = low_t // g, low_u // g, target // g
            high_t = (t * pow(a, -1, b)) % b if b > 1 else 0
            high_u = (t - a * high_t) // b
            if 0 <= high_u < 1 << 32 and high_t < 1 << 32:
                dt, du = ((high_t << 32) | low_t) ^ k[1], ((high_u << 32) | low_u) ^ k[2]
                ds = (total - dt - du) & _M64
                return [ds, dt, du]
