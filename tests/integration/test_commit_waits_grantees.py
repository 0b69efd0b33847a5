"""A writer grantee (``auth.shared_writers``) holds open a reservation of keys in the
owner's namespace: the owner's reserve of the same keys gave them no slot (awaited),
so each of the owner's commits waited up to 2.5 s for the grantee's, and dropped its
blocks from there on if the grantee never committed.  Another tenant could stall and
empty the owner's writes so.  Now a writer awaits only its own tenant's reservations
and the namespace owner's: a key pending only in another tenant's takes a slot, as
without ``skip_pending``; a grantee still awaits the owner's.  A real daemon process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtest import make_identity, tenants_daemon

from kvstore import Client

PUBLIC = make_identity(tenant="public", model="grantee-waits", num_kv_heads=8,
                       head_dim=128)


def test_a_writer_grantees_open_reservation_makes_no_owner_commit_wait(
        daemon_factory: Any, tmp_path: Path) -> None:
    d, token = tenants_daemon(daemon_factory, tmp_path, "16MiB",
                              auth='[auth.shared_writers]\npublic = ["acme"]\n')

    def connect(tenant: str) -> Client:
        return Client(d.endpoint, token=token(tenant))

    with connect("public") as owner, connect("acme") as grantee, connect("ops") as ops:
        mine, theirs = owner.namespace(PUBLIC), grantee.namespace(PUBLIC)
        keys = mine.keys(range(4 * PUBLIC.block_tokens))
        data = [os.urandom(mine.block_bytes) for _ in keys]
        held_open = theirs.reserve(keys[:2])  # (never committed while the owner writes)
        r = mine.reserve(keys)
        assert min(r.offsets) >= 0, r.offsets  # a slot each: not the grantee's bytes
        for buf, block in zip(r.buffers, data):
            buf[:] = block
        assert r.commit() == 4 and r.dropped == 0
        dram = ops.stats()["tiers"]["dram"]
        assert (dram["commits_waited"], dram["awaited"], dram["awaited_dropped"]) == (
            0, 0, 0), dram
        assert mine.get(keys) == data
        held_open.abort()
        # the grantee still awaits the owner's writes: it trusts the owner's namespace
        first = mine.reserve(mine.keys(range(6 * PUBLIC.block_tokens))[4:], parent=keys[-1])
        later = theirs.reserve(first.keys, parent=keys[-1])
        assert later.offsets == [-1, -1], later.offsets
        first.abort()
        later.abort()
        dram = ops.stats()["tiers"]["dram"]
        assert (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0), dram
