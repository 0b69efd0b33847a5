"""More tenants writing than the budget over their arenas has slabs: a real daemon, one
budget of 16 slabs, 24 tenants writing a block each in turn.  A tenant holding no slab
took one from another arena at each request, so slabs bounced between arenas every
request (each bounce a slab's blocks evicted, its memory given back and allocated
again); now such a tenant takes only the slab of an arena that wrote nothing for
``MIN_HOLD``, and is refused meanwhile with a CapacityError telling the operator what to
change."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from daemon_proc import DaemonProcess
from kvtest import make_identity, tenants_daemon

from kvstore.arena_budget import MIN_HOLD
from kvstore.client import Client
from kvstore.errors import CapacityError
from kvstore.keys import chain_keys

TENANTS = 24
ROUNDS = 6


def test_slabs_do_not_bounce_between_arenas_at_every_request(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    d, token = tenants_daemon(daemon_factory, tmp_path, "1MiB",
                              'slab_size = "64KiB"\narena_kind = "memfd"\ndefer_seconds = 0.01\n')
    names = [f"t{i}" for i in range(TENANTS)]
    clients = {t: Client(d.endpoint, token=token(t)) for t in names}
    ops = Client(d.endpoint, token=token("ops"))
    try:
        spaces = {t: c.namespace(make_identity(tenant=t)) for t, c in clients.items()}
        block = spaces[names[0]].identity.block_bytes  # 8 KiB: 8 a slab
        slabs = ops.stats()["tiers"]["dram"]["budget_slabs"]
        assert slabs == 16
        stored = 0
        refused: list[str] = []
        started = time.monotonic()
        for r in range(ROUNDS):
            for t, ns in spaces.items():
                key = chain_keys(ns.id, list(range(r * 16, r * 16 + 16)), 16)[0]
                try:
                    ns.put([key], [bytes([r + 1]) * block])
                    stored += 1
                except CapacityError as exc:
                    refused.append(str(exc))
        elapsed = time.monotonic() - started
        dram = ops.stats()["tiers"]["dram"]
        # a slab goes to an arena holding none only from one that wrote nothing for
        # MIN_HOLD: at most once a MIN_HOLD each (53 in 0.27 s, about one a put of a
        # tenant holding none, before)
        bound = slabs * elapsed / MIN_HOLD
        assert dram["budget_taken"] <= bound, (dram["budget_taken"], bound, elapsed)
        assert stored >= slabs * ROUNDS, stored  # every slab serves a tenant each round
        assert all("raise dram.capacity or lower dram.slab_size" in r for r in refused)
        assert dram["budget_held_back"] >= len(refused)  # (a deferral's attempts too)
        assert ops.stats()["invariant_violations"] == 0
        assert d.proc is not None and d.proc.poll() is None
    finally:
        for c in [*clients.values(), ops]:
            c.close()
