"""A get's reply pins its blocks until ZeroMQ has sent it; an evict or a drop that follows
the reply must not find them still pinned."""

from __future__ import annotations

from collections.abc import Callable

from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client

BIG = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 64}  # 256 KiB blocks: sends take a while


def test_a_drop_right_after_a_get_drops_every_block(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    identity = make_identity(**BIG)
    daemon = daemon_factory(dram_capacity="256MiB")
    with Client(daemon.endpoint, tenant=identity.tenant, map_arena=False) as client:
        ns = client.namespace(identity)
        for round_ in range(20):
            tokens = list(range(round_ * 10_000, round_ * 10_000 + 16 * identity.block_tokens))
            keys = ns.keys(tokens)
            blocks = [bytes([round_ + i]) * identity.block_bytes for i in range(len(keys))]
            ns.put(keys, blocks)
            got = ns.get(keys)
            assert ns.drop() == len(keys), f"round {round_}: a block stayed pinned"
            assert got == blocks
        assert client.stats()["tiers"]["dram"]["committed"] == 0


def test_an_evict_right_after_a_get_evicts_the_blocks(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    identity = make_identity(**BIG)
    daemon = daemon_factory(dram_capacity="256MiB")
    with Client(daemon.endpoint, tenant=identity.tenant, map_arena=False) as client:
        ns = client.namespace(identity)
        for round_ in range(20):
            tokens = list(range(round_ * 10_000, round_ * 10_000 + 2 * identity.block_tokens))
            keys = ns.keys(tokens)
            ns.put(keys, [bytes(identity.block_bytes)] * len(keys))
            ns.get(keys)
            assert ns.evict(keys[-1:]) == 1, f"round {round_}: the leaf stayed pinned"
