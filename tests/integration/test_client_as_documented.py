"""A user's own engine on the client library, written from the README alone, against a
real daemon process over real ZeroMQ: where the library did otherwise than the README
says, the case that showed it.

- A session whose lease ran out raised ``LeaseExpiredError`` on every later call, where
  the README says ``NoSessionError`` ("open a new client"): an engine that reconnects on
  ``NoSessionError``, as documented, never did.  The error is now both.
- ``with ns.acquire(...)`` whose body failed after the session was gone raised the
  release's error in place of the body's own (``with ns.reserve(...)`` keeps the body's,
  as the README says); now both keep it.
- A key that is no key (one bytes object passed for the list, a key of another length,
  text) came back as the daemon's decoder saw it: "bad request header: Expected `bytes`
  of length >= 16 - at `$[3][0]`"; the client now says what is wrong before sending.
- A block that is not bytes-like (text, a list of ints) in a ``put`` raised memoryview's
  bare TypeError, no ``KVStoreError``; now a MalformedError naming the block.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import AsyncClient, Client
from kvstore.errors import LeaseExpiredError, MalformedError, NoSessionError

IDENT = make_identity()
LEASE = 1.0


class EnginesOwnError(Exception):
    pass


def wait_for_sessions(d: Any, count: int) -> None:
    """Until the daemon holds ``count`` sessions (a lease ran out: the reaper's turn)."""
    with Client(d.endpoint, tenant="acme") as watcher:
        deadline = time.monotonic() + 30
        while watcher.stats()["sessions"] > count + 1:
            assert time.monotonic() < deadline, "the lease never ran out"
            time.sleep(0.1)


def test_a_session_whose_lease_ran_out_is_a_no_session_error(daemon_factory: Any) -> None:
    d = daemon_factory(lease=LEASE)
    c = Client(d.endpoint, tenant="acme", timeout=5)
    try:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(2 * IDENT.block_tokens))
        ns.put(keys, [b"\x01" * IDENT.block_bytes] * 2)
        wait_for_sessions(d, 0)  # the client went silent past its lease
        for call in (lambda: ns.lookup(keys), lambda: ns.get(keys), c.ping):
            with pytest.raises(NoSessionError) as caught:  # the README's reconnect cue
                call()
            assert isinstance(caught.value, LeaseExpiredError), caught.value  # and still that
    finally:
        c.close()
    with Client(d.endpoint, tenant="acme") as fresh:  # a new client is served
        assert fresh.namespace(IDENT).lookup(keys).blocks == 2


def test_an_async_session_whose_lease_ran_out_is_a_no_session_error(
        daemon_factory: Any) -> None:
    d = daemon_factory(lease=LEASE)

    async def main() -> None:
        async with AsyncClient(d.endpoint, tenant="acme", timeout=5) as c:
            ns = await c.namespace(IDENT)
            keys = ns.keys(range(IDENT.block_tokens))
            await ns.put(keys, [b"\x02" * IDENT.block_bytes])
            await asyncio.to_thread(wait_for_sessions, d, 0)
            for _ in range(2):  # the reply that says so, and every call after it
                with pytest.raises(NoSessionError) as caught:
                    await ns.lookup(keys)
                assert isinstance(caught.value, LeaseExpiredError), caught.value

    asyncio.run(main())


def test_an_acquire_body_s_own_error_comes_through_a_lost_session(
        daemon_factory: Any) -> None:
    d = daemon_factory(lease=LEASE)
    with Client(d.endpoint, tenant="acme", timeout=5) as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(2 * IDENT.block_tokens))
        ns.put(keys, [b"\x03" * IDENT.block_bytes] * 2)
        with pytest.raises(EnginesOwnError):
            with ns.acquire(keys):
                wait_for_sessions(d, 0)
                with pytest.raises(LeaseExpiredError):
                    ns.lookup(keys)  # the engine hears the session is gone ...
                raise EnginesOwnError("... and gives up the request its own way")


