"""The routing query across real daemons: cheapest first, the silent ranked last."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from daemon_proc import free_port
from kvtest import make_identity

from kvstore import Client
from kvstore.auth import write_secret
from kvstore.errors import MalformedError
from kvstore.keys import chain_keys
from kvstore.router import Router, read_tokens, route

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks
BT = IDENT.block_tokens
TOKENS = list(range(1000, 1000 + BT * 8))


def fill(endpoint: str, blocks: int, evict_to_ssd: bool = False) -> None:
    """Cache the first ``blocks`` blocks of TOKENS in the daemon."""
    with Client(endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(TOKENS)[:blocks]
        if keys:
            ns.put(keys, [bytes([i]) * IDENT.block_bytes for i in range(len(keys))])


def test_route_ranks_daemons_by_estimated_cost(daemon_factory: Any, tmp_path: Path) -> None:
    full = daemon_factory(tcp=True)
    half = daemon_factory(tcp=True)
    cold = daemon_factory(tcp=True)
    fill(full.endpoint, 8)
    fill(half.endpoint, 4)
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    endpoints = [dead, cold.tcp_endpoint, half.tcp_endpoint, full.tcp_endpoint]
    with Client(full.endpoint, tenant="acme") as c:
        keys = c.namespace(IDENT).keys(TOKENS)
        started = time.monotonic()
        results = c.route(keys, endpoints, deadline=0.5, prefill_rate=1000.0)
        took = time.monotonic() - started
        assert [r.endpoint for r in results] == [full.tcp_endpoint, half.tcp_endpoint,
                                                 cold.tcp_endpoint, dead]
        assert took < 3.0  # the dead one was not waited on past the deadline
        best, mid, none, silent = results
        assert (best.hits, best.tiers) == (8, {"dram": 8})
        assert (mid.hits, mid.tiers) == (4, {"dram": 4})
        assert (none.hits, none.tiers) == (0, {})
        assert not silent.answered and math.isinf(silent.cost) and silent.error
        # the estimate: prefill of what is not cached, plus loading what is
        assert none.prefill_seconds == pytest.approx(len(TOKENS) / 1000.0)
        assert mid.prefill_seconds == pytest.approx(4 * BT / 1000.0)
        assert best.prefill_seconds == 0.0
        assert best.transfer_seconds == pytest.approx(8 * IDENT.block_bytes / 20e9)
        assert best.cost == pytest.approx(best.queue_seconds + best.transfer_seconds)
        # the connections stay: a second query answers from all three again
        again = c.route(keys, endpoints, deadline=0.5, prefill_rate=1000.0)
        assert [r.hits for r in again] == [8, 4, 0, 0]
        # a probe touches nothing: the blocks' use counts stand as they were
        assert c.stats()["tiers"]["dram"]["lookups"] == 0


def test_a_stopped_daemon_ranks_last_and_is_not_waited_on(daemon_factory: Any) -> None:
    a = daemon_factory(tcp=True)
    b = daemon_factory(tcp=True)
    fill(a.endpoint, 8)
    fill(b.endpoint, 8)
    keys = chain_keys(IDENT.namespace_id, TOKENS, BT)
    with Router([a.tcp_endpoint, b.tcp_endpoint], tenant="acme") as r:
        assert all(x.answered for x in r.route(keys, deadline=2.0))
        assert a.proc is not None
        a.proc.send_signal(signal.SIGSTOP)  # alive, but it answers nobody
        try:
            started = time.monotonic()
            results = r.route(keys, deadline=0.2)
            took = time.monotonic() - started
            assert took < 1.5
            assert [x.endpoint for x in results] == [b.tcp_endpoint, a.tcp_endpoint]
            assert results[0].answered and not results[1].answered
        finally:
            a.proc.send_signal(signal.SIGCONT)
        # its late answer to the old query is dropped; the next query gets a fresh one
        deadline = time.monotonic() + 10
        while True:
            results = r.route(keys, deadline=1.0)
            if all(x.answered for x in results) or time.monotonic() > deadline:
                break
        assert all(x.answered and x.hits == 8 for x in results)


def test_a_refused_probe_is_that_probes_alone(daemon_factory: Any) -> None:
    """A probe the daemon refuses (a chain over its keys a request, a rate limit) is
    ranked last on its own: the next route is answered (the router took any refusal
    for a lost session and said hello again on its connection, which the daemon refused
    and the router backed off from: the daemon ranked last for good)."""
    d = daemon_factory(tcp=True)
    fill(d.endpoint, 8)
    keys = chain_keys(IDENT.namespace_id, TOKENS, BT)
    with Client(d.endpoint, tenant="acme") as c:
        assert c.route(keys, [d.tcp_endpoint], deadline=2.0)[0].answered
        too_long = keys + [os.urandom(16) for _ in range(5000)]
        refused = c.route(too_long, [d.tcp_endpoint], deadline=2.0)[0]
        assert not refused.answered and "too_large" in refused.error, refused
        for _ in range(5):
            again = c.route(keys, [d.tcp_endpoint], deadline=2.0)[0]
            assert again.answered and again.hits == 8, again


def test_probes_toward_a_daemon_that_takes_none_are_bounded(daemon_factory: Any) -> None:
    """A daemon that is not there takes no probe: the router queues at most
    ``PROBES_QUEUED`` messages toward it (each route after that ranks it last at once,
    sending nothing), rather than every probe of every route (3000 routes to a daemon
    that was down held 210 MiB, all delivered when it came up), and the daemon that is
    there is answered meanwhile."""
    from kvstore import router as router_module

    a = daemon_factory(tcp=True)
    fill(a.endpoint, 8)
    keys = chain_keys(IDENT.namespace_id, TOKENS, BT)
    gone = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    with Router([a.tcp_endpoint, gone], tenant="acme") as r:
        results = [r.route(keys, deadline=0.2) for _ in range(60)]
    assert all(x[0].endpoint == a.tcp_endpoint and x[0].answered for x in results)
    errors = [x[1].error for x in results]
    # its hello and the first probes queue; then none is sent
    queued = errors.index(next(e for e in errors if e.startswith("takes no message")))
    assert queued == router_module.PROBES_QUEUED - 1, errors
    assert all(e.startswith("takes no message") for e in errors[queued:]), errors


def test_a_client_keeps_its_latest_routers(daemon_factory: Any) -> None:
    """``client.route`` keeps one router per set of endpoints, the latest
    ``ROUTERS_KEPT`` (each a ZeroMQ context and thread, and a session at every daemon):
    232 sets held 464 threads and 13.7k descriptors."""
    import threading

    from kvstore.router import ROUTERS_KEPT

    a, b = daemon_factory(tcp=True), daemon_factory(tcp=True)
    fill(a.endpoint, 8)
    keys = chain_keys(IDENT.namespace_id, TOKENS, BT)
    threads = threading.active_count()
    with Client(a.endpoint, tenant="acme") as c:
        sets = [[a.tcp_endpoint, b.tcp_endpoint] + [a.tcp_endpoint] * i for i in range(30)]
        for endpoints in sets:
            assert c.route(keys, endpoints, deadline=2.0)[0].answered
        assert len(c._routers) == ROUTERS_KEPT
        assert list(c._routers) == [tuple(e) for e in sets[-ROUTERS_KEPT:]]
        assert threading.active_count() <= threads + 2 * ROUTERS_KEPT + 2
        assert c.route(keys, sets[-1], deadline=2.0)[0].answered  # kept: used again
    assert threading.active_count() <= threads + 2


def test_route_refuses_bad_input() -> None:
    with pytest.raises(MalformedError):
        route([], ["tcp://127.0.0.1:1"])
    with pytest.raises(MalformedError):
        route([b"short"], ["tcp://127.0.0.1:1"])
    with pytest.raises(MalformedError):
        Router([])
    with pytest.raises(MalformedError):
        Router(["tcp://127.0.0.1:1"], prefill_rate=0)


def test_hostile_token_files_are_refused_with_a_reason(tmp_path: Path) -> None:
    # a binary file and one of 100k nested lists ended in a traceback
    binary, nested = tmp_path / "binary", tmp_path / "nested"
    binary.write_bytes(b"\xff\xfe\x00\x80" * 64)
    nested.write_text("[" * 100_000)
    for path in (binary, nested):
        with pytest.raises(MalformedError, match="token ids"):
            read_tokens(str(path))


def test_kvstore_route_command(daemon_factory: Any, tmp_path: Path) -> None:
    full = daemon_factory(tcp=True)
    cold = daemon_factory(tcp=True)
    fill(full.endpoint, 8)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(map(str, TOKENS)))
    identity = tmp_path / "identity.json"
    identity.write_bytes(msgspec.json.encode(IDENT))
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "route", "--endpoints",
         f"{cold.tcp_endpoint},{full.tcp_endpoint}", "--tokens", str(tokens),
         "--identity", f"@{identity}", "--json"],
        check=True, capture_output=True, text=True, timeout=60)
    results = json.loads(out.stdout)
    assert [r["endpoint"] for r in results] == [full.tcp_endpoint, cold.tcp_endpoint]
    assert results[0]["hits"] == 8 and results[0]["tiers"] == {"dram": 8}
    table = subprocess.run(
        [sys.executable, "-m", "kvstore", "route", "--endpoints", full.tcp_endpoint,
         "--tokens", str(tokens), "--identity", f"@{identity}"],
        check=True, capture_output=True, text=True, timeout=60).stdout
    assert "8/8" in table and "dram=8" in table
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 x")
    refused = subprocess.run(
        [sys.executable, "-m", "kvstore", "route", "--endpoints", full.tcp_endpoint,
         "--tokens", str(bad), "--identity", f"@{identity}"],
        check=False, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "token ids" in refused.stderr


def test_the_async_client_routes_and_snapshots(daemon_factory: Any) -> None:
    import asyncio

    from kvstore import AsyncClient

    full = daemon_factory(tcp=True)
    cold = daemon_factory(tcp=True)
    fill(full.endpoint, 8)

    async def main() -> None:
        async with AsyncClient(full.endpoint, tenant="acme") as c:
            ns = await c.namespace(IDENT)
            keys = ns.keys(TOKENS)
            endpoints = [cold.tcp_endpoint, full.tcp_endpoint]
            both = await asyncio.gather(c.route(keys, endpoints, deadline=2.0),
                                        c.route(keys[:4], endpoints, deadline=2.0))
            assert [r.hits for r in both[0]] == [8, 0]
            assert [r.hits for r in both[1]] == [4, 0]
            assert both[0][0].endpoint == full.tcp_endpoint
            snap = await c.snapshot()
            assert snap.seq == -1  # no event stream here
            assert {(k, t) for k, _, t in snap.blocks} == {(k, "dram") for k in keys}
            parents = {k: parent for k, parent, _ in snap.blocks}
            assert [parents[k] for k in keys] == [None, *keys[:-1]]
            # its latest ROUTERS_KEPT routers are kept, one per set of endpoints, even
            # with queries on them at once (one let go under a waiting query: a new one)
            from kvstore.router import ROUTERS_KEPT
            sets = [endpoints + [cold.tcp_endpoint] * i for i in range(3 * ROUTERS_KEPT)]
            answers = await asyncio.gather(*(c.route(keys, e, deadline=2.0) for e in sets))
            assert all(a[0].endpoint == full.tcp_endpoint and a[0].hits == 8
                       for a in answers)
            assert len(c._routers) == ROUTERS_KEPT

    asyncio.run(main())


def test_a_daemon_that_refuses_the_hello_is_not_greeted_again_until_its_back_off_ends(
        daemon_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon whose tcp endpoint refuses every hello (``peer_tenants`` alone) ranks
    last with its refusal; the router greets it again only once a back-off that doubles
    with each refusal in a row has passed (1, 2, then 2 s: the cap), reporting the
    refusal at once meanwhile with no hello and no probe, while the others answer."""
    config = tmp_path / "peer.toml"
    config.write_text(f'[auth]\npeer_tenants = {{ "{os.getuid()}" = "acme" }}\n')
    refusing = daemon_factory(tcp=True, extra=["--config", str(config)])
    open_ = daemon_factory(tcp=True)
    fill(open_.endpoint, 8)
    hellos: list[str] = []
    greet = Router._hello

    def counted(self: Router, peer: Any) -> None:
        hellos.append(peer.endpoint)
        greet(self, peer)

    monkeypatch.setattr(Router, "_hello", counted)
    keys = chain_keys(IDENT.namespace_id, TOKENS, BT)
    now = [0.0]
    with Router([refusing.tcp_endpoint, open_.tcp_endpoint], tenant="acme",
                refused_s=(1.0, 2.0), clock=lambda: now[0]) as r:
        first = r.route(keys, deadline=10.0)
        assert [x.endpoint for x in first] == [open_.tcp_endpoint, refusing.tcp_endpoint]
        assert first[0].hits == 8 and not first[1].answered
        assert first[1].error.startswith("forbidden: ")
        sent, backing_off = [], []
        for t in (0.5, 0.9, 1.0, 2.9, 3.0, 4.9, 5.0):
            now[0] = t
            results = r.route(keys, deadline=10.0)
            assert results[0].hits == 8 and not results[1].answered
            assert results[1].error.startswith("forbidden: ")
            sent.append(hellos.count(refusing.tcp_endpoint))
            backing_off.append("not greeted again" in results[1].error)
        # at 0 (the first), 1, 3 (+2), 5 (+2, capped); the refusal told at once between
        assert sent == [1, 1, 2, 2, 3, 3, 4]
        assert backing_off == [True, True, False, True, False, True, False]
        assert hellos.count(open_.tcp_endpoint) == 1


