"""A daemon that did not run for longer than the lease (stopped, a host that stalled)
reads what its clients sent meanwhile before any lease ends.  A real daemon, SIGSTOPped.

Before: the reaper's timer, due long since, ran before the queued requests were read
and ended every session's lease at once, the pings sent to keep them included: the
client's next request was told its reservation and pins were rolled back.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.errors import UnavailableError

IDENT = make_identity()


def test_leases_kept_alive_while_the_daemon_was_stopped_survive(daemon_factory: Any) -> None:
    d = daemon_factory(lease=2.0)
    with Client(d.endpoint, tenant="acme") as c:  # (0.5 s from the stop on: a loaded
        ns = c.namespace(IDENT)                    # machine's hello may take longer)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        ns.put(keys[:2], [b"\x01" * IDENT.block_bytes] * 2)
        held = ns.acquire(keys[:2])
        r = ns.reserve(keys[2:])
        assert d.proc is not None
        c.timeout = 0.5
        d.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(10):  # 5 s, the lease 2: pings that queue unread
                try:
                    c.ping()
                except UnavailableError:
                    pass
        finally:
            d.proc.send_signal(signal.SIGCONT)
        time.sleep(0.3)
        c.timeout = 5
        assert r.commit() == 2  # the reservation held
        assert bytes(held.buffers[0][:1]) == b"\x01"
        held.release()
        stats = c.stats()
        assert stats["tiers"]["dram"]["lease_expiries"] == 0, stats["tiers"]["dram"]


def test_the_side_socket_keeps_to_the_clients_timeout(daemon_factory: Any) -> None:
    """A client of a daemon that hands its arena out over the side socket (memfd) waits
    there no longer than its own timeout (it waited a fixed 5 s)."""
    import asyncio

    from kvstore import AsyncClient

    d = daemon_factory(env={"KVSTORE_DRAM_ARENA_KIND": "memfd"})
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)
    try:
        for connect in (lambda: Client(d.endpoint, tenant="acme", timeout=0.5).close(),
                        lambda: asyncio.run(
                            AsyncClient(d.endpoint, tenant="acme", timeout=0.5).connect())):
            started = time.monotonic()
            try:
                connect()
            except UnavailableError:
                pass
            else:
                raise AssertionError("a stopped daemon answered")
            assert time.monotonic() - started < 2.5
    finally:
        d.proc.send_signal(signal.SIGCONT)