def test_an_async_acquire_body_s_own_error_comes_through_a_lost_session(
        daemon_factory: Any) -> None:
    d = daemon_factory(lease=LEASE)

    async def main() -> None:
        async with AsyncClient(d.endpoint, tenant="acme", timeout=5) as c:
            ns = await c.namespace(IDENT)
            keys = ns.keys(range(IDENT.block_tokens))
            await ns.put(keys, [b"\x04" * IDENT.block_bytes])
            with pytest.raises(EnginesOwnError):
                async with ns.acquire(keys):
                    await asyncio.to_thread(wait_for_sessions, d, 0)
                    with pytest.raises(LeaseExpiredError):
                        await ns.lookup(keys)
                    raise EnginesOwnError("given up")

    asyncio.run(main())


def not_keys(keys: list[bytes]) -> list[Any]:
    """What a user passes in place of a list of keys, by mistake."""
    return [keys[0], [keys[0] + b"\x00"], [keys[0][:8]], [keys[0].hex()]]


def test_keys_that_are_no_keys_are_refused_saying_what_keys_are(daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(2 * IDENT.block_tokens))
        ns.put(keys, [b"\x05" * IDENT.block_bytes] * 2)
        block = [b"\x06" * IDENT.block_bytes]
        for bad in not_keys(keys):
            for call in (lambda: ns.lookup(bad), lambda: ns.lookup_pin(bad),
                         lambda: ns.get(bad), lambda: ns.acquire(bad),
                         lambda: ns.reserve(bad), lambda: ns.put(bad, block * len(bad)),
                         lambda: ns.evict(bad), lambda: ns.keep_warm(bad, seconds=1),
                         lambda: ns.prefetch(bad)):
                with pytest.raises(MalformedError, match=r"16.byte keys|16 bytes each"):
                    call()
        # nothing left behind: the session goes on, no pin or reservation is held
        assert ns.lookup(keys).blocks == 2
        # keys the wire takes as bytes are still keys (a bytearray, a memoryview)
        for like in ([bytearray(k) for k in keys], [memoryview(k) for k in keys]):
            assert ns.lookup(like).blocks == 2
            assert [bytes(b) for b in ns.get(like)] == [b"\x05" * IDENT.block_bytes] * 2
        assert [bytes(b) for b in ns.get(keys)] == [b"\x05" * IDENT.block_bytes] * 2
        assert ns.evict(keys) == 2


def test_async_keys_that_are_no_keys_are_refused_saying_what_keys_are(
        daemon_factory: Any) -> None:
    d = daemon_factory()

    async def main() -> None:
        async with AsyncClient(d.endpoint, tenant="acme") as c:
            ns = await c.namespace(IDENT)
            keys = ns.keys(range(IDENT.block_tokens))
            for bad in not_keys(keys):
                for call in (lambda: ns.lookup(bad), lambda: ns.get(bad),
                             lambda: ns.acquire(bad), lambda: ns.reserve(bad),
                             lambda: ns.put(bad, [b"\x07" * IDENT.block_bytes] * len(bad))):
                    with pytest.raises(MalformedError, match=r"16.byte keys|16 bytes each"):
                        await call()
            await ns.put(keys, [b"\x07" * IDENT.block_bytes])
            assert (await ns.lookup(keys)).blocks == 1

    asyncio.run(main())


def test_a_put_of_blocks_that_are_not_bytes_is_a_malformed_error(daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(2 * IDENT.block_tokens))
        good = b"\x08" * IDENT.block_bytes
        for bad in ("x" * IDENT.block_bytes, [0] * IDENT.block_bytes, None):
            with pytest.raises(MalformedError, match="block 1 is a"):
                ns.put(keys, [good, bad])
        assert ns.lookup(keys).blocks == 0  # nothing of the refused puts is there
        assert ns.put(keys, [good, good]) == 2


def test_evict_and_drop_do_what_the_readme_now_says(daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(4 * IDENT.block_tokens))
        blocks = [b"\x09" * IDENT.block_bytes] * 4
        ns.put(keys, blocks)
        assert ns.evict(keys[:1]) == 4 and ns.lookup(keys).blocks == 0  # all below it
        ns.put(keys, blocks)
        with ns.acquire(keys[2:3]):  # a pinned block and its prefix stay
            assert ns.evict(keys) == 1 and ns.lookup(keys).blocks == 3
        ns.put(keys[3:], blocks[3:], parent=keys[2])
        assert ns.drop() == 4 and ns.lookup(keys).blocks == 0
