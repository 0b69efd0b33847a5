"""Second reading of the remote tier's per-tenant share, the closes of ended sessions'
namespaces and their neighbours (defects found, each with the test that showed it)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvtest import make_identity

from kvstore import Client
from kvstore.auth import issue_token, read_secret, write_secret
from kvstore.remote_shares import TenantShares

SIZE = 100


def _shares(bound: int) -> tuple[TenantShares, Any]:
    store: Any = SimpleNamespace(namespaces={}, changed=lambda b: None)
    ns = SimpleNamespace(tenant="a", id=b"A", block_bytes=SIZE)
    return TenantShares(store, bound), ns


def _send(shares: TenantShares, ns: Any, keys: list[bytes]) -> Any:
    plan = shares.plan(ns, keys)
    shares.deleted(plan, True)
    shares.done(plan, [True] * len(plan.send))
    return plan


def test_a_victim_read_again_while_its_delete_fails_is_counted_once() -> None:
    """A send past the bound picks the tenant's oldest value to delete; a read of that
    value lands while the delete is under way (the ledger counts it again, newest), and
    the delete fails (the value is still there: counted again).  Before, the second
    count added its bytes once more: 300 bytes for two values, for good (nothing took
    the extra 100 off), and each such race took a block off the tenant's share until
    every send of the tenant was refused."""
    shares, ns = _shares(2 * SIZE)
    _send(shares, ns, [b"1", b"2"])
    for _ in range(2):
        plan = shares.plan(ns, [b"3"])
        victim = [key for (_, key), _ in plan.victims]
        assert victim, plan
        shares.seen(ns, victim)  # read from the store meanwhile
        shares.deleted(plan, False)  # the delete failed: the value is still there
        shares.done(plan, [])  # (and the put was never sent)
        assert shares.stats()["a"]["bytes"] == 2 * SIZE, shares.stats()
    plan = _send(shares, ns, [b"4"])
    assert plan.send == [0], plan  # room made by deleting its oldest: not refused
    shares.check()
    assert shares.stats()["a"] == {"bytes": 2 * SIZE, "share_deleted": 1,
                                   "share_refused": 0}


SESSIONS, EACH = 4, 4000


def test_a_tenant_sees_no_other_tenants_queued_namespace_closes(
        daemon_factory: Any, tmp_path: Path) -> None:
    """With credentials, a tenant's stats show only the figures of the tenants whose
    namespaces it may open (``verbs.stats_for``); ``namespace_closes_queued`` was the
    daemon's: another tenant asking while acme's sessions of 16k namespaces ended saw
    acme's closes counted down (how many namespaces its sessions held, and when they
    ended).  Now each sees its own tenants' closes: globex none."""
    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[server]\nmax_namespaces_per_session = {EACH}\n\n'
                      f'[auth]\nsecret_file = "{secret_file}"\n')
    d = daemon_factory(extra=["--config", str(config)], debug_invariants=False)
    secret = read_secret(secret_file)
    clients = [Client(d.endpoint, tenant="acme", token=issue_token(secret, "acme", 3600))
               for _ in range(SESSIONS)]
    for n, c in enumerate(clients):
        for i in range(EACH):
            c.namespace(make_identity(salt=f"{n}-{i}"))
    seen: list[int] = []
    own: list[int] = []
    stop = threading.Event()
    with Client(d.endpoint, tenant="globex",
                token=issue_token(secret, "globex", 3600)) as asker:
        def ask() -> None:
            while not stop.is_set() or not seen:
                seen.append(asker.stats().get("namespace_closes_queued", 0))
        thread = threading.Thread(target=ask)
        thread.start()
        try:
            for c in clients:
                c.close()  # (a goodbye: its session ends, its closes are queued)
            with Client(d.endpoint, tenant="acme",
                        token=issue_token(secret, "acme", 3600)) as mine:
                while (queued := mine.stats()["namespace_closes_queued"]):
                    own.append(queued)
        finally:
            stop.set()
            thread.join()
    assert seen and not any(seen), sorted(set(seen))[-10:]
    assert all(0 < n <= SESSIONS * EACH for n in own), own[:10]  # (its own: seen)


def test_a_reply_made_later_at_a_requests_last_round_gives_back_what_it_held() -> None:
    """A request runs again after each plan (a move, a wake-up for room), at most
    1000 rounds.  One whose last round answered with a reply to come later (a big put's,
    holding its reservation; a get's, pinned) was refused "blocks kept moving" and its
    reply dropped unrun, ``Later.gave_up`` never called: the reservation or the pin
    stayed the session's till its lease ran out (an engine's never does).  Now it is
    given up, what it held let go."""
    import asyncio

    from kvstore.errors import CapacityError
    from kvstore.later import _MAX_ROUNDS, Finisher
    from kvstore.pending import Later
    from kvstore.plans import Plan

    gave_up: list[bool] = []
    calls = 0

    async def reply() -> Any:
        raise AssertionError("never run")

    def handler(session: Any, request: Any, payload: list[Any]) -> Any:
        nonlocal calls
        calls += 1
        if calls < _MAX_ROUNDS:
            return Plan()  # (moves again)
        return Later(reply(), lambda: gave_up.append(True))

    async def carry_out(plan: Any) -> None:
        return None

    session = SimpleNamespace(id="s1")
    daemon: Any = SimpleNamespace(
        moves=SimpleNamespace(room=[], carry_out=carry_out, freed=lambda: None,
                              abandon=lambda plan: None),
        sessions=SimpleNamespace(by_id={"s1": session}, counted=lambda s: None),
        store=SimpleNamespace(early=False), defer=False, clock=lambda: 0.0)
    finisher = Finisher(daemon)
    with pytest.raises(CapacityError, match="kept moving"):
        asyncio.run(finisher._settle("put", "acme", handler, session, None, [], Plan()))
    assert calls == _MAX_ROUNDS
    assert gave_up == [True]