def test_a_daemon_whose_handshake_refuses_the_router_is_not_waited_on(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A gated ipc endpoint lets in no peer without a ticket: once ZeroMQ dropped the
    refused connection a query neither blocks on sending to it nor waits for it."""
    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    config = tmp_path / "auth.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\n')
    gated = daemon_factory(extra=["--config", str(config)])
    open_ = daemon_factory(tcp=True)
    fill(open_.endpoint, 8)
    keys = chain_keys(IDENT.namespace_id, TOKENS, BT)
    with Router([gated.endpoint, open_.tcp_endpoint], tenant="acme") as r:
        for _ in range(100):  # until the refused connection is gone (the first query)
            results = r.route(keys, deadline=0.1)
            assert [x.endpoint for x in results] == [open_.tcp_endpoint, gated.endpoint]
            assert not results[1].answered
            if "takes no message" in results[1].error:
                break
        assert "takes no message" in results[1].error
        results = r.route(keys, deadline=300.0)  # answered by the open one: no wait
        assert results[0].hits == 8 and "takes no message" in results[1].error


def test_the_async_clients_routers_are_let_go_safely(daemon_factory: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The async client's routers: a query's thread keeps its router (a cancelled task
    let go of its lock, and a later eviction closed the router under the thread); an
    evicted router is closed once free, even if the task that evicted it is cancelled;
    ``close`` with a query under way and another asked meanwhile ends, rather than
    raising (the dict changed as it closed them) or hanging (the query found its router
    closed and asked again under its lock)."""
    import asyncio

    from kvstore import AsyncClient
    from kvstore.errors import KVStoreError
    from kvstore.router import ROUTERS_KEPT

    d = daemon_factory()
    failed: list[str] = []
    real_route = Router.route

    def route_recorded(self: Router, *args: Any, **kwargs: Any) -> Any:
        try:
            return real_route(self, *args, **kwargs)
        except BaseException as exc:  # (in a worker thread: recorded, raised)
            failed.append(repr(exc))
            raise

    monkeypatch.setattr(Router, "route", route_recorded)
    key = [b"k" * 16]
    nowhere = [f"tcp://127.0.0.1:{free_port()}" for _ in range(ROUTERS_KEPT + 3)]

    async def main() -> None:
        async with AsyncClient(d.endpoint, tenant="acme") as c:
            # a task cancelled while its query's thread runs; then its router is evicted
            task = asyncio.ensure_future(c.route(key, nowhere[:1], deadline=0.6))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            first = c._routers[tuple(nowhere[:1])][0]
            for e in nowhere[1:ROUTERS_KEPT + 1]:
                await c.route(key, [e], deadline=0.01)
            assert tuple(nowhere[:1]) not in c._routers
            assert not first.closed  # its thread is still in it
            await asyncio.sleep(0.8)
            assert first.closed and not failed, failed  # closed once the thread was done
            # an evicting task cancelled while the router it evicts is busy
            busy = asyncio.ensure_future(c.route(key, nowhere[2:3], deadline=0.5))
            await asyncio.sleep(0.05)
            held = c._routers[tuple(nowhere[2:3])][0]
            for e in nowhere[3:ROUTERS_KEPT + 2]:  # (the busy one is the oldest now)
                await c.route(key, [e], deadline=0.01)
            evictor = asyncio.ensure_future(c.route(key, nowhere[-1:], deadline=0.01))
            await asyncio.sleep(0)
            evictor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await evictor
            await busy
            await asyncio.sleep(0.1)
            assert held.closed
            # close with a query under way and another asked meanwhile
            busy = asyncio.ensure_future(c.route(key, nowhere[-1:], deadline=0.3))
            await asyncio.sleep(0.05)
            closing = asyncio.ensure_future(c.close())
            await asyncio.sleep(0)
            late = asyncio.ensure_future(c.route(key, nowhere[-1:], deadline=0.01))
            await asyncio.wait_for(asyncio.shield(closing), 5)
            with pytest.raises(KVStoreError, match="closed"):
                await asyncio.wait_for(late, 5)
            await busy
            assert not c._routers and not failed, failed

    asyncio.run(main())


def test_a_daemon_started_again_behind_queued_probes_is_greeted_again(
        daemon_factory: Any, tmp_path: Path) -> None:
    """Probes queued while a daemon was down reach the new one first: it answers a few
    "no session", then drops a sessionless peer's messages, the router's new hello among
    them.  Before, the router waited for that hello for good: the daemon, there and
    serving, was ranked unanswered at every route."""
    from daemon_proc import DaemonProcess

    d = DaemonProcess(tmp_path / "d").start()
    try:
        fill(d.endpoint, 8)
        keys = chain_keys(IDENT.namespace_id, TOKENS, BT)
        with Router([d.endpoint], tenant="acme") as r:
            assert r.route(keys, deadline=2.0)[0].answered
            d.stop(signal.SIGKILL)
            for _ in range(12):  # queued toward it while it is down (more than 8)
                assert not r.route(keys, deadline=0.01)[0].answered
            d.start()
            deadline = time.monotonic() + 15
            while not r.route(keys, deadline=0.2)[0].answered:
                assert time.monotonic() < deadline, "the daemon was never greeted again"
    finally:
        d.stop()
