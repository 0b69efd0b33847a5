"""A real daemon's warm restart (the SSD index read in columns) brings back branching
chains of several namespaces exactly."""

from __future__ import annotations

import hashlib
import signal
import time
from typing import Any

from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks


def content(key: bytes, size: int = IDENT.block_bytes) -> bytes:
    """Bytes that follow from the key, so any reader can check any block."""
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def tier_stats(client: Client, tier: str) -> dict[str, Any]:
    stats = client.stats()
    assert stats["invariant_violations"] == 0
    t: dict[str, Any] = stats["tiers"][tier]
    return t


def start(factory: Any, **kw: Any) -> DaemonProcess:
    kw.setdefault("ssd_capacity", "64MiB")
    kw.setdefault("dram_capacity", "2MiB")
    return factory(**kw)


def restart(d: DaemonProcess, sig: int = signal.SIGTERM) -> int | None:
    code = d.stop(sig)
    d.start()
    return code


def test_branches_of_two_namespaces_come_back_warm_after_a_restart(
        daemon_factory: Any) -> None:
    """The warm restart (read in columns) brings back every chain of a branching tree in
    each namespace, no more, no less: same prefixes found, same bytes, same SSD count."""
    d = start(daemon_factory, extra=["--slab-size", "1MiB", "--ssd-write-policy",
                                     "write-through"])
    other = make_identity(num_layers=4, num_kv_heads=4, head_dim=64, model="other")
    trunk = list(range(16 * 3))
    chains: dict[tuple[int, int], list[bytes]] = {}
    with Client(d.endpoint, tenant="acme") as client:
        for i, ident in enumerate((IDENT, other)):
            ns = client.namespace(ident)
            for branch in range(3):  # three branches off one trunk of three blocks
                first = 10_000 * (branch + 1)
                keys = ns.keys(trunk + list(range(first, first + 16 * 2)))
                ns.put(keys, [content(k) for k in keys])
                chains[i, branch] = keys
        unique = 2 * (3 + 3 * 2)
        deadline = time.monotonic() + 10
        while tier_stats(client, "ssd")["committed_slots"] < unique:
            assert time.monotonic() < deadline, "write-through did not reach the ssd"
            time.sleep(0.05)
        assert tier_stats(client, "ssd")["committed_slots"] == unique
    assert restart(d) == 0
    with Client(d.endpoint, tenant="acme") as client:
        assert tier_stats(client, "ssd")["committed_slots"] == unique
        for i, ident in enumerate((IDENT, other)):
            ns = client.namespace(ident)
            for branch in range(3):
                keys = chains[i, branch]
                hit = ns.lookup(keys)
                assert hit.blocks == 5 and "ssd" in hit.tiers
                assert ns.get(keys) == [content(k) for k in keys]
        # a chain never written: nothing of it came back
        assert client.namespace(IDENT).lookup(
            client.namespace(IDENT).keys(list(range(90_000, 90_000 + 32)))).blocks == 0
