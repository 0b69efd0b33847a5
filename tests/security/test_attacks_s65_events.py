"""A hostile tenant against the KV event stream (session 65): keys of another tenant's
making.  Real daemon processes, a real subscriber."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from daemon_proc import free_port
from events_sub import Subscriber
from kvtest import make_identity

from kvstore import Client


@contextmanager
def _both_holding(daemon_factory: Any) -> Iterator[tuple[Subscriber, Client, Any, Any,
                                                           list[bytes]]]:
    """A daemon publishing to a subscriber; alice's chain of 4 in DRAM, and the same
    keys stored by mallory in a namespace of her own: (the subscriber, alice's client,
    her namespace, mallory's, the keys)."""
    pub, replay = free_port(), free_port()
    d = daemon_factory(env={"KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
                            "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
                            "KVSTORE_EVENTS_TOPIC": "kv@pod@m"})
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        with Client(d.endpoint, tenant="alice") as alice, \
                Client(d.endpoint, tenant="mallory") as mallory:
            mine = alice.namespace(make_identity(tenant="alice"))
            keys = mine.keys(range(mine.identity.block_tokens * 4))
            mine.put(keys, [b"a" * mine.block_bytes] * 4)
            theirs = mallory.namespace(make_identity(tenant="mallory"))
            assert theirs.put(keys, [b"m" * theirs.block_bytes] * 4) == 4
            yield sub, alice, mine, theirs, keys
    finally:
        sub.close()


def test_another_tenants_copy_of_my_keys_going_leaves_my_blocks_in_the_stream(
        daemon_factory: Any) -> None:
    """The stream names a block by its key alone, as vLLM's does, and routers keep a
    set per (key, tier); the daemon keys blocks per namespace, and a client may send keys
    of its own making.  A tenant that knows another's keys (a shared system prompt's,
    hashed with the other's identity) stores them in a namespace of its own and evicts
    them: the stream announces them removed from DRAM while the other tenant's copies
    stay there, so every router following the stream stops sending that tenant's
    requests here (its chain of 4 read 0 from the events, 4 from the daemon)."""
    with _both_holding(daemon_factory) as (sub, alice, mine, theirs, keys):
        assert theirs.evict(keys[:1]) == 4
        snap = alice.snapshot()
        sub.until(snap.seq)
        assert mine.lookup(keys).tiers == ["dram"] * 4
        assert sub.index.lookup(keys) == ["dram"] * 4, (
            "another tenant's eviction of its own copies announced mine removed")


def test_my_copies_going_while_another_tenant_holds_my_keys_wait_for_its_copies(
        daemon_factory: Any) -> None:
    """The converse order: the owner evicts first while the other tenant still holds the
    same keys in DRAM; the stream keeps them (the daemon still holds them in DRAM) until
    the last holder's copies go, then announces them removed."""
    with _both_holding(daemon_factory) as (sub, alice, mine, theirs, keys):
        sub.until(alice.snapshot().seq)  # (both stores announced, in batches before)
        assert mine.evict(keys[:1]) == 4
        sub.until(alice.snapshot().seq)
        assert theirs.lookup(keys).tiers == ["dram"] * 4
        assert sub.index.lookup(keys) == ["dram"] * 4
        assert theirs.evict(keys[:1]) == 4
        sub.until(alice.snapshot().seq)
        assert sub.index.lookup(keys) == []
