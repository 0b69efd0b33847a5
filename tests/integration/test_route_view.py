"""A router's view kept from the daemons' event streams (``kvstore.route_view``), against
real daemons: it answers routes as their own probes do (DRAM, SSD, evictions), fills a
gap in a stream through the replay socket, follows a daemon that started again from a
new snapshot, and ranks one that is down last without waiting on it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess, free_port
from kvtest import make_identity

from kvstore import Client
from kvstore.errors import MalformedError
from kvstore.route_view import RouteView
from kvstore.router import RouteResult, Router

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB blocks
BT = IDENT.block_tokens


class Fleet:
    """Daemons with their event streams on, each with its ports."""

    def __init__(self, tmp: Path, count: int, ssd: str = "8MiB", extra: tuple[str, ...] = (),
                 **more: str) -> None:
        self.tmp = tmp
        self.ssd = ssd
        self.extra = list(extra)
        self.more = more
        self.ports = [(free_port(), free_port()) for _ in range(count)]
        self.daemons = [self._daemon(i) for i in range(count)]

    def _daemon(self, i: int) -> DaemonProcess:
        pub, replay = self.ports[i]
        work = self.tmp / f"d{i}"
        work.mkdir(exist_ok=True)
        env = {"KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
               "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}", **self.more}
        return DaemonProcess(work, dram_capacity="1MiB", ssd_capacity=self.ssd,
                             extra=["--slab-size", "1MiB", *self.extra], env=env).start()

    def view(self, **kw: Any) -> RouteView:
        return RouteView([d.endpoint for d in self.daemons],
                         [f"tcp://127.0.0.1:{pub}" for pub, _ in self.ports],
                         [f"tcp://127.0.0.1:{replay}" for _, replay in self.ports],
                         tenant="acme", **kw)

    def restart(self, i: int, pause: float = 0.0) -> None:
        self.daemons[i].stop()
        time.sleep(pause)
        self.daemons[i] = self._daemon(i)

    def stop(self) -> None:
        for d in self.daemons:
            if d.alive():
                d.stop()


def put(endpoint: str, first: int, blocks: int) -> list[bytes]:
    with Client(endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(list(range(first, first + BT * blocks)))
        ns.put(keys, [bytes([i]) * IDENT.block_bytes for i in range(blocks)])
        return keys


def chain(first: int, blocks: int, endpoint: str) -> list[bytes]:
    with Client(endpoint, tenant="acme") as c:
        return c.namespace(IDENT).keys(list(range(first, first + BT * blocks)))


def by_endpoint(results: list[RouteResult]) -> dict[str, tuple[int, dict[str, int]]]:
    return {r.endpoint: (r.hits, r.tiers) for r in results if r.answered}


def agrees(view: RouteView, router: Router, chains: list[list[bytes]],
           timeout: float = 10.0) -> Callable[[], str]:
    """Wait until the view answers every chain as the daemons' probes do (a batch waits
    a little for others before it goes out); what still differs, "" once none."""
    end = time.monotonic() + timeout
    while True:
        diff = ""
        for keys in chains:
            ours, theirs = by_endpoint(view.route(keys)), by_endpoint(router.route(keys, deadline=2.0))
            if ours != theirs:
                diff = f"view {ours} != probes {theirs}"
                break
        if not diff or time.monotonic() > end:
            return lambda: diff
        time.sleep(0.05)


def test_the_view_answers_routes_as_the_daemons_probes_do(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, 2)
    try:
        a, b = (d.endpoint for d in fleet.daemons)
        put(a, 0, 6)
        put(b, 0, 3)
        with fleet.view(figures_every=0.2) as view, Router([a, b], tenant="acme") as router:
            assert view.ready(10) == 2
            first = chain(0, 8, a)
            assert agrees(view, router, [first])() == ""
            results = view.route(first, prefill_rate=1000.0)
            assert [(r.endpoint, r.hits) for r in results] == [(a, 6), (b, 3)]
            # more than DRAM holds (16 blocks of 64 KiB in 1 MiB): the oldest go to SSD
            for i in range(1, 5):
                put(a, 10_000 * i, 6)
            assert agrees(view, router, [first, chain(40_000, 6, a)])() == ""
            assert by_endpoint(view.route(first))[a][1].get("ssd"), by_endpoint(view.route(first))
            with Client(b, tenant="acme") as c:  # an eviction: b holds none of it
                c.namespace(IDENT).evict(first[:1])
            assert agrees(view, router, [first])() == ""
            assert by_endpoint(view.route(first))[b] == (0, {})
    finally:
        fleet.stop()


def test_a_gap_in_a_stream_is_filled_through_the_replay_socket(tmp_path: Path) -> None:
    """The view's stream cut for a while (its socket closed, as a network would lose
    it): the batches meanwhile never reach it; the next one's number jumps, and the view
    takes the missed ones from the replay socket, not from a new snapshot."""
    import zmq

    from kvstore.client_wire import event_socket

    fleet = Fleet(tmp_path, 1, KVSTORE_EVENTS_INTERVAL_MS="0")
    try:
        (d,) = fleet.daemons
        with fleet.view(figures_every=0.2) as view, Router([d.endpoint], tenant="acme") as router:
            assert view.ready(10) == 1
            follow = view._follows[0]
            follow.sub.close(linger=0)
            chains = [put(d.endpoint, 1000 * i, 1) for i in range(12)]  # a batch each
            follow.sub = event_socket(view._ctx, zmq.SUB, follow.events)
            follow.sub.setsockopt(zmq.SUBSCRIBE, b"")
            deadline = time.monotonic() + 10
            while not view.replays:  # a batch after the cut: its number jumps
                assert time.monotonic() < deadline, "no gap was seen"
                chains.append(put(d.endpoint, 900_000 + len(chains), 1))
                time.sleep(0.05)
                view.sync()
            assert agrees(view, router, chains)() == ""
            assert view.snapshots == 1  # (the start's alone)
    finally:
        fleet.stop()


@pytest.mark.parametrize("pause", [0.0, 1.0], ids=["at-once", "down-a-while"])
def test_a_daemon_started_again_is_followed_from_a_new_snapshot(tmp_path: Path,
                                                                 pause: float) -> None:
    """Started again at once, or after a while down (its new life's first batches, the
    one that clears all among them, go out before the view's socket is back: the view
    kept the old life's blocks and dropped the new one's as applied already, a second
    reader's finding)."""
    fleet = Fleet(tmp_path, 2, ssd="0")
    try:
        a, b = (d.endpoint for d in fleet.daemons)
        old = put(a, 0, 4)
        with fleet.view(figures_every=0.2) as view:
            assert view.ready(10) == 2
            assert by_endpoint(view.route(old))[a] == (4, {"dram": 4})
            for i in range(12):  # the old life's numbers past the new one's first
                put(a, 100_000 + 1000 * i, 1)
            fleet.restart(0, pause)  # DRAM only: it comes back empty
            new = put(a, 50_000, 3)
            with Router([a, b], tenant="acme") as router:
                assert agrees(view, router, [old, new])() == ""
            assert by_endpoint(view.route(old))[a] == (0, {})
            assert by_endpoint(view.route(new))[a] == (3, {"dram": 3})
    finally:
        fleet.stop()


def test_a_daemon_down_ranks_last_and_is_never_waited_on(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, 2)
    try:
        a, b = (d.endpoint for d in fleet.daemons)
        keys = put(a, 0, 4)
        put(b, 0, 4)
        with fleet.view(figures_every=0.2) as view:
            assert view.ready(10) == 2
            fleet.daemons[0].stop()
            deadline = time.monotonic() + 10
            while view.route(keys)[-1].endpoint != a:
                assert time.monotonic() < deadline, view.route(keys)
                time.sleep(0.05)
            started = time.monotonic()
            results = view.route(keys)
            assert time.monotonic() - started < 0.1  # answered from what it holds
            assert [r.answered for r in results] == [True, False]
            assert "probe" in results[-1].error, results[-1].error
    finally:
        fleet.stop()


def test_a_stream_that_is_not_the_daemons_is_never_trusted_nor_raised(tmp_path: Path) -> None:
    """Batches not laid out as the stream's (garbage, the wrong shape, an event of no
    known medium) from what the view was told is a daemon's stream: that daemon ranks
    last, the others are answered, and no route raises."""
    import msgspec
    import zmq

    fleet = Fleet(tmp_path, 1)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        (d,) = fleet.daemons
        keys = put(d.endpoint, 0, 2)
        view = RouteView([d.endpoint, d.endpoint],
                         [f"tcp://127.0.0.1:{fleet.ports[0][0]}", f"tcp://127.0.0.1:{port}"],
                         [f"tcp://127.0.0.1:{fleet.ports[0][1]}", ""], tenant="acme",
                         figures_every=0.2)
        with view:
            assert view.ready(10) == 2
            bad = [b"\xc1\xc1", msgspec.msgpack.encode([1.0, 5]),
                   msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "medium": "TAPE"}]]),
                   msgspec.msgpack.encode([1.0, [["BlockRemoved"]]])]
            for payload in bad:
                for seq in range(200):  # (a subscription takes a moment to reach the PUB)
                    pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                    if not view._follows[1].synced:
                        break
                    time.sleep(0.005)
                    view.route(keys)
                results = view.route(keys)  # never raises
                assert [r.answered for r in results] == [True, False], results
                assert "could not be followed" in results[-1].error
                assert results[0].hits == 2
                deadline = time.monotonic() + 10
                while not view._follows[1].synced:  # followed again from a snapshot
                    assert time.monotonic() < deadline
                    view.sync()
                    time.sleep(0.02)
    finally:
        pub.close(linger=0)
        ctx.term()
        fleet.stop()


