"""Two threads on one Client, their steps forced into the orders that lost a reply.

A Client serves one thread at a time and refuses a second (``KVStoreError``), but the
refusal is decided per send and per receive, so a thread's reply may be read by the
other thread and filed for it.  Each test here holds one thread at a chosen point (a
method wrapped to wait on an event) while the other reads, against a real daemon.

Before: a request was marked awaited only after its thread let the socket go, and a
reply read in that gap was dropped (its caller waited out its whole timeout); a reply
filed after its caller had looked for it was never looked for again (the caller waited
out its timeout, and the reply stayed kept for good, with the pin an acquire's holds).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvtest import make_identity

from kvstore import Client
from kvstore.errors import KVStoreError

IDENT = make_identity()
TIMEOUT = 3.0


def _call(out: dict[str, str], name: str, call: Any) -> None:
    started = time.monotonic()
    try:
        call()
        out[name] = "ok"
    except KVStoreError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
    out[name + "_s"] = f"{time.monotonic() - started:.2f}"


def test_a_reply_read_by_the_other_thread_right_after_the_send_is_kept(
        daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme", timeout=TIMEOUT) as c:
        paused, go = threading.Event(), threading.Event()

        class SlowAdd(set):  # A stops as it marks its request awaited
            def add(self, rid: Any) -> None:
                if threading.current_thread().name == "A":
                    paused.set()
                    go.wait(TIMEOUT)
                super().add(rid)

        c._awaited = SlowAdd(c._awaited)
        out: dict[str, str] = {}
        a = threading.Thread(target=_call, args=(out, "A", c.ping), name="A")
        a.start()
        assert paused.wait(TIMEOUT)
        time.sleep(0.05)  # A's reply is at the socket by now
        _call(out, "B", c.ping)  # B reads now: A's reply is filed for A, or B is refused
        go.set()
        a.join()
        assert out["A"] == "ok", out
        assert float(out["A_s"]) < TIMEOUT / 2, out
        assert out["B"] == "ok" or "another thread" in out["B"], out
        assert not c._early
        c.ping()  # the client goes on


def test_a_reply_filed_after_its_caller_looked_is_found(daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme", timeout=TIMEOUT) as c:
        paused, go = threading.Event(), threading.Event()
        claim = c._claim
        claims = [0]

        def slow_claim() -> None:  # A's second claim, its wait's: held until B has read
            if threading.current_thread().name == "A":
                claims[0] += 1
                if claims[0] == 2:
                    paused.set()
                    go.wait(TIMEOUT)
            claim()

        c._claim = slow_claim  # type: ignore[method-assign]
        out: dict[str, str] = {}
        a = threading.Thread(target=_call, args=(out, "A", c.ping), name="A")
        a.start()
        assert paused.wait(TIMEOUT)
        time.sleep(0.05)
        _call(out, "B", c.ping)  # reads A's reply first and files it for A
        assert out["B"] == "ok", out
        go.set()
        a.join()
        assert out["A"] == "ok", out
        assert float(out["A_s"]) < TIMEOUT / 2, out
        assert not c._early


def test_a_refused_wait_takes_its_reply_filed_meanwhile_and_leaves_no_pin(
        daemon_factory: Any) -> None:
    d = daemon_factory()
    with Client(d.endpoint, tenant="acme", timeout=TIMEOUT) as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(2 * IDENT.block_tokens))
        value = b"\x07" * IDENT.block_bytes
        ns.put(keys, [value, value])
        a_ready, a_go, b_filed, a_tried = (threading.Event() for _ in range(4))
        claim, file = c._claim, c._file
        claims = [0]

        def paced_claim() -> None:
            if threading.current_thread().name == "A":
                claims[0] += 1
                if claims[0] == 2:  # A's wait: held until B has filed A's reply
                    a_ready.set()
                    a_go.wait(TIMEOUT)
                    try:
                        claim()  # refused: B is still reading
                    finally:
                        a_tried.set()
                    return
            claim()

        def slow_file(received: Any) -> None:  # B, having filed A's reply, stays in
            file(received)                     # the socket until A was refused
            if threading.current_thread().name == "B":
                b_filed.set()
                a_go.set()
                a_tried.wait(TIMEOUT)

        c._claim = paced_claim  # type: ignore[method-assign]
        c._file = slow_file  # type: ignore[method-assign]
        out: dict[str, str] = {}
        got: list[bytes] = []
        a = threading.Thread(target=_call, args=(out, "A", lambda: got.extend(ns.get(keys))),
                             name="A")
        a.start()
        assert a_ready.wait(TIMEOUT)
        time.sleep(0.05)
        b = threading.Thread(target=_call, args=(out, "B", c.ping), name="B")
        b.start()
        a.join()
        b.join()
        assert b_filed.is_set()
        assert out["A"] == "ok", out  # refused the socket, yet its reply was there
        assert got == [value, value]
        assert out["B"] == "ok", out
        assert not c._early
        time.sleep(0.2)
        assert c.stats()["tiers"]["dram"]["pinned_blocks"] == 0
