"""Client processes for integration tests: ``python tests/workers.py VERB ENDPOINT ...``."""

from __future__ import annotations

import hashlib
import os
import sys
import time

from kvstore import Client, Identity


def _identity(tenant: str) -> Identity:
    return Identity(model="tiny-llama", model_revision="r1", tenant=tenant, kv_dtype="float16",
                    num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16)


def _block(seed: str, i: int, size: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{seed}:{i}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def roundtrip(endpoint: str, seed: str, rounds: str) -> None:
    """Store and read back random blocks through the arena and through frames."""
    with Client(endpoint, tenant="acme") as client:
        ns = client.namespace(_identity("acme"))
        size = ns.block_bytes
        for r in range(int(rounds)):
            tokens = [hash((seed, r, t)) % 50_000 for t in range(16 * 8)]
            keys = ns.keys(tokens)
            blocks = [_block(f"{seed}-{r}", i, size) for i in range(len(keys))]
            half = len(keys) // 2
            with ns.reserve(keys[:half]) as res:          # arena plane
                for buf, block in zip(res.buffers, blocks):
                    buf[:] = block
                res.commit()
            ns.put(keys[half:], blocks[half:])            # frame plane
            assert ns.get(keys) == blocks, "frames read back wrong bytes"
            with ns.acquire(keys) as held:
                assert [bytes(b) for b in held.buffers] == blocks, "arena read back wrong bytes"
    print("ok", flush=True)


def hold_reservation(endpoint: str, count: str) -> None:
    """Reserve slots, say so, then wait to be killed."""
    client = Client(endpoint, tenant="acme")
    ns = client.namespace(_identity("acme"))
    keys = ns.keys(list(range(16 * int(count))))
    res = ns.reserve(keys)
    res.buffers[0][:4] = b"half"
    print("reserved", flush=True)
    time.sleep(600)


def hold_pin(endpoint: str, count: str) -> None:
    """Put a chain, pin it, say so, then wait to be killed."""
    client = Client(endpoint, tenant="acme")
    ns = client.namespace(_identity("acme"))
    keys = ns.keys(list(range(16 * int(count))))
    ns.put(keys, [os.urandom(ns.block_bytes) for _ in keys])
    ns.acquire(keys)
    print("pinned", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    {"roundtrip": roundtrip, "hold_reservation": hold_reservation,
     "hold_pin": hold_pin}[sys.argv[1]](*sys.argv[2:])