def test_a_chain_is_costed_by_its_own_block_size_whatever_was_routed_before(
        tmp_path: Path) -> None:
    """The probes' figures come with the block bytes of the chain routed last: a route
    after another chain's costed its SSD blocks' transfer at 0 bytes and ranked a daemon
    with them first, where the daemons' probes rank it last (a second reader's
    finding); and blocks in the GPU pool and DRAM are named by DRAM, as probes name
    them (the view named the pool, and costed it at the slowest tier's bandwidth)."""
    fleet = Fleet(tmp_path, 2, extra=("--gpu-device", "cpu", "--gpu-capacity", "4MiB"))
    try:
        a, b = (d.endpoint for d in fleet.daemons)
        x = put(a, 0, 4)
        for i in range(1, 5):  # more than a's DRAM holds: x goes to SSD
            put(a, 10_000 * i, 6)
        put(b, 0, 3)
        other = put(b, 500_000, 2)
        with fleet.view(figures_every=0.2) as view, Router([a, b], tenant="acme") as router:
            assert view.ready(10) == 2
            assert agrees(view, router, [x, other])() == ""
            deadline = time.monotonic() + 10
            while not view._bytes:  # the block size's bytes heard from a probe
                assert time.monotonic() < deadline
                view.route(x)
                time.sleep(0.05)
            for chain_ in (x, other, x):
                ours = [(r.endpoint, round(r.cost, 4)) for r in view.route(x, prefill_rate=1e6)]
                theirs = [(r.endpoint, round(r.cost, 4))
                          for r in router.route(x, deadline=2.0, prefill_rate=1e6)]
                assert ours == theirs, (ours, theirs)
                view.route(chain_)
            with Client(b, tenant="acme") as c:
                assert c.stats()["tiers"]["gpu"]["copies"] > 0
            assert by_endpoint(view.route(other))[b] == (2, {"dram": 2})
    finally:
        fleet.stop()


