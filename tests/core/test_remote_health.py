"""The remote tier's judgement of a timed-out call (``kvstore.remote_health``), with a
clock and calls of the test's own: no store, no sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from kvstore.errors import CallTimeoutError
from kvstore.plugins import BackendHealth
from kvstore.remote_health import TierHealth


def health() -> tuple[TierHealth, list[float]]:
    now = [100.0]

    async def probe() -> BackendHealth:
        return BackendHealth(ok=True, detail="")

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        coro.close()  # (answers are told by the test)

    return TierHealth(5.0, 2.0, probe, spawn, clock=lambda: now[0]), now


def test_a_call_behind_another_tenants_timeout_is_made_again_while_the_tier_serves() -> None:
    async def main() -> None:
        h, now = health()
        made: list[str] = []

        async def b_call() -> bool:
            made.append("b")
            if len(made) == 1:
                await asyncio.sleep(0)
                h.answered_at = now[0]  # the store answers others meanwhile
                h._timed_out("acme", now[0] - 3, "read", CallTimeoutError("acme's"))
                now[0] += 2
                raise CallTimeoutError("globex's, behind acme's")
            return True

        assert await h.call("globex", "read", b_call) is True
        assert made == ["b", "b"] and h.counters["calls_again"] == 1
        assert not h.serves("acme") and h.serves("globex") and h.healthy

    asyncio.run(main())


def test_a_timeout_with_no_answer_since_the_call_began_is_every_tenants() -> None:
    async def main() -> None:
        h, now = health()
        h.answered_at = now[0] - 1  # the last answer came before the call began

        async def hangs() -> bool:
            now[0] += 2
            raise CallTimeoutError("did not finish within 2 s")

        with pytest.raises(CallTimeoutError):
            await h.call("acme", "read", hangs)
        assert not h.healthy and not h.serves("globex")

    asyncio.run(main())


def test_a_timeout_while_the_store_answers_is_the_tenants_own() -> None:
    async def main() -> None:
        h, now = health()

        async def too_big() -> bool:
            h.answered_at = now[0] + 1  # another call came back meanwhile
            now[0] += 2
            raise CallTimeoutError("did not finish within 2 s")

        with pytest.raises(CallTimeoutError):
            await h.call("acme", "read", too_big)
        assert h.healthy and h.serves("globex") and not h.serves("acme")
        assert h.skipping() == 1 and h.counters["tenant_timeouts"] == 1
        now[0] += 5  # the cooldown is over
        assert h.serves("acme") and h.skipping() == 0

    asyncio.run(main())


def test_a_check_for_no_tenant_timed_out_behind_others_is_not_the_stores_failure() -> None:
    # the generation check, behind one tenant's huge reads, marked the tier down for all
    h, now = health()
    began = now[0]
    h.answered_at = began + 1  # others' calls came back while it waited
    now[0] += 2
    h.failed("generation check", CallTimeoutError("did not finish within 2 s"), began)
    assert h.healthy and h.counters["late_checks"] == 1
    began = now[0]  # nothing answered since this one began: the store's failure
    now[0] += 2
    h.failed("generation check", CallTimeoutError("did not finish within 2 s"), began)
    assert not h.healthy
    h.clear()
    h.failed("generation check", ConnectionError("refused"), now[0])  # not a timeout
    assert not h.healthy
