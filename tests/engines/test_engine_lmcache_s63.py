"""kvstore's LMCache L2 adapter under LMCache's per-salt quota eviction (its
``IsolatedLRU`` L2 policy and eviction controller, lmcache_s63_checks.py, in the
LMCache environment, against a real daemon).

Before: the adapter's ``delete`` was the interface's no-op, so a salt over its quota
kept all its objects, and one with no quota (which LMCache's allow-list rule empties)
kept them too, each found and loaded; and every store told LMCache its objects were
stored, those the daemon held already too, so a salt's chunks stored twice counted
twice against its quota (and, with ``delete`` at work, were evicted though within it).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from daemon_proc import DaemonProcess
from engine_envs import HERE, ROOT, last_json, run_in_env


def test_salts_over_their_quota_lose_what_lmcache_evicts(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    proc = run_in_env("lmcache", [str(HERE / "lmcache_s63_checks.py"), daemon.endpoint,
                                  f"lmcache-{uuid.uuid4().hex[:8]}"],
                      timeout=180, PYTHONPATH=str(ROOT))
    out = last_json(proc.stdout)
    assert out["alice_stored"] == [[True], [True]] and out["bob_stored"] == [True], out
    # chunks of each salt, as LMCache counts them (before: alice 8, her four stored twice)
    assert out["usage_before"] == {"alice": 4, "bob": 4, "mallory": 4}, out
    # (before: unchanged, and every chunk still found)
    assert out["usage_after"] == {"alice": 4, "bob": 2}, out
    assert out["found_after"] == {"alice": [0, 1, 2, 3], "bob": [0, 1], "mallory": []}, out
    assert out["alice_loaded"] == [0, 1, 2, 3] and out["alice_same"], out
    # a listener deleting on the store thread as it is told of a store: at once (before:
    # the delete waited on its own thread for three times the adapter's 5 s timeout)
    assert out["eve_stored"] == [True] and out["eve_seconds"] < 10, out
    assert out["eve_found"] == [], out
    assert out["pinned_at_end"] == 0 and out["healthy"], out
    assert "Traceback" not in proc.stderr
