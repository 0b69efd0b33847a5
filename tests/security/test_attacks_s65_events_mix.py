"""Tenants storing, evicting and pressing out one another's keys (a client may send keys
of its own making) against a real daemon with its invariant checks on, restarted now and
then, a subscriber rebuilding the index from the stream: after each sync the keys the
stream says are in DRAM are exactly those some namespace holds there."""

from __future__ import annotations

import random
from typing import Any

import pytest
from daemon_proc import free_port
from events_sub import Subscriber
from kvtest import make_identity

from kvstore import Client

TENANTS = ("alice", "mallory", "eve")


@pytest.mark.parametrize(("seed", "ssd"), [(3, "0"), (11, "0"), (5, "4MiB"), (8, "4MiB")])
def test_a_random_mix_over_shared_keys_keeps_the_stream_exact(
        daemon_factory: Any, seed: int, ssd: str) -> None:
    """With an SSD tier too, restarts warm: what the stream says is cached (DRAM or
    SSD) is what some namespace holds."""
    rng = random.Random(seed)
    pub, replay = free_port(), free_port()
    d = daemon_factory(dram_capacity="2MiB", ssd_capacity=ssd,
                       env={"KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
                            "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
                            "KVSTORE_EVENTS_TOPIC": "kv@pod@m"})
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    clients: dict[str, Client] = {}
    spaces: dict[str, Any] = {}

    def connect() -> None:
        for t in TENANTS:
            clients[t] = Client(d.endpoint, tenant=t)
            spaces[t] = clients[t].namespace(make_identity(tenant=t))

    connect()
    ident = spaces["alice"].identity
    bt, size = ident.block_tokens, ident.block_bytes
    chains = [spaces["alice"].keys([c] * bt * 40 + list(range(bt * 40))) for c in range(6)]
    try:
        for step in range(160):
            t = rng.choice(TENANTS)
            ns = spaces[t]
            keys = rng.choice(chains)
            op = rng.random()
            if op < 0.6:
                n = rng.randint(1, len(keys))
                ns.put(keys[:n], [bytes([step % 251]) * size] * n)
            elif op < 0.93:
                ns.evict(keys[rng.randrange(len(keys)):])
            else:
                clients["alice"].snapshot()
                sub.until(clients["alice"].snapshot().seq)
                for c in clients.values():
                    c.close()
                d.stop(rng.choice([15, 9]))
                sub.restart()
                d.start()
                connect()
            if step % 4 == 3:
                sub.until(clients["alice"].snapshot().seq)
                held = {k for s in spaces.values() for keys in chains
                        for k in keys[:s.lookup(keys).blocks]}
                seen = {k for k, tiers in sub.index.tiers.items() if tiers & {"dram", "ssd"}}
                assert seen == held, (f"step {step}: {len(seen - held)} announced not held, "
                                      f"{len(held - seen)} held not announced")
    finally:
        for c in clients.values():
            c.close()
        sub.close()