def test_daemons_down_never_keep_the_others_from_being_answered(tmp_path: Path) -> None:
    """Three of four daemons killed: the figures of the one left keep coming (the probes
    went one after another, each down one waiting its timeout, until the healthy one's
    figures were stale: 76 of 397 routes ranked it last), and a route after the view is
    closed is refused plainly."""
    import signal

    fleet = Fleet(tmp_path, 4, ssd="0")
    try:
        keys = put(fleet.daemons[0].endpoint, 0, 2)
        view = fleet.view(figures_every=0.2)
        with view:
            assert view.ready(10) == 4
            for d in fleet.daemons[1:]:
                d.stop(signal.SIGKILL)
            time.sleep(1.0)
            missed = 0
            for _ in range(40):
                first = view.route(keys)[0]
                missed += not (first.answered and first.hits == 2)
                time.sleep(0.05)
            assert missed == 0
        with pytest.raises(MalformedError):
            view.route(keys)
    finally:
        fleet.stop()


def test_two_models_chains_are_each_costed_by_their_own_block_size(tmp_path: Path) -> None:
    """Two models (16- and 32-token blocks): a chain routed right after the other
    model's was costed with that one's block size, taken from the figures' probe of the
    chain before (a second reader's finding: 6 of 6 routes differed from the probes);
    and a chain no daemon holds wakes the figures thread at most four times a
    ``figures_every``, not at every route (1760 probe rounds in 2 s)."""
    other = make_identity(num_layers=4, num_kv_heads=4, head_dim=32, block_tokens=32)
    fleet = Fleet(tmp_path, 2, ssd="0")
    try:
        a, b = (d.endpoint for d in fleet.daemons)
        y = put(a, 0, 4)
        with Client(b, tenant="acme") as c:
            ns = c.namespace(other)
            x = ns.keys(list(range(500_000, 500_000 + 32 * 4)))
            ns.put(x, [bytes([i]) * other.block_bytes for i in range(4)])
        with fleet.view(figures_every=0.3) as view, Router([a, b], tenant="acme") as router:
            assert view.ready(10) == 2
            assert agrees(view, router, [x, y])() == ""

            def costs(results: list[RouteResult]) -> list[tuple[str, int, float, float]]:
                return [(r.endpoint, r.hits, round(r.prefill_seconds, 4),
                         round(r.transfer_seconds * 1e6, 2)) for r in results]
            deadline = time.monotonic() + 10
            while len(view._bytes) < 2:  # both sizes' bytes heard from a probe
                assert time.monotonic() < deadline, view._bytes
                view.route(x)
                time.sleep(0.05)
                view.route(y)
                time.sleep(0.05)
            for first, then in ((y, x), (x, y), (y, x)):
                view.route(first)
                time.sleep(0.4)  # the figures are the first chain's now
                assert (costs(view.route(then, prefill_rate=1000.0))
                        == costs(router.route(then, deadline=2.0, prefill_rate=1000.0)))
            cold = [bytes([7]) * len(x[0]), *x[1:]]
            view.route(cold)
            time.sleep(0.4)
            rounds, start = view.probe_rounds, time.monotonic()
            while time.monotonic() - start < 1.0:
                view.route(cold)
                time.sleep(0.001)
            assert view.probe_rounds - rounds <= 20, view.probe_rounds - rounds
    finally:
        fleet.stop()


def test_a_daemon_endpoint_that_is_none_is_refused_at_once() -> None:
    """(The figures thread met it and died, and every daemon ranked last, not followed.)"""
    with pytest.raises(MalformedError):
        RouteView(["tcp://127.0.0.1"], ["tcp://127.0.0.1:1"], [""])
