"""One tenant's block under the key another tenant's chain begins with.

Keys are computed by clients (``H(namespace, parent, tokens)``, from an identity that is
no secret), and the daemon takes any 16 bytes as a key.  The store's map of chains'
first blocks (``BlockStore.roots``, which ``probe`` looks a chain up in) holds one
namespace a key: a tenant that commits a first block under another tenant's first key
takes the entry, and the owner's probe (a router's question) then finds nothing of its
own cached chain; once that block is evicted the entry is deleted, and the owner's chain
is in no map at all (``check_invariants``: "the first blocks' map").  A real daemon
process.  Fixed: a key that heads chains in several namespaces maps to all of them
(``kvstore/first_blocks.py``).
"""

from __future__ import annotations

import os
from typing import Any

from daemon_proc import DaemonProcess
from kvtest import make_identity

from kvstore import Client


def test_another_tenants_block_under_my_first_key_hides_nothing_of_mine(
        daemon_factory: Any) -> None:
    d: DaemonProcess = daemon_factory()  # invariants checked, the first blocks' map too
    with Client(d.endpoint, tenant="acme") as acme, Client(d.endpoint, tenant="evil") as evil:
        mine = acme.namespace(make_identity(tenant="acme"))
        theirs = evil.namespace(make_identity(tenant="evil"))
        keys = [os.urandom(16) for _ in range(4)]
        mine.put(keys, [b"\1" * mine.block_bytes] * 4)
        assert acme.probe(keys).tier_runs == [("dram", 4)]
        theirs.put(keys[:1], [b"\2" * theirs.block_bytes])  # my first key, theirs
        assert evil.probe(keys).tier_runs == [("dram", 1)]  # (theirs, as they see it)
        assert acme.probe(keys).tier_runs == [("dram", 4)], "my chain hidden"
        assert theirs.evict(keys[:1]) == 1
        assert acme.probe(keys).tier_runs == [("dram", 4)], "my chain lost from the map"
